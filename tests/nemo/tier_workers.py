"""Code that runs inside the ranks of tests/nemo/test_local_tier.py: CloudMegatronCheckpointIO
with a local tier, driven with megatron sharded state dicts as MegatronStrategy hands
them over. ``local_dir`` is ``<root>/node`` for both ranks (one node) or
``<root>/rank<N>`` (a directory per rank, as on two nodes).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mcore_workers as w
import torch
import torch.distributed as dist
from nemo_workers import (
    CONTENT,
    cpu_friendly_megatron,
    names_under,
    nemo_checkpoint,
    nemo_load_request,
    restore,
)

import cloudckpt.megatron as cm


def local_dir(root: str, rank: int | None) -> str:
    """The local_dir of ``rank`` (None: the one both ranks share)."""
    return f"{root}/node" if rank is None else f"{root}/rank{rank}"


def copies(where: str) -> list[str]:
    """The checkpoint folders of a local tier (its drain records' folder aside)."""
    return [p.name for p in Path(where).iterdir() if p.is_dir() and p.name != "_DRAINS"]


def _io(root: str, rank: int | None, so: dict[str, Any], **kwargs: Any) -> Any:
    from cloudckpt.nemo import CloudMegatronCheckpointIO

    return CloudMegatronCheckpointIO(local_dir=local_dir(root, rank), storage_options=so, **kwargs)


def _states() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The checkpoints of steps 1 and 2 (two models: a checkpoint holds its model's
    live tensors) and the states they hold; the same in every process (seeded)."""
    checkpoints, wanted = [], []
    for step in (1, 2):
        model = w.build_gpt(2)
        opt = w.adam_for(model, 2)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(float(step))
        wanted.append(w.full_state(model, opt))
        checkpoints.append(nemo_checkpoint(model, opt, step))
    return checkpoints, wanted


def _check_load(io: Any, path: str, want: dict[str, Any], what: str) -> None:
    fresh = w.build_gpt(2, seed=7)
    fresh_opt = w.adam_for(fresh, 1)
    restore(fresh, fresh_opt, io.load_checkpoint(path, nemo_load_request(fresh, fresh_opt)))
    w.assert_same(w.full_state(fresh, fresh_opt), want, what)


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []
        logging.getLogger("cloudckpt").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(record.getMessage())


def save_and_drain(rank: int, world: int, url: str, so: dict[str, Any], root: str) -> None:
    """A sync save (local commit before it returns), then an async one through NeMo's
    finalizer (committed locally in the finalize step); drain(); the bucket holds both,
    committed, and the plain IO reads them back."""
    from nemo.utils.callbacks.dist_ckpt_io import AsyncFinalizerCallback

    from cloudckpt.nemo import CloudMegatronCheckpointIO, cloud_checkpoint_io

    cpu_friendly_megatron()
    checkpoints, wanted = _states()
    sync = _io(root, None, so)
    sync.save_checkpoint(checkpoints[0], f"{url}/step=1.ckpt",
                         storage_options={"content_metadata": CONTENT})  # fmt: skip
    info = sync._tier.info("step=1")
    assert info is not None and info.metadata["nemo_name"] == "step=1" and info.step == 1
    assert Path(local_dir(root, None), "step=1", "weights", "metadata.json").is_file()
    sync.drain()
    assert cm.is_checkpoint(f"{url}/step=1/weights", storage_options=so)

    io = cloud_checkpoint_io(async_save=True, local_dir=local_dir(root, None), storage_options=so)
    trainer = SimpleNamespace(strategy=SimpleNamespace(checkpoint_io=io))
    io.save_checkpoint(checkpoints[1], f"{url}/step=2.ckpt", {"content_metadata": CONTENT})
    assert io.checkpoint_io._tier.info("step=2") is None  # committed in the finalize step
    AsyncFinalizerCallback().on_train_end(trainer)
    assert io.checkpoint_io._tier.info("step=2") is not None
    io.teardown()  # NeMo's teardown drains what is left
    assert cm.is_checkpoint(f"{url}/step=2/weights", storage_options=so)
    plain = CloudMegatronCheckpointIO(storage_options=so)
    for step, want in zip((1, 2), wanted, strict=True):
        _check_load(plain, f"{url}/step={step}/weights", want, f"rank {rank} step {step}")
    assert plain.load_content_metadata(f"{url}/step=2") == CONTENT


def load_local(rank: int, world: int, url: str, so: dict[str, Any], root: str) -> None:
    """A new IO with the same local_dir reads step=2 from its local copies."""
    _, wanted = _states()
    warnings = _Warnings()
    io = _io(root, None, so)
    assert io.load_content_metadata(f"{url}/step=2") == CONTENT
    _check_load(io, f"{url}/step=2/weights", wanted[1], f"rank {rank} local load")
    assert warnings.seen == [], warnings.seen


def load_with_a_copy_missing(
    rank: int, world: int, url: str, so: dict[str, Any], root: str
) -> None:
    """The node's local copy lacks a file: every rank reads the bucket, saying why."""
    _, wanted = _states()
    warnings = _Warnings()
    io = _io(root, None, so)
    _check_load(io, f"{url}/step=2", wanted[1], f"rank {rank} bucket load")
    said = [s for s in warnings.seen if "reading it from the bucket" in s]
    assert len(said) == 1 and "step=2" in said[0] and "rank 1" in said[0], warnings.seen


class _SpyCondition(threading.Condition):
    """The tier's condition, telling when a removal starts waiting for a drain."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()
        return super().wait(timeout)


def removals_race_drains(rank: int, world: int, url: str, so: dict[str, Any], root: str) -> None:
    """Top-k removal (rank 0) of a checkpoint whose drain has not started, then of one
    being drained: neither is left in the bucket; keep_local prunes the local copies."""
    cpu_friendly_megatron()
    checkpoints, _ = _states()
    io = _io(root, rank, so, keep_local=1)
    tier = io._tier
    spy = tier._cond = _SpyCondition()
    # Not started: rank 0 holds the tier's lock, so its drainer can't ask whether step=1
    # is still wanted until the removal recorded it.
    if rank == 0:
        spy.acquire()
    io.save_checkpoint(checkpoints[0], f"{url}/step=1.ckpt")
    if rank == 0:
        io.remove_checkpoint(f"{url}/step=1.ckpt")
        spy.release()
    io.drain()
    assert names_under(f"{url}/step=1", so) == [], names_under(f"{url}/step=1", so)

    # Under way: the removal waits for the drain's commit, then deletes.
    order: list[str] = []
    started = threading.Event()
    copy = tier._copy

    def commit_copy(name: str, exclude: tuple[str, ...]) -> None:
        if not exclude and rank == 0:  # the coordinator's copy, metadata.json last
            started.set()
            assert spy.waiting.wait(60), "the removal did not wait for the drain"
            copy(name, exclude)
            order.append("committed")
            return
        copy(name, exclude)

    tier._copy = commit_copy
    io.save_checkpoint(checkpoints[1], f"{url}/step=2.ckpt")
    if rank == 0:
        assert started.wait(60)
        io.remove_checkpoint(f"{url}/step=2.ckpt")
        order.append("removed")
        assert order == ["committed", "removed"], order
    io.drain()
    assert names_under(f"{url}/step=2", so) == [], names_under(f"{url}/step=2", so)

    tier._copy = copy
    checkpoints[1]["global_step"] = 3
    io.save_checkpoint(checkpoints[1], f"{url}/step=3.ckpt")
    io.drain()
    assert cm.is_checkpoint(f"{url}/step=3/weights", storage_options=so)
    here = sorted(copies(local_dir(root, rank)))
    assert here == ["step=3"], here
    dist.barrier()


def drain_cut_short(rank: int, world: int, url: str, so: dict[str, Any], root: str) -> None:
    """A save committed locally whose drain stopped after each directory's data (what
    a kill leaves: copy_tree writes metadata.json last): no background drain runs."""
    from cloudckpt.manager.payload import MegatronPayload

    cpu_friendly_megatron()
    checkpoints, _ = _states()
    io = _io(root, rank, so)
    io._tier.queue = lambda name: None  # the process "dies" before its drain runs
    io.save_checkpoint(checkpoints[0], f"{url}/step=1.ckpt")
    io._tier._copy("step=1", MegatronPayload().coordinator_files)
    dist.barrier()


def next_io_finishes(rank: int, world: int, url: str, so: dict[str, Any], root: str) -> None:
    """A new IO with the same local_dir: drain() finishes the drain left behind."""
    from cloudckpt.nemo import CloudMegatronCheckpointIO

    _, wanted = _states()
    io = _io(root, rank, so)
    io.drain()
    assert cm.is_checkpoint(f"{url}/step=1/weights", storage_options=so)
    _check_load(
        CloudMegatronCheckpointIO(storage_options=so), f"{url}/step=1", wanted[0], "drained"
    )
    # Each rank's own directory: its files from local disk, the other node's (a tensor
    # only the coordinator saved) from the bucket.
    _check_load(io, f"{url}/step=1", wanted[0], f"rank {rank} from local and the bucket")


def failed_drain_retried(rank: int, world: int, url: str, so: dict[str, Any], root: str) -> None:
    """A drain that fails (the coordinator's copy, once) is a WARNING on every rank and
    leaves the bucket uncommitted; drain() tries it again and commits it."""
    cpu_friendly_megatron()
    checkpoints, wanted = _states()
    warnings = _Warnings()
    io = _io(root, rank, so)
    tier = io._tier
    copy = tier._copy
    failures = [OSError("the bucket went away")] if rank == 0 else []

    def flaky(name: str, exclude: tuple[str, ...]) -> None:
        if not exclude and failures:
            raise failures.pop()
        copy(name, exclude)

    tier._copy = flaky
    io.save_checkpoint(checkpoints[1], f"{url}/step=2.ckpt")
    assert set(tier.drainer.wait()) == {"step=2"}
    said = [s for s in warnings.seen if "the drain of checkpoint step=2" in s]
    assert len(said) == 1 and "bucket went away" in said[0], warnings.seen
    assert not cm.is_checkpoint(f"{url}/step=2/weights", storage_options=so)
    io.drain()
    assert tier.unfinished() == set()
    _check_load(io, f"{url}/step=2", wanted[1], f"rank {rank} after the retried drain")


TIMEOUT = 120


def resave_while_draining(rank: int, world: int, url: str, so: dict[str, Any], root: str) -> None:
    """A name saved again while its first copy drains: the new save's writes wait for
    that drain (on every rank), so the bucket never commits a mix of the two; the new
    copy is drained after it and read back whole."""
    cpu_friendly_megatron()
    checkpoints, wanted = _states()
    io = _io(root, rank, so)
    tier = io._tier
    copy, forget = tier._copy, tier.forget
    started, resaving = threading.Event(), threading.Event()
    order: list[str] = []

    def held_copy(name: str, exclude: tuple[str, ...]) -> None:
        first = not started.is_set()
        if first:  # the first drain's copy waits until the new save of its name begins
            started.set()
            assert resaving.wait(TIMEOUT)
        copy(name, exclude)
        if first:
            order.append("first drain copied")

    def marked_forget(name: str) -> None:
        resaving.set()
        forget(name)
        order.append("resave began")

    from cloudckpt.errors import NotFoundError
    from cloudckpt.manager import MARKER_NAME
    from cloudckpt.options import resolve_options
    from cloudckpt.store import open_url

    commit_url = f"{url}/step=1/weights/metadata.json"  # the bucket's commit of the name
    bucket, commit = open_url(commit_url, resolve_options(storage_options=so))
    uncommitted: list[bool] = []  # at each uncommit of the old copy: is the bucket's committed?

    def committed() -> bool:
        try:
            bucket.head(commit)
        except NotFoundError:
            return False
        return True

    tier._copy = held_copy
    io.save_checkpoint(checkpoints[0], f"{url}/step=1.ckpt")
    assert started.wait(TIMEOUT)
    local = tier._local().store  # bound by the first save
    delete = local.delete

    def noted_delete(key: str) -> None:
        if key == f"step=1/{MARKER_NAME}" and resaving.is_set():
            uncommitted.append(committed())
        delete(key)

    local.delete = noted_delete  # type: ignore[method-assign]
    tier.forget = marked_forget
    io.save_checkpoint(checkpoints[1], f"{url}/step=1.ckpt")  # the same name, new state
    assert order == ["first drain copied", "resave began"], (rank, order)
    # No rank uncommits its old copy before the drain committed it in the bucket: a
    # crash in between left nothing to restore (rank 1 did it at once).
    assert uncommitted == [True], (rank, uncommitted)
    io.drain()
    assert tier.unfinished() == set()
    from cloudckpt.nemo import CloudMegatronCheckpointIO

    plain = CloudMegatronCheckpointIO(storage_options=so)
    _check_load(plain, f"{url}/step=1", wanted[1], f"rank {rank}: the bucket's copy")


def full_tier(rank: int, world: int, url: str, so: dict[str, Any], root: str) -> None:
    """Rank 1's local tier has 1 KiB free: the save fails on every rank before anything
    is written (LocalTierFullError there, a CollectiveError naming it on rank 0); with
    room again, the same save commits."""
    import shutil
    from collections import namedtuple

    import pytest

    from cloudckpt.errors import CollectiveError, LocalTierFullError

    cpu_friendly_megatron()
    checkpoints, wanted = _states()
    io = _io(root, rank, so)
    real = shutil.disk_usage
    if rank == 1:
        usage = namedtuple("usage", "total used free")
        shutil.disk_usage = lambda path: usage(1 << 30, 1 << 30, 1024)  # type: ignore[assignment]
    expected = LocalTierFullError if rank == 1 else CollectiveError
    with pytest.raises(expected, match="1024 bytes free" if rank == 1 else "rank 1"):
        io.save_checkpoint(checkpoints[0], f"{url}/step=1.ckpt")
    shutil.disk_usage = real  # type: ignore[assignment]
    assert not Path(local_dir(root, rank), "step=1").exists()  # nothing written
    io.save_checkpoint(checkpoints[0], f"{url}/step=1.ckpt")
    io.drain()
    _check_load(io, f"{url}/step=1", wanted[0], f"rank {rank} after the refused save")


def records(where: str) -> dict[str, dict[str, Any]]:
    """The drain records of a local tier by checkpoint name (engine/journal.py)."""
    return {p.stem: json.loads(p.read_text()) for p in Path(where, "_DRAINS").glob("*.json")}


def drained_by_the_record(rank: int, world: int, url: str, so: dict[str, Any], root: str) -> None:
    """Each directory records its drain (``_DRAINS/<name>.json``): committed once the
    bucket's commit is written; keep_local then prunes the older copy by that record."""
    cpu_friendly_megatron()
    checkpoints, wanted = _states()
    io = _io(root, rank, so, keep_local=1)
    io.save_checkpoint(checkpoints[0], f"{url}/step=1.ckpt")
    io.drain()
    here = local_dir(root, rank)
    (record,) = records(here).values()
    info = io._tier.info("step=1")
    assert record["committed"] and record["started"] and record["remote"] == url, record
    assert record["time"] == info.time, (record, info)
    io.save_checkpoint(checkpoints[1], f"{url}/step=2.ckpt")
    io.drain()
    assert sorted(copies(here)) == ["step=2"] and list(records(here)) == ["step=2"]
    _check_load(io, f"{url}/step=2", wanted[1], f"rank {rank} from local and the bucket")


def tier_of_the_previous_release(
    rank: int, world: int, url: str, so: dict[str, Any], root: str
) -> None:
    """What the previous release left in each directory: step=1 drained, step=2
    committed locally and never drained (its process died), each recorded in
    ``<name>.drain.json`` beside its folder, nothing under ``_DRAINS``."""
    cpu_friendly_megatron()
    checkpoints, _ = _states()
    io = _io(root, rank, so)
    io.save_checkpoint(checkpoints[0], f"{url}/step=1.ckpt")
    io.drain()
    io._tier.queue = lambda name: None  # the process "dies" before step=2's drain runs
    io.save_checkpoint(checkpoints[1], f"{url}/step=2.ckpt")
    here = Path(local_dir(root, rank))
    for name, drained in (("step=1", True), ("step=2", False)):
        Path(here, "_DRAINS", f"{name}.json").unlink(missing_ok=True)
        body = {"started": drained, "drained": drained}
        Path(here, f"{name}.drain.json").write_text(json.dumps(body))
    dist.barrier()


def previous_release_resumed(
    rank: int, world: int, url: str, so: dict[str, Any], root: str
) -> None:
    """A new IO on that tier: step=2 is drained (its old record: not drained; the
    test checks the bucket's commit after), step=1 pruned by keep_local (its old
    record: drained); the old records give way to ``_DRAINS/<name>.json``."""
    _, wanted = _states()
    io = _io(root, rank, so, keep_local=1)
    io.drain()
    here = local_dir(root, rank)
    assert sorted(copies(here)) == ["step=2"]
    assert sorted(p.name for p in Path(here).glob("*.drain.json")) == []
    assert records(here)["step=2"]["committed"], records(here)
    _check_load(io, f"{url}/step=2", wanted[1], f"rank {rank} after the previous release")


def leftovers_swept(rank: int, world: int, url: str, so: dict[str, Any], root: str) -> None:
    """A temp file of a dead writer (a local save killed mid-file: no lock held on it)
    is removed by the next save and by retention; a live writer's is kept."""
    from cloudckpt.store.local import LocalStore

    cpu_friendly_megatron()
    checkpoints, _ = _states()
    io = _io(root, rank, so)
    io.save_checkpoint(checkpoints[0], f"{url}/step=1.ckpt")
    io.drain()
    here = Path(local_dir(root, rank))
    store = LocalStore(here)
    live = store.create_multipart("step=1/weights/live.distcp")  # alive: its lock held
    alive = here / "step=1" / "weights" / live.upload_id

    def dead(folder: Path) -> Path:
        path = folder / f".__1_0.distcp.cloudckpt-{uuid.uuid4().hex}.part"
        path.write_bytes(b"\0" * 4096)
        return path

    try:
        left = dead(here / "step=1" / "weights")
        dist.barrier()
        io.save_checkpoint(checkpoints[1], f"{url}/step=2.ckpt")
        assert not left.exists() and alive.exists(), (left, alive)
        left = dead(here)
        io.drain()  # its retention sweeps the tier
        assert not left.exists() and alive.exists(), (left, alive)
    finally:
        store.abort_multipart(live)
    dist.barrier()


def copy_without_a_record(rank: int, world: int, url: str, so: dict[str, Any], root: str) -> None:
    """Another save of step=1 straight to the bucket, then a copy of the same name
    committed locally by a release that kept no drain record (its drain never ran): the
    same shapes (the same sizes), other values. The local commit is the newer one (a
    bucket commit newer than the local one is kept by the drain instead:
    ``a_newer_bucket_commit_of_the_name``)."""
    import time

    from cloudckpt.nemo import CloudMegatronCheckpointIO

    cpu_friendly_megatron()
    checkpoints, _ = _states()
    plain = CloudMegatronCheckpointIO(storage_options=so)
    plain.save_checkpoint(checkpoints[1], f"{url}/step=1.ckpt")  # another save, committed
    later = time.time() + 1.1  # past the whole second the bucket's clock gives that commit
    while time.time() < later:
        time.sleep(0.05)
    io = _io(root, rank, so)
    io._tier.queue = lambda name: None  # the process "dies" before its drain runs
    io.save_checkpoint(checkpoints[0], f"{url}/step=1.ckpt")
    for record in Path(local_dir(root, rank)).rglob("*.json"):
        if record.parent.name == "_DRAINS" or record.name.endswith(".drain.json"):
            record.unlink()
    dist.barrier()


def record_less_copy_drained(
    rank: int, world: int, url: str, so: dict[str, Any], root: str
) -> None:
    """A new IO on those directories drains the local copy: nothing of the bucket's
    other save is kept for it by its time or size, so the bucket's step=1 is the local
    copy's state, and the local copy's record says it is drained."""
    from cloudckpt.nemo import CloudMegatronCheckpointIO

    _, wanted = _states()
    io = _io(root, rank, so)
    io.drain()
    plain = CloudMegatronCheckpointIO(storage_options=so)
    _check_load(plain, f"{url}/step=1", wanted[0], f"rank {rank}: the bucket's copy")
    assert records(local_dir(root, rank))["step=1"]["committed"]


def resave_after_a_killed_save(
    rank: int, world: int, url: str, so: dict[str, Any], root: str
) -> None:
    """Both ranks share one local_dir where a killed save of step=1 left files (one no
    rank writes again, a folder): the next save of the name removes them first, so
    neither its local marker nor the bucket's copy holds them, and the copy loads."""
    cpu_friendly_megatron()
    checkpoints, wanted = _states()
    here = Path(local_dir(root, None))
    stale = here / "step=1" / "weights" / "__9_0.distcp"
    if rank == 0:
        stale.parent.mkdir(parents=True)
        stale.write_bytes(b"a killed save's")
        (here / "step=1" / "extra").mkdir()
        (here / "step=1" / "extra" / "x.bin").write_bytes(b"x")
    dist.barrier()
    io = _io(root, None, so)
    io.save_checkpoint(checkpoints[0], f"{url}/step=1.ckpt")
    info = io._tier.info("step=1")
    assert info is not None
    names = {f.name for f in info.files}
    assert "weights/__9_0.distcp" not in names and "extra/x.bin" not in names, names
    assert not stale.exists() and not (here / "step=1" / "extra").exists()
    io.drain()
    assert "__9_0.distcp" not in names_under(f"{url}/step=1/weights", so)
    from cloudckpt.nemo import CloudMegatronCheckpointIO

    plain = CloudMegatronCheckpointIO(storage_options=so)
    _check_load(plain, f"{url}/step=1/weights", wanted[0], f"rank {rank}: the bucket's copy")


def a_newer_bucket_commit_of_the_name(
    rank: int, world: int, url: str, so: dict[str, Any], root: str
) -> None:
    """step=1 committed in each rank's local tier and never drained (its process died
    right after the commit: the drain is not queued); then another save of the same
    name straight to the bucket (another node's, later). A new IO on the same local_dirs
    loads the bucket's newer commit (WARNING), not the older local copy, and its drain
    leaves the bucket's commit as it is (WARNING)."""
    import time

    from cloudckpt.nemo import CloudMegatronCheckpointIO

    cpu_friendly_megatron()
    checkpoints, wanted = _states()
    io = _io(root, rank, so)
    io._tier.queue = lambda name: None  # the process dies before it drains
    io.save_checkpoint(checkpoints[0], f"{url}/step=1.ckpt")
    committed = io._tier.info("step=1").time
    # The bucket's times are whole seconds: the other save's is then surely later.
    while time.time() < committed + 1.1:
        time.sleep(0.05)
    other = CloudMegatronCheckpointIO(storage_options=so)
    other.save_checkpoint(checkpoints[1], f"{url}/step=1.ckpt")

    warnings = _Warnings()
    again = _io(root, rank, so)
    _check_load(again, f"{url}/step=1/weights", wanted[1], f"rank {rank} the bucket's newer")
    again.drain()
    _check_load(other, f"{url}/step=1/weights", wanted[1], f"rank {rank} the bucket kept")
    if rank == 0:  # the first rank decides both, and says so
        newer = [m for m in warnings.seen if "is newer than the local tier's" in m]
        assert any("reading the bucket's" in m for m in newer), warnings.seen
        assert any("the bucket keeps its own" in m for m in newer), warnings.seen


def a_drained_copy_then_a_newer_bucket_commit(
    rank: int, world: int, url: str, so: dict[str, Any], root: str
) -> None:
    """step=1 saved and drained by this run, then saved twice more at once (the same
    run's new commits of the name drain over its older ones, within the same second of
    the bucket's clock too); then another save of the name straight to the bucket. Every
    megatron ``metadata.json`` holds the same bytes (same ETag), so only the whole drain
    record tells the copy's own commit from the other save's: a new IO loads the
    bucket's newer commit. Then a drain whose check of the bucket fails (an outage)
    fails, and leaves the bucket's commit as it is."""
    import time

    from cloudckpt.errors import RetriesExhaustedError
    from cloudckpt.nemo import CloudMegatronCheckpointIO

    cpu_friendly_megatron()
    checkpoints, wanted = _states()
    io = _io(root, rank, so)
    for checkpoint in (checkpoints[0], checkpoints[1], checkpoints[0]):
        io.save_checkpoint(checkpoint, f"{url}/step=1.ckpt")
        io.drain()
    plain = CloudMegatronCheckpointIO(storage_options=so)
    _check_load(plain, f"{url}/step=1/weights", wanted[0], f"rank {rank} the run's last drain")
    committed = io._tier.info("step=1").time
    while time.time() < committed + 1.1:  # the bucket's times are whole seconds
        time.sleep(0.05)
    plain.save_checkpoint(checkpoints[1], f"{url}/step=1.ckpt")

    warnings = _Warnings()
    again = _io(root, rank, so)
    _check_load(again, f"{url}/step=1/weights", wanted[1], f"rank {rank} the bucket's newer")
    if rank == 0:
        assert any("reading the bucket's" in m for m in warnings.seen), warnings.seen

    # A copy not drained (its process died after the commit), then a drain whose look at
    # the bucket's commit fails for an outage: the drain fails, the bucket keeps its own.
    undrained = _io(root, rank, so)
    undrained._tier.queue = lambda name: None
    undrained.save_checkpoint(checkpoints[0], f"{url}/step=3.ckpt")
    plain.save_checkpoint(checkpoints[1], f"{url}/step=3.ckpt")
    later = _io(root, rank, so)
    later._tier.bind(url, later._settings.open(url))
    store = later._tier.remote.store
    real_list, failed = store.list, []

    def away_once(prefix: str, *args: Any, **kwargs: Any) -> Any:
        if prefix.endswith("step=3/weights/") and not failed:
            failed.append(prefix)  # the first look at the name's commit only
            raise RetriesExhaustedError("the bucket is away (injected)")
        return real_list(prefix, *args, **kwargs)

    store.list = away_once
    with contextlib.suppress(Exception):  # fails, or tried again finds the newer commit
        later.drain()
    store.list = real_list
    _check_load(plain, f"{url}/step=3/weights", wanted[1], f"rank {rank} the bucket kept")
