"""A 1 GiB save adds at most write_concurrency x part_size (+ a small constant) of memory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, sys, torch, cloudckpt

    def status(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise KeyError(field)

    url, options = sys.argv[1], json.loads(sys.argv[2])
    MiB = 1 << 20
    # 1 GiB of float32 in 16 tensors, every page touched before we measure.
    state = {f"layer{i}": torch.full((16 * MiB,), float(i)) for i in range(16)}
    cloudckpt.save({"warmup": torch.zeros(4)}, url + ".warmup", **options)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS counter (VmHWM) to the current RSS
    base = status("VmRSS")
    assert status("VmHWM") <= base + MiB, "could not reset the peak-RSS counter"
    result = cloudckpt.save(state, url, **options)
    print(json.dumps({"base": base, "peak": status("VmHWM"), "size": result.size}))
    """
)


@pytest.mark.slow
def test_one_gib_save_stays_within_the_part_buffer_bound(rclone_server, tmp_path):
    bucket = "memory-bound"
    rclone_server.make_bucket(bucket)
    part_size, concurrency = 8 << 20, 4
    options = {
        "part_size": part_size,
        "write_concurrency": concurrency,
        "storage_options": rclone_server.storage_options(),
    }
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, f"s3://{bucket}/big.pt", json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    extra = report["peak"] - report["base"]
    bound = concurrency * part_size + (64 << 20)
    print(f"1 GiB save: +{extra / 2**20:.0f} MiB peak RSS (bound {bound / 2**20:.0f} MiB)")
    assert report["size"] > 1 << 30
    assert extra <= bound, f"save added {extra / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB"
