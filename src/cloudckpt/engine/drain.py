"""A local tier's two shared pieces: the run file that claims a directory for one bucket
root, and the background thread that drains what was committed locally to the bucket.

The manager's tier (``manager/tiers.py``: keys are steps) and Lightning's
(``lightning/tier.py``: keys are file names) both use them, the run file through their
base class (``engine/tier.py``), the drainer each its own (docs/tiers.md).
A tier of several ranks (NeMo's, ``nemo/tier.py``) also completes each local directory
with the coordinator's files: :func:`directory_owner`, :func:`complete_directories`.
"""

from __future__ import annotations

import atexit
import json
import logging
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

from ..errors import (
    AlreadyExistsError,
    CorruptCheckpointError,
    DeadlineExceededError,
    RetriesExhaustedError,
    StorageError,
    TransientError,
)
from ..format.commit import commit_marker, read_committed
from ..ranks.collectives import agree, group_rank, on_first, settle
from ..ranks.groups import runs_collectives
from ..store import Store
from ..store.waits import SLICE

__all__ = [
    "RUN_FILE",
    "RUN_FORMAT",
    "Drainer",
    "claim",
    "complete_directories",
    "directory_owner",
    "is_outage",
    "read_owner",
]

log = logging.getLogger("cloudckpt")

#: The run file at the top of a local tier: which bucket root the tier belongs to.
RUN_FILE = "_TIER.json"
RUN_FORMAT = "cloudckpt.tier/1"

K = TypeVar("K", bound=Hashable)


def claim(store: Store, root_url: str) -> str:
    """Create the run file of the tier ``store`` naming ``root_url`` (create-only), or
    read the owner an earlier process recorded there; returns the owner."""
    body = json.dumps({"format": RUN_FORMAT, "root_url": root_url}, sort_keys=True)
    try:
        commit_marker(store, RUN_FILE, body.encode())
        return root_url
    except AlreadyExistsError:
        pass
    owner = read_owner(store)
    if owner is None:  # removed between the two calls: nobody owns it now
        return claim(store, root_url)
    return owner


def read_owner(store: Store) -> str | None:
    """The bucket root the tier ``store``'s run file names (None: no run file yet);
    CorruptCheckpointError naming the file when it is not one."""
    data = read_committed(store, RUN_FILE)
    if data is None:
        return None
    try:
        owner = json.loads(data)["root_url"]
        if not isinstance(owner, str):
            raise TypeError(f"root_url is {type(owner).__name__}, not a string")
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(
            f"{store.url(RUN_FILE)} is not a local tier's run file: {exc}"
        ) from exc
    return owner


def directory_owner(path: Path, group: Any) -> tuple[bool, bool]:
    """(whether this rank is the first of those sharing its local directory ``path``,
    whether that directory is the coordinator's); a collective on ``group``. A directory
    is its host name and path: the same path on two nodes is two directories."""
    mine = (socket.gethostname(), str(path.resolve()))
    paths = agree(value=mine, group=group).values
    me, _ = group_rank(group)
    return paths.index(mine) == me, mine == paths[0]


def complete_directories(
    store: Store,
    prefix: str,
    names: Sequence[str],
    *,
    owner: bool,
    coordinators: bool,
    group: Any,
    what: str,
) -> None:
    """Give every local directory the files only the coordinator wrote: the first rank
    of ``group`` reads those of ``names`` under ``prefix``, each directory's first rank
    (``owner``) but the coordinator's writes them in the order given (the last one
    commits). Raises on every rank if any rank failed; ``what`` names the files."""

    def read() -> dict[str, bytes]:
        there = {o.key.rpartition("/")[2] for o in store.list(prefix)}
        return {n: store.get(prefix + n) for n in names if n in there}

    error: BaseException | None = None
    try:
        files = on_first(read, group, what=f"reading {what}")
        if owner and not coordinators:
            for name, data in files.items():
                store.put(prefix + name, data)
    except Exception as exc:
        error = exc
    settle(error, f"the copy of {what} to every local tier", group=group)


def is_outage(error: BaseException | None) -> bool:
    """Whether ``error`` (or an error it was raised from) says the bucket cannot be
    reached or fails every request now: retries spent, a deadline or a timeout passed,
    a connection refused or dropped. A drain failing so is part of an outage, not a
    fault of its own step."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(
            error,
            (
                RetriesExhaustedError,
                DeadlineExceededError,
                TransientError,
                ConnectionError,
                TimeoutError,
            ),
        ):
            return True
        error = error.__cause__ or error.__context__
    return False


def _in_order(keys: Iterable[K]) -> list[K]:
    """``keys`` sorted when they compare (steps, file names), else as given."""
    found = list(keys)
    try:
        return sorted(found)  # type: ignore[type-var]
    except TypeError:
        return found


#: How long an exit waits for a drain of several ranks under way (seconds).
EXIT_WAIT_S = 120.0


class Drainer(Generic[K]):
    """One daemon thread running ``work(key)`` for queued keys, in order (FIFO). A
    failure is kept with its error, naming the key, until the key is queued again; the
    thread ends when the queue is empty and starts on the next one.

    A key submitted while its work runs is queued again (what it drains changed since
    the work began: a file saved again). With ``merge`` (the default) a key submitted
    while it is queued and not started is queued once; without, every submit is queued,
    for work that is a collective: every rank's drainer must run the same keys in the
    same order, and whether a key is still queued differs from rank to rank.

    ``noun`` names a key in messages ("step", "file"); ``at_exit`` says what becomes of
    a drain left at exit, ``retry`` what tries a failed one again. At exit what is
    left is logged at WARNING; only a drain of several ranks under way is waited for
    (bounded: :func:`_report_at_exit`).

    ``prepare``, when given, runs in the thread before the first work (and again after
    it failed, at the next :meth:`kick`, submit or :meth:`retry_failed`): the keys it
    returns (the drains an earlier process left unfinished, found in the bucket) are
    queued first, oldest first. Whoever saves never waits for it: the bucket is the
    thread's business.

    An outage (:func:`is_outage`: the bucket refuses, fails or does not answer) is
    logged at WARNING once, when it begins, with the keys waiting; while it lasts, a
    failed drain is logged at INFO. With ``solo()`` true (the work is this process's
    alone, not a collective every rank must run alike; default: ``merge``) the keys
    queued behind the failure are not tried: they wait, failed, for the next retry,
    which takes the oldest first, and starts with ``probe()`` (one request to the
    bucket, not retried) when given: while it fails nothing else is sent. The first
    drain that succeeds again ends the outage (INFO).
    """

    def __init__(
        self,
        work: Callable[[K], object],
        src: str,
        dst: str,
        *,
        noun: str = "step",
        at_exit: str = "the next CheckpointManager with this local_dir finishes it",
        retry: str = "the next save or drain()",
        merge: bool = True,
        prepare: Callable[[], Iterable[K]] | None = None,
        probe: Callable[[], object] | None = None,
        solo: Callable[[], bool] | None = None,
    ) -> None:
        self._work = work
        self._merge = merge
        self._probe = probe
        self._solo = solo if solo is not None else (lambda: merge)
        self.src, self.dst = src, dst
        self.noun, self.at_exit, self.retry = noun, at_exit, retry
        self._cond = threading.Condition()
        self._queue: deque[K] = deque()
        self._busy: K | None = None
        self._failed: dict[K, BaseException] = {}
        #: Keys deleted while their drain ran (:meth:`discard`): its outcome is dropped.
        self._discarded: set[K] = set()
        self._thread: threading.Thread | None = None
        self._prepare = prepare
        self._prepared = prepare is None
        self._preparing = False
        #: Counts the requests for work (submit, kick, retry): a probe or prepare that
        #: failed is tried again when one came after it began.
        self._generation = 0
        #: Why the last ``prepare`` failed (None: it has not, or it succeeded since).
        self.prepare_error: BaseException | None = None
        #: The failure that began the outage under way (None: no outage).
        self.outage: BaseException | None = None
        #: Set at interpreter exit: no key is started any more.
        self._closing = False
        atexit.register(_report_at_exit, weakref.ref(self))

    def _start(self) -> None:
        """Start the thread if it is not running (under the lock)."""
        self._generation += 1
        if self._thread is None and not self._closing:
            self._thread = threading.Thread(target=self._run, name="cloudckpt-drain", daemon=True)
            runs_collectives(self._thread)  # its drains agree on the drain group
            self._thread.start()
        self._cond.notify_all()

    def submit(self, key: K) -> None:
        """Queue ``key`` (a failed key is forgotten and tried again)."""
        with self._cond:
            if self._merge and key in self._queue:
                return
            self._failed.pop(key, None)
            self._queue.append(key)
            self._start()

    def kick(self) -> None:
        """Start the thread if it has work: a queue, or ``prepare`` not done yet."""
        with self._cond:
            if self._queue or not self._prepared:
                self._start()

    def retry_failed(self) -> None:
        """Queue every failed key again, oldest first: with ``merge``, before the keys
        queued since (they are newer); without, after them, as every rank queued them."""
        with self._cond:
            failed = _in_order(self._failed)
            if self._merge:
                for key in failed:
                    del self._failed[key]
                fresh = [k for k in failed if k not in self._queue]
                self._queue.extendleft(reversed(fresh))
                if self._queue or not self._prepared:
                    self._start()
                return
        for key in failed:
            self.submit(key)
        self.kick()

    def discard(self, key: K) -> None:
        """Forget ``key`` (its checkpoint is being deleted): no longer queued or failed;
        a drain of it under way ends first (this waits for it, unless called from the
        drain itself), so what the caller then deletes is not committed after by a
        drain already past its uploads. That drain's outcome is not kept: no later
        ``wait()`` or retry reports it."""
        with self._cond:
            self._queue = deque(k for k in self._queue if k != key)
            self._failed.pop(key, None)
            if self._busy == key:
                self._discarded.add(key)
            self._cond.notify_all()
            if threading.current_thread() is self._thread:
                return
            while self._busy == key:
                self._cond.wait(SLICE)  # in slices: Ctrl-C lands

    def unfinished(self) -> set[K]:
        """Keys queued, draining or failed: due for the bucket, not there yet."""
        with self._cond:
            left = set(self._queue) | set(self._failed)
            if self._busy is not None:
                left.add(self._busy)
            return left

    def wait(self, timeout: float | None = None) -> dict[K, BaseException]:
        """Wait until nothing is queued or draining; the failed keys and their errors.
        TimeoutError after ``timeout`` seconds."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._thread is not None or self._queue or self._busy is not None:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    busy = [] if self._busy is None else [self._busy]
                    keys = _in_order({*self._queue, *busy})
                    raise TimeoutError(
                        f"the drain of {self.noun}(s) {keys} from {self.src} to {self.dst} "
                        f"did not finish within {timeout} s"
                    )
                self._cond.wait(SLICE if left is None else min(left, SLICE))  # Ctrl-C
            return dict(self._failed)

    def _run(self) -> None:
        # A failed prepare, and during an outage the probe before anything is sent, are
        # tried once per request for work (submit, kick, retry), not in a loop.
        tried = probed = -1
        while True:
            probe = False
            with self._cond:
                if (
                    self.outage is not None
                    and self._probe is not None
                    and probed != self._generation
                    and (self._queue or not self._prepared)
                    and self._solo()
                ):
                    probe, probed = True, self._generation
                elif not self._prepared and tried != self._generation:
                    self._preparing, tried = True, self._generation
                elif not self._queue or self._closing:
                    self._thread = None
                    self._cond.notify_all()
                    return
                else:
                    key = self._busy = self._queue.popleft()
            if probe:
                if not self._run_probe(probed):
                    tried = probed  # and no prepare either: the bucket is still away
                continue
            if self._preparing:
                self._run_prepare()
                continue
            error: BaseException | None = None
            try:
                self._work(key)
            except BaseException as exc:  # kept for wait(): the thread never dies silently
                error = StorageError(
                    f"the drain of {self.noun} {key} from {self.src} to {self.dst} failed "
                    f"({type(exc).__name__}: {exc}); {self.retry} tries again"
                )
                error.__cause__ = exc
            with self._cond:
                self._busy = None
                if key in self._discarded:
                    self._discarded.discard(key)
                elif error is not None:
                    self._failed[key] = error
                    self._failure(error)
                else:
                    self._healed()
                self._cond.notify_all()

    def _run_probe(self, generation: int) -> bool:
        """During an outage: whether the bucket answers ``probe()`` again; while it does
        not, the queued keys wait (failed) and nothing else is sent (INFO). A request
        for work made while it ran (a save, ``drain()``) gets a probe of its own."""
        assert self._probe is not None
        try:
            self._probe()
        except BaseException as exc:
            if not is_outage(exc):
                return True  # it answers, if not this: the drains say what fails
            with self._cond:
                if self._generation != generation:
                    return False  # asked again meanwhile: probed again, nothing parked
                error = StorageError(
                    f"the bucket {self.dst} is still unreachable ({type(exc).__name__}: "
                    f"{exc}); {self.retry} tries again"
                )
                error.__cause__ = exc
                self._failure(error)
                self._cond.notify_all()
            return False
        return True

    def _run_prepare(self) -> None:
        """Run ``prepare`` (in the thread) and queue what it found before the rest."""
        assert self._prepare is not None
        error: BaseException | None = None
        found: list[K] = []
        try:
            found = _in_order(self._prepare())
        except BaseException as exc:
            error = StorageError(
                f"finding the {self.noun}s left to drain from {self.src} to {self.dst} failed "
                f"({type(exc).__name__}: {exc}); {self.retry} tries again"
            )
            error.__cause__ = exc
        with self._cond:
            self._preparing = False
            self.prepare_error = error
            if error is None:
                self._prepared = True
                fresh = [k for k in found if k not in self._queue and k != self._busy]
                for key in fresh:
                    self._failed.pop(key, None)
                self._queue.extendleft(reversed(fresh))
                self._healed()
            else:  # tried again at the next kick, submit or retry
                self._failure(error)
            self._cond.notify_all()

    def _failure(self, error: BaseException) -> None:
        """Log a failed drain (under the lock): an outage's first at WARNING with the
        keys waiting, its later ones at INFO; with ``solo()`` the keys queued behind it
        wait, failed, for the next retry (the bucket would fail them the same way)."""
        cause = error.__cause__ or error
        if not is_outage(cause):
            log.warning("%s", error)
            return
        busy = [] if self._busy is None else [self._busy]
        waiting = _in_order({*self._failed, *self._queue, *busy})
        if self._solo():
            for key in self._queue:
                parked = StorageError(
                    f"the drain of {self.noun} {key} from {self.src} to {self.dst} waits: "
                    f"the bucket is unreachable ({type(cause).__name__}: {cause}); "
                    f"{self.retry} tries again"
                )
                parked.__cause__ = cause
                self._failed[key] = parked
            self._queue.clear()
        if self.outage is None:
            self.outage = error
            log.warning(
                "the bucket %s is unreachable (%s: %s); %d %s(s) wait to be drained: %s, "
                "kept in %s (saves go on there); %s tries again",
                self.dst,
                type(cause).__name__,
                cause,
                len(waiting),
                self.noun,
                waiting,
                self.src,
                self.retry,
            )
        else:
            log.info("%s", error)

    def _healed(self) -> None:
        """A drain succeeded (under the lock): an outage under way is over."""
        if self.outage is not None:
            self.outage = None
            left = _in_order({*self._failed, *self._queue})
            log.info(
                "the bucket %s answers again; %d %s(s) still to drain: %s",
                self.dst,
                len(left),
                self.noun,
                left,
            )


def _report_at_exit(ref: weakref.ref[Drainer[Any]]) -> None:
    """At interpreter exit: say which drains are left for the next process. A drainer
    of several ranks starts no other key and its drain under way may end first (up to
    :data:`EXIT_WAIT_S`): every rank's drainer is in the same collective drain, and a
    process that ended with its thread inside one aborted ("terminate called")."""
    drainer = ref()
    if drainer is None:
        return
    with drainer._cond:
        drainer._closing = True
        busy = drainer._busy is not None and not drainer._solo()
    if busy:
        log.info(
            "waiting up to %s s at exit for the drain of %s %s under way (call drain() "
            "before exit to drain every %s)",
            EXIT_WAIT_S,
            drainer.noun,
            drainer._busy,
            drainer.noun,
        )
        end = time.monotonic() + EXIT_WAIT_S
        with drainer._cond:
            while drainer._thread is not None and time.monotonic() < end:
                drainer._cond.wait(min(SLICE, max(0.0, end - time.monotonic())))
    left = drainer.unfinished()
    if left:
        log.warning(
            "the drain of %s(s) %s from %s to %s is unfinished at exit; %s",
            drainer.noun,
            _in_order(left),
            drainer.src,
            drainer.dst,
            drainer.at_exit,
        )
