"""A local tier while the bucket is away, and drains that keep only their own bytes.

Real servers: moto behind the fault proxy (``cloudckpt.testing.fault_proxy``), which
either is not there (connections refused), or accepts and never answers. Saves with a
local tier send nothing to the bucket: they go on at local speed, one WARNING says the
bucket is away and how many steps wait, and when it returns the drains land in order.
A drain that finds objects under the bucket's uncommitted step keeps only those proven
to be its own (its journal, or a checksum the bucket reports): never "the same size and
recent, so the same" (docs/tiers.md, "What a crash loses").
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import unquote, urlsplit

import pytest
import torch

from cloudckpt.engine.copy import copy_tree, plan_tree
from cloudckpt.errors import LocalTierFullError, StorageError
from cloudckpt.manager import MARKER_NAME, CheckpointManager
from cloudckpt.manager.marker import parse_step, step_dir
from cloudckpt.options import MiB, resolve_options
from cloudckpt.store import open_url
from cloudckpt.testing.fault_proxy import FaultProxy
from faults import FaultyStore
from servers import S3Server, free_port, unique_bucket_name

#: A bucket that is away fails a request fast: two attempts, short waits and timeouts.
FAST: dict[str, Any] = {
    "max_attempts": 2,
    "backoff_base": 0.05,
    "backoff_max": 0.2,
    "connect_timeout": 1.0,
    "request_timeout": 2.0,
}
#: A save to a local tier takes well under this, whatever the bucket does (generous: the
#: machine may be busy); before, a save waited for the bucket (20 s and more).
LOCAL_SAVE_S = 10.0


def state(step: int, n: int = 1 << 14, value: float | None = None) -> dict[str, Any]:
    return {"w": torch.full((n,), float(step) if value is None else value), "step": step}


def local_steps(tier: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in tier.glob("step-*") if (p / MARKER_NAME).exists())


def outage_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and "is unreachable" in r.getMessage()
    ]


def other_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """WARNINGs but the outage's and the retries of single requests."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING
        and "is unreachable" not in r.getMessage()
        and not r.getMessage().startswith("retrying ")
    ]


def marker_puts(order: list[int]) -> Callable[[str, str], bool]:
    """A proxy ``match`` noting the step of every marker PUT, in order."""

    def match(method: str, target: str) -> bool:
        path = unquote(urlsplit(target).path)
        if method == "PUT" and path.endswith("/" + MARKER_NAME):
            step = parse_step(path.split("/")[-2])
            if step is not None:
                order.append(step)
        return True

    return match


def marker_put_held(
    step: int, held: threading.Event, release: threading.Event
) -> Callable[[str, str], bool]:
    """A proxy ``match`` holding the PUT of ``step``'s marker (``held`` set) until
    ``release`` is set: a drain stopped after its uploads, before its commit."""

    def match(method: str, target: str) -> bool:
        path = unquote(urlsplit(target).path)
        if method == "PUT" and path.endswith(f"/{step_dir(step)}/{MARKER_NAME}"):
            held.set()
            assert release.wait(120)
        return False

    return match


def timed_saves(m: CheckpointManager, steps: range) -> list[float]:
    took = []
    for step in steps:
        started = time.monotonic()
        info = m.save(step, state(step))
        took.append(time.monotonic() - started)
        assert info.tiers == ("local",)
    return took


def check_bucket(root: str, options: dict[str, Any], steps: list[int]) -> None:
    """Every step of ``steps`` committed in the bucket and restorable from it."""
    plain = CheckpointManager(root, storage_options=options)  # no local tier
    assert [c.step for c in plain.list()] == steps
    for step in steps:
        got = plain.restore(step=step)
        assert got["step"] == step and torch.equal(got["w"], state(step)["w"])


class Usage(NamedTuple):
    total: int
    used: int
    free: int


def test_saves_go_on_while_the_bucket_refuses_connections_and_drain_in_order_after(
    moto_server: S3Server,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bucket = moto_server.make_bucket(unique_bucket_name("refused"))
    port = free_port()  # nothing listens there yet: every connection is refused
    options = {**moto_server.storage_options(), "endpoint_url": f"http://127.0.0.1:{port}"}
    root, tier = f"s3://{bucket}/run", tmp_path / "tier"
    caplog.set_level(logging.INFO, logger="cloudckpt")
    m = CheckpointManager(root, local_dir=tier, keep_local=1, storage_options=options, **FAST)
    took = timed_saves(m, range(1, 4))  # before: RetriesExhaustedError, nothing saved
    assert max(took) < LOCAL_SAVE_S, took
    assert local_steps(tier) == [1, 2, 3]  # keep_local=1 never deletes an undrained step
    for _ in range(2):
        with pytest.raises(StorageError, match=r"unreachable|connection refused"):
            m.drain()  # still away: the drain says so, the steps stay local
    timed_saves(m, range(4, 6))
    said = outage_warnings(caplog)
    assert len(said) == 1, said  # one per outage, not one per save or drain
    assert "wait to be drained" in said[0] and str(tier) in said[0], said[0]
    assert other_warnings(caplog) == []
    with monkeypatch.context() as mp:  # the tier fills up: the error names what waits
        mp.setattr(shutil, "disk_usage", lambda path: Usage(1 << 30, 1 << 30, 1024))
        with pytest.raises(LocalTierFullError, match=re.escape("[1, 2, 3, 4, 5]")):
            m.save(6, state(6))
    assert local_steps(tier) == [1, 2, 3, 4, 5]

    order: list[int] = []
    with FaultProxy(moto_server.endpoint_url, port=port, match=marker_puts(order)):
        m.drain()
        assert order == [1, 2, 3, 4, 5]  # the bucket's commits, oldest first
        check_bucket(root, options, [1, 2, 3, 4, 5])
        assert local_steps(tier) == [5]  # drained: local retention applies again
    assert len(outage_warnings(caplog)) == 1


def test_saves_return_in_local_time_while_the_bucket_never_answers(
    moto_server: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bucket = moto_server.make_bucket(unique_bucket_name("silent"))
    root, tier = f"s3://{bucket}/run", tmp_path / "tier"
    order: list[int] = []
    caplog.set_level(logging.INFO, logger="cloudckpt")
    # Every request is accepted and held without an answer (until the proxy stops).
    with FaultProxy(
        moto_server.endpoint_url,
        rate=1.0,
        kinds=("slow",),
        slow_seconds=600,
        match=marker_puts(order),
    ) as proxy:
        options = {**moto_server.storage_options(), "endpoint_url": proxy.url}
        m = CheckpointManager(root, local_dir=tier, storage_options=options, **FAST)
        took = timed_saves(m, range(1, 4))  # before: blocked on the bucket's marker
        assert max(took) < LOCAL_SAVE_S, took
        assert local_steps(tier) == [1, 2, 3]
        with pytest.raises(StorageError):
            m.drain()  # the drainer's requests time out: the outage is said once
        took += timed_saves(m, range(4, 5))
        assert max(took) < LOCAL_SAVE_S, took
        said = outage_warnings(caplog)
        assert len(said) == 1 and "wait to be drained" in said[0], said
        assert other_warnings(caplog) == []
        assert order == []

        proxy.rate = 0.0  # the bucket answers again
        m.drain()
        assert order == [1, 2, 3, 4]
        check_bucket(root, options, [1, 2, 3, 4])
    assert len(outage_warnings(caplog)) == 1


def test_a_restart_while_the_bucket_refuses_connections_restores_from_the_local_tier(
    moto_server: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A job restarted while the bucket is away resumes from its local tier (WARNING:
    only the local tier was seen); a node whose tier is empty refuses to start fresh
    (the bucket may hold the run); a manager without a tier raises as before."""
    bucket = moto_server.make_bucket(unique_bucket_name("refused-restart"))
    port = free_port()
    options = {**moto_server.storage_options(), "endpoint_url": f"http://127.0.0.1:{port}"}
    root, tier = f"s3://{bucket}/run", tmp_path / "tier"
    timed_saves(
        CheckpointManager(root, local_dir=tier, storage_options=options, **FAST), range(1, 4)
    )

    caplog.set_level(logging.WARNING, logger="cloudckpt")
    restarted = CheckpointManager(root, local_dir=tier, storage_options=options, **FAST)
    got = restarted.restore()  # before: RetriesExhaustedError from the bucket's listing
    assert restarted.restored_step == 3 and torch.equal(got["w"], state(3)["w"])
    said = [m for m in outage_warnings(caplog) if "reading the local tier" in m]
    assert said and root in said[0] and str(tier) in said[0], said
    assert [(c.step, c.tiers) for c in restarted.list()] == [(s, ("local",)) for s in (1, 2, 3)]
    latest = restarted.latest()
    assert latest is not None and latest.step == 3
    assert restarted.info(2).tiers == ("local",)
    assert torch.equal(restarted.restore(step=2)["w"], state(2)["w"])
    with pytest.raises(StorageError, match=r"unreachable|refused"):
        restarted.info(7)  # not in the local tier: the bucket's error, not "not found"

    fresh = CheckpointManager(
        root, local_dir=tmp_path / "new-node", storage_options=options, **FAST
    )
    with pytest.raises(StorageError, match="not starting fresh"):
        fresh.restore()
    with pytest.raises(StorageError, match=r"unreachable|refused|attempt"):
        CheckpointManager(root, storage_options=options, **FAST).restore()

    restarted.save(4, state(4))  # the run goes on from step 3
    with FaultProxy(moto_server.endpoint_url, port=port):
        restarted.drain()
        check_bucket(root, options, [1, 2, 3, 4])
        assert fresh.restore()["step"] == 4  # the bucket answers: read from it


@pytest.mark.parametrize(
    ("kind", "mode"),
    [("object", "async"), ("dcp", "sync"), ("dcp", "async")],
    ids=["object-async", "dcp", "dcp-async"],
)
def test_every_kind_saves_locally_while_the_bucket_refuses_connections(
    moto_server: S3Server, tmp_path: Path, kind: str, mode: str
) -> None:
    if kind == "dcp":
        pytest.importorskip("cloudckpt.dcp")
    bucket = moto_server.make_bucket(unique_bucket_name("refused-kinds"))
    port = free_port()
    options = {**moto_server.storage_options(), "endpoint_url": f"http://127.0.0.1:{port}"}
    root = f"s3://{bucket}/run"
    m = CheckpointManager(
        root, local_dir=tmp_path / "tier", kind=kind, storage_options=options, **FAST
    )
    for step in (1, 2):
        started = time.monotonic()
        saved = {"w": torch.full((64,), float(step))}
        if mode == "async":
            info = m.async_save(step, saved).result(timeout=LOCAL_SAVE_S)
        else:
            info = m.save(step, saved)
        assert time.monotonic() - started < LOCAL_SAVE_S
        assert info.tiers == ("local",)
    with FaultProxy(moto_server.endpoint_url, port=port):
        m.drain()
        plain = CheckpointManager(root, kind=kind, storage_options=options)
        assert [c.step for c in plain.list()] == [1, 2]


def _ranks_save_while_away(rank: int, world: int, url: str, so: dict[str, Any], base: str) -> None:
    """Every rank: a save, an async save and a save, all local, while the bucket refuses."""
    m = CheckpointManager(
        url, local_dir=Path(base) / f"node{rank}", kind="dcp", storage_options=so, **FAST
    )
    for step in (1, 2, 3):
        started = time.monotonic()
        saved = {f"own{rank}": torch.full((300,), float(step))}
        if step == 2:
            info = m.async_save(step, saved).result(timeout=LOCAL_SAVE_S)
        else:
            info = m.save(step, saved)
        assert time.monotonic() - started < LOCAL_SAVE_S, (rank, step)
        assert info.tiers == ("local",)
    with pytest.raises(Exception):  # noqa: B017 - rank 0's error, or its echo on rank 1
        m.drain()  # every rank: the bucket is still away


def _ranks_restore_while_away(
    rank: int, world: int, url: str, so: dict[str, Any], base: str
) -> None:
    """Every rank, restarted while the bucket still refuses: the newest step every
    rank's local tier holds is restored."""
    m = CheckpointManager(
        url, local_dir=Path(base) / f"node{rank}", kind="dcp", storage_options=so, **FAST
    )
    got = m.restore(state={f"own{rank}": torch.zeros(300)})
    assert m.restored_step == 3
    assert torch.equal(got[f"own{rank}"], torch.full((300,), 3.0))
    with pytest.raises(StorageError, match="unreachable"):  # not "in no tier"
        m.restore(step=9, state={f"own{rank}": torch.zeros(300)})


def _ranks_drain(rank: int, world: int, url: str, so: dict[str, Any], base: str) -> None:
    m = CheckpointManager(
        url, local_dir=Path(base) / f"node{rank}", kind="dcp", storage_options=so, **FAST
    )
    m.drain()
    assert [(c.step, c.tiers) for c in m.list()] == [(s, ("local", "remote")) for s in (1, 2, 3)]


def test_every_rank_saves_locally_while_the_bucket_refuses_connections(
    moto_server: S3Server, tmp_path: Path
) -> None:
    pytest.importorskip("cloudckpt.dcp")
    from ranks import run_ranks

    bucket = moto_server.make_bucket(unique_bucket_name("refused-ranks"))
    port = free_port()
    options = {**moto_server.storage_options(), "endpoint_url": f"http://127.0.0.1:{port}"}
    url = f"s3://{bucket}/run"
    run_ranks(_ranks_save_while_away, 2, url, options, str(tmp_path), timeout=300)
    run_ranks(_ranks_restore_while_away, 2, url, options, str(tmp_path), timeout=300)
    with FaultProxy(moto_server.endpoint_url, port=port):
        run_ranks(_ranks_drain, 2, url, options, str(tmp_path), timeout=300)


class MarkerPutFails(FaultyStore):
    """Node A "dies" before the bucket's marker: every marker write fails."""

    def _put(self, key: str, data: Any, if_none_match: bool) -> None:
        if key.endswith(MARKER_NAME):
            raise StorageError(f"injected: node A died before writing {key}")
        super()._put(key, data, if_none_match)


@pytest.mark.parametrize(
    ("kind", "n"),
    [("object", 1 << 14), ("object", 3 * MiB), ("dcp", 1 << 14)],
    ids=["object", "object-multipart", "dcp"],
)
def test_a_drain_never_commits_another_nodes_bytes_of_the_same_step(
    moto_server: S3Server, tmp_path: Path, kind: str, n: int
) -> None:
    if kind == "dcp":
        pytest.importorskip("cloudckpt.dcp")
    bucket = moto_server.make_bucket(unique_bucket_name("two-nodes"))
    options = moto_server.storage_options()
    root = f"s3://{bucket}/run"
    # 12 MiB of tensors in 5 MiB parts: the multipart case goes up in three parts.
    opts: dict[str, Any] = {"kind": kind, "storage_options": options, "part_size": 5 * MiB}

    def saved(step: int, value: float) -> dict[str, Any]:
        return {"w": torch.full((n,), value)} if kind == "dcp" else state(step, n, value)

    def load(m: CheckpointManager, step: int) -> torch.Tensor:
        if kind == "dcp":
            target = {"w": torch.zeros(n)}
            m.restore(step=step, state=target)
            return target["w"]
        return m.restore(step=step)["w"]

    a = CheckpointManager(root, local_dir=tmp_path / "node-a", **opts)
    a.save(4, saved(4, 4.0))
    a.drain()
    a.store = MarkerPutFails(a.store)
    a.save(5, saved(5, -1.0))  # node A's step 5: its payload goes up, no marker
    with pytest.raises(StorageError, match="node A died"):
        a.drain()
    uncommitted = [o.key for o in a.store.list(f"run/{step_dir(5)}/")]
    assert uncommitted and not any(k.endswith(MARKER_NAME) for k in uncommitted)

    b = CheckpointManager(root, local_dir=tmp_path / "node-b", **opts)  # a fresh node
    assert torch.equal(load(b, 4), torch.full((n,), 4.0))  # from the bucket
    b.save(5, saved(5, 5.0))  # the same step again: same shapes, other values
    b.drain()
    plain = CheckpointManager(root, kind=kind, storage_options=options)
    assert [c.step for c in plain.list()] == [4, 5]
    assert torch.equal(load(plain, 5), torch.full((n,), 5.0))  # B's bytes, not A's
    local = tmp_path / "node-b" / step_dir(5)
    for f in plain.info(5).files:  # every file the bucket's marker lists is B's
        assert plain.store.get(f"run/{step_dir(5)}/{f.name}") == (local / f.name).read_bytes()


def test_cp_r_resume_copies_again_a_same_size_object_with_other_bytes(
    moto_server: S3Server, tmp_path: Path
) -> None:
    """``cp -r`` run again keeps only what is proven the same bytes: the bucket's MD5
    (one part) or MD5 of part MD5s (multipart) against the local file, or two local
    files compared; never the same size alone."""
    bucket = moto_server.make_bucket(unique_bucket_name("cp-r-proof"))
    opts = resolve_options(
        part_size=5 * MiB, write_concurrency=2, storage_options=moto_server.storage_options()
    )
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    files = {"small.bin": os.urandom(1000), "big.bin": os.urandom(11 * MiB + 3)}
    for name, data in files.items():
        (src_dir / name).write_bytes(data)
    src, src_key = open_url(str(src_dir), opts.replace(storage_options={}))
    dst, dst_key = open_url(f"s3://{bucket}/copy", opts)
    copy_tree(src, src_key, dst, dst_key, opts, state_dir=tmp_path / "state")
    assert all(e.skip for e in plan_tree(src, src_key, dst, dst_key))  # proven, kept

    for name, data in files.items():  # the same sizes, other bytes
        (src_dir / name).write_bytes(bytes(b ^ 0xFF for b in data[:64]) + data[64:])
    assert not any(e.skip for e in plan_tree(src, src_key, dst, dst_key))
    copy_tree(src, src_key, dst, dst_key, opts, state_dir=tmp_path / "state")
    for name in files:
        assert dst.get(f"copy/{name}") == (src_dir / name).read_bytes()

    out = tmp_path / "out"  # to the filesystem: the two files are compared
    shutil.copytree(src_dir, out)
    (out / "small.bin").write_bytes(b"\0" * len(files["small.bin"]))
    local, local_key = open_url(str(out), opts.replace(storage_options={}))
    plan = {e.name: e.skip for e in plan_tree(src, src_key, local, local_key)}
    assert plan == {"big.bin": True, "small.bin": False}


def test_a_delete_during_a_drain_past_its_uploads_leaves_nothing_committed(
    moto_server: S3Server, tmp_path: Path
) -> None:
    """delete(step) while the step's drain waits on the bucket's marker PUT (its data
    uploaded): the delete waits for that drain, then removes the step from both tiers;
    the marker never lands after the delete (a committed step with its files gone)."""
    bucket = moto_server.make_bucket(unique_bucket_name("delete-mid-drain"))
    root, tier = f"s3://{bucket}/run", tmp_path / "tier"
    held, release = threading.Event(), threading.Event()

    with FaultProxy(moto_server.endpoint_url, match=marker_put_held(2, held, release)) as proxy:
        options = {**moto_server.storage_options(), "endpoint_url": proxy.url}
        m = CheckpointManager(root, local_dir=tier, storage_options=options, **FAST)
        m.save(1, state(1))
        m.drain()
        m.async_save(2, state(2)).result(timeout=60)  # committed locally, drain queued
        assert held.wait(60), "the drain never reached the bucket's marker"
        deleting = threading.Thread(target=m.delete, args=(2,))
        deleting.start()
        deleting.join(0.5)
        assert deleting.is_alive()  # it waits for the drain under way
        release.set()
        deleting.join(120)
        assert not deleting.is_alive()
        m.drain()
        plain = CheckpointManager(root, storage_options=options)
        assert [c.step for c in plain.list()] == [1]  # before: step 2's marker landed
        assert list(plain.store.list(f"run/{step_dir(2)}/")) == []
        assert [c.step for c in m.list()] == [1]


def _delete_during_ranked_drain(
    rank: int, world: int, url: str, so: dict[str, Any], base: str, other: bool
) -> None:
    """Every rank: step 1 saved (async: its drain queued on every rank's drainer), then,
    once the test says the drain is held at the bucket's marker, delete(1), by the same
    manager or (``other``) by another manager of the run (as another process would)."""
    local = Path(base) / f"node{rank}"
    m = CheckpointManager(url, local_dir=local, kind="dcp", storage_options=so, **FAST)
    m.async_save(1, {f"own{rank}": torch.full((300,), 1.0)}).result(timeout=120)
    held = Path(base) / "held"
    deadline = time.monotonic() + 120
    while not held.exists():  # the test process's proxy holds the marker PUT
        assert time.monotonic() < deadline, "the drain never reached the bucket's marker"
        time.sleep(0.05)
    if rank == 0:
        (Path(base) / "deleting").touch()
    if not other:
        m.delete(1)
        assert m.list() == []
        m.drain()  # nothing left to drain, nothing failed
    else:  # the drain under way finds its files gone after its commit: withdrawn
        CheckpointManager(url, local_dir=local, kind="dcp", storage_options=so, **FAST).delete(1)
        m.drain()  # its failed drain is tried again: no local copy left, nothing to send
    assert not (local / step_dir(1) / MARKER_NAME).exists()


@pytest.mark.parametrize("other", [False, True], ids=["same-manager", "another-manager"])
def test_a_delete_on_several_ranks_during_a_background_drain_leaves_nothing_committed(
    moto_server: S3Server, tmp_path: Path, other: bool
) -> None:
    """2 ranks, a local_dir each: delete(1) while step 1's background drain waits on
    the bucket's marker PUT. Before, the first rank deleted the bucket's files and its
    own copy at once, the marker landed after (a committed step with its files gone),
    and the other rank's local copy stayed committed."""
    pytest.importorskip("cloudckpt.dcp")
    from ranks import run_ranks

    bucket = moto_server.make_bucket(unique_bucket_name("delete-ranked"))
    url = f"s3://{bucket}/run"
    held, release = threading.Event(), threading.Event()

    def release_once_deleting() -> None:
        if held.wait(120):
            (tmp_path / "held").touch()
        deadline = time.monotonic() + 120
        while not (tmp_path / "deleting").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        release.set()

    with FaultProxy(moto_server.endpoint_url, match=marker_put_held(1, held, release)) as proxy:
        options = {**moto_server.storage_options(), "endpoint_url": proxy.url}
        helper = threading.Thread(target=release_once_deleting, daemon=True)
        helper.start()
        run_ranks(_delete_during_ranked_drain, 2, url, options, str(tmp_path), other, timeout=300)
        helper.join(10)
        plain = CheckpointManager(url, storage_options=options)
        assert plain.list() == []
        assert list(plain.store.list(f"run/{step_dir(1)}/")) == []
