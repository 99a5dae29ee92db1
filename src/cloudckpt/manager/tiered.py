"""What a manager with a local tier does beside the bucket: the drains, the local
retention, the commits and restores of several ranks (docs/tiers.md).

:class:`TieredRun` holds the local tier (manager/tiers.py), the drainer that copies the
due steps to the bucket (engine/drain.py) and what it learned of the bucket's committed
steps, which a save asks instead of the bucket. ``CheckpointManager`` delegates every
tier matter here and keeps the bucket's: its listing, its commit, its retention and the
loads from it, which this module reaches through :class:`Bucket`, the manager's side.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

from ..engine.drain import Drainer, directory_owner, is_outage
from ..engine.remove import remove_checkpoint
from ..errors import (
    AlreadyExistsError,
    CorruptCheckpointError,
    DistributedLoadError,
    LocalTierFullError,
    NoSpaceError,
    NotFoundError,
    StorageError,
)
from ..options import TransferOptions
from ..ranks.collectives import agree, on_first, rank, settle, world_size
from ..ranks.groups import checkpoint_group, drain_group
from ..store import Store, Target
from ..store.deadline import deadline_scope
from ..store.overlay import OverlayStore
from . import peers
from .choose import RankHolds, choose_step
from .gc import GcReport, collect_garbage
from .marker import MARKER_NAME, CheckpointInfo, DamagedMarker, read_marker, root_prefix
from .payload import DcpPayload, MegatronPayload, PayloadKind, Wrote
from .tiers import LOCAL, REMOTE, LocalTier

__all__ = ["Bucket", "TieredRun"]

log = logging.getLogger("cloudckpt")


class Bucket(Protocol):
    """The manager's side, as the tier uses it: the bucket's root, listing, commit,
    retention and loads, and the steps being saved (which no retention or gc removes)."""

    store: Store
    options: TransferOptions
    kind: PayloadKind
    root_key: str
    root_url: str
    restored_step: int | None
    _lock: threading.Lock
    _pending: set[int]

    def step_url(self, step: int) -> str: ...
    def _step_prefix(self, step: int) -> str: ...
    def _check_step(self, step: int) -> int: ...
    def _list_local(self) -> builtins.list[CheckpointInfo]: ...
    def _scan_local(
        self,
    ) -> tuple[builtins.list[CheckpointInfo], builtins.list[DamagedMarker]]: ...
    def _commit(
        self,
        step: int,
        metrics: Mapping[str, float],
        metadata: Mapping[str, Any],
        when: float | None = None,
        files: Wrote = None,
    ) -> CheckpointInfo: ...
    def _retain_quietly(self) -> builtins.list[int]: ...
    def _remove_step(self, step: int) -> int: ...
    def _await_in_flight(self) -> None: ...
    def _damaged_error(self, damaged: Sequence[DamagedMarker]) -> CorruptCheckpointError: ...
    def _warn_fallback(self, chosen: int, damaged: Sequence[DamagedMarker]) -> None: ...
    def _start_fresh(self) -> None: ...
    def _restore_bucket(
        self, step: int, map_location: Any, weights_only: bool, state: Any
    ) -> Any: ...
    def _load_committed(self, info: CheckpointInfo, load: Callable[..., Any]) -> Any: ...


class TieredRun:
    """The local tier of one manager's run (``tier``), its drainer and what the drainer
    learned of the bucket: saves commit in the tier, due steps drain in the background."""

    def __init__(self, bucket: Bucket, tier: LocalTier, replicate_to_peer: bool) -> None:
        self.bucket = bucket
        self.tier = tier
        #: Each local directory's steps are also kept by the next one (docs/tiers.md).
        self.replicate_to_peer = replicate_to_peer
        self.drainer: Drainer[int] = Drainer(
            self._drain_step,
            tier.url,
            bucket.root_url,
            prepare=self._find_undrained,
            probe=self._probe,
            solo=lambda: not self.ranked(),  # several ranks: collective drains
        )
        self._drain_owner: bool | None = None
        self._lock = threading.Lock()
        #: The steps the drainer last saw committed in the bucket (its listing, its commits).
        self._in_bucket: set[int] = set()
        #: The steps this process's drains committed in the bucket (kept after either
        #: tier's retention removed them).
        self.drained: set[int] = set()

    @staticmethod
    def ranked() -> bool:
        """Whether the tier serves several ranks: each rank keeps its own files."""
        return world_size() > 1

    # -- what the drainer learned of the bucket -------------------------------------------
    def learn(self, remote: Sequence[CheckpointInfo]) -> None:
        """Note the bucket's committed steps (a listing made by this process, or heard
        from the first rank): what a save asks instead of the bucket."""
        with self._lock:
            self._in_bucket = {c.step for c in remote}

    def left_bucket(self, step: int) -> None:
        """Note that ``step`` was removed from the bucket (retention, a delete)."""
        with self._lock:
            self._in_bucket.discard(step)

    def drained_steps(self) -> set[int]:
        """The local steps committed in the bucket: those the tier's drain records say
        so of, and those this process drained (since gone from the tier or the bucket
        by retention). No request to the bucket."""
        waiting = set(self.waiting())
        with self._lock:
            drained = set(self.drained)
        tier = self.tier
        return drained | {c.step for c in tier.list() if tier.due(c.step) and c.step not in waiting}

    def _entered_bucket(self, step: int) -> None:
        with self._lock:
            self._in_bucket.add(step)  # committed there: by this drain, or another save
            self.drained.add(step)

    # -- a bucket that is away ------------------------------------------------------------
    def scan_bucket(
        self,
    ) -> tuple[builtins.list[CheckpointInfo], builtins.list[DamagedMarker], str | None]:
        """The bucket's committed and damaged steps, and None; a bucket that cannot be
        reached (:func:`~cloudckpt.engine.drain.is_outage`, its retries spent) gives
        none of either and what failed, said at WARNING: a listing or restore then sees
        the local tier only (docs/tiers.md, "When the bucket is away")."""
        try:
            found, damaged = self.bucket._scan_local()
        except Exception as exc:
            if not self.away(exc):
                raise
            return [], [], f"{type(exc).__name__}: {exc}"
        return found, damaged, None

    def away(self, error: BaseException) -> bool:
        """Whether a read of the bucket that raised ``error`` may be answered from the
        local tier alone: the bucket cannot be reached, and the tier is this run's. Said
        at WARNING when so."""
        if not (self.tier.owned and is_outage(error)):
            return False
        log.warning(
            "the bucket %s is unreachable (%s: %s); reading the local tier %s only: a step "
            "only the bucket holds (drained by another node, or this tier's dropped) is "
            "not seen",
            self.bucket.root_url,
            type(error).__name__,
            error,
            self.tier.url,
        )
        return True

    def nothing_local(self, why: str) -> StorageError:
        """The error of a restore of the newest step while the bucket is away and the
        local tier holds none: the run may have checkpoints there, so it is not
        started fresh."""
        return StorageError(
            f"the bucket {self.bucket.root_url} is unreachable ({why}) and the local tier "
            f"{self.tier.url} holds no committed step: not starting fresh over a run the "
            "bucket may hold; restore again once the bucket answers"
        )

    # -- saves ---------------------------------------------------------------------------
    def refuse_committed(self, step: int) -> None:
        """AlreadyExistsError when ``step`` is committed in the tier, or in the bucket as
        far as the drainer knows: never asked of the bucket, so a save does not wait for
        it (a step another process committed there that the drainer has not seen yet is
        found by its drain, which keeps the bucket's, WARNING)."""
        if self.tier.info(step) is not None:
            raise AlreadyExistsError(
                f"step {step} is already committed at {self.tier.step_url(step)}"
            )
        with self._lock:
            there = step in self._in_bucket
        if there:
            raise AlreadyExistsError(
                f"step {step} is already committed at {self.bucket.step_url(step)}; "
                "delete it first to overwrite"
            )

    def before_save(self, kind: PayloadKind) -> None:
        """The tier's checks before a save asks anything else: this run's directory, a
        kind it can take; the files the last retention dropped gone, crash leftovers
        swept."""
        self.tier.check_ready(kind)
        self.tier.settle()  # the files the last save's retention dropped are gone first
        self.tier.sweep()

    def clear(self, step: int) -> None:
        """Before a save writes ``step`` into the tier (after the check that it is not
        committed): what an earlier, killed save of the step left in its folder is
        removed (LocalTier.clear), so the local commit records this save's files only;
        with several ranks each directory's first rank removes it and every rank waits
        (a collective on the checkpoint group). A step this manager is saving already
        (an async save in flight) is AlreadyExistsError: its files are never removed."""
        if self.ranked():  # a save of several ranks waited for the one in flight first
            self.tier.clear_ranks(step, checkpoint_group())
            return
        with self.bucket._lock:
            busy = step in self.bucket._pending
        if busy:
            raise AlreadyExistsError(
                f"step {step} is being saved at {self.tier.step_url(step)}; wait for that save"
            )
        self.tier.clear(step)

    def check_room(self, state: Any) -> None:
        """LocalTierFullError before anything is written, naming the steps that wait;
        with several ranks a collective on the checkpoint group: one rank's tier full
        fails the save on every rank before any writes (CollectiveError naming that
        rank on the others)."""
        ranked = self.ranked()
        error: BaseException | None = None
        # A kind that links files already on the tier's disk takes no room (Hugging
        # Face's: the Trainer's folder, hard-linked).
        needs_room = getattr(self.bucket.kind, "needs_room", None)
        try:
            copies = 2 if self.replicate_to_peer and ranked else 1
            if needs_room is None or needs_room(state):
                self.tier.check_room(state, copies=copies, waiting=self.waiting)
        except Exception as exc:
            error = exc
        group = checkpoint_group() if ranked else None  # one process: its own error, as is
        settle(error, f"the room in every rank's local tier {self.tier.url}", group=group)

    @contextlib.contextmanager
    def room(self) -> Iterator[None]:
        """Around a save's write to the tier: a write that runs out of space (another
        program filled the disk, or the state is larger than the room check saw) is
        LocalTierFullError naming the steps that wait for the bucket, like the check."""
        try:
            yield
        except LocalTierFullError:
            raise
        except NoSpaceError as exc:
            raise self.tier.full(str(exc), self.waiting()) from None

    def after_commit(self, step: int, defer: bool = False) -> None:
        """After a save's local commit: local retention, then queue the step's drain if
        it is due (and retry failed ones). The drainer starts last, so a synchronous
        save does not share the CPUs with it; ``defer`` (such a save): the files of the
        steps local retention drops are removed after it returns (LocalTier.retain)."""
        self.retain_local(defer=defer)  # the new step is kept: due and not drained, or newest
        if not self.ranked():  # several ranks: drain() retries, all ranks in step
            self.drainer.retry_failed()  # and, the first time, finds earlier drains
        if self.tier.due(step):
            self.drainer.submit(step)

    # -- drains --------------------------------------------------------------------------
    def drain(self, timeout: float | None = None) -> None:
        """:meth:`CheckpointManager.drain`: wait until every due step is committed in the
        bucket, failed drains tried again first; raises the error of one that fails
        again (naming its step); TimeoutError after ``timeout`` s."""
        if self.ranked():
            # The saves in flight commit and the background drains end on every rank;
            # then one collective pass drains what is left (failed, or an earlier job's).
            self.bucket._await_in_flight()
            self.drainer.wait(timeout)
            self._drain_ranks()
            return
        self.drainer.retry_failed()  # and finds what an earlier process left, first
        failed = self.drainer.wait(timeout)
        self.tier.settle()  # and the files the last save's retention dropped are gone
        if failed:
            raise failed[min(failed)]
        if self.drainer.prepare_error is not None:
            raise self.drainer.prepare_error

    def _find_undrained(self) -> builtins.list[int]:
        """The drainer's first work (in its thread, never a save's): list the bucket,
        learn its committed steps, record in the tier's journals the local commits it
        holds, and return this run's local steps that are due, not committed there and
        not drained before (drains an earlier process left unfinished; a step whose
        journal records its bucket commit was removed there since, by retention or a
        delete, and is not sent again)."""
        tier = self.tier
        if not tier.owned or self.ranked():
            return []  # several ranks: drain() on every rank drains them together
        remote = self.bucket._list_local()  # learns the bucket's steps too
        local = tier.list()
        there = {c.step: c for c in remote}
        for c in local:
            found = there.get(c.step)
            if found is not None and found.time == c.time and not tier.drained(c):
                tier.record(c.step, c, committed=True)
        return tier.waiting(there, local)

    def _probe(self) -> None:
        """During an outage, before the drainer sends anything else: one listing request
        to the bucket, not retried, bounded by the manager's ``deadline``."""
        store = self.bucket.store
        quick = store.with_retry(replace(store.retry, max_attempts=1))
        with deadline_scope(self.bucket.options.deadline):
            next(iter(quick.list(root_prefix(self.bucket.root_key))), None)

    def waiting(self) -> builtins.list[int]:
        """The local steps due for the bucket and not drained (the tier's journals, what
        the drainer learned and holds): kept by local retention; named when full."""
        with self._lock:
            there = set(self._in_bucket)
        return sorted(set(self.tier.waiting(there)) | self.drainer.unfinished())

    def _drain_step(self, step: int) -> None:
        """The drainer's work: copy ``step`` to the bucket and commit it there with the
        local commit's metrics, metadata and time; then retention in both tiers."""
        if self.ranked():
            self._drain_ranked_queued(step)
            return
        bucket = self.bucket
        with bucket._lock:
            bucket._pending.add(step)  # gc leaves the bucket's uncommitted step alone
        try:
            drained = self.tier.drain_step(
                step,
                bucket.store,
                bucket._step_prefix(step),
                bucket.options,
                lambda local: bucket._commit(
                    step,
                    local.metrics,
                    local.metadata,
                    local.time,
                    files=self.tier.payload_files(local),
                ),
            )
        finally:
            with bucket._lock:
                bucket._pending.discard(step)
        self._entered_bucket(step)
        if drained:
            bucket._retain_quietly()
        self.retain_local()

    def retain_local(self, defer: bool = False) -> None:
        """Local retention (and the sweep of crash leftovers); never a step due and not
        drained (the tier's journals and what the drainer holds: no bucket request),
        being saved, or restored. ``defer``: the dropped steps' files are removed by a
        thread of their own (:meth:`LocalTier.retain`)."""
        bucket = self.bucket

        def protected() -> set[int]:
            with bucket._lock:
                keep = set(bucket._pending)
            keep.update(self.waiting())
            if bucket.restored_step is not None:
                keep.add(bucket.restored_step)
            return keep

        try:
            self.tier.retain(protected, defer=defer)
        except Exception as exc:
            log.warning("retention in the local tier %s failed: %s", self.tier.url, exc)

    # -- several ranks (kind="dcp" or "megatron") ------------------------------------------
    def commit_ranks(
        self, step: int, metrics: Mapping[str, float], metadata: Mapping[str, Any]
    ) -> CheckpointInfo:
        """After a save into each rank's local tier: every directory gets the files the
        coordinator alone wrote (the kind's ``coordinator_files``, in commit order), then
        its first rank commits it locally; raises on every rank if any rank failed."""
        tier = self.tier
        group = checkpoint_group()
        tier.commit_ranks(step, step, self.bucket.kind, metrics, metadata, group, f"step {step}")
        if self.replicate_to_peer:
            self._replicate(step, group)
        info = tier.info(step)
        if info is None:
            raise NotFoundError(f"step {step} is not committed in the local tier {tier.url}")
        return replace(info, tiers=(LOCAL,))

    def _replicate(self, step: int, group: Any) -> None:
        """Send each directory's copy of ``step`` to the next directory (every rank).
        A failure is a WARNING, on every rank alike: the step is committed locally."""
        try:
            peers.replicate(self.tier, step, group, peers.ring(self.tier, group))
        except Exception as exc:
            log.warning("the peer copy of step %d failed (it is committed locally): %s", step, exc)

    def _drain_ranks(self) -> None:
        """drain() on every rank: each directory's first rank copies its files of every
        due step not in the bucket; once all are there the coordinator copies the
        kind's coordinator files (commit markers last) and commits the bucket's marker,
        step by step, oldest first."""
        tier, bucket = self.tier, self.bucket
        group = checkpoint_group()
        owner, _ = directory_owner(tier.path, group)
        remote = on_first(bucket._list_local, group, what="the bucket listing")
        self.learn(remote)
        mine = tier.waiting(c.step for c in remote)  # not one retention removed since
        lists = agree(value=mine, group=group).values
        common = set(lists[0]).intersection(*lists[1:])
        for r, steps in enumerate(lists):
            if set(steps) - common:
                log.warning(
                    "step(s) %s of rank %d are not in every rank's local tier: not drained",
                    sorted(set(steps) - common),
                    r,
                )
        for step in sorted(common):
            self._drain_ranked_step(step, group, owner)
        on_first(bucket._retain_quietly, group, what=f"retention under {bucket.root_url}")
        self.retain_local()

    def _drain_ranked_queued(self, step: int) -> None:
        """The drainer's work with several ranks (after an ``async_save``): every rank's
        drainer takes the same steps in the same order and drains each together, on a
        group of their own (ranks/groups.drain_group); a step ``drain()`` already sent is
        skipped. A failure is raised on every rank and left for ``drain()``."""
        bucket = self.bucket
        group = drain_group()
        if self._drain_owner is None:
            self._drain_owner = directory_owner(self.tier.path, group)[0]
        remote = on_first(bucket._list_local, group, what="the bucket listing")
        self.learn(remote)
        if step not in {c.step for c in remote}:
            self._drain_ranked_step(step, group, self._drain_owner)
            on_first(bucket._retain_quietly, group, what=f"retention under {bucket.root_url}")
        self.retain_local()

    def _drain_ranked_step(self, step: int, group: Any, owner: bool) -> None:
        """Drain ``step`` on every rank of ``group`` (LocalTier.drain_ranks): each
        directory's first rank (``owner``) sends its files but the coordinator's,
        keeping only the objects proven its own; then the coordinator sends its files,
        the commit markers last, and commits the bucket's marker."""
        tier, bucket = self.tier, self.bucket
        prefix = bucket._step_prefix(step)
        # by name, as copy_tree excludes: a coordinator file in a folder too
        theirs = (n.rpartition("/")[2] for n in bucket.kind.coordinator_files)
        skip = (MARKER_NAME, *theirs)

        def commit(local: CheckpointInfo, files: dict[str, int | None]) -> None:
            tier.send_payload(step, local, bucket.store, prefix, bucket.options, (MARKER_NAME,))
            info = bucket._commit(step, local.metrics, local.metadata, local.time, files=files)
            tier.confirm(step, bucket.store, prefix, info)

        with bucket._lock:
            bucket._pending.add(step)
        try:
            tier.drain_ranks(
                step,
                bucket.store,
                prefix,
                group=group,
                owner=owner,
                send=lambda local: tier.send_payload(
                    step, local, bucket.store, prefix, bucket.options, skip
                ),
                commit=commit,
            )
            self._entered_bucket(step)
        finally:
            with bucket._lock:
                bucket._pending.discard(step)

    # -- restores ------------------------------------------------------------------------
    def restores_ranked(self) -> bool:
        """Whether a restore takes the path of several ranks (:meth:`restore_ranks`):
        the job has several, or the local tier holds steps several ranks saved, each
        directory with its own ranks' files only."""
        if self.ranked():
            return True
        if not isinstance(self.bucket.kind, (DcpPayload, MegatronPayload)):
            return False
        return bool(self.tier.saved_by())

    def restore_ranks(
        self, step: int | None, map_location: Any, weights_only: bool, state: Any
    ) -> Any:
        """Every rank loads the same step: the ranks agree on what each holds and
        :func:`~.choose.choose_step` picks it (the newest, or ``step``, that each rank
        has whole locally or that the bucket has; the rules are in manager/choose.py).
        A directory lacking it gets it from its peer copy first. A rank holding it
        whole reads each file from its local copy where that copy has it, else from the
        bucket's committed copy (another node's files after a change of world size, a
        tensor only the coordinator saved); a rank without its local copy reads the
        bucket's (WARNING). A load that fails on any rank is read from the bucket by
        every rank, when the bucket has the step."""
        tier, bucket = self.tier, self.bucket
        world = world_size()
        group = checkpoint_group() if world > 1 else None
        listed, damaged, away = on_first(self.scan_bucket, group, what="the bucket listing")
        remote = {c.step for c in listed}
        mine_damaged: builtins.list[DamagedMarker] = []
        whole = set(tier.whole_steps(mine_damaged))
        saved_by = tier.saved_by()
        other_world = frozenset(s for s in whole if saved_by.get(s, world) != world)
        ringed = self.replicate_to_peer and group is not None
        layout = peers.ring(tier, group) if ringed else None
        held = peers.held(tier) if layout is not None else {}
        mine = RankHolds(frozenset(whole), held, other_world, tuple(mine_damaged))
        holds = agree(value=mine, group=group).values
        if step is not None:
            bucket._check_step(step)
        # The same on every rank: the bucket's (one listing) and every directory's.
        damaged += [d for h in holds for d in h.damaged if d.step not in remote]
        try:
            choice = choose_step(holds, remote, step=step, ring=layout, root_url=bucket.root_url)
        except NotFoundError as exc:
            if away is None:
                raise
            raise StorageError(
                f"{exc}; the bucket was not asked: it is unreachable ({away})"
            ) from None
        if choice is None:  # every rank computed the same: all return None together
            if step is None and away is not None:
                raise self.nothing_local(away)
            if damaged:
                raise bucket._damaged_error(damaged)
            return bucket._start_fresh()
        chosen, fill = choice.step, choice.fill
        if step is None:
            bucket._warn_fallback(chosen, damaged)
        if layout is not None and fill:
            for owner in fill:
                if owner == layout.me:
                    log.warning(
                        "step %d is not whole in the local tier %s of rank %d; copying it "
                        "back from its peer, rank %d",
                        chosen,
                        tier.url,
                        rank(),
                        layout.ranks[layout.holder_of(owner) or 0],
                    )
            peers.receive_missing(tier, chosen, group, layout, fill)
            whole = set(tier.whole_steps())
        error: BaseException | None = None
        fatal = False
        result: Any = None
        try:  # every rank reaches the agreement below, whichever copy it reads
            if chosen in whole:
                by = saved_by.get(chosen)
                result = self._restore_tiered(
                    chosen, chosen in remote, by, map_location, weights_only, state
                )
            else:
                log.warning(
                    "step %d is not whole in the local tier %s of rank %d; reading it from %s",
                    chosen,
                    tier.url,
                    rank(),
                    bucket.step_url(chosen),
                )
                result = bucket._restore_bucket(chosen, map_location, weights_only, state)
        except (CorruptCheckpointError, NotFoundError, DistributedLoadError) as exc:
            error = exc  # DCP raises on every rank at once: each rank gets here
        except Exception as exc:  # not the copy's fault (a bad target, a kind's check)
            error, fatal = exc, True
        said = None if error is None else (fatal, f"{type(error).__name__}: {error}")
        told = agree(value=said, group=group).values
        failures = {r: t[1] for r, t in enumerate(told) if t}
        if failures and (chosen not in remote or any(t[0] for t in told if t)):
            # Raised on every rank: the failed one its own error, the others theirs or
            # one naming it; the bucket's copy would fail the same way, or is not there.
            where = "the local tiers (not in the bucket)" if chosen not in remote else "either tier"
            raise error or DistributedLoadError.of(
                f"the load of step {chosen} from {where}", failures
            )
        if failures:
            log.warning(
                "step %d failed while loading (%s); every rank reads it from %s",
                chosen,
                "; ".join(f"rank {r}: {t}" for r, t in failures.items()),
                bucket.step_url(chosen),
            )
            if error is not None:  # its frames hold what the failed load had read
                traceback.clear_frames(error.__traceback__)
            error = None
            result = bucket._restore_bucket(chosen, map_location, weights_only, state)
        bucket.restored_step = chosen
        return result

    def _restore_tiered(
        self,
        step: int,
        in_bucket: bool,
        saved_by: int | None,
        map_location: Any,
        weights_only: bool,
        state: Any,
    ) -> Any:
        """Load ``step`` on this rank through a view of its local copy over the bucket's
        (store/overlay.py): each file from the local copy when the local marker lists it
        (checked whole before), else from the bucket's committed copy (``in_bucket``;
        without it such a file is a NotFoundError naming it and the step). Logs at INFO
        what the bucket served."""
        tier, bucket = self.tier, self.bucket
        # A kind with coordinator files (DCP, Megatron, DeepSpeed's) loads from a view.
        load: Callable[..., Any] = bucket.kind.load
        info = tier.info(step)
        if info is None:
            raise NotFoundError(f"step {step} is not committed in the local tier {tier.url}")
        world = world_size()
        if saved_by is not None and saved_by != world:
            hint = (
                f"it was saved by {saved_by} ranks and this job has {world}: drain it from "
                f"a job of {saved_by} ranks, or restore it on {saved_by} ranks"
            )
        else:
            hint = "another node's local tier may hold it: drain the step to read it here"
        view = OverlayStore(
            tier.store,
            tier.step_prefix(step),
            [*(f.name for f in info.files), MARKER_NAME],  # the local commit's description
            bucket.store if in_bucket else None,
            bucket._step_prefix(step),
            what=f"step {step}",
            hint=hint,
            also=self._peer_copies(step),
        )
        url = tier.step_url(step)
        result = load(
            Target(url, view, "", tier.options, url),
            tier.options,
            map_location=map_location,
            weights_only=weights_only,
            state=state,
            local=True,
        )
        files, nbytes = view.remote_reads
        log.info(
            "step %d: rank %d read %d file(s), %d bytes, from the bucket at %s; the rest "
            "from its local tier %s",
            step,
            rank(),
            files,
            nbytes,
            bucket.step_url(step),
            tier.url,
        )
        return result

    def _peer_copies(self, step: int) -> builtins.list[tuple[str, builtins.list[str]]]:
        """The whole copies of ``step`` this directory keeps for its peer (with
        ``replicate_to_peer``): each prefix and the names its marker lists, read before
        the bucket when this directory's own copy lacks a file."""
        if not self.replicate_to_peer:
            return []
        found = []
        for source, steps in peers.held(self.tier).items():
            prefix = peers.peer_prefix(source, step)
            copy = read_marker(self.tier.store, prefix + MARKER_NAME) if step in steps else None
            if copy is not None:
                found.append((prefix, [f.name for f in copy.files]))
        return found

    def restore_local(self, info: CheckpointInfo, load: Callable[..., Any]) -> Any:
        """Load ``info``'s step from the local tier (its files mapped where the kind can:
        ``local=True``); when the local copy fails a check (a missing file, a wrong size,
        a corrupt record), say so at WARNING and load the same step from the bucket (the
        error is raised when the bucket lacks it)."""
        tier, bucket = self.tier, self.bucket
        local = tier.step_url(info.step)
        try:
            tier.check_files(tier.info(info.step) or info)
            return load(local, tier.options, local=True)
        except (CorruptCheckpointError, NotFoundError) as exc:
            if REMOTE not in info.tiers:
                raise
            log.warning(
                "step %d: the local copy at %s failed a check (%s: %s); loading it from %s",
                info.step,
                local,
                type(exc).__name__,
                exc,
                bucket.step_url(info.step),
            )
            # The failed load's frames hold what it had read (in a cycle through its
            # transfer group): freed now, not at the next full collection, so the
            # bucket's copy is not read beside it.
            traceback.clear_frames(exc.__traceback__)
        return bucket._load_committed(info, load)

    # -- removals ------------------------------------------------------------------------
    def delete_ranks(self, step: int) -> None:
        """:meth:`CheckpointManager.delete` in a job of several ranks (a collective on
        the checkpoint group): every rank's drainer finishes what it has queued first
        (those drains are collectives of every rank's drainer, so none is cut short on
        one rank; a drain of ``step`` past its uploads commits before the delete, not
        after it), then the first rank removes the bucket's copy (marker first) and
        every rank its own local copy; NotFoundError on every rank when no tier held it."""
        group = checkpoint_group()
        self.drainer.wait()  # other steps' failures stay for drain() to report
        settle(None, f"every rank's drains before step {step} is deleted", group=group)
        self.drainer.discard(step)  # idle on every rank: nothing waits, all forget it
        bucket = self.bucket
        removed = on_first(
            lambda: bucket._remove_step(step), group, what=f"deleting step {step} from the bucket"
        )
        self.left_bucket(step)
        error: BaseException | None = None
        local = 0
        try:
            local = self.delete(step)
        except Exception as exc:
            error = exc
        counts = agree(
            error, value=local, group=group, what=f"deleting the local copies of step {step}"
        )
        if error is not None:
            raise error
        counts.raise_failures(f"deleting the local copies of step {step}")
        if removed + sum(counts.values) == 0:
            raise NotFoundError(f"no checkpoint for step {step} at {bucket.step_url(step)}")

    def stop_drain(self, step: int) -> None:
        """Before ``step`` is deleted by one process: its drain is no longer queued, and
        one under way ends first (Drainer.discard), so it does not commit the step in the
        bucket after the delete removed it there (several ranks: :meth:`delete_ranks`)."""
        self.drainer.discard(step)

    def delete(self, step: int) -> int:
        """Delete the local copy of ``step`` (its marker first) and its journal, if the
        directory is this run's; returns the objects deleted. The caller took the step
        off the drainer first (:meth:`stop_drain`, :meth:`delete_ranks`)."""
        tier = self.tier
        if not tier.owned:
            return 0
        tier.settle()
        removed = remove_checkpoint(tier.store, tier.step_prefix(step), tier.options)
        tier.forget(step)
        return removed

    def collect_garbage(
        self, grace_seconds: float, dry_run: bool, protected: set[int]
    ) -> GcReport | None:
        """gc in the local directory (None when it is not this run's): a temp file whose
        lock is free is dead (node-local), whatever its age."""
        tier = self.tier
        if not tier.owned:
            return None
        tier.settle()  # a step retention is removing is not garbage
        return collect_garbage(
            tier.store,
            "",
            tier.options,
            grace_seconds=grace_seconds,
            dry_run=dry_run,
            protected=protected,
            trust_locks=True,  # node-local: a temp file whose lock is free is dead
        )
