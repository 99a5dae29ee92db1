"""async_save: a snapshot at return, commit in the background, errors never dropped."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import cloudckpt
from cloudckpt import errors
from cloudckpt.engine import async_save as async_mod
from cloudckpt.engine.staging import get_pool
from cloudckpt.options import MiB


@pytest.fixture(autouse=True)
def _no_leftover_saves():
    yield
    with contextlib.suppress(Exception):  # failures belong to the test that made them
        cloudckpt.wait_all(timeout=60)


def test_snapshot_isolation_and_handle_moments(store_url):
    opts = {"storage_options": store_url.storage_options}
    w = torch.randn(512, 512)
    state = {"model": {"w": w, "w_t": w.t(), "half": w[:256]}, "step": 10, "meta": {"lr": 0.1}}
    url = f"{store_url.base_url}/async/a.pt"
    handle = cloudckpt.async_save(state, url, **opts)
    assert handle.staged()
    # Training goes on at once: tensors, dicts and scalars change right after return.
    expected = w.clone()
    w.mul_(0).add_(7)
    state["step"] = 11
    state["meta"]["lr"] = 0.2
    result = handle.result(timeout=120)
    assert handle.done() and result.size > 512 * 512 * 4
    out = cloudckpt.load(url, **opts)
    assert torch.equal(out["model"]["w"], expected)
    assert torch.equal(out["model"]["w_t"], expected.t())
    assert (
        out["model"]["half"].untyped_storage().data_ptr()
        == out["model"]["w"].untyped_storage().data_ptr()
    )
    assert out["step"] == 10 and out["meta"] == {"lr": 0.1}


def test_background_failure_is_raised_by_result(s3_server):
    url = "s3://no-such-bucket-async/x.pt"
    h = cloudckpt.async_save(
        {"w": torch.zeros(10)}, url, storage_options=s3_server.storage_options()
    )
    assert h.staged()
    with pytest.raises(errors.BucketNotFoundError, match="no-such-bucket-async"):
        h.result(timeout=60)
    assert isinstance(h.exception(), errors.BucketNotFoundError)


def test_unchecked_failure_surfaces_on_the_next_async_save(s3_server, tmp_path):
    opts = {"storage_options": s3_server.storage_options()}
    failing = cloudckpt.async_save({"w": torch.zeros(10)}, "s3://no-such-bucket-next/x.pt", **opts)
    failing.wait(60)
    with pytest.raises(errors.BucketNotFoundError, match="no-such-bucket-next"):
        cloudckpt.async_save({"w": torch.ones(1)}, tmp_path / "next.pt")
    # Reported once: the following save goes ahead.
    cloudckpt.async_save({"w": torch.ones(1)}, tmp_path / "next.pt").result(60)
    assert (tmp_path / "next.pt").exists()


def test_unchecked_failure_surfaces_in_wait_all(s3_server):
    cloudckpt.async_save(
        {"w": torch.zeros(10)},
        "s3://no-such-bucket-all/x.pt",
        storage_options=s3_server.storage_options(),
    )
    with pytest.raises(errors.BucketNotFoundError):
        cloudckpt.wait_all(timeout=60)
    cloudckpt.wait_all(timeout=60)  # nothing left to report


def test_a_new_save_waits_for_the_oldest_beyond_max_in_flight(tmp_path, monkeypatch):
    from cloudckpt.store.local import LocalStore
    from faults import FaultyStore

    store = FaultyStore(LocalStore(tmp_path))
    monkeypatch.setattr(async_mod, "open_target", store.opener())
    gate = threading.Event()

    def held(n):
        gate.wait(30)  # the first save's upload is held until the timer opens the gate
        return None

    store.faults["put"] = held
    first = cloudckpt.async_save({"w": torch.zeros(4)}, "first.pt", max_in_flight=1)
    threading.Timer(0.5, gate.set).start()
    second = cloudckpt.async_save({"w": torch.ones(4)}, "second.pt", max_in_flight=1)
    assert first.done(), "the second save started before the first finished"
    second.result(30)
    assert torch.equal(cloudckpt.load(tmp_path / "second.pt")["w"], torch.ones(4))


def test_unpicklable_state_fails_at_once_and_stages_nothing(tmp_path):
    pool = get_pool()
    before = pool.idle_bytes
    with pytest.raises(errors.UnpicklableError, match=r"state\['opt'\]\['fn'\]"):
        cloudckpt.async_save({"w": torch.zeros(1024), "opt": {"fn": lambda: 1}}, tmp_path / "x.pt")
    assert not (tmp_path / "x.pt").exists()
    assert pool.idle_bytes >= before  # buffers taken before the failure went back


def test_staging_buffers_are_reused(tmp_path):
    pool = get_pool()
    state = {"a": torch.randn(3 * MiB // 4 + 1), "b": torch.randn(1000)}
    cloudckpt.async_save(state, tmp_path / "1.pt").result(60)
    allocated = pool.allocated_bytes
    for i in range(3):
        cloudckpt.async_save(state, tmp_path / f"{i + 2}.pt").result(60)
    assert pool.allocated_bytes == allocated


EXIT_SCRIPT = textwrap.dedent(
    """
    import sys, torch, cloudckpt
    good, bad, endpoint = sys.argv[1], sys.argv[2], sys.argv[3]
    opts = {"endpoint_url": endpoint, "aws_access_key_id": "testing-key",
            "aws_secret_access_key": "testing-secret", "region_name": "us-east-1"}
    cloudckpt.async_save({"w": torch.arange(1 << 20)}, good)
    cloudckpt.async_save({"w": torch.zeros(3)}, bad, storage_options=opts, max_in_flight=2)
    # exit without waiting: the good save must still commit, the bad one be reported
    """
)


def test_pending_saves_finish_or_are_reported_at_exit(tmp_path, moto_server):
    good = tmp_path / "exit.pt"
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            EXIT_SCRIPT,
            str(good),
            "s3://no-such-bucket-exit/x.pt",
            moto_server.endpoint_url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert torch.equal(cloudckpt.load(good)["w"], torch.arange(1 << 20))
    assert "never checked" in out.stderr and "no-such-bucket-exit" in out.stderr
