"""Big buffers are freed by reference counting, not left for the cyclic collector.

Part buffers or loaded storages caught in a reference cycle stay allocated until the
garbage collector happens to run: a training loop that saves every few minutes would
hold several checkpoints' worth of memory.
"""

from __future__ import annotations

import gc

import torch

import cloudckpt


def _garbage_buffers(fn) -> list[str]:
    gc.collect()
    gc.disable()
    try:
        fn()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        # bytearrays are not tracked by the collector: look for what holds them instead.
        big = (torch.UntypedStorage, torch.Tensor)
        return [
            type(o).__name__
            for o in gc.garbage
            if isinstance(o, big) or type(o).__module__.startswith("cloudckpt")
        ]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def test_save_and_load_leave_no_buffers_in_cycles(tmp_path):
    state = {"w": torch.randn(3 << 20), "b": torch.zeros(10)}

    def round_trip():
        cloudckpt.save(state, tmp_path / "c.pt", part_size=5 << 20, write_concurrency=2)
        out = cloudckpt.load(tmp_path / "c.pt", read_chunk_size=1 << 20)
        assert torch.equal(out["w"], state["w"])

    assert _garbage_buffers(round_trip) == []


def test_async_save_leaves_no_buffers_in_cycles(tmp_path):
    state = {"w": torch.randn(1 << 20)}
    assert _garbage_buffers(lambda: cloudckpt.async_save(state, tmp_path / "a.pt").result(60)) == []


def test_safetensors_save_and_load_leave_no_buffers_in_cycles(tmp_path):
    state = {"w": torch.randn(3 << 20), "b": torch.zeros(10)}

    def round_trip():
        url = tmp_path / "st"
        cloudckpt.save_safetensors(state, url, max_shard_size=1 << 20, part_size=5 << 20)
        out = cloudckpt.load_safetensors(url, read_chunk_size=1 << 20, device="meta")
        assert out["w"].shape == state["w"].shape
        out = cloudckpt.load_safetensors(url, read_chunk_size=1 << 20)
        assert torch.equal(out["w"], state["w"])

    assert _garbage_buffers(round_trip) == []
