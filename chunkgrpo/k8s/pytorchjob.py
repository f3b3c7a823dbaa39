"""Kubeflow Training Operator v1 (v1.9): a `kubeflow.org/v1` PyTorchJob built from the cluster's template.

    template = read_template(api, namespace)                          # launcher.read_template
    obj = build_pytorchjob(spec, template)

Contracts: Master + (num_nodes - 1) Workers, container `pytorch`, derived from the suspended
`PyTorchJob/chunkgrpo-torch-template` that manifests/components/training-operator-v1 installs: its pod
templates (pool placement, RDMA devices, memory, /dev/shm, security) are kept and this job's settings
merged in, never replacing them; a missing template is a `TemplateError`, never a bare pod. Kept for
clusters on the Kubeflow Platform 1.10 distribution, which ships Training Operator v1.9 and no Trainer v2.
"""

from __future__ import annotations

import copy
from typing import Any

from chunkgrpo.k8s.jobspec import (
    KINDS,
    POD_ANNOTATIONS,
    JobSpec,
    TemplateError,
    merge_resources,
    with_spec_hash,
)

PYTORCHJOB_TEMPLATE = "chunkgrpo-torch-template"


def _set_pod(spec: JobSpec, pod: dict, command: list[str], args: list[str]) -> None:
    """Apply this job's settings to a PyTorchJob pod template (in place), merging, never replacing."""
    meta = pod.setdefault("metadata", {})
    meta.setdefault("labels", {}).update(spec.all_labels())
    meta.setdefault("annotations", {}).update(POD_ANNOTATIONS)
    ps = pod["spec"]
    c = next((c for c in ps["containers"] if c["name"] == "pytorch"), None)
    if c is None:
        raise TemplateError("the PyTorchJob template has no container named 'pytorch'")
    c.update({"image": spec.image, "command": command, "args": args})
    if spec.env_list():
        names = {e["name"] for e in spec.env_list()}
        c["env"] = [e for e in c.get("env", []) if e["name"] not in names] + spec.env_list()
    if spec.resources():
        c["resources"] = merge_resources(c.get("resources"), spec.resources())
    if spec.node_selector:
        ps["nodeSelector"] = {**ps.get("nodeSelector", {}), **spec.node_selector}
    if spec.tolerations:
        ps["tolerations"] = ps.get("tolerations", []) + [t for t in copy.deepcopy(spec.tolerations)
                                                          if t not in ps.get("tolerations", [])]
    if spec.image_pull_secrets:
        have = ps.setdefault("imagePullSecrets", [])
        have += [{"name": n} for n in spec.image_pull_secrets if {"name": n} not in have]
    if spec.shm_size:
        ps["volumes"] = [v for v in ps.get("volumes", []) if v["name"] != "dshm"] + [spec.shm_volume()]
        mounts = c.setdefault("volumeMounts", [])
        if not any(m["name"] == "dshm" for m in mounts):
            mounts.append({"name": "dshm", "mountPath": "/dev/shm"})


def build_pytorchjob(spec: JobSpec, template: dict) -> dict:
    """A `kubeflow.org/v1` PyTorchJob (Training Operator v1.9): Master + (num_nodes - 1) Workers.

    Built from `template`, the suspended `PyTorchJob/chunkgrpo-torch-template` read from the cluster
    (`read_template`): its pod templates (pool placement, RDMA devices, memory, /dev/shm, security)
    are kept, this job's image/command/args/env are set and its resource overrides MERGED into the
    template's; `runPolicy.suspend` becomes false (true with a Kueue queue, which admits it).
    """
    if not template or "pytorchReplicaSpecs" not in (template.get("spec") or {}):
        raise TemplateError("build_pytorchjob needs the PyTorchJob template (read_template); "
                            "install manifests/components/training-operator-v1")
    command, args = spec.container_command()
    tspec = copy.deepcopy(template["spec"])
    master = tspec["pytorchReplicaSpecs"]["Master"]
    master["replicas"] = 1
    replicas = {"Master": master}
    if spec.num_nodes > 1:
        worker = tspec["pytorchReplicaSpecs"].get("Worker") or copy.deepcopy(master)
        worker["replicas"] = spec.num_nodes - 1
        replicas["Worker"] = worker
    for rs in replicas.values():
        _set_pod(spec, rs["template"], command, args)
    run_policy = {**tspec.get("runPolicy", {}), "suspend": bool(spec.queue_name)}
    if spec.active_deadline_seconds:
        run_policy["activeDeadlineSeconds"] = int(spec.active_deadline_seconds)
    body: dict[str, Any] = {
        "apiVersion": KINDS["PyTorchJob"].api_version,
        "kind": "PyTorchJob",
        "metadata": spec.metadata(),
        "spec": {
            "nprocPerNode": str(spec.nproc_per_node),
            "runPolicy": run_policy,
            "pytorchReplicaSpecs": replicas,
        },
    }
    return with_spec_hash(body)
