"""Private temp folders (under $TMPDIR: in a pod the /cache volume, components/k8s.py) that never outlive
their use.

    with scratch("chunkgrpo-plan-") as tmp:              # removed when the block ends, on failure too
        ...
    with owned_on_failure("chunkgrpo-eval-") as work:   # removed only if the block fails: on success the
        return make_result(work)                        # caller owns it (and removes it when done)
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path


@contextlib.contextmanager
def scratch(prefix: str):
    """A new private temp folder, removed with everything in it when the block ends, on failure too. A
    step's outputs leave it before the block ends (uploaded to S3, copied to the step's output artifacts)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def owned_on_failure(prefix: str, dst: str | Path | None = None):
    """`dst` as given (never removed here), or a new private temp folder that is removed if the block fails;
    on success the caller owns it."""
    if dst:
        yield Path(dst)
        return
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
