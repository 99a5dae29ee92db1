"""One deadline per operation: a whole save or load, across every request it makes.

An entry point (``save``, ``load``, a DCP writer or reader, a Megatron save) opens
:func:`deadline_scope` with ``TransferOptions.deadline``; every transfer group and every
retry loop inside, in any thread the operation hands work to (they re-enter the scope
with :func:`within`), reads the same expiry. Retries stop at it
(:class:`~cloudckpt.errors.DeadlineExceededError`), groups stop waiting at it, and the
cleanup after a failure (aborting an upload, deleting what was written) gets
:data:`CLEANUP_GRACE` seconds more, never a retry past that.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = [
    "CLEANUP_GRACE",
    "Deadline",
    "cleanup_scope",
    "current_deadline",
    "deadline_scope",
    "start_deadline",
    "within",
]

#: Seconds the cleanup after a failed operation may take past its deadline (one abort
#: or a few deletes); what is not done by then is left for ``cloudckpt gc``.
CLEANUP_GRACE = 5.0


@dataclass(frozen=True)
class Deadline:
    """An operation's time limit: ``seconds`` as asked, ``expires`` on the monotonic clock."""

    seconds: float
    expires: float

    def remaining(self) -> float:
        """Seconds left (0 once passed)."""
        return max(0.0, self.expires - time.monotonic())

    @property
    def passed(self) -> bool:
        return time.monotonic() >= self.expires


_current: contextvars.ContextVar[Deadline | None] = contextvars.ContextVar(
    "cloudckpt_deadline", default=None
)


def start_deadline(seconds: float | None) -> Deadline | None:
    """A deadline starting now, for an operation spread over several calls (a DCP writer
    starts one at ``set_up_storage_writer`` and re-enters it with :func:`within`); the
    earlier of it and the scope it starts in."""
    if seconds is None:
        return _current.get()
    mine = Deadline(seconds, time.monotonic() + seconds)
    outer = _current.get()
    return outer if outer is not None and outer.expires <= mine.expires else mine


def current_deadline() -> Deadline | None:
    """The deadline of the innermost scope, if any."""
    return _current.get()


@contextlib.contextmanager
def within(deadline: Deadline | None) -> Iterator[Deadline | None]:
    """Run under ``deadline`` (an operation's, handed to another thread); ``None``: as is."""
    if deadline is None:
        yield _current.get()
        return
    outer = _current.get()
    if outer is not None and outer.expires <= deadline.expires:
        deadline = outer
    token = _current.set(deadline)
    try:
        yield deadline
    finally:
        _current.reset(token)


@contextlib.contextmanager
def deadline_scope(seconds: float | None) -> Iterator[Deadline | None]:
    """An operation bounded by ``seconds`` from now (the earlier of it and any outer one)."""
    with within(start_deadline(seconds)) as deadline:
        yield deadline


@contextlib.contextmanager
def cleanup_scope() -> Iterator[Deadline | None]:
    """The cleanup after a failure: the operation's deadline plus :data:`CLEANUP_GRACE`."""
    outer = _current.get()
    if outer is None:
        yield None
        return
    grace = Deadline(outer.seconds, max(outer.expires, time.monotonic()) + CLEANUP_GRACE)
    token = _current.set(grace)
    try:
        yield grace
    finally:
        _current.reset(token)
