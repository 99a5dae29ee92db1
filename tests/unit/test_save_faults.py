"""A save that fails at any point leaves no object and no open upload behind."""

from __future__ import annotations

import pytest
import torch

import cloudckpt
from cloudckpt.engine import load as load_mod
from cloudckpt.engine import save as save_mod
from cloudckpt.errors import RetriesExhaustedError, StorageError, TransientError
from cloudckpt.options import MiB
from cloudckpt.store.local import LocalStore
from faults import FaultyStore

FAST = {"backoff_base": 0.001, "backoff_max": 0.002, "max_attempts": 3}


@pytest.fixture
def faulty(tmp_path, monkeypatch):
    store = FaultyStore(LocalStore(tmp_path))
    monkeypatch.setattr(save_mod, "open_target", store.opener())
    monkeypatch.setattr(load_mod, "open_target", store.opener())
    return store


def state(mib: int) -> dict:
    return {"w": torch.arange(mib * MiB // 4, dtype=torch.float32), "step": 7}


def assert_nothing_left(store: FaultyStore, key: str) -> None:
    assert list(store.inner.list("")) == [], "a partial object became visible"
    assert list(store.inner.list_multipart("")) == [], "an upload was left open"


def test_failure_after_retries_leaves_nothing(faulty):
    faulty.faults["upload_part"] = lambda n: TransientError("503 SlowDown") if n >= 2 else None
    with pytest.raises(RetriesExhaustedError, match="upload part"):
        cloudckpt.save(state(16), "ckpt.pt", part_size=5 * MiB, write_concurrency=2, **FAST)
    assert_nothing_left(faulty, "ckpt.pt")


def test_transient_faults_within_budget_still_commit_identical_bytes(faulty):
    faulty.faults["upload_part"] = lambda n: TransientError("reset") if n % 2 else None
    s = state(16)
    # One part at a time: every part fails once, then succeeds.
    cloudckpt.save(s, "ckpt.pt", part_size=5 * MiB, write_concurrency=1, **FAST)
    faulty.faults.clear()
    out = cloudckpt.load("ckpt.pt")
    assert torch.equal(out["w"], s["w"]) and out["step"] == 7


def test_keyboard_interrupt_mid_upload_aborts(faulty):
    faulty.faults["upload_part"] = lambda n: KeyboardInterrupt() if n == 2 else None
    with pytest.raises(KeyboardInterrupt):
        cloudckpt.save(state(16), "ckpt.pt", part_size=5 * MiB, write_concurrency=1, **FAST)
    assert_nothing_left(faulty, "ckpt.pt")


def test_failing_complete_leaves_nothing(faulty):
    faulty.faults["complete_multipart"] = lambda n: StorageError("InternalError")
    with pytest.raises(StorageError):
        cloudckpt.save(state(12), "ckpt.pt", part_size=5 * MiB, **FAST)
    assert_nothing_left(faulty, "ckpt.pt")


class Exploding:
    def __reduce__(self):
        raise KeyboardInterrupt


def test_interrupt_while_pickling_uploads_nothing(faulty):
    with pytest.raises(KeyboardInterrupt):
        cloudckpt.save({"w": torch.zeros(10), "x": Exploding()}, "ckpt.pt", **FAST)
    assert faulty.calls.get("upload_part", 0) == 0 and faulty.calls.get("put", 0) == 0
    assert_nothing_left(faulty, "ckpt.pt")


def test_an_existing_checkpoint_survives_a_failed_overwrite(faulty):
    cloudckpt.save(state(6), "ckpt.pt", part_size=5 * MiB, **FAST)
    before = (faulty.inner.root / "ckpt.pt").read_bytes()
    faulty.faults["upload_part"] = lambda n: TransientError("503") if n >= 2 else None
    with pytest.raises(RetriesExhaustedError):
        cloudckpt.save(state(16), "ckpt.pt", part_size=5 * MiB, **FAST)
    assert (faulty.inner.root / "ckpt.pt").read_bytes() == before


def test_read_faults_are_retried(faulty):
    s = state(8)
    cloudckpt.save(s, "ckpt.pt", **FAST)
    faulty.faults["read_into"] = lambda n: TransientError("reset") if n % 2 else None
    # One request at a time: every request fails once, then succeeds.
    out = cloudckpt.load("ckpt.pt", read_chunk_size=MiB, read_concurrency=1, **FAST)
    assert torch.equal(out["w"], s["w"])
    assert faulty.calls["read_into"] >= 16
