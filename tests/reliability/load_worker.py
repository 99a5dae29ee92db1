"""One of many concurrent writers/readers: save N checkpoints, load each back, report."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import json
import sys

import torch

import cloudckpt


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def settled_rss() -> int:
    """Resident memory once garbage and free allocator pages are handed back."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc:
        with contextlib.suppress(AttributeError):  # not glibc
            ctypes.CDLL(libc).malloc_trim(0)
    return status("VmRSS")


def main() -> None:
    base_url, options, worker, count = (
        sys.argv[1],
        json.loads(sys.argv[2]),
        int(sys.argv[3]),
        int(sys.argv[4]),
    )
    opts = {"storage_options": options, "part_size": 5 << 20, "write_concurrency": 2}
    cloudckpt.save({"warm": torch.zeros(1)}, f"{base_url}/w{worker}/warm.pt", **opts)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS counter
    base = status("VmRSS")
    bad = 0
    mid_rss = 0
    for i in range(count):
        g = torch.Generator().manual_seed(worker * 1000 + i)
        state = {"w": torch.randn(3 << 20, generator=g), "i": i, "worker": worker}  # 12 MiB
        url = f"{base_url}/w{worker}/ckpt-{i}.pt"
        if i % 2:
            cloudckpt.async_save(state, url, **opts).result(300)
        else:
            cloudckpt.save(state, url, **opts)
        out = cloudckpt.load(url, **opts)
        bad += not (torch.equal(out["w"], state["w"]) and out["i"] == i and out["worker"] == worker)
        del state, out  # one checkpoint's worth of memory at a time
        if i == count // 2 - 1:
            # Allocator arenas and caches fill up over the first rounds, then plateau.
            mid_rss = settled_rss()
    extra = status("VmHWM") - base
    grown = settled_rss() - mid_rss
    print(json.dumps({"worker": worker, "bad": bad, "extra": extra, "grown": grown}))


if __name__ == "__main__":
    main()
