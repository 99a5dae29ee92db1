"""A DDP-style resume on N forked gloo ranks: every rank loads the same object, with and
without ``share=True`` (ranks/share.py), against ``rclone serve s3`` on tmpfs.

    .venv/bin/python -m benchmarks.studies.shared_load --mib 512 --ranks 4 --reps 3

Prints, per mode and repetition, the slowest rank's wall time, the ranks' CPU summed,
and the S3 requests the server logged; every rank checks every tensor it loaded. The
medians go to ``--out`` (default ``benchmarks/studies/results/shared_load.json``), which
docs/benchmarks.md's "Many ranks" section is rendered from. The
bytes each mode reads are asserted in tests/integration/test_shared_load.py (a proxy
counts them); here the store is reached directly, so the proxy costs nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

import cloudckpt
from benchmarks import server
from benchmarks.systems.ranks import run_ranks
from benchmarks.worker import build_state

RESULTS = Path(__file__).with_name("results") / "shared_load.json"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--tensors", type=int, default=100)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    args = p.parse_args()
    srv = server.start()
    try:
        srv.make_bucket("shared")
        so = srv.storage_options()
        url = "s3://shared/run/state.pt"
        state = build_state(args.mib << 20, args.tensors, seed=0)
        size = cloudckpt.save(state, url, storage_options=so).size
        del state
        rows: dict[str, list[dict[str, Any]]] = {"alone": [], "shared": []}
        for rep in range(args.reps):
            for mode in ("alone", "shared") if rep % 2 == 0 else ("shared", "alone"):

                def setup(rank: int, world: int, share: bool = mode == "shared") -> Any:
                    want = build_state(args.mib << 20, args.tensors, seed=0)
                    got: dict[str, Any] = {}

                    def step() -> None:
                        got.update(cloudckpt.load(url, share=share, storage_options=so))

                    def check() -> None:
                        assert all(torch.equal(got[k], v) for k, v in want.items())

                    return step, check

                before = srv.log_offset()
                figs = run_ranks(args.ranks, setup)
                figs["requests"] = srv.count_requests(before)
                rows[mode].append(figs)
                print(json.dumps({"mode": mode, "rep": rep, **figs}), flush=True)
        print(f"# {size / 2**20:.0f} MiB object, {args.ranks} ranks, median of {args.reps}")
        medians: dict[str, dict[str, float]] = {}
        for mode, runs in rows.items():
            medians[mode] = {
                k: statistics.median(r[k] for r in runs) for k in ("seconds", "cpu_s", "requests")
            }
            m = medians[mode]
            print(f"{mode:7s} {m['seconds']:6.2f} s  cpu {m['cpu_s']:6.2f} s  "
                  f"requests {m['requests']:5.0f}")  # fmt: skip
        result = {
            "study": "shared_load",
            "object_bytes": size,
            "tensors": args.tensors,
            "ranks": args.ranks,
            "reps": args.reps,
            "medians": medians,
            "runs": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    finally:
        server.stop(srv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
