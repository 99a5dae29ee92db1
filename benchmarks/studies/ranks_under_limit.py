"""Many ranks saving to one prefix behind a per-prefix request limit, as S3 enforces it.

    .venv/bin/python -m benchmarks.studies.ranks_under_limit --ranks 16 --saves 6 --rate 30

Starts ``rclone serve s3`` and, in front of it, the fault proxy
(``cloudckpt.testing.fault_proxy``) enforcing ``--rate`` requests per second (burst: one
second's worth) per key prefix with 503 SlowDown. ``--ranks`` forked gloo ranks each
save ``--saves`` small objects (one PUT each) to the same prefix at once, in three
modes, each to its own prefix, in one run:

- ``adaptive``: the default (``adaptive_rate=True``);
- ``plain``: retries with backoff only (``adaptive_rate=False``);
- ``static``: a fixed token bucket per rank at its fair share (``requests_per_second``
  = rate / ranks), as a user who knows the limit would set it.

Prints per mode the slowest rank's time, the ideal time (requests / rate, after the
burst), their ratio, and the 503s the proxy sent; every object is read back past the
proxy and compared.
"""

from __future__ import annotations

import argparse
import io
import statistics
from typing import Any

import torch

import cloudckpt
from benchmarks import server
from benchmarks.systems.ranks import run_ranks
from cloudckpt.testing.fault_proxy import FaultProxy

RETRYING = {"max_attempts": 30, "backoff_base": 0.05, "backoff_max": 2.0}


def _value(rank: int, i: int) -> torch.Tensor:
    return torch.full((4096,), float(rank * 1000 + i))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--saves", type=int, default=6, help="objects per rank")
    p.add_argument("--rate", type=float, default=30.0, help="requests/s per prefix")
    p.add_argument("--reps", type=int, default=3, help="rounds of the three modes")
    args = p.parse_args()
    srv = server.start(log_level="INFO")
    bucket = "limit"
    modes: dict[str, dict[str, Any]] = {
        "adaptive": {"adaptive_rate": True},
        "plain": {"adaptive_rate": False},
        "static": {"adaptive_rate": False, "requests_per_second": args.rate / args.ranks},
    }
    try:
        srv.make_bucket(bucket)
        with FaultProxy(
            srv.endpoint_url, prefix_rate=args.rate, prefix_burst=args.rate, max_requests=10**6
        ) as proxy:
            so = {**srv.storage_options(), "endpoint_url": proxy.url}
            rows: dict[str, list[tuple[float, int]]] = {m: [] for m in modes}
            for rep in range(args.reps):
                order = list(modes)[rep % 3 :] + list(modes)[: rep % 3]
                for mode in order:
                    knobs, prefix = modes[mode], f"{mode}-{rep}"

                    def setup(
                        rank: int, world: int, prefix: str = prefix, knobs: Any = knobs
                    ) -> Any:
                        def step() -> None:
                            for i in range(args.saves):
                                cloudckpt.save(
                                    {"t": _value(rank, i)},
                                    f"s3://{bucket}/{prefix}/r{rank}-{i}.pt",
                                    storage_options=so,
                                    **knobs,
                                    **RETRYING,
                                )

                        return step, lambda: None

                    figs = run_ranks(args.ranks, setup)
                    rows[mode].append((figs["seconds"], proxy.throttled[prefix]))
        client = srv.client()
        for mode in modes:
            for rep in range(args.reps):
                for r in range(args.ranks):
                    for i in range(args.saves):
                        key = f"{mode}-{rep}/r{r}-{i}.pt"
                        body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
                        got = torch.load(io.BytesIO(body), weights_only=True)["t"]
                        assert torch.equal(got, _value(r, i)), key
        requests = args.ranks * args.saves
        ideal = max(0.0, requests - args.rate) / args.rate
        print(f"# {args.ranks} ranks x {args.saves} PUTs to one prefix, limit {args.rate:g}/s, "
              f"ideal {ideal:.2f} s, {args.reps} rounds")  # fmt: skip
        print("mode      x ideal (median, range)   503s (median, range)")
        for mode, runs in rows.items():
            ratios = sorted(sec / ideal for sec, _ in runs)
            sent = sorted(n for _, n in runs)
            print(f"{mode:8s} {statistics.median(ratios):5.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"
                  f"            {statistics.median(sent):5.0f} ({sent[0]}-{sent[-1]})")  # fmt: skip
        print("# every object read back past the proxy and compared: all intact")
    finally:
        server.stop(srv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
