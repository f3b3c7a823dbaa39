"""Kubernetes helpers that are plain library code (no kfp import; the `kubernetes` client is
imported lazily): building, submitting, watching and cancelling distributed training jobs.

    from chunkgrpo.k8s import JobSpec, build_trainjob, launch
"""

from chunkgrpo.k8s.trainjob import (  # noqa: F401
    KINDS,
    JobFailedError,
    JobSpec,
    build_job,
    build_pytorchjob,
    build_trainjob,
    delete,
    delete_on_cancel,
    job_name,
    job_state,
    launch,
    load_api,
    read_template,
    submit_or_attach,
    wait,
)
