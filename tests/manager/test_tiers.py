"""CheckpointManager with a local tier: a temp directory as the tier, moto as the bucket.

Saves commit locally and return; the drainer copies the same bytes to the bucket and
commits them there with a marker of its own, last. Restores take the newest step of
either tier, from local when its copy is whole, from the bucket otherwise.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from cloudckpt.errors import ConfigError, LocalTierFullError, NotFoundError, StorageError
from cloudckpt.manager import MARKER_NAME, CheckpointManager
from cloudckpt.manager.marker import step_dir
from cloudckpt.manager.tiers import RUN_FILE
from cloudckpt.store import Store
from faults import FaultyStore
from servers import S3Server, recorded_bucket


@dataclass
class Bucket:
    """A fresh moto bucket reached through a recording proxy."""

    url: str
    storage_options: dict[str, str]
    #: (method, path) of every request the proxy forwarded.
    requests: list[tuple[str, str]] = field(default_factory=list)

    def payload_reads(self, name: str = "state.pt") -> int:
        """GETs of objects called ``name`` so far."""
        return sum(1 for m, p in self.requests if m == "GET" and p.endswith("/" + name))


@pytest.fixture
def bucket(moto_server: S3Server) -> Iterator[Bucket]:
    with recorded_bucket(moto_server) as (name, options, seen):
        yield Bucket(f"s3://{name}", options, seen)


def tiered(bucket: Bucket, tier: Path, run: str = "run", **kwargs: Any) -> CheckpointManager:
    return CheckpointManager(
        f"{bucket.url}/{run}", local_dir=tier, storage_options=bucket.storage_options, **kwargs
    )


def state(step: int, n: int = 1 << 14) -> dict[str, Any]:
    return {"w": torch.full((n,), float(step)), "step": step}


def remote_key(m: CheckpointManager, step: int, name: str) -> str:
    return f"{m.root_key}/{step_dir(step)}/{name}"


def local_file(tier: Path, step: int, name: str = "state.pt") -> Path:
    return tier / step_dir(step) / name


def remote_steps(m: CheckpointManager) -> list[int]:
    return [c.step for c in m.list() if "remote" in c.tiers]


def local_steps(tier: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in tier.glob("step-*") if (p / MARKER_NAME).exists())


class MarkerPutFails(FaultyStore):
    """Fails the writes chosen by ``fail`` ("marker": the manager's markers; "all")."""

    fail = "marker"

    def _put(self, key: str, data: Any, if_none_match: bool) -> None:
        if self.fail == "all" or (self.fail == "marker" and key.endswith(MARKER_NAME)):
            raise StorageError(f"injected failure writing {key}")
        super()._put(key, data, if_none_match)

    def _create_multipart(self, key: str) -> Any:
        if self.fail == "all":
            raise StorageError(f"injected failure writing {key}")
        return super()._create_multipart(key)


def test_save_commits_locally_and_drain_copies_the_same_bytes(
    bucket: Bucket, tmp_path: Path
) -> None:
    tier = tmp_path / "tier"
    m = tiered(bucket, tier)
    info = m.save(3, state(3), metrics={"loss": 0.5}, metadata={"epoch": 1})
    assert info.tiers == ("local",) and info.url.startswith("file://")
    assert (tier / step_dir(3) / MARKER_NAME).exists()  # committed before save returned
    assert json.loads((tier / RUN_FILE).read_bytes())["root_url"] == m.root_url
    m.drain()
    assert m.store.get(remote_key(m, 3, "state.pt")) == local_file(tier, 3).read_bytes()
    remote = m.info(3)
    local = json.loads(local_file(tier, 3, MARKER_NAME).read_bytes())
    assert remote.tiers == ("local", "remote") and remote.url.startswith("s3://")
    assert remote.time == local["time"] and remote.metrics == {"loss": 0.5}
    assert remote.metadata == {"epoch": 1}
    assert [f.name for f in remote.files] == ["state.pt"]  # the local marker is not copied
    assert [(c.step, c.tiers) for c in m.list()] == [(3, ("local", "remote"))]


def test_a_failed_bucket_commit_leaves_no_marker_and_the_next_drain_completes_it(
    bucket: Bucket, tmp_path: Path
) -> None:
    m = tiered(bucket, tmp_path / "tier")
    m.store = faulty = MarkerPutFails(m.store)
    m.save(1, state(1))
    with pytest.raises(StorageError, match="drain of step 1") as failed:
        m.drain()
    assert "injected failure" in str(failed.value.__cause__)
    keys = {o.key.rpartition("/")[2] for o in m.store.list(f"{m.root_key}/")}
    assert keys == {"state.pt"}  # the payload, no marker: not committed in the bucket
    assert [(c.step, c.tiers) for c in m.list()] == [(1, ("local",))]
    faulty.fail = ""
    faulty.calls.clear()
    m.drain()
    assert remote_steps(m) == [1]
    assert faulty.calls.get("put") == 1  # the marker only: the payload was already whole


def test_restore_from_local_reads_no_payload_from_the_bucket(
    bucket: Bucket, tmp_path: Path
) -> None:
    m = tiered(bucket, tmp_path / "tier")
    for step in (1, 2):
        m.save(step, state(step))
    m.drain()
    again = tiered(bucket, tmp_path / "tier")
    reads = bucket.payload_reads()
    restored = again.restore()
    assert restored["step"] == 2 and torch.equal(restored["w"], state(2)["w"])
    assert bucket.payload_reads() == reads  # no byte of state.pt from the bucket
    # The local file is mapped (load(mmap=True)), not copied into new memory ...
    path = os.path.realpath(local_file(tmp_path / "tier", 2))
    maps = Path("/proc/self/maps").read_text().splitlines()
    assert any(line.endswith(" " + path) for line in maps), path
    # ... copy-on-write: writing the restored tensor leaves the committed copy as it was.
    restored["w"].add_(1)
    assert torch.equal(again.restore(step=2)["w"], state(2)["w"])
    assert again.restore(step=1)["step"] == 1 and bucket.payload_reads() == reads


def test_a_corrupt_local_copy_is_restored_from_the_bucket(
    bucket: Bucket, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = tmp_path / "tier"
    m = tiered(bucket, tier)
    m.save(7, state(7))
    m.drain()
    path = local_file(tier, 7)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the tensor's record
    path.write_bytes(bytes(data))
    reads = bucket.payload_reads()
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        restored = tiered(bucket, tier).restore()
    assert torch.equal(restored["w"], state(7)["w"])
    assert bucket.payload_reads() > reads
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("step 7" in w and "ChecksumError" in w for w in warned), warned


def test_a_deleted_local_copy_is_restored_from_the_bucket(
    bucket: Bucket, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = tmp_path / "tier"
    m = tiered(bucket, tier)
    m.save(4, state(4))
    m.drain()
    local_file(tier, 4).unlink()  # the marker stays: a missing file
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        assert tiered(bucket, tier).restore()["step"] == 4
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("step 4" in w and "NotFoundError" in w for w in warned), warned
    shutil.rmtree(tier / step_dir(4))  # the whole step gone: only the bucket has it
    again = tiered(bucket, tier)
    assert [(c.step, c.tiers) for c in again.list()] == [(4, ("remote",))]
    assert again.restore()["step"] == 4


def test_a_local_step_newer_than_the_bucket_is_restored_from_local(
    bucket: Bucket, tmp_path: Path
) -> None:
    tier = tmp_path / "tier"
    m = tiered(bucket, tier, drain_every_n_steps=10)
    m.save(10, state(10))
    m.save(11, state(11))  # not due: local only
    m.drain()
    reads = bucket.payload_reads()
    again = tiered(bucket, tier, drain_every_n_steps=10)
    assert [(c.step, c.tiers) for c in again.list()] == [
        (10, ("local", "remote")),
        (11, ("local",)),
    ]
    assert again.restore()["step"] == 11 and bucket.payload_reads() == reads


def test_a_local_dir_of_another_run_is_never_used(
    bucket: Bucket, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = tmp_path / "tier"
    other = tiered(bucket, tier, run="other")
    other.save(5, state(500))
    other.drain()
    ours = CheckpointManager(f"{bucket.url}/run", storage_options=bucket.storage_options)
    ours.save(5, state(5))
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        m = tiered(bucket, tier)
    assert any("holds the local tier of" in r.getMessage() for r in caplog.records)
    assert [(c.step, c.tiers) for c in m.list()] == [(5, ("remote",))]
    assert m.restore()["step"] == 5  # ours, from the bucket; not the other run's step 5
    with pytest.raises(ConfigError, match="holds the local tier of"):
        m.save(6, state(6))
    assert local_steps(tier) == [5]


def test_only_due_steps_are_drained_and_keep_local_keeps_undrained_ones(
    bucket: Bucket, tmp_path: Path
) -> None:
    tier = tmp_path / "tier"
    m = tiered(bucket, tier, drain_every_n_steps=2, keep_local=2)
    m.store = faulty = MarkerPutFails(m.store)
    faulty.fail = "all"  # every drain fails: steps 2 and 4 stay due
    for step in range(1, 5):
        m.save(step, state(step))
    with pytest.raises(StorageError, match="drain of step 2"):
        m.drain()
    assert local_steps(tier) == [2, 3, 4]  # 2 is kept beyond keep_local: not drained
    faulty.fail = ""
    m.drain()
    assert remote_steps(m) == [2, 4]
    m.save(5, state(5))  # local retention runs again: 2 is in the bucket now
    assert local_steps(tier) == [4, 5]
    assert m.restore(step=2)["step"] == 2  # from the bucket


def test_a_save_uncommits_what_keep_local_drops_and_starts_the_drainer_last(
    bucket: Bucket, tmp_path: Path
) -> None:
    # The save's last acts: the dropped step uncommitted (its files removed after the
    # save returns, before the next save or drain), then the drainer, so the save does
    # not share the CPUs with either (docs/tiers.md, the protocol's step 4).
    tier = tmp_path / "tier"
    m = tiered(bucket, tier, keep_local=1, drain_every_n_steps=2)
    assert m._tier is not None and m._drainer is not None
    order: list[str] = []
    retain, submit = m._tier.retain, m._drainer.submit
    m._tier.retain = lambda *a, **k: order.append("retain") or retain(*a, **k)  # type: ignore[method-assign]
    m._drainer.submit = lambda *a: order.append("submit") or submit(*a)  # type: ignore[method-assign]
    m.save(2, state(2))
    assert order == ["retain", "submit"]
    m.drain()
    m.save(3, state(3))  # not due: 2 is drained, so dropped
    assert local_steps(tier) == [3]
    m.save(4, state(4))  # 2's files are gone before it writes; 3 is dropped in turn
    assert local_steps(tier) == [4] and not (tier / step_dir(2)).exists()
    m.drain()
    assert sorted(p.name for p in tier.glob("step-*")) == [step_dir(4)]
    assert remote_steps(m) == [2, 4]
    assert m.restore(step=2)["step"] == 2 and m.restore()["step"] == 4


def test_a_full_local_tier_refuses_the_save_before_writing(
    bucket: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = tmp_path / "tier"
    m = tiered(bucket, tier)

    class Usage(NamedTuple):
        total: int
        used: int
        free: int

    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(1 << 30, 1 << 30, 1024))
    with pytest.raises(LocalTierFullError, match=re.escape(str(tier))):
        m.save(1, state(1))  # 64 KiB of tensors, 1 KiB free
    assert sorted(p.name for p in tier.iterdir()) == [RUN_FILE]
    m.drain()
    assert m.list() == []


def test_a_drain_killed_midway_is_finished_by_the_next_manager(
    bucket: Bucket, tmp_path: Path
) -> None:
    tier = tmp_path / "tier"
    read_end, write_end = os.pipe()
    with contextlib.ExitStack() as stack:
        errors = stack.enter_context(open(tmp_path / "child.err", "w+b"))
        pid = os.fork()
        if pid == 0:  # the child: only os._exit leaves it
            try:
                os.close(read_end)
                torch.set_num_threads(1)
                _save_and_stall(bucket, tier, write_end)
            except BaseException:
                errors.write(traceback.format_exc().encode())
                errors.flush()
            os._exit(3)
        os.close(write_end)
        ready, _, _ = select.select([read_end], [], [], 120)
        told = os.read(read_end, 1) if ready else b""
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        os.close(read_end)
        errors.seek(0)
        assert told == b"x", errors.read().decode()[-2000:]
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert local_steps(tier) == [1]
    m = tiered(bucket, tier)
    names = {o.key.rpartition("/")[2] for o in m.store.list(f"{m.root_key}/")}
    assert names == {"state.pt"}  # the payload went up, the marker never did
    m.store = spy = FaultyStore(m.store)
    m.drain()  # the new manager finds step 1 due and not in the bucket
    assert remote_steps(m) == [1]
    assert spy.calls.get("put") == 1  # the marker only: state.pt was whole in the bucket
    assert not {"create_multipart", "upload_part", "upload_part_views"} & set(spy.calls)
    assert m.store.get(remote_key(m, 1, "state.pt")) == local_file(tier, 1).read_bytes()


class _StallMarker(FaultyStore):
    """Holds the bucket's marker write forever, after telling ``fd``."""

    def __init__(self, inner: Store, fd: int) -> None:
        super().__init__(inner)
        self.fd = fd

    def _put(self, key: str, data: Any, if_none_match: bool) -> None:
        if key.endswith(MARKER_NAME):
            os.write(self.fd, b"x")
            threading.Event().wait()
        super()._put(key, data, if_none_match)


def _save_and_stall(bucket: Bucket, tier: Path, fd: int) -> None:
    """In the child: save step 1 (committed locally), its drain stalls at the marker."""
    m = tiered(bucket, tier)
    m.store = _StallMarker(m.store, fd)
    m.save(1, state(1))
    threading.Event().wait()  # until killed


def test_dcp_round_trip_through_both_tiers(bucket: Bucket, tmp_path: Path) -> None:
    pytest.importorskip("cloudckpt.dcp")
    tier = tmp_path / "tier"
    m = tiered(bucket, tier, kind="dcp")
    saved = {"w": torch.arange(256.0), "b": torch.full((8,), 3, dtype=torch.long)}
    m.save(1, saved)
    m.drain()
    info = m.info(1)
    assert info.kind == "dcp" and info.tiers == ("local", "remote")
    assert ".metadata" in {f.name for f in info.files}
    reads = bucket.payload_reads(".metadata")
    target = {"w": torch.zeros(256), "b": torch.zeros(8, dtype=torch.long)}
    tiered(bucket, tier, kind="dcp").restore(state=target)
    assert torch.equal(target["w"], saved["w"]) and torch.equal(target["b"], saved["b"])
    assert bucket.payload_reads(".metadata") == reads  # read from local
    shutil.rmtree(tier / step_dir(1))
    target = {"w": torch.zeros(256), "b": torch.zeros(8, dtype=torch.long)}
    tiered(bucket, tier, kind="dcp").restore(state=target)
    assert torch.equal(target["w"], saved["w"]) and torch.equal(target["b"], saved["b"])
    assert bucket.payload_reads(".metadata") > reads


def test_async_save_commits_locally_then_drains(bucket: Bucket, tmp_path: Path) -> None:
    tier = tmp_path / "tier"
    m = tiered(bucket, tier)
    handle = m.async_save(2, state(2), metrics={"loss": 1.0})
    info = handle.result()
    assert info.tiers == ("local",) and (tier / step_dir(2) / MARKER_NAME).exists()
    m.drain()
    assert remote_steps(m) == [2] and m.info(2).metrics == {"loss": 1.0}


class _HoldMarker(FaultyStore):
    """Holds the bucket's marker write until ``release`` is set."""

    release = threading.Event()

    def _put(self, key: str, data: Any, if_none_match: bool) -> None:
        if key.endswith(MARKER_NAME):
            self.release.wait()
        super()._put(key, data, if_none_match)


def test_drain_timeout_names_the_steps_in_flight(bucket: Bucket, tmp_path: Path) -> None:
    m = tiered(bucket, tmp_path / "tier")
    m.store = held = _HoldMarker(m.store)
    held.release = threading.Event()
    m.save(1, state(1))
    with pytest.raises(TimeoutError, match=r"step\(s\) \[1\]"):
        m.drain(timeout=0)  # the marker write is held: step 1 is in flight
    held.release.set()
    m.drain()
    assert remote_steps(m) == [1]


_EXIT_PROGRAM = """
import json, logging, sys, threading
sys.path.insert(0, sys.argv[3])
import torch
from cloudckpt.manager import MARKER_NAME, CheckpointManager
from faults import FaultyStore

class Stall(FaultyStore):
    def _put(self, key, data, if_none_match):
        if key.endswith(MARKER_NAME):
            threading.Event().wait()  # never answered
        super()._put(key, data, if_none_match)

logging.basicConfig(level=logging.WARNING)
m = CheckpointManager(sys.argv[1], local_dir=sys.argv[2], storage_options=json.loads(sys.argv[4]))
m.store = Stall(m.store)
m.save(1, {"w": torch.ones(4)})
"""


def test_exit_leaves_an_unfinished_drain_for_the_next_manager(
    bucket: Bucket, tmp_path: Path
) -> None:
    tier = tmp_path / "tier"
    root = f"{bucket.url}/run"
    tests_dir = str(Path(__file__).resolve().parents[1])
    argv = [root, str(tier), tests_dir, json.dumps(bucket.storage_options)]
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_PROGRAM, *argv], capture_output=True, timeout=300
    )
    err = done.stderr.decode()
    assert done.returncode == 0, err[-2000:]  # the stalled drain did not hold the exit
    assert "step(s) [1]" in err and "unfinished at exit" in err, err[-2000:]
    m = tiered(bucket, tier)
    m.drain()
    assert remote_steps(m) == [1]


def test_tier_options_are_checked(bucket: Bucket, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="need local_dir"):
        CheckpointManager(f"{bucket.url}/run", keep_local=2)
    with pytest.raises(ConfigError, match="keep_local=0"):
        tiered(bucket, tmp_path / "tier", keep_local=0)
    plain = CheckpointManager(f"{bucket.url}/run", storage_options=bucket.storage_options)
    plain.drain()  # no local tier: nothing to wait for
    assert plain.restore() is None  # a fresh run


# -- several ranks (kind="dcp"), each with a local tier of its own ----------------------
def _rank_state(rank: int, step: int) -> dict[str, Any]:
    """Tensors only this rank holds, so each rank's items live in its own files."""
    return {f"own{rank}": torch.arange(300.0) * step + rank, f"ids{rank}": torch.full((7,), step)}


def _rank_empty(rank: int) -> dict[str, Any]:
    return {f"own{rank}": torch.zeros(300), f"ids{rank}": torch.zeros(7, dtype=torch.long)}


def _ranks_save_and_drain(rank: int, world: int, url: str, so: dict[str, str], base: str) -> None:
    m = CheckpointManager(url, local_dir=Path(base) / f"node{rank}", kind="dcp", storage_options=so)
    for step in (1, 2):
        assert m.save(step, _rank_state(rank, step)).tiers == ("local",)
    assert remote_steps(m) == []  # nothing reaches the bucket before drain()
    m.drain()
    assert [(c.step, c.tiers) for c in m.list()] == [(s, ("local", "remote")) for s in (1, 2)]


def _warnings_seen() -> list[str]:
    """The cloudckpt WARNINGs logged in this rank's process from now on (a spawned rank
    has no caplog)."""
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("cloudckpt").addHandler(handler)
    return seen


def _ranks_restore(rank: int, world: int, url: str, so: dict[str, str], base: str) -> None:
    seen = _warnings_seen()
    m = CheckpointManager(url, local_dir=Path(base) / f"node{rank}", kind="dcp", storage_options=so)
    got = m.restore(state=_rank_empty(rank))
    assert m.restored_step == 2
    want = _rank_state(rank, 2)
    assert all(torch.equal(got[k], want[k]) for k in want)
    warned = [s for s in seen if "reading it from" in s]
    assert len(warned) == (1 if rank == 1 else 0), seen


def test_dcp_on_two_ranks_drains_every_rank_and_restores_a_lost_rank_from_the_bucket(
    bucket: Bucket, tmp_path: Path
) -> None:
    pytest.importorskip("cloudckpt.dcp")
    from ranks import run_ranks

    url = f"{bucket.url}/run"
    run_ranks(_ranks_save_and_drain, 2, url, bucket.storage_options, str(tmp_path), timeout=300)

    def files(node: str, step: int) -> set[str]:
        return {p.name for p in (tmp_path / node / step_dir(step)).iterdir()}

    own = {r: files(f"node{r}", 2) - files("node1" if r == 0 else "node0", 2) for r in (0, 1)}
    assert own[0] and own[1]  # each node holds data files the other lacks
    assert ".metadata" in files("node1", 2)  # the coordinator's metadata, on every node
    remote = {
        f.name for f in CheckpointManager(url, storage_options=bucket.storage_options).info(2).files
    }
    assert own[0] | own[1] | {".metadata"} <= remote

    shutil.rmtree(tmp_path / "node1" / step_dir(2))  # node 1 lost its copy of step 2
    bucket.requests.clear()
    run_ranks(_ranks_restore, 2, url, bucket.storage_options, str(tmp_path), timeout=300)
    step2 = f"/run/{step_dir(2)}/"
    read = {p.rpartition("/")[2] for m, p in bucket.requests if m == "GET" and step2 in p}
    assert read & own[1]  # node 1's files came from the bucket
    assert not read & own[0]  # node 0 read its own from local disk
    assert not any(step_dir(1) in p for m, p in bucket.requests if m == "GET" and "distcp" in p)


def _ranks_share_a_dir(rank: int, world: int, url: str, so: dict[str, str], base: str) -> None:
    m = CheckpointManager(url, local_dir=Path(base) / "node", kind="dcp", storage_options=so)
    m.save(1, _rank_state(rank, 1))
    m.drain()
    assert [(c.step, c.tiers) for c in m.list()] == [(1, ("local", "remote"))]
    got = CheckpointManager(
        url, local_dir=Path(base) / "node", kind="dcp", storage_options=so
    ).restore(state=_rank_empty(rank))
    want = _rank_state(rank, 1)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_dcp_ranks_sharing_one_local_dir_commit_and_drain_it_once(
    bucket: Bucket, tmp_path: Path
) -> None:
    pytest.importorskip("cloudckpt.dcp")
    from ranks import run_ranks

    url = f"{bucket.url}/run"
    run_ranks(_ranks_share_a_dir, 2, url, bucket.storage_options, str(tmp_path), timeout=300)
    local = {p.name for p in (tmp_path / "node" / step_dir(1)).iterdir()}
    data = {n for n in local if n.endswith(".distcp")}
    assert len(data) == 2  # both ranks' files in the one directory
    remote = {
        f.name for f in CheckpointManager(url, storage_options=bucket.storage_options).info(1).files
    }
    assert data | {".metadata"} <= remote
    puts = [p for m, p in bucket.requests if m == "PUT" and p.endswith(".distcp")]
    assert len(puts) == len(set(puts)) == 2  # each data file sent once
    gets = [p for m, p in bucket.requests if m == "GET" and p.endswith(".distcp")]
    assert gets == []  # restored from the shared local copy


def _node_manager(rank: int, url: str, so: dict[str, str], base: str) -> CheckpointManager:
    """Rank ``rank``'s DCP manager with a directory of its own, draining even steps."""
    return CheckpointManager(
        url,
        local_dir=Path(base) / f"node{rank}",
        kind="dcp",
        drain_every_n_steps=2,
        storage_options=so,
    )


def _ranks_async_save(rank: int, world: int, url: str, so: dict[str, str], base: str) -> None:
    m = _node_manager(rank, url, so, base)
    handles = [m.async_save(step, _rank_state(rank, step)) for step in (1, 2, 3, 4)]
    assert [h.result().tiers for h in handles] == [("local",)] * 4
    # Steps 2 and 4 are due: each rank's drainer sends them, on a group of their own,
    # with no drain() called. Every rank polls the same listing (a collective).
    plain = CheckpointManager(url, kind="dcp", storage_options=so)
    deadline = time.monotonic() + 120
    while [c.step for c in plain.list()] != [2, 4]:
        assert time.monotonic() < deadline, [c.step for c in plain.list()]
        time.sleep(0.05)
    m.drain()  # nothing left: the background drain sent both
    assert [(c.step, c.tiers) for c in m.list()] == [
        (1, ("local",)),
        (2, ("local", "remote")),
        (3, ("local",)),
        (4, ("local", "remote")),
    ]
    got = m.restore(state=_rank_empty(rank))
    want = _rank_state(rank, 4)
    assert m.restored_step == 4
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_dcp_async_save_on_two_ranks_commits_locally_and_drains_in_the_background(
    bucket: Bucket, tmp_path: Path
) -> None:
    pytest.importorskip("cloudckpt.dcp")
    from ranks import run_ranks

    url = f"{bucket.url}/run"
    run_ranks(_ranks_async_save, 2, url, bucket.storage_options, str(tmp_path), timeout=300)
    for step in (2, 4):  # every rank's data file and .metadata sent once, marker last
        prefix = f"/run/{step_dir(step)}/"
        puts = [p for m, p in bucket.requests if m == "PUT" and prefix in p]
        data = [p for p in puts if p.endswith(".distcp")]
        assert len(data) == len(set(data)) == 2, puts
        assert puts[-1].endswith(MARKER_NAME), puts
    sent = [p for m, p in bucket.requests if m == "PUT"]
    assert not [p for p in sent for s in (1, 3) if f"/{step_dir(s)}/" in p]  # not due


def test_drains_and_newer_saves_share_max_bytes_in_flight(
    bucket: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drain's part buffers count against the process's byte budget, with every
    save's: with 8 parts allowed at once per transfer, no more than the budget's 2 are
    ever held, while async saves of newer steps run beside the drains."""
    from cloudckpt.io import scheduler

    peak = [0]
    acquire = scheduler.ByteBudget.acquire

    def counting(self: scheduler.ByteBudget, n: int, cancel: Any = None) -> None:
        acquire(self, n, cancel)
        with self._cond:
            peak[0] = max(peak[0], self.used)

    monkeypatch.setattr(scheduler.ByteBudget, "acquire", counting)
    part = 5 << 20
    m = tiered(
        bucket,
        tmp_path / "tier",
        part_size=part,
        write_concurrency=8,
        max_bytes_in_flight=2 * part,
    )
    handles = [m.async_save(s, {"w": torch.full((6 * part // 4,), float(s))}) for s in (1, 2, 3)]
    assert [h.result().step for h in handles] == [1, 2, 3]
    m.drain()
    assert remote_steps(m) == [1, 2, 3]
    assert 0 < peak[0] <= 2 * part


# -- peer copy: each node's local directory also keeps the next node's steps ------------
def _ranks_save_with_peers(rank: int, world: int, url: str, so: dict[str, str], base: str) -> None:
    m = CheckpointManager(
        url,
        local_dir=Path(base) / f"node{rank}",
        kind="dcp",
        keep_local=1,
        replicate_to_peer=True,
        storage_options=so,
    )
    for step in (1, 2):
        m.save(step, _rank_state(rank, step))
    m.drain()


def _ranks_restore_from_peer(
    rank: int, world: int, url: str, so: dict[str, str], base: str
) -> None:
    seen = _warnings_seen()
    m = CheckpointManager(
        url,
        local_dir=Path(base) / f"node{rank}",
        kind="dcp",
        replicate_to_peer=True,
        storage_options=so,
    )
    got = m.restore(state=_rank_empty(rank))
    assert m.restored_step == 2
    want = _rank_state(rank, 2)
    assert all(torch.equal(got[k], want[k]) for k in want)
    from_peer = [s for s in seen if "back from its peer" in s]
    assert len(from_peer) == (1 if rank == 1 else 0), seen
    assert not [s for s in seen if "reading it from" in s], seen  # never the bucket


def test_a_replaced_node_restores_from_its_peer_not_the_bucket(
    bucket: Bucket, tmp_path: Path
) -> None:
    pytest.importorskip("cloudckpt.dcp")
    from ranks import run_ranks

    url = f"{bucket.url}/run"
    run_ranks(_ranks_save_with_peers, 2, url, bucket.storage_options, str(tmp_path), timeout=300)

    def names(path: Path) -> set[str]:
        return {p.name for p in path.iterdir()}

    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    # Each node keeps the other's newest step (keep_local=1), byte for byte, committed.
    for here, there, source in ((node0, node1, 1), (node1, node0, 0)):
        peer = here / "_peers" / f"rank-{source}"
        assert names(peer) == {step_dir(2)}
        assert names(peer / step_dir(2)) == names(there / step_dir(2))
        for f in (there / step_dir(2)).iterdir():
            assert (peer / step_dir(2) / f.name).read_bytes() == f.read_bytes()
    own1 = {n for n in names(node1 / step_dir(2)) if n.endswith(".distcp")}
    own1 -= names(node0 / step_dir(2))
    assert own1  # node 1's own data files

    shutil.rmtree(node1)  # node 1 is replaced: a fresh, empty local directory
    bucket.requests.clear()
    run_ranks(_ranks_restore_from_peer, 2, url, bucket.storage_options, str(tmp_path), timeout=300)
    gets = [p for m, p in bucket.requests if m == "GET" and p.endswith((".distcp", ".metadata"))]
    assert gets == []  # the bucket, which holds step 2 too, served no payload
    assert (node1 / step_dir(2) / MARKER_NAME).is_file()  # the node's local copy is back
    assert own1 <= names(node1 / step_dir(2))


# -- restores across tiers: each file from local when this directory holds it ------------
def _everyone_empty() -> dict[str, Any]:
    return {**_rank_empty(0), **_rank_empty(1)}


def _ranks_save_two_steps(rank: int, world: int, url: str, so: dict[str, str], base: str) -> None:
    m = _node_manager(rank, url, so, base)
    for step in (2, 3):
        m.save(step, _rank_state(rank, step))
    m.drain()  # step 2 is due and goes to the bucket; step 3 stays local only
    assert [(c.step, c.tiers) for c in m.list()] == [(2, ("local", "remote")), (3, ("local",))]


def test_a_restore_on_fewer_ranks_reads_only_what_its_local_dir_lacks_from_the_bucket(
    bucket: Bucket, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("cloudckpt.dcp")
    from ranks import run_ranks

    url = f"{bucket.url}/run"
    run_ranks(_ranks_save_two_steps, 2, url, bucket.storage_options, str(tmp_path), timeout=300)
    names = {r: {p.name for p in (tmp_path / f"node{r}" / step_dir(2)).iterdir()} for r in (0, 1)}
    lacking = names[1] - names[0]  # node 1's data files
    assert lacking and all(n.endswith(".distcp") for n in lacking)

    # One process, on node 0's directory: DCP reshards the 2 ranks' step into one state.
    m = CheckpointManager(url, local_dir=tmp_path / "node0", kind="dcp", **_so(bucket))
    bucket.requests.clear()
    with caplog.at_level(logging.INFO, logger="cloudckpt"):
        got = m.restore(state=_everyone_empty())
    assert m.restored_step == 2  # step 3, saved by 2 ranks and local only, is no candidate
    want = {**_rank_state(0, 2), **_rank_state(1, 2)}
    assert all(torch.equal(got[k], want[k]) for k in want)
    step2 = f"/run/{step_dir(2)}/"
    read = {p.rpartition("/")[2] for meth, p in bucket.requests if meth == "GET" and step2 in p}
    assert read - {MARKER_NAME} == lacking  # not .metadata, not node 0's own files
    served = [r.getMessage() for r in caplog.records if "from the bucket at" in r.getMessage()]
    assert [r.levelno for r in caplog.records if "from the bucket at" in r.getMessage()] == [
        logging.INFO
    ]
    assert f"read {len(lacking)} file(s)" in served[0], served
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "cloudckpt" in r.name]

    # Step 3 is in no bucket, and node 0 lacks node 1's files: a typed error naming both.
    with pytest.raises(NotFoundError, match=r"step 3.*\.distcp|\.distcp.*step 3") as info:
        m.restore(step=3, state=_everyone_empty())
    missing = str(info.value).split(" of step 3")[0].rpartition(" ")[2]
    assert missing in names[1] - names[0], info.value
    empty = tmp_path / "alone"  # a tier holding only step 3: nothing this world can read
    shutil.copytree(tmp_path / "node0", empty)
    shutil.rmtree(empty / step_dir(2))
    plain = CheckpointManager(url, storage_options=bucket.storage_options)
    plain.delete(2)
    with pytest.raises(NotFoundError, match=r"step\(s\) \[3\] are only in the local tiers"):
        CheckpointManager(url, local_dir=empty, kind="dcp", **_so(bucket)).restore(
            state=_everyone_empty()
        )


def _so(bucket: Bucket) -> dict[str, Any]:
    return {"storage_options": bucket.storage_options}


def _with_shared(rank: int, step: int) -> dict[str, Any]:
    """One tensor every rank holds alike, first (DCP's save gives it to the rank with
    the least planned so far: rank 0, the coordinator), then each rank's own."""
    return {"shared": torch.arange(64.0) * step, f"own{rank}": torch.arange(300.0) * step + rank}


def _with_shared_empty(rank: int) -> dict[str, Any]:
    return {"shared": torch.zeros(64), f"own{rank}": torch.zeros(300)}


def _ranks_restore_shared(rank: int, world: int, url: str, so: dict[str, str], base: str) -> None:
    from cloudckpt.errors import CloudCkptError

    seen: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("cloudckpt")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    tier = Path(base) / f"node{rank}"
    m = CheckpointManager(url, local_dir=tier, kind="dcp", storage_options=so)
    m.save(1, _with_shared(rank, 1))
    # Not drained: rank 1 needs the replicated tensor from node 0's file, which no
    # directory of rank 1 holds. Every rank raises a typed error naming it and the step.
    with pytest.raises(CloudCkptError, match=r"__0_\d+\.distcp of step 1") as info:
        m.restore(state=_with_shared_empty(rank))
    assert isinstance(info.value, NotFoundError) == (rank == 1), info.value
    m.drain()
    seen.clear()
    again = CheckpointManager(url, local_dir=tier, kind="dcp", storage_options=so)
    got = again.restore(state=_with_shared_empty(rank))
    want = _with_shared(rank, 1)
    assert all(torch.equal(got[k], want[k]) for k in want)
    served = [s for s in seen if "from the bucket at" in s]
    assert len(served) == 1 and f"read {1 if rank == 1 else 0} file(s)" in served[0], served
    assert not [s for s in seen if "reading it from" in s], seen  # each rank's own copy


def test_a_replicated_tensor_saved_by_the_coordinator_is_read_from_the_bucket(
    bucket: Bucket, tmp_path: Path
) -> None:
    pytest.importorskip("cloudckpt.dcp")
    from ranks import run_ranks

    url = f"{bucket.url}/run"
    bucket.requests.clear()
    run_ranks(_ranks_restore_shared, 2, url, bucket.storage_options, str(tmp_path), timeout=300)
    node0 = {p.name for p in (tmp_path / "node0" / step_dir(1)).iterdir()}
    node1 = {p.name for p in (tmp_path / "node1" / step_dir(1)).iterdir()}
    step1 = f"/run/{step_dir(1)}/"
    read = {p.rpartition("/")[2] for meth, p in bucket.requests if meth == "GET" and step1 in p}
    read -= {MARKER_NAME}  # the bucket's listing reads its markers
    assert read and read <= node0 - node1  # only node 0's data file, read by rank 1


# -- a local copy that fails while loading, on several ranks ----------------------------
def _damage_element_50(node: Path, step: int, rank: int) -> None:
    """Flip a byte of element 50 of ``own{rank}`` in this node's copy of ``step``
    (same size: only the load's checks can tell)."""
    path = next((node / step_dir(step)).glob("*.distcp"))
    data = bytearray(path.read_bytes())
    at = data.find(struct.pack("<f", 50.0 * step + rank))
    assert at >= 0, "element 50 is not in the file"
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _ranks_restore_past_a_corrupt_file(
    rank: int, world: int, url: str, so: dict[str, str], base: str
) -> None:
    import torch.distributed as dist

    from cloudckpt.errors import ChecksumError, DistributedLoadError

    seen = _warnings_seen()
    node = Path(base) / f"node{rank}"
    m = CheckpointManager(
        url, local_dir=node, kind="dcp", drain_every_n_steps=2, storage_options=so
    )
    # Step 2 is in the bucket too: every rank reads it from there, WARNING on every rank.
    got = m.restore(state=_rank_empty(rank))
    want = _rank_state(rank, 2)
    assert m.restored_step == 2 and all(torch.equal(got[k], want[k]) for k in want)
    warned = [s for s in seen if "failed while loading" in s and "rank 1: ChecksumError" in s]
    assert len(warned) == 1, seen
    # Step 3 is in the local tiers only (not due): the same damage fails on every rank.
    m.save(3, _rank_state(rank, 3))
    if rank == 1:
        _damage_element_50(node, 3, rank)
    dist.barrier()
    expected = ChecksumError if rank == 1 else DistributedLoadError
    with pytest.raises(expected, match="rank 1" if rank == 0 else "CRC"):
        m.restore(state=_rank_empty(rank))


def test_a_local_file_failing_its_checks_while_loading_sends_every_rank_to_the_bucket(
    bucket: Bucket, tmp_path: Path
) -> None:
    pytest.importorskip("cloudckpt.dcp")
    from ranks import run_ranks

    url = f"{bucket.url}/run"
    run_ranks(_ranks_save_and_drain, 2, url, bucket.storage_options, str(tmp_path), timeout=300)
    _damage_element_50(tmp_path / "node1", 2, 1)
    bucket.requests.clear()
    run_ranks(
        _ranks_restore_past_a_corrupt_file,
        2,
        url,
        bucket.storage_options,
        str(tmp_path),
        timeout=300,
    )
    step2 = f"/run/{step_dir(2)}/"
    read = [p for m, p in bucket.requests if m == "GET" and step2 in p and ".distcp" in p]
    assert len(read) >= 2  # every rank's data file, from the bucket


def test_a_drained_object_another_save_rewrites_at_the_same_size_is_never_committed(
    bucket: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another save of the step writes over the object a drain just sent (the same size,
    other bytes) before the drain lists what it wrote: its ETag is not the one the
    drain's upload got, so the drain fails with nothing committed, and its next try
    sends its own bytes again and commits them."""
    from cloudckpt.manager import tiers

    m = tiered(bucket, tmp_path / "tier")
    m.save(2, state(2))
    m.drain()
    real = tiers.copy_tree

    def then_theirs(*args: Any, **kwargs: Any) -> Any:
        copied = real(*args, **kwargs)
        key = remote_key(m, 3, "state.pt")
        m.store.put(key, bytes(len(m.store.get(key))))  # theirs: zeros, the same size
        return copied

    monkeypatch.setattr(tiers, "copy_tree", then_theirs)
    m.save(3, state(3))
    with pytest.raises(StorageError, match="written by another save while this drain sent it"):
        m.drain()
    assert remote_steps(m) == [2]
    monkeypatch.setattr(tiers, "copy_tree", real)
    m.drain()
    assert remote_steps(m) == [2, 3]
    bucket_only = CheckpointManager(f"{bucket.url}/run", storage_options=bucket.storage_options)
    assert torch.equal(bucket_only.restore(step=3)["w"], state(3)["w"])
