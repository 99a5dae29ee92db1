"""Typed errors raised by cloudckpt.

Every error derives from :class:`CloudCkptError` and, where one fits, from the
builtin a caller would already catch (``FileNotFoundError``, ``PermissionError``,
``ValueError``...), so ``except FileNotFoundError`` keeps working::

    CloudCkptError
    ├── ConfigError (ValueError)                  bad option or storage option
    │   ├── InvalidURLError                       malformed or unsupported URL
    │   └── UnsafePathError                       a local write would go through a link
    ├── NotFoundError (FileNotFoundError)         object or key is missing
    │   └── BucketNotFoundError                   bucket/container is missing
    ├── AlreadyExistsError (FileExistsError)      conditional create lost
    ├── MissingKeyError (KeyError)                a requested top-level key is absent
    ├── NotAnObjectError (IsADirectoryError)      URL names a directory/prefix
    ├── NotAPrefixError (NotADirectoryError)      URL names one object, not a prefix
    ├── CredentialsError (PermissionError)        missing or rejected credentials
    ├── AccessDeniedError (PermissionError)       credentials lack permission
    ├── StorageError (OSError)                    the store failed a request
    │   ├── TransientError                        worth retrying (throttled, 5xx, reset)
    │   │   └── ThrottledError                    the store asked for fewer requests
    │   ├── RetriesExhaustedError                 transient faults outlasted retries
    │   ├── DeadlineExceededError                 a save or load outlasted its deadline
    │   └── NoSpaceError                          a filesystem ran out of space mid-write
    │       └── LocalTierFullError                a manager's local tier lacks the room
    ├── SerializationError (TypeError)
    │   └── UnpicklableError                      state holds a closure/lambda/handle
    ├── CorruptCheckpointError (ValueError)       bytes on storage are not a checkpoint
    │   └── ChecksumError                         a record's CRC-32 does not match
    ├── UnsupportedFormatError (ValueError)       a valid checkpoint in a variant not read
    ├── CollectiveError (RuntimeError)            a step taken by every rank failed on some
    │   │                                         rank(s), named with what failed
    │   ├── DistributedSaveError                  a multi-rank save failed on some rank
    │   └── DistributedLoadError                  a shared load failed on another rank
    └── UnsafeCheckpointError (pickle.UnpicklingError)
                                                  weights_only refused a global

Messages name the URL or the key path involved and never contain credentials.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any, ClassVar

__all__ = [
    "AccessDeniedError",
    "AlreadyExistsError",
    "BucketNotFoundError",
    "ChecksumError",
    "CloudCkptError",
    "CollectiveError",
    "ConfigError",
    "CorruptCheckpointError",
    "CredentialsError",
    "DeadlineExceededError",
    "DistributedLoadError",
    "DistributedSaveError",
    "InvalidURLError",
    "LocalTierFullError",
    "MissingKeyError",
    "NoSpaceError",
    "NotAPrefixError",
    "NotAnObjectError",
    "NotFoundError",
    "RetriesExhaustedError",
    "SerializationError",
    "StorageError",
    "ThrottledError",
    "TransientError",
    "UnpicklableError",
    "UnsafeCheckpointError",
    "UnsafePathError",
    "UnsupportedFormatError",
]


class CloudCkptError(Exception):
    """Base class of every error cloudckpt raises on purpose."""


class ConfigError(CloudCkptError, ValueError):
    """An option, storage option or profile is invalid."""


class InvalidURLError(ConfigError):
    """A URL is malformed or uses a scheme cloudckpt does not support."""


class UnsafePathError(ConfigError):
    """A local write would go through a symbolic link inside the directory it writes in
    (a ``step-N`` that links elsewhere, a link two levels down): refused, naming the
    path and the link, before a byte is written. The directory the caller names itself
    (a store's root, ``cp``'s destination) may be a link: only what lies inside it is
    checked (docs/security.md, "Links and sizes")."""

    def __init__(self, message: str, path: str = "", link: str = "") -> None:
        super().__init__(message)
        self.path = path
        self.link = link

    def __reduce__(self) -> tuple[Any, ...]:  # sent between ranks: keep the path and link
        return (type(self), (str(self), self.path, self.link))


class NotFoundError(CloudCkptError, FileNotFoundError):
    """The object (or key) at a URL does not exist."""


class BucketNotFoundError(NotFoundError):
    """The bucket or container named in a URL does not exist."""


class AlreadyExistsError(CloudCkptError, FileExistsError):
    """A create-only write found an object already in place."""


class MissingKeyError(CloudCkptError, KeyError):
    """``load(..., keys=[...])`` asked for a top-level key the checkpoint does not hold."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class NotAnObjectError(CloudCkptError, IsADirectoryError):
    """A URL that should name one object names a directory or prefix."""


class NotAPrefixError(CloudCkptError, NotADirectoryError):
    """A URL that should name a prefix (a run root, a DCP checkpoint) names one object."""


class CredentialsError(CloudCkptError, PermissionError):
    """Credentials are missing, malformed, or were rejected by the store."""


class AccessDeniedError(CloudCkptError, PermissionError):
    """The store refused the request for lack of permission."""


class StorageError(CloudCkptError, OSError):
    """The store failed a request in a way that is not one of the cases above."""


class TransientError(StorageError):
    """A fault worth retrying: throttling, 5xx, timeout, reset, truncated body.

    Every store method retries these (cloudckpt.store.retry); one that outlasts the
    retry budget is re-raised as :class:`RetriesExhaustedError`.
    """


class ThrottledError(TransientError):
    """The store asked for fewer requests: S3 ``503 SlowDown``, a 429, Azure ``ServerBusy``.

    Retried like any transient fault; it also slows the request rate of its key prefix
    (``adaptive_rate``, cloudckpt.store.retry).
    """


class RetriesExhaustedError(StorageError):
    """A transient fault (throttling, 5xx, timeout, reset) outlasted the retry budget."""


class DeadlineExceededError(StorageError):
    """A save or load did not finish within its ``deadline``: it was cancelled (a save's
    upload aborted, nothing committed). The message names the requests still running."""


class NoSpaceError(StorageError):
    """A write to the filesystem ran out of space (or quota) midway: the temp file is
    removed and nothing is committed. The message names the file."""


class LocalTierFullError(NoSpaceError):
    """A save to a manager's local tier (``local_dir``) does not fit in its free space:
    refused before anything is written when the room check sees it, naming the
    directory, the bytes needed and the steps that wait for the bucket (or, when the
    space ran out during the write, its temp file removed and nothing committed)."""


class SerializationError(CloudCkptError, TypeError):
    """The object given to ``save`` cannot be written as a checkpoint."""


class UnpicklableError(SerializationError):
    """Part of the state cannot be pickled; ``path`` names where it sits."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class CorruptCheckpointError(CloudCkptError, ValueError):
    """The bytes on storage are not a readable checkpoint."""


class ChecksumError(CorruptCheckpointError):
    """A record's stored checksum does not match its bytes."""


class UnsupportedFormatError(CloudCkptError, ValueError):
    """A well-formed checkpoint in a format or variant cloudckpt does not read."""


class CollectiveError(CloudCkptError, RuntimeError):
    """A step every rank of a group takes together failed on some rank(s).

    ``failures`` maps each failed rank (its global rank) to its error as text; the
    message names each of them and the step. Raised on the ranks that did not fail
    (cloudckpt.ranks.collectives); a failed rank raises its own error.
    """

    #: What a failure of this kind leaves behind, appended to the message.
    consequence: ClassVar[str] = ""

    def __init__(self, message: str, failures: Mapping[int, str]) -> None:
        super().__init__(message)
        self.failures = dict(failures)

    @classmethod
    def of(cls, what: str, failures: Mapping[int, str]) -> CollectiveError:
        """The error saying ``what`` failed, naming each failed rank and its error."""
        listed = "; ".join(f"rank {rank}: {text}" for rank, text in sorted(failures.items()))
        tail = f"; {cls.consequence}" if cls.consequence else ""
        return cls(f"{what} failed ({listed}){tail}", failures)

    def __reduce__(self) -> tuple[Any, ...]:  # sent between ranks: keep the failures
        return (type(self), (str(self), self.failures))


class DistributedSaveError(CollectiveError):
    """A multi-rank save failed on some rank(s); ``failures`` maps each to its error."""

    consequence = "nothing committed"


class DistributedLoadError(CollectiveError):
    """A load shared by several ranks failed on other rank(s); ``failures`` maps each to
    its error (the failing rank raises its own)."""


class UnsafeCheckpointError(CloudCkptError, pickle.UnpicklingError):
    """``weights_only`` loading met a global it does not allow."""
