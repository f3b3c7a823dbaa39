"""The wait between two attempts of a background delivery loop (the MLflow tracker, the S3 checkpoint mirror).

While the service is down the loop backs off (its delay doubles up to a cap of tens of seconds), so a long
outage costs a few attempts, not thousands. Once somebody waits for the loop's queue to drain (the end of a
stage, with a deadline), a long backoff would sleep through a service that came back within that deadline:
while draining, the loop retries at least every `drain_retry_s`, and the moment draining starts ends the
current backoff at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


def retry_wait(cv: threading.Condition, stop: Callable[[], bool], draining: Callable[[], bool],
               delay_s: float, drain_retry_s: float) -> bool:
    """Wait on `cv` (held by the caller) before the next attempt: `delay_s`, or at most `drain_retry_s`
    while `draining()`; a drain that starts meanwhile ends the wait. True if `stop()` became true (the loop
    should end), False when it is time to retry."""
    if delay_s < 0 or drain_retry_s <= 0:
        raise ValueError(f"delay_s must be >= 0 and drain_retry_s > 0, got {delay_s}, {drain_retry_s}")
    was_draining = draining()
    timeout = min(delay_s, drain_retry_s) if was_draining else delay_s
    cv.wait_for(lambda: stop() or (draining() and not was_draining), timeout=timeout)
    return stop()
