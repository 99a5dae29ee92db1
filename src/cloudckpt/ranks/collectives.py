"""Collectives: act on the first rank, agree, settle, barrier; one error naming the rank.

Every "one rank acts, every rank learns the outcome" in cloudckpt goes through here,
over the ranks of the group the caller passes (None: the world). Each runs on one of
cloudckpt's own gloo groups over those ranks (:func:`~cloudckpt.ranks.groups.dedicated`),
never on the program's: its collectives never interleave with the training loop's,
need no device, and their groups are cloudckpt's to destroy at exit (ranks/groups.py
says why that matters). Without an initialized process group, or in a group of one,
each is a plain local call.

- :func:`on_first`: the group's first rank runs ``fn``; every rank returns its result.
  If ``fn`` raises, the first rank raises its own error and every other rank the same
  error, sent pickled (its type kept, so ``except NotFoundError`` works on every rank;
  a note names the rank it came from), or, when it does not survive pickling, a
  :class:`~cloudckpt.errors.CollectiveError` naming the rank and the error's text.
- :func:`agree`: every rank passes its outcome (an error or None) and a value; every rank
  learns every rank's failure and value alike (:class:`Agreement`).
- :func:`settle`: :func:`agree`, then every rank raises if any rank failed: a failed
  rank its own error, the others a ``CollectiveError`` (or the caller's subclass,
  ``DistributedSaveError``, ``DistributedLoadError``) naming each failed rank and what
  failed. No rank is left waiting in a collective for one that raised.

The model is torch DCP's ``_DistWrapper`` (exceptions gathered, raised on every rank);
here a failed rank keeps its own error and traceback, and the others get its text.
"""

from __future__ import annotations

import contextlib
import pickle
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import CollectiveError
from .groups import dedicated, torch_distributed

__all__ = [
    "Agreement",
    "agree",
    "barrier",
    "first_rank",
    "group_rank",
    "is_distributed",
    "on_first",
    "rank",
    "settle",
    "torch_distributed",
    "world_size",
]

T = TypeVar("T")


# -- ranks -------------------------------------------------------------------------------
def _initialized() -> bool:
    if "torch" not in sys.modules:  # nothing can have started a process group
        return False
    dist = torch_distributed()
    return bool(dist.is_available() and dist.is_initialized())


def is_distributed() -> bool:
    """True when torch.distributed is initialized with more than one rank."""
    return _initialized() and torch_distributed().get_world_size() > 1


def rank() -> int:
    """This process's global rank (0 without an initialized process group)."""
    return int(torch_distributed().get_rank()) if _initialized() else 0


def world_size() -> int:
    """The job's ranks (1 without an initialized process group)."""
    return int(torch_distributed().get_world_size()) if _initialized() else 1


def group_rank(group: Any) -> tuple[int, int]:
    """``(rank, size)`` of this process in ``group`` (None: the world)."""
    return int(torch_distributed().get_rank(group)), int(torch_distributed().get_world_size(group))


def first_rank(group: Any = None) -> int:
    """The global rank of ``group``'s first rank (the world's: 0)."""
    return (
        0
        if group is None or not _initialized()
        else int(torch_distributed().get_global_rank(group, 0))
    )


def _global(group: Any, index: int) -> int:
    """The global rank of the ``index``-th rank of ``group``."""
    return index if group is None else int(torch_distributed().get_global_rank(group, index))


def _alone(group: Any) -> bool:
    """No one to talk to: no process group, or a group of one."""
    return not _initialized() or torch_distributed().get_world_size(group) < 2


def _text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


@contextlib.contextmanager
def _peers(what: str, error_type: type[CollectiveError] = CollectiveError) -> Iterator[None]:
    """Around one collective: a failure of its transport (a rank's process died or left:
    gloo's "Connection closed by peer", a timeout) is ``error_type`` saying ``what``
    could not finish, with the backend's first line; never the backend's bare error."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as exc:  # torch's DistBackendError is one
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise error_type(
            f"{what} failed: the collective with the other ranks broke off ({type(exc).__name__}: "
            f"{first}); a rank's process may have died or left the job",
            {},
        ) from exc


def barrier(group: Any = None, *, what: str = "a barrier of the ranks") -> None:
    """Wait until every rank of ``group`` (None: the world) got here."""
    if not _alone(group):
        with _peers(what):
            torch_distributed().barrier(group=dedicated(group))


# -- act on the first rank ----------------------------------------------------------------
def on_first(
    fn: Callable[[], T],
    group: Any = None,
    *,
    what: str = "a step run on the first rank",
    error_type: type[CollectiveError] = CollectiveError,
) -> T:
    """``fn()`` on the first rank of ``group`` (None: the world), its result (or error)
    delivered to every rank (one ``broadcast_object_list``).

    ``what`` names the step in the error the other ranks raise when the first rank's
    error cannot be sent as itself (``error_type``, a :class:`CollectiveError`).
    """
    if _alone(group):
        return fn()
    first = first_rank(group)
    box: list[Any] = [None]
    failed: BaseException | None = None
    result: Any = None
    if torch_distributed().get_rank() == first:
        try:
            result = fn()
            # Pickled here: a result that cannot be sent fails this rank too.
            box[0] = ("ok", pickle.dumps(result), None)
        except Exception as exc:  # sent to the others, raised here below
            failed = exc
            box[0] = ("error", _pickled(exc), _text(exc))
    with _peers(what, error_type):
        torch_distributed().broadcast_object_list(box, src=first, group=dedicated(group))
    if failed is not None:
        raise failed
    if torch_distributed().get_rank() == first:
        return result  # type: ignore[no-any-return]
    status, payload, text = box[0]
    if status == "ok":
        return pickle.loads(payload)  # type: ignore[no-any-return]
    error = _unpickled(payload)
    if error is None:
        raise error_type.of(what, {first: text})
    if sys.version_info >= (3, 11):
        error.add_note(
            f"raised on rank {first} ({what}), received by rank {torch_distributed().get_rank()}"
        )
    raise error


def _pickled(error: BaseException) -> bytes | None:
    """``error`` pickled, if it comes back as itself (an exception whose ``__init__``
    takes other arguments than its ``args`` pickles, then fails to unpickle)."""
    try:
        blob = pickle.dumps(error)
        pickle.loads(blob)
    except Exception:
        return None
    return blob


def _unpickled(blob: bytes | None) -> BaseException | None:
    if blob is None:
        return None
    try:
        error = pickle.loads(blob)
    except Exception:
        return None
    return error if isinstance(error, BaseException) else None


# -- agree, settle ------------------------------------------------------------------------
@dataclass(frozen=True)
class Agreement:
    """What :func:`agree` tells every rank alike: each failed rank (global rank -> its
    error as text) and each rank's value, in group order."""

    failures: Mapping[int, str]
    values: tuple[Any, ...]

    @property
    def ok(self) -> bool:
        """True when no rank failed."""
        return not self.failures

    @property
    def unanimous(self) -> bool:
        """True when every rank passed an equal value."""
        return all(v == self.values[0] for v in self.values)

    def raise_failures(
        self, what: str, error_type: type[CollectiveError] = CollectiveError
    ) -> None:
        """Raise ``error_type`` naming each failed rank and ``what`` failed, if any did."""
        if self.failures:
            raise error_type.of(what, self.failures)


def agree(
    error: BaseException | None = None,
    value: Any = None,
    *,
    group: Any = None,
    what: str = "an agreement of the ranks",
    error_type: type[CollectiveError] = CollectiveError,
) -> Agreement:
    """Every rank of ``group`` (None: the world) passes its outcome (``error`` or None)
    and a ``value``; every rank gets the same :class:`Agreement` (one
    ``all_gather_object``). Never raises for another rank's failure: see :func:`settle`.
    A rank that left the collective (its process died) is ``error_type`` naming ``what``.

    A value that cannot be pickled counts as this rank's failure (sent as None), so no
    rank waits for it.
    """
    mine = None if error is None else _text(error)
    try:
        pickle.dumps(value)
    except Exception as exc:
        mine = mine or f"{_text(exc)} (the value to agree on does not pickle)"
        value = None
    if _alone(group):
        return Agreement({} if mine is None else {rank(): mine}, (value,))
    got: list[Any] = [None] * torch_distributed().get_world_size(group)
    with _peers(what, error_type):
        torch_distributed().all_gather_object(got, (mine, value), group=dedicated(group))
    failures = {_global(group, i): text for i, (text, _) in enumerate(got) if text is not None}
    return Agreement(failures, tuple(v for _, v in got))


def settle(
    error: BaseException | None,
    what: str,
    *,
    group: Any = None,
    error_type: type[CollectiveError] = CollectiveError,
) -> None:
    """Raise on every rank of ``group`` if any rank's part of ``what`` failed (a
    collective): a failed rank its own ``error``, the others ``error_type`` naming each
    failed rank and its error."""
    agreement = agree(error, group=group, what=what, error_type=error_type)
    if error is not None:
        raise error
    agreement.raise_failures(what, error_type)
