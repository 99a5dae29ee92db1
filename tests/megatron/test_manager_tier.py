"""CheckpointManager(kind="megatron") on a real megatron-core GPTModel (TP=2, 2 gloo ranks).

Each rank saves into its own local tier; ``drain()`` sends every rank's files to the
bucket, the coordinator's last; the bucket's copy loads with megatron's own
``dist_checkpointing.load``; a rank whose local copy is gone restores from the bucket
while the other reads only its local directory (each rank reaches the bucket through a
request-recording proxy of its own during the restore).
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

from cloudckpt.errors import ConfigError
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


def bucket_only(rank: int, world: int, root: str, so: dict[str, Any]) -> None:
    """Without a local tier the manager saves and restores straight in the bucket."""
    model = w.build_gpt(2)
    opt = w.adam_for(model, 1)
    want = w.full_state(model, opt)
    manager = CheckpointManager(root, kind="megatron", storage_options=so)
    manager.save(5, w.checkpoint_state(model, opt))
    fresh = w.build_gpt(2, seed=31)
    fresh_opt = w.adam_for(fresh, 1)
    restored = manager.restore(state=w.checkpoint_state(fresh, fresh_opt))
    assert manager.restored_step == 5
    w.assert_same(_restored(fresh, fresh_opt, restored), want, "step 5 from the bucket")


def object_refused(rank: int, world: int, root: str, so: dict[str, Any], tmp: str) -> None:
    """A kind without per-rank files takes no local tier on several ranks: refused before
    anything is written."""
    local = Path(tmp) / f"tier{rank}"
    manager = CheckpointManager(root, local_dir=local, kind="object", storage_options=so)
    with pytest.raises(ConfigError, match="kind='dcp' or kind='megatron', not 'object'"):
        manager.save(1, {"w": torch.ones(4)})
    assert not (local / step_dir(1)).exists()


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


def test_bucket_only_round_trip(moto_server: S3Server) -> None:
    so = moto_server.storage_options()
    root = f"s3://{moto_server.make_bucket(unique_bucket_name())}/run"
    run_ranks(bucket_only, 2, root, so, timeout=TIMEOUT)
    assert {"metadata.json", "common.pt", MARKER_NAME} <= _names(f"{root}/{step_dir(5)}", so)


def test_a_kind_without_per_rank_files_is_refused_on_several_ranks(
    moto_server: S3Server, tmp_path: Path
) -> None:
    so = moto_server.storage_options()
    root = f"s3://{moto_server.make_bucket(unique_bucket_name())}/run"
    run_ranks(object_refused, 2, root, so, str(tmp_path), timeout=TIMEOUT)
