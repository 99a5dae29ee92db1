"""CheckpointManager against the filesystem, moto and rclone (the ``store_url`` fixture)."""

from __future__ import annotations

import math
import threading
from typing import Any

import pytest
import torch

from cloudckpt.errors import AlreadyExistsError, CorruptCheckpointError, NotFoundError, StorageError
from cloudckpt.manager import MARKER_NAME, CheckpointManager
from cloudckpt.manager.marker import root_prefix
from conftest import StoreTarget
from faults import FaultyStore


def manager(target: StoreTarget, run: str = "run1", **kwargs: Any) -> CheckpointManager:
    return CheckpointManager(
        f"{target.base_url}/{run}", storage_options=target.storage_options, **kwargs
    )


def state(step: int, n: int = 64) -> dict[str, Any]:
    return {"w": torch.full((n,), float(step)), "step": step, "nested": {"b": torch.arange(4)}}


def keys_under(m: CheckpointManager, prefix: str = "") -> list[str]:
    root = root_prefix(m.root_key)
    return [o.key[len(root) :] for o in m.store.list(root + prefix)]


def test_save_list_latest_restore(store_url: StoreTarget) -> None:
    m = manager(store_url)
    assert m.list() == [] and m.latest() is None
    assert m.restore() is None and m.restored_step is None  # a fresh run: nothing yet
    for step in (10, 20, 30):
        info = m.save(step, state(step), metrics={"loss": 1 / step}, metadata={"epoch": step // 10})
        assert info.step == step and info.files[0].name == "state.pt"
    found = m.list()
    assert [c.step for c in found] == [10, 20, 30]
    assert found[0].metrics == {"loss": 0.1} and found[0].metadata == {"epoch": 1}
    assert all(c.size == c.files[0].size > 0 for c in found)
    # Resume in two lines, from a fresh manager (another process would do the same).
    restored = manager(store_url).restore()
    assert restored["step"] == 30 and torch.equal(restored["w"], torch.full((64,), 30.0))
    assert m.restore(step=10)["step"] == 10
    with pytest.raises(NotFoundError, match="step 11"):
        m.restore(step=11)


def test_same_step_twice_is_refused(store_url: StoreTarget) -> None:
    m = manager(store_url)
    m.save(1, state(1))
    with pytest.raises(AlreadyExistsError, match="step 1"):
        m.save(1, state(2))
    assert m.restore()["step"] == 1


def test_listing_reads_markers_only_and_caches_them(store_url: StoreTarget) -> None:
    m = manager(store_url)
    for step in range(3):
        m.save(step, state(step))
    real = m.store
    m.store = spy = FaultyStore(real)
    assert [c.step for c in m.list()] == [0, 1, 2]
    assert spy.calls == {"list": 1, "get_range": 3}  # no HEAD, no payload read
    spy.calls.clear()
    m.list()
    assert spy.calls == {"list": 1}  # markers never change: read once


def test_keep_last_runs_after_commit(store_url: StoreTarget) -> None:
    m = manager(store_url, keep_last=2)
    for step in range(1, 5):
        m.save(step, state(step))
        assert [c.step for c in m.list()] == list(range(max(1, step - 1), step + 1))
    assert not any(k.startswith("step-000000001/") for k in keys_under(m))


def test_top_k_with_ties_and_nan(store_url: StoreTarget) -> None:
    m = manager(store_url, keep_top_k=2, metric="acc", mode="max")
    for step, acc in [(1, 0.5), (2, math.nan), (3, 0.5), (4, 0.9), (5, 0.5), (6, math.nan)]:
        m.save(step, state(step), metrics={"acc": acc})
    # Best two: 4 (0.9), then 5 (newest of the 0.5 tie); 6 survives as the newest.
    found = m.list()
    assert [c.step for c in found] == [4, 5, 6]
    assert math.isnan(found[-1].metrics["acc"])


def test_a_failed_save_between_two_good_ones(store_url: StoreTarget) -> None:
    m = manager(store_url, keep_last=1)
    m.save(1, state(1))
    real = m.store
    m.store = faulty = FaultyStore(real)
    faulty.faults["put"] = lambda n: StorageError("injected: marker write refused")
    with pytest.raises(StorageError, match="injected"):
        m.save(2, state(2))
    m.store = real
    # The payload of step 2 is there, but without its marker it is not a checkpoint;
    # retention did not run, so step 1 is intact and is what a restart resumes.
    assert "step-000000002/state.pt" in keys_under(m)
    assert [c.step for c in m.list()] == [1]
    assert manager(store_url).restore()["step"] == 1
    m.save(3, state(3))
    assert [c.step for c in m.list()] == [3]
    assert m.gc().prefixes == []  # the leftover is younger than the grace period
    report = m.gc(grace_seconds=0)
    assert [u for u, _, _ in report.prefixes] == [m.step_url(2)]
    assert keys_under(m) == [f"step-000000003/{MARKER_NAME}", "step-000000003/state.pt"]


def test_restored_step_is_never_pruned(store_url: StoreTarget) -> None:
    m = manager(store_url)
    for step in (1, 2):
        m.save(step, state(step), metrics={"loss": float(step)})
    resumed = manager(store_url, keep_last=1)
    assert resumed.restore(step=1)["step"] == 1
    resumed.save(3, state(3))
    resumed.save(4, state(4))
    assert [c.step for c in resumed.list()] == [1, 4]


def test_delete_removes_the_marker_first(store_url: StoreTarget) -> None:
    m = manager(store_url)
    m.save(1, state(1))
    m.save(2, state(2))
    real = m.store
    m.store = faulty = FaultyStore(real)
    # The first delete (the marker) goes through; the payload delete fails.
    faulty.faults["delete"] = lambda n: StorageError("injected") if n > 1 else None
    with pytest.raises(StorageError, match="injected"):
        m.delete(1)
    m.store = real
    assert [c.step for c in m.list()] == [2]  # half-deleted never looks committed
    assert "step-000000001/state.pt" in keys_under(m)
    m.gc(grace_seconds=0)
    m.delete(2)
    assert keys_under(m) == []
    with pytest.raises(NotFoundError):
        m.delete(2)


def test_gc_aborts_stale_uploads_and_dry_run_keeps_them(store_url: StoreTarget) -> None:
    m = manager(store_url)
    m.save(1, state(1))
    upload = m.store.create_multipart(root_prefix(m.root_key) + "step-000000002/state.pt")
    m.store.upload_part(upload, 1, b"x" * 10, 0)
    dry = m.gc(grace_seconds=0, dry_run=True)
    assert len(dry.uploads) == 1 and dry.uploads[0][0] == m.step_url(2) + "state.pt"
    assert len(list(m.store.list_multipart(root_prefix(m.root_key)))) == 1
    report = m.gc(grace_seconds=0)
    assert len(report.uploads) == 1
    assert list(m.store.list_multipart(root_prefix(m.root_key))) == []
    assert [c.step for c in m.list()] == [1]


def test_concurrent_reader_sees_only_complete_checkpoints(store_url: StoreTarget) -> None:
    writer = manager(store_url)
    reader = manager(store_url)
    errors: list[BaseException] = []

    def write() -> None:
        try:
            for step in range(1, 7):
                writer.save(step, state(step, n=32 * 1024))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=write)
    thread.start()
    seen: list[int] = []
    for _ in range(500):  # bounded; the writer finishes long before
        found = reader.list()
        steps = [c.step for c in found]
        assert steps == sorted(steps) and steps == list(range(1, len(steps) + 1))
        if found:
            loaded = reader.restore(step=found[-1].step)
            assert torch.equal(loaded["w"], torch.full((32 * 1024,), float(found[-1].step)))
            seen.append(found[-1].step)
        if not thread.is_alive():
            break
    thread.join(timeout=120)
    assert not errors
    assert seen == sorted(seen)
    assert [c.step for c in reader.list()] == list(range(1, 7))


def test_async_save_commits_marker_after_payload(store_url: StoreTarget) -> None:
    m = manager(store_url, keep_last=1)
    m.save(1, state(1))
    s = state(2)
    handle = m.async_save(2, s, metrics={"loss": 0.5})
    s["w"].fill_(-1.0)  # mutate after the snapshot: the checkpoint must not see it
    assert handle.wait(timeout=60) is True
    info = handle.result(timeout=60)
    assert handle.done() and handle.staged() and info.step == 2
    assert [c.step for c in m.list()] == [2]
    assert torch.equal(m.restore()["w"], torch.full((64,), 2.0))


def test_dcp_directory_checkpoints(store_url: StoreTarget, tmp_path: Any) -> None:
    pytest.importorskip("cloudckpt.dcp")
    m = manager(store_url, kind="dcp", keep_last=1)
    for step in (1, 2):
        m.save(step, {"w": torch.full((128,), float(step)), "b": torch.arange(8)})
    found = m.list()
    assert [c.step for c in found] == [2] and found[0].kind == "dcp"
    assert ".metadata" in {f.name for f in found[0].files}
    target = {"w": torch.zeros(128), "b": torch.zeros(8, dtype=torch.long)}
    m.restore(state=target)
    assert torch.equal(target["w"], torch.full((128,), 2.0))


def test_retention_ignores_a_save_in_flight(store_url: StoreTarget) -> None:
    m = manager(store_url, keep_last=1)
    m.save(1, state(1))
    # A concurrent save of step 5 is running: its prefix has bytes but no marker.
    m._pending.add(5)
    m.store.put(root_prefix(m.root_key) + "step-000000005/state.pt", b"partial")
    m.save(2, state(2))
    assert m.gc(grace_seconds=0).prefixes == []  # gc leaves the save in flight alone
    assert "step-000000005/state.pt" in keys_under(m)
    assert [c.step for c in m.list()] == [2]


def test_retention_in_a_directory_leaves_no_empty_step_folders(tmp_path: Any) -> None:
    """A filesystem run root looks like a bucket after retention: a deleted step's
    folder goes with its files, and nothing above the step is touched."""
    root = tmp_path / "runs" / "run1"
    m = CheckpointManager(str(root), keep_last=1)
    for step in (1, 2, 3):
        m.save(step, {"w": torch.ones(4) * step})
    assert sorted(p.name for p in root.iterdir()) == ["step-000000003"]
    m.delete(3)
    assert root.is_dir() and list(root.iterdir()) == []  # the root itself stays


def test_another_steps_file_copied_over_is_refused_at_restore(store_url: StoreTarget) -> None:
    """Step 5's ``state.pt`` copied over step 10's (the same size, valid records): the
    restore checks each file against its marker's ETag first and names the file, where
    the store keeps ETags (the filesystem keeps none: the same size passes there, and
    a record's CRC-32 is what a load checks)."""
    m = manager(store_url)
    m.save(5, state(5))
    m.save(10, state(10))
    prefix = root_prefix(m.root_key)
    m.store.put(f"{prefix}step-000000010/state.pt", m.store.get(f"{prefix}step-000000005/state.pt"))
    if store_url.name == "file":
        assert torch.equal(m.restore()["w"], state(5)["w"])  # what no ETag can tell
        return
    with pytest.raises(
        CorruptCheckpointError, match=r"step-000000010/state\.pt changed since step 10"
    ):
        m.restore()
    with pytest.raises(CorruptCheckpointError, match=r"state\.pt changed since step 10"):
        m.restore(step=10)
    assert torch.equal(m.restore(step=5)["w"], state(5)["w"])


@pytest.mark.parametrize("kind", ["object", "dcp"])
def test_a_crashed_saves_leftovers_stay_out_of_the_next_commit(
    store_url: StoreTarget, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A save of step 2 on two ranks died before its commit and left rank 1's file; the
    restarted job saves step 2 again on one rank: its marker lists the files this save
    wrote, not the dead save's (a WARNING names what is left out)."""
    import logging

    m = manager(store_url, kind=kind)
    prefix = f"{root_prefix(m.root_key)}step-000000002/"
    m.store.put(prefix + "__1_0.distcp", b"the dead save's rank 1 data")
    caplog.set_level(logging.WARNING, logger="cloudckpt")
    info = m.save(2, {"w": torch.arange(8.0)} if kind == "dcp" else state(2))
    names = sorted(f.name for f in info.files)
    assert "__1_0.distcp" not in names
    if kind == "object":
        assert names == ["state.pt"]
    else:
        assert names == [".cloudckpt-layout.json", ".metadata", "__0_0.distcp"]
    assert m.info(2).files == info.files
    assert any(
        "__1_0.distcp" in r.getMessage() and "left out" in r.getMessage() for r in caplog.records
    )
    out = {"w": torch.zeros(8)} if kind == "dcp" else None
    restored = m.restore(state=out)
    assert torch.equal(restored["w"], torch.arange(8.0) if kind == "dcp" else state(2)["w"])


def test_a_dcp_data_file_another_save_rewrites_before_the_commit_fails_it(
    store_url: StoreTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCP's writer tells the commit each object's size and the ETag its upload got:
    another save's same-size data file, landing between the writes and the commit,
    fails the commit (stores without ETags: only another size is seen)."""
    m = manager(store_url, kind="dcp")
    real = m._commit_save
    prefix = f"{root_prefix(m.root_key)}step-000000001/"

    def theirs_first(*args: Any, **kwargs: Any) -> Any:
        data = bytearray(m.store.get(prefix + "__0_0.distcp"))
        data[-1] ^= 0xFF  # the same size, other bytes
        m.store.put(prefix + "__0_0.distcp", bytes(data))
        return real(*args, **kwargs)

    monkeypatch.setattr(m, "_commit_save", theirs_first)
    if store_url.name == "file":  # no ETags: the same size passes the commit
        m.save(1, {"w": torch.arange(8.0)})
        return
    with pytest.raises(CorruptCheckpointError, match=r"__0_0\.distcp is not the object"):
        m.save(1, {"w": torch.arange(8.0)})
    assert m.list() == []
