"""Which failures of the S3 client are retried: `classify_error` sorts a minio exception into
authentication (never retried), transient (retried with backoff), missing and other."""

from __future__ import annotations

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
