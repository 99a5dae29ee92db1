"""Big buffers are freed by reference counting, not left for the cyclic collector.

Part buffers or loaded storages caught in a reference cycle stay allocated until the
garbage collector happens to run: a training loop that saves every few minutes would
hold several checkpoints' worth of memory.

Each check runs in a fresh interpreter: a full collection with ``DEBUG_SAVEALL`` walks
the whole heap, which in the test session's own process (every library the suite
imported, every object it made) costs a minute a check rather than a second.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

PRELUDE = """
import gc, json, sys
import torch
import cloudckpt

def garbage_buffers(fn):
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

tmp = sys.argv[1]
"""


def _garbage_buffers(body: str, tmp_path: Path) -> list[str]:
    """What ``body`` (which defines ``fn()``) leaves in cycles, in a fresh interpreter."""
    code = PRELUDE + textwrap.dedent(body) + "\nprint(json.dumps(garbage_buffers(fn)))\n"
    src = str(Path(__file__).resolve().parents[2] / "src")
    path = os.environ.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, path]))},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_save_and_load_leave_no_buffers_in_cycles(tmp_path):
    body = """
    state = {"w": torch.randn(3 << 20), "b": torch.zeros(10)}

    def fn():
        cloudckpt.save(state, tmp + "/c.pt", part_size=5 << 20, write_concurrency=2)
        out = cloudckpt.load(tmp + "/c.pt", read_chunk_size=1 << 20)
        assert torch.equal(out["w"], state["w"])
        many = {f"t{i}": torch.randn(64) for i in range(300)}  # small records, batched
        cloudckpt.save(many, tmp + "/m.pt")
        back = cloudckpt.load(tmp + "/m.pt")
        assert all(torch.equal(back[k], v) for k, v in many.items())
    """
    assert _garbage_buffers(body, tmp_path) == []


def test_async_save_leaves_no_buffers_in_cycles(tmp_path):
    body = """
    state = {"w": torch.randn(1 << 20)}

    def fn():
        cloudckpt.async_save(state, tmp + "/a.pt").result(60)
    """
    assert _garbage_buffers(body, tmp_path) == []


def test_safetensors_save_and_load_leave_no_buffers_in_cycles(tmp_path):
    body = """
    state = {"w": torch.randn(3 << 20), "b": torch.zeros(10)}

    def fn():
        url = tmp + "/st"
        cloudckpt.save_safetensors(state, url, max_shard_size=1 << 20, part_size=5 << 20)
        out = cloudckpt.load_safetensors(url, read_chunk_size=1 << 20, device="meta")
        assert out["w"].shape == state["w"].shape
        out = cloudckpt.load_safetensors(url, read_chunk_size=1 << 20)
        assert torch.equal(out["w"], state["w"])
    """
    assert _garbage_buffers(body, tmp_path) == []


def test_the_check_sees_a_buffer_left_in_a_cycle(tmp_path):
    """The check itself: a storage held only by a cycle is reported."""
    body = """
    class Holder:
        pass

    def fn():
        a, b = Holder(), Holder()
        a.other, b.other = b, a
        a.buffer = torch.UntypedStorage(1 << 20)
    """
    assert "UntypedStorage" in _garbage_buffers(body, tmp_path)
