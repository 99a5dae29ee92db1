"""One table from a store's answer (HTTP status, service error code) to a typed error.

Every HTTP backend extracts ``(status, code, message)`` from its SDK's failure and asks
:func:`error_for`; its own error codes (``NoSuchBucket``, ``BlobNotFound``...) are a
small mapping it passes in, checked before the status. A new failure mode is one row.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import (
    AccessDeniedError,
    AlreadyExistsError,
    BucketNotFoundError,
    CloudCkptError,
    CorruptCheckpointError,
    CredentialsError,
    NotFoundError,
    StorageError,
    ThrottledError,
    TransientError,
)
from ..redact import redact_text

__all__ = ["STATUS_ERRORS", "TRANSIENT_STATUS", "error_for"]

#: Statuses worth retrying: timeouts, throttling, server faults.
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})

#: What a status means when the service's error code is not in the backend's own table.
STATUS_ERRORS: Mapping[int, type[CloudCkptError]] = {
    401: CredentialsError,
    403: AccessDeniedError,
    404: NotFoundError,
    412: AlreadyExistsError,
    416: CorruptCheckpointError,
    **dict.fromkeys(TRANSIENT_STATUS, TransientError),
    # Every service means "too many requests" by it; a 503 means it only on S3 (SlowDown,
    # by the error code) and Azure (ServerBusy): those backends say so in their codes.
    429: ThrottledError,
}


#: The message of each kind of error (the service's own message follows some of them).
_MESSAGES: Mapping[type[CloudCkptError], str] = {
    BucketNotFoundError: "{container} does not exist: {root_url} (for {url})",
    NotFoundError: "no such object: {url}",
    CredentialsError: "credentials rejected for {url}: {detail}",
    AccessDeniedError: "access denied: {op} {url} ({detail})",
    AlreadyExistsError: "{url} already exists",
    CorruptCheckpointError: "{url} is shorter than the range being read",
    TransientError: "{op} {url}: {detail}",
    ThrottledError: "{op} {url}: {detail}",
    StorageError: "{op} {url} failed: {detail}:",
}
_WITH_MESSAGE = (TransientError, ThrottledError, StorageError)


def error_for(
    status: int,
    code: str,
    message: str,
    *,
    url: str,
    root_url: str,
    op: str,
    codes: Mapping[str, type[CloudCkptError]] = {},
    container: str = "bucket",
) -> CloudCkptError:
    """The typed error for one failed request to ``url`` (never naming a secret)."""
    kind = codes.get(code) or STATUS_ERRORS.get(status, StorageError)
    template = _MESSAGES.get(kind, _MESSAGES[StorageError])
    text = template.format(
        container=container, root_url=root_url, url=url, op=op, detail=code or str(status)
    )
    if kind in _WITH_MESSAGE and message:
        return kind(f"{text} {redact_text(message)}")
    return kind(text.rstrip(":"))
