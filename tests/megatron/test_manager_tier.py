"""CheckpointManager(kind="megatron") on a real megatron-core GPTModel (TP=2, 2 gloo ranks).

Each rank saves into its own local tier; ``drain()`` sends every rank's files to the
bucket, the coordinator's last; the bucket's copy loads with megatron's own
``dist_checkpointing.load``; a rank whose local copy is gone restores from the bucket
while the other reads only its local directory (each rank reaches the bucket through a
request-recording proxy of its own during the restore). ``async_save`` commits in the
background, in the bucket or in each rank's tier (then drained by the ranks' drainers),
and a save that fails on one rank fails on every rank with nothing committed.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
import torch

pytest.importorskip("megatron.core.dist_checkpointing")

import mcore_workers as w
import torch.distributed as dist

from cloudckpt.dcp import writer as writer_module
from cloudckpt.engine.handle import in_flight
from cloudckpt.errors import ConfigError, DistributedSaveError
from cloudckpt.manager import MARKER_NAME, CheckpointManager
from cloudckpt.manager.marker import step_dir
from cloudckpt.options import TransferOptions
from cloudckpt.store import open_url
from cloudckpt.testing.fault_proxy import FaultProxy
from ranks import run_ranks
from servers import S3Server, unique_bucket_name

pytestmark = pytest.mark.filterwarnings("ignore")

TIMEOUT = 300  # seconds for a whole multi-rank scenario on a busy 2-core machine
COORDINATOR_FILES = {".cloudckpt-layout.json", ".metadata", "common.pt", "metadata.json"}


class _Messages(logging.Handler):
    """Collects the WARNING messages of the ``cloudckpt`` logger."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _restored(model: Any, opt: Any, loaded: dict[str, Any]) -> dict[str, Any]:
    model.load_state_dict(loaded.pop("model"))
    w.restore_optimizer(opt, loaded.pop("optimizer"))
    return w.full_state(model, opt)


def tiers_then_bucket(
    rank: int,
    world: int,
    root: str,
    so: dict[str, Any],
    restore_so: list[dict[str, Any]],
    tmp: str,
) -> None:
    """Steps 1 and 2 to per-rank local tiers, drained; megatron reads the bucket's step 2;
    rank 1 loses its step 2 and restores it from the bucket, rank 0 from its directory."""
    from megatron.core import dist_checkpointing

    w._cpu_friendly_megatron()
    local = Path(tmp) / f"tier{rank}"
    model = w.build_gpt(2)
    manager = CheckpointManager(root, local_dir=local, kind="megatron", storage_options=so)
    manager.save(1, w.checkpoint_state(model, w.adam_for(model, 1)))
    opt = w.adam_for(model, 2)
    want = w.full_state(model, opt)
    manager.save(2, w.checkpoint_state(model, opt))
    manager.drain()

    down = Path(tmp) / "from-bucket"
    if rank == 0:
        w._copy_down(f"{root}/{step_dir(2)}", down, so)
    dist.barrier()
    other = w.build_gpt(2, seed=21)
    other_opt = w.adam_for(other, 1)
    loaded = dist_checkpointing.load(w.checkpoint_state(other, other_opt), str(down))
    w.assert_same(_restored(other, other_opt, loaded), want, "the bucket's step 2 by megatron")

    if rank == 1:
        shutil.rmtree(local / step_dir(2))
    dist.barrier()
    again = CheckpointManager(
        root, local_dir=local, kind="megatron", storage_options=restore_so[rank]
    )
    fresh = w.build_gpt(2, seed=22)
    fresh_opt = w.adam_for(fresh, 1)
    seen = _Messages()
    logging.getLogger("cloudckpt").addHandler(seen)
    try:
        loaded = again.restore(state=w.checkpoint_state(fresh, fresh_opt))
    finally:
        logging.getLogger("cloudckpt").removeHandler(seen)
    assert again.restored_step == 2
    w.assert_same(_restored(fresh, fresh_opt, loaded), want, f"step 2 restored on rank {rank}")
    from_bucket = [m for m in seen.messages if "step 2" in m and "reading it from" in m]
    assert len(from_bucket) == (1 if rank == 1 else 0), seen.messages


def bucket_only(rank: int, world: int, root: str, so: dict[str, Any], background: bool) -> None:
    """Without a local tier the manager saves and restores straight in the bucket. An
    async_save returns once staged, training changes the weights meanwhile, and the
    handle gives the committed checkpoint on every rank."""
    model = w.build_gpt(2)
    opt, want = _trained(model, 1)
    manager = CheckpointManager(root, kind="megatron", storage_options=so)
    state = w.checkpoint_state(model, opt)
    if background:
        handle = manager.async_save(5, state, metrics={"loss": 0.5})
        with torch.no_grad():  # training goes on while the save uploads
            for p in model.parameters():
                p.add_(1.0)
        info = handle.result(timeout=TIMEOUT)
    else:
        info = manager.save(5, state, metrics={"loss": 0.5})
    assert (info.step, info.metrics) == (5, {"loss": 0.5})
    latest = manager.latest()
    assert latest is not None and latest.step == 5
    _restores(manager, 5, want, seed=31)


def object_refused(rank: int, world: int, root: str, so: dict[str, Any], tmp: str) -> None:
    """A kind without per-rank files takes no local tier on several ranks: refused before
    anything is written."""
    local = Path(tmp) / f"tier{rank}"
    manager = CheckpointManager(root, local_dir=local, kind="object", storage_options=so)
    with pytest.raises(ConfigError, match="kind='dcp' or kind='megatron', not 'object'"):
        manager.save(1, {"w": torch.ones(4)})
    assert not (local / step_dir(1)).exists()


def _trained(model: Any, steps: int) -> tuple[Any, dict[str, Any]]:
    """The model after ``steps`` Adam steps, with what a save of it must restore."""
    opt = w.adam_for(model, steps)
    return opt, w.full_state(model, opt)


def _restores(manager: CheckpointManager, step: int, want: dict[str, Any], seed: int) -> None:
    """``manager.restore()`` on a fresh model gives back ``want``, saved as ``step``."""
    fresh = w.build_gpt(2, seed=seed)
    fresh_opt = w.adam_for(fresh, 1)
    loaded = manager.restore(state=w.checkpoint_state(fresh, fresh_opt))
    assert manager.restored_step == step
    w.assert_same(_restored(fresh, fresh_opt, loaded), want, f"step {step} restored")


def tiers_async(rank: int, world: int, root: str, so: dict[str, Any], tmp: str) -> None:
    """Two async saves commit in each rank's directory; each rank's drainer sends both
    to the bucket with no drain() called; the bucket's newest step restores."""
    local = Path(tmp) / f"tier{rank}"
    model = w.build_gpt(2)
    manager = CheckpointManager(root, local_dir=local, kind="megatron", storage_options=so)
    opt, _ = _trained(model, 1)
    first = manager.async_save(1, w.checkpoint_state(model, opt))
    opt, want = _trained(model, 2)  # changes the weights while step 1 may still be saving
    second = manager.async_save(2, w.checkpoint_state(model, opt))
    assert [h.result(timeout=TIMEOUT).tiers for h in (first, second)] == [("local",)] * 2
    # Both steps were queued for this rank's drainer when their handles finished.
    assert manager._drainer is not None and manager._drainer.wait(TIMEOUT) == {}
    plain = CheckpointManager(root, kind="megatron", storage_options=so)
    assert [c.step for c in plain.list()] == [1, 2]  # drained in the background
    manager.drain()  # nothing left to send
    assert [(c.step, c.tiers) for c in manager.list()] == [
        (1, ("local", "remote")),
        (2, ("local", "remote")),
    ]
    # From the bucket: rank 1's directory lacks the replicated tensors rank 0 wrote.
    _restores(plain, 2, want, seed=42)


def failing_rank(rank: int, world: int, root: str, so: dict[str, Any], tmp: str | None) -> None:
    """Rank 1 cannot write its data: every rank's result() raises, naming rank 1, and
    no marker is written anywhere; the next save commits."""
    local = None if tmp is None else Path(tmp) / f"tier{rank}"
    model = w.build_gpt(2)
    opt, want = _trained(model, 1)
    manager = CheckpointManager(root, local_dir=local, kind="megatron", storage_options=so)
    real = writer_module.CloudStorageWriter.write_data
    if rank == 1:

        def broken(self: Any, plan: Any, planner: Any) -> Any:
            raise OSError("injected: rank 1 cannot write")

        writer_module.CloudStorageWriter.write_data = broken  # type: ignore[method-assign]
    handle = manager.async_save(1, w.checkpoint_state(model, opt))
    with pytest.raises(DistributedSaveError, match="rank 1: OSError: injected: rank 1 cannot"):
        handle.result(timeout=TIMEOUT)
    # Reported once, through the manager's handle: megatron's own is not left unchecked.
    assert in_flight.take_unreported_error() is None
    writer_module.CloudStorageWriter.write_data = real  # type: ignore[method-assign]
    assert manager.list() == []
    if local is not None:
        assert not (local / step_dir(1) / MARKER_NAME).exists()
    info = manager.async_save(2, w.checkpoint_state(model, opt)).result(timeout=TIMEOUT)
    assert info.step == 2 and [c.step for c in manager.list()] == [2]
    manager.drain()  # with a tier: step 2 goes to the bucket, which it restores from
    _restores(CheckpointManager(root, kind="megatron", storage_options=so), 2, want, seed=43)


def peers_fill_in(rank: int, world: int, root: str, so: dict[str, Any], tmp: str) -> None:
    """Step 1 stays in the local tiers only (not due for the bucket), each directory also
    keeping its peer's copy: rank 1 lacks the tensors only rank 0 wrote (replicated under
    TP=2) and reads them from the copy of node 0 it keeps, so both restore from local."""
    local = Path(tmp) / f"tier{rank}"

    def manager() -> CheckpointManager:
        return CheckpointManager(
            root,
            local_dir=local,
            kind="megatron",
            drain_every_n_steps=10,
            replicate_to_peer=True,
            storage_options=so,
        )

    model = w.build_gpt(2)
    opt, want = _trained(model, 1)
    saved = manager()
    saved.save(1, w.checkpoint_state(model, opt))
    assert not {p.name for p in (local / step_dir(1)).iterdir()} >= {"__0_0.distcp", "__1_0.distcp"}
    assert CheckpointManager(root, kind="megatron", storage_options=so).list() == []
    _restores(manager(), 1, want, seed=45)


@contextlib.contextmanager
def _recording(server: S3Server, seen: list[tuple[str, str]]) -> Iterator[dict[str, Any]]:
    """Storage options reaching ``server`` through a proxy that records into ``seen``."""

    def record(method: str, target: str) -> bool:
        seen.append((method, unquote(urlsplit(target).path)))
        return False  # inject nothing

    with FaultProxy(server.endpoint_url, match=record) as proxy:
        yield {**server.storage_options(), "endpoint_url": proxy.url}


def _names(url: str, so: dict[str, Any]) -> set[str]:
    store, key = open_url(url, TransferOptions(storage_options=so))
    return {o.key[len(key) + 1 :] for o in store.list(key + "/")}


def _run(server: S3Server) -> tuple[str, dict[str, Any]]:
    """A run's URL in a fresh bucket of ``server``, and the storage options reaching it."""
    return f"s3://{server.make_bucket(unique_bucket_name())}/run", server.storage_options()


def _payload_reads(seen: list[tuple[str, str]]) -> list[str]:
    """The GETs of a step's payload objects (listings and markers left out)."""
    return [p for m, p in seen if m == "GET" and "/step-" in p and not p.endswith(MARKER_NAME)]


def test_local_tiers_on_two_ranks_drain_and_restore(moto_server: S3Server, tmp_path: Path) -> None:
    so = moto_server.storage_options()
    bucket = moto_server.make_bucket(unique_bucket_name())
    root = f"s3://{bucket}/run"
    reads: list[list[tuple[str, str]]] = [[], []]
    with _recording(moto_server, reads[0]) as so0, _recording(moto_server, reads[1]) as so1:
        run_ranks(tiers_then_bucket, 2, root, so, [so0, so1], str(tmp_path), timeout=TIMEOUT)
    for step in (1, 2):
        names = _names(f"{root}/{step_dir(step)}", so)
        assert COORDINATOR_FILES | {MARKER_NAME, "__0_0.distcp", "__1_0.distcp"} <= names
    # Each rank's directory was made whole with the coordinator's files.
    rank1 = {p.name for p in (tmp_path / "tier1" / step_dir(1)).iterdir()}
    assert COORDINATOR_FILES | {MARKER_NAME, "__1_0.distcp"} <= rank1
    assert "__0_0.distcp" not in rank1
    assert _payload_reads(reads[0]) == []  # rank 0 read its local directory only
    assert any(p.endswith("__1_0.distcp") for p in _payload_reads(reads[1])), reads[1]


@pytest.mark.parametrize("background", [False, True], ids=["save", "async_save"])
def test_bucket_only_round_trip(background: bool, moto_server: S3Server) -> None:
    root, so = _run(moto_server)
    run_ranks(bucket_only, 2, root, so, background, timeout=TIMEOUT)
    assert {"metadata.json", "common.pt", MARKER_NAME} <= _names(f"{root}/{step_dir(5)}", so)


def test_a_kind_without_per_rank_files_is_refused_on_several_ranks(
    moto_server: S3Server, tmp_path: Path
) -> None:
    root, so = _run(moto_server)
    run_ranks(object_refused, 2, root, so, str(tmp_path), timeout=TIMEOUT)


def test_async_save_to_local_tiers_drains_in_the_background(
    moto_server: S3Server, tmp_path: Path
) -> None:
    root, plain = _run(moto_server)
    seen: list[tuple[str, str]] = []
    with _recording(moto_server, seen) as so:
        run_ranks(tiers_async, 2, root, so, str(tmp_path), timeout=TIMEOUT)
    for step in (1, 2):  # every rank's data file sent once, the marker last
        puts = [p for m, p in seen if m == "PUT" and f"/run/{step_dir(step)}/" in p]
        data = [p for p in puts if p.endswith(".distcp")]
        assert sorted(p.rpartition("/")[2] for p in data) == ["__0_0.distcp", "__1_0.distcp"]
        assert puts[-1].endswith(MARKER_NAME), puts
        assert COORDINATOR_FILES | {MARKER_NAME} <= _names(f"{root}/{step_dir(step)}", plain)


@pytest.mark.parametrize("tier", [False, True], ids=["bucket", "local-tier"])
def test_async_save_failing_on_one_rank_fails_everywhere(
    tier: bool, moto_server: S3Server, tmp_path: Path
) -> None:
    root, so = _run(moto_server)
    run_ranks(failing_rank, 2, root, so, str(tmp_path) if tier else None, timeout=TIMEOUT)
    assert MARKER_NAME not in _names(f"{root}/{step_dir(1)}", so)


def test_a_local_only_step_reads_what_its_directory_lacks_from_the_peer_copy(
    moto_server: S3Server, tmp_path: Path
) -> None:
    root, so = _run(moto_server)
    run_ranks(peers_fill_in, 2, root, so, str(tmp_path), timeout=TIMEOUT)
    # Each directory keeps the other's files in its peer folder.
    assert (tmp_path / "tier1" / "_peers" / "rank-0" / step_dir(1) / "__0_0.distcp").is_file()
