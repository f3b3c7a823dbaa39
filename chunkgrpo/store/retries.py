"""Which failures of the S3 client are retried: `classify_error` sorts a minio exception into
authentication (never retried), transient (retried with backoff), missing and other; `request_retry` is
the quick retry of each HTTP request beneath that."""

from __future__ import annotations

import functools

AUTH_ERROR_CODES = frozenset({
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken",
    "ExpiredToken", "InvalidSecurity", "AuthorizationHeaderMalformed", "AccountProblem",
})
TRANSIENT_ERROR_CODES = frozenset({
    "SlowDown", "SlowDownRead", "SlowDownWrite", "InternalError", "ServiceUnavailable",
    "RequestTimeout", "OperationAborted", "Throttling", "ThrottlingException", "RequestLimitExceeded",
    "TooManyRequests", "ServerBusy",
})


def classify_error(exc: BaseException) -> str:
    """'auth' | 'transient' | 'missing' | 'other' for an exception raised by the minio client."""
    from minio.error import InvalidResponseError, S3Error, ServerError
    from urllib3.exceptions import HTTPError as Urllib3Error

    if isinstance(exc, S3Error):
        if exc.code in AUTH_ERROR_CODES:
            return "auth"
        if exc.code in ("NoSuchKey", "NoSuchBucket", "NoSuchUpload"):
            return "missing"
        status = getattr(getattr(exc, "response", None), "status", 0) or 0
        if exc.code in TRANSIENT_ERROR_CODES or status >= 500 or status == 429:
            return "transient"
        return "other"
    if isinstance(exc, ServerError):
        return "transient" if exc.status_code >= 500 or exc.status_code == 429 else "other"
    if isinstance(exc, InvalidResponseError):
        code = getattr(exc, "_code", 0) or 0
        if code in (401, 403):
            return "auth"
        return "transient" if code >= 500 or code == 429 else "other"
    if isinstance(exc, (Urllib3Error, ConnectionError, TimeoutError)):
        return "transient"
    return "other"


def request_retry(attempts: int):
    """urllib3's retry policy for each HTTP request of a client making `attempts` attempts per operation:
    one quick retry (0.2 s: a reset or refused connection on a single part), beneath the operation-level
    backoff of `ArtifactStore._retry`. With one attempt (callers that own their retry loop and time budget:
    the checkpoint mirror, the resume listing, the writer lease) a request whose response timed out is not
    sent again, so a hung server costs their timeout once, not twice; a reset is still retried, so a
    multi-GB checkpoint upload does not start over for it."""
    import urllib3

    kind = _timeout_not_repeated() if attempts == 1 else urllib3.Retry
    return kind(total=1, connect=1, read=1, status=0, backoff_factor=0.2, allowed_methods=None,
                raise_on_status=False)


@functools.cache
def _timeout_not_repeated() -> type:
    """The class below, made on first use (urllib3 loads only with a client)."""
    import urllib3
    from urllib3.exceptions import ReadTimeoutError

    class TimeoutNotRepeated(urllib3.Retry):
        """urllib3.Retry that gives up on a read timeout at once (MaxRetryError, as when exhausted)."""

        def increment(self, method=None, url=None, response=None, error=None, _pool=None, _stacktrace=None):
            if isinstance(error, ReadTimeoutError):
                exhausted = self.new(total=0)  # urllib3's own increment: MaxRetryError from the timeout
                return urllib3.Retry.increment(exhausted, method, url, response, error, _pool, _stacktrace)
            return super().increment(method, url, response, error, _pool, _stacktrace)

    return TimeoutNotRepeated
