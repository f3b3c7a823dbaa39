"""Kubernetes helpers that are plain library code (no kfp import; the `kubernetes` client is
imported lazily):

- `jobspec`: what a distributed training job runs, where (`JobSpec`, names, kinds, errors);
- `trainjob`: the Kubeflow Trainer v2 TrainJob built from it; `pytorchjob`: the Training Operator v1
  PyTorchJob;
- `launcher`: reading the runtime/template, submitting, watching, cancelling and cleaning up jobs;
- `pod`: the commands the training container runs around torchrun (fetch inputs, upload final/);
- `diagnose`: failing fast on blocked pods.

    from chunkgrpo.k8s.jobspec import JobSpec
    from chunkgrpo.k8s.launcher import build_job, launch, load_api

The image-digest release tool is `scripts/digests.py`.
"""
