"""Kubernetes helpers that are plain library code (no kfp import; the `kubernetes` client is
imported lazily): building, submitting, watching, cancelling and cleaning up distributed training
jobs (`trainjob`) and failing fast on blocked pods (`diagnose`). The image-digest release tool is
`scripts/digests.py`.

    from chunkgrpo.k8s import JobSpec, build_trainjob, launch
"""

from chunkgrpo.k8s.trainjob import (  # noqa: F401
    KINDS,
    JobBlockedError,
    JobFailedError,
    JobSpec,
    TemplateError,
    build_job,
    build_pytorchjob,
    build_trainjob,
    cleanup_run,
    delete,
    delete_on_cancel,
    job_name,
    job_state,
    launch,
    load_api,
    merge_resources,
    merge_tolerations,
    needs_runtime,
    owner_from_pod,
    read_runtime,
    read_template,
    submit_or_attach,
    wait,
)
