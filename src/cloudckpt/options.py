"""Transfer knobs: one frozen dataclass, process-wide defaults, per-call overrides.

Precedence: arguments of a call > :func:`configure` (process defaults) > built-in
defaults. The built-in defaults fit S3 and match what NeMo users configure: 64 MiB
parts, 10 concurrent writes, 15 concurrent reads.
"""

from __future__ import annotations

import dataclasses
import math
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import ConfigError
from .redact import dataclass_repr

if TYPE_CHECKING:
    from .profiles import Profile

__all__ = [
    "MiB",
    "TransferOptions",
    "apply_profile",
    "check_flag",
    "check_seconds",
    "check_text",
    "configure",
    "get_defaults",
    "resolve_options",
]

MiB = 1024 * 1024

#: S3's multipart limits (also used for the filesystem so behaviour is identical).
MIN_PART_SIZE = 5 * MiB
MAX_PART_SIZE = 5 * 1024 * MiB
MAX_PARTS = 10_000
#: Threads in the process's I/O pool (engine.scheduler); every transfer's requests run
#: there, so no store needs fewer connections than this.
IO_THREADS = 64


@dataclass(frozen=True, kw_only=True)
class TransferOptions:
    """How a transfer uses the store; every field can be set per call or per process."""

    #: Size of one multipart part on save (grown automatically past 10,000 parts).
    part_size: int = 64 * MiB
    #: Parts uploaded concurrently by one save; also the number of part buffers.
    write_concurrency: int = 10
    #: Ranged reads in flight for one load.
    read_concurrency: int = 15
    #: Largest byte range fetched by one read request (large records are split).
    read_chunk_size: int = 32 * MiB
    #: Unneeded bytes one read may span to serve two neighbouring ranges with one request
    #: (about what one stream moves while a request waits for its first byte).
    read_gap: int = 1 * MiB
    #: Process-wide cap on bytes held in write buffers; ``None`` means no cap
    #: beyond each save's own ``write_concurrency * part_size``.
    max_bytes_in_flight: int | None = None
    #: Requests per second per key prefix (token bucket); ``None`` disables it.
    requests_per_second: float | None = None
    #: Slow a key prefix's requests down when the store throttles them (503 SlowDown,
    #: 429, ServerBusy) and speed them up again as they succeed; never above
    #: ``requests_per_second`` (docs/reliability.md, "Adaptive request rate").
    adaptive_rate: bool = True
    #: Attempts per request, the first included.
    max_attempts: int = 10
    #: First retry delay in seconds; doubles each attempt (full jitter).
    backoff_base: float = 0.2
    #: Longest delay between two attempts, in seconds.
    backoff_max: float = 20.0
    #: Seconds to establish a connection.
    connect_timeout: float = 10.0
    #: Seconds without progress on a request before it is abandoned and retried on a
    #: fresh connection (the stall timeout).
    request_timeout: float = 120.0
    #: Seconds to wait for the answer to a request whose answer is small (a HEAD, a
    #: listing, a marker or manifest read, creating or aborting an upload, a delete),
    #: never more than ``request_timeout``: a silent endpoint is given up on (and the
    #: request retried) after this, not after the stall timeout of data transfers.
    metadata_timeout: float = 10.0
    #: Seconds a whole save or load may take: every request, retry and wait of it, in
    #: whatever threads it uses, and the cleanup after a failure (a few seconds more,
    #: never a retry past them). Past it the operation fails (``DeadlineExceededError``),
    #: nothing committed. ``None``: no deadline. docs/reliability.md.
    deadline: float | None = None
    #: Show a progress bar on stderr.
    progress: bool = False
    #: Backend settings: endpoint, credentials, region (see docs/configuration.md).
    storage_options: Mapping[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        """The dataclass repr with secret storage options masked (cloudckpt.redact)."""
        return dataclass_repr(self)

    def __post_init__(self) -> None:
        for name in (
            "part_size",
            "write_concurrency",
            "read_concurrency",
            "read_chunk_size",
            "max_attempts",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"option {name}={value!r} must be a positive integer")
        if self.part_size < MIN_PART_SIZE:
            raise ConfigError(
                f"option part_size={self.part_size} is below the S3 minimum of "
                f"{MIN_PART_SIZE} bytes (5 MiB)"
            )
        if self.part_size > MAX_PART_SIZE:
            raise ConfigError(f"option part_size={self.part_size} is above the 5 GiB maximum")
        if (
            not isinstance(self.read_gap, int)
            or isinstance(self.read_gap, bool)
            or self.read_gap < 0
        ):
            raise ConfigError(f"option read_gap={self.read_gap!r} must be an integer >= 0")
        if self.deadline is not None and (
            isinstance(self.deadline, bool)
            or not isinstance(self.deadline, (int, float))
            or self.deadline <= 0
        ):
            raise ConfigError(f"option deadline={self.deadline!r} must be positive seconds or None")
        if self.max_bytes_in_flight is not None and self.max_bytes_in_flight < 1:
            raise ConfigError("option max_bytes_in_flight must be positive or None")
        if self.requests_per_second is not None and self.requests_per_second <= 0:
            raise ConfigError("option requests_per_second must be positive or None")
        if not isinstance(self.adaptive_rate, bool):
            raise ConfigError(f"option adaptive_rate={self.adaptive_rate!r} must be True or False")
        for name in (
            "backoff_base",
            "backoff_max",
            "connect_timeout",
            "request_timeout",
            "metadata_timeout",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"option {name} must be positive")
        if not isinstance(self.storage_options, Mapping):
            raise ConfigError("option storage_options must be a mapping")

    @property
    def connection_pool_size(self) -> int:
        """Connections a store keeps: a full-concurrency load and save at once, and never
        fewer than the I/O pool's threads (a connection per running request)."""
        return max(IO_THREADS, self.read_concurrency + self.write_concurrency)

    def replace(self, **changes: Any) -> TransferOptions:
        """Return a copy with ``changes`` applied (unknown names raise ConfigError)."""
        _check_names(changes)
        return dataclasses.replace(self, **changes)


def check_flag(backend: str, name: str, value: Any) -> bool:
    """A boolean storage option, or a ConfigError naming it (``"1"`` is not ``True``)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{backend} storage option {name}={value!r} must be True or False")
    return value


def check_text(backend: str, name: str, value: Any, pattern: str, expected: str) -> str:
    """A string storage option that fully matches ``pattern``, or a ConfigError naming it
    and saying what was ``expected`` (for plain settings: a secret is never checked here)."""
    if not isinstance(value, str) or not re.fullmatch(pattern, value):
        raise ConfigError(f"{backend} storage option {name}={value!r} must be {expected}")
    return value


_FIELDS = frozenset(f.name for f in dataclasses.fields(TransferOptions))
_lock = threading.Lock()
_defaults = TransferOptions()


def check_seconds(name: str, value: object) -> None:
    """ConfigError naming ``name`` unless ``value`` is None or a finite number of
    seconds, 0 or more (a wait's bound: 0 waits for nothing; checked when given, not
    when first waited on)."""
    if value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ConfigError(f"{name}={value!r} must be seconds (0 or more) or None")


def _check_names(changes: Mapping[str, Any]) -> None:
    unknown = sorted(set(changes) - _FIELDS)
    if unknown:
        valid = ", ".join(sorted(_FIELDS))
        raise ConfigError(f"unknown option(s) {', '.join(unknown)}; valid options are {valid}")


def configure(**changes: Any) -> TransferOptions:
    """Set process-wide defaults for every later call; returns the new defaults."""
    global _defaults
    with _lock:
        _defaults = _defaults.replace(**changes)
        return _defaults


def get_defaults() -> TransferOptions:
    """The process-wide defaults currently in force."""
    return _defaults


def resolve_options(
    options: TransferOptions | None = None, *, url: Any = None, **overrides: Any
) -> TransferOptions:
    """Merge a call's ``options`` object and keyword overrides over the process defaults.

    With ``url``, a profile it selects (cloudckpt.profiles) sits between the two: call
    arguments win over the profile, the profile over ``configure()``.
    """
    profile = None
    if url is not None and "://" in str(url):
        from .profiles import find_profile

        profile = find_profile(str(url))
    return apply_profile(options, profile, **overrides)


def apply_profile(
    options: TransferOptions | None, profile: Profile | None, **overrides: Any
) -> TransferOptions:
    """:func:`resolve_options` for a caller that has found its URL's profile already
    (``cloudckpt.store.resolve`` looks it up once, for both the URL and the options)."""
    base = options if options is not None else _defaults
    if not isinstance(base, TransferOptions):
        raise ConfigError(f"options must be a TransferOptions, not {type(base).__name__}")
    if profile is not None:
        if options is None and profile.transfer:
            base = base.replace(**profile.transfer)
        if options is None:  # the profile wins over configure()'s storage options
            storage = {**base.storage_options, **profile.storage_options}
        else:  # an explicit options object wins over the profile
            storage = {**profile.storage_options, **base.storage_options}
        storage.update(overrides.pop("storage_options", None) or {})
        base = base.replace(storage_options=storage)
    return base.replace(**overrides) if overrides else base
