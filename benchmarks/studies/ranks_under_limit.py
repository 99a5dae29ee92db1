"""Many ranks saving to one prefix behind a per-prefix request limit, as S3 enforces it.

    .venv/bin/python -m benchmarks.studies.ranks_under_limit --ranks 16 --saves 20 --rate 40

Starts ``rclone serve s3`` and, in front of it, the fault proxy
(``cloudckpt.testing.fault_proxy``) enforcing ``--rate`` requests per second (burst: one
second's worth) per key prefix with 503 SlowDown. ``--ranks`` forked gloo ranks each
save ``--saves`` small objects (one PUT each, one after the other) to the same prefix at
once, in these modes, each to its own prefix, in one run:

- ``adaptive``: the default (``adaptive_rate=True``);
- ``plain``: retries with backoff only (``adaptive_rate=False``);
- ``static``: a fixed token bucket per rank at its fair share (``requests_per_second``
  = rate / ranks), as a user who knows the limit would set it;
- ``unlimited``: the default through a second proxy that limits nothing: how fast this
  machine saves the same objects at all (the floor under every mode's time).

Prints per mode the slowest rank's time, the ideal time (requests / rate, after the
burst), their ratio, and the 503s the proxy sent; then, from counters each rank keeps
(the study wraps the limiter's and the policy's methods in the forked ranks only), the
503s the ranks saw, the limiter's cuts, the seconds a rank spent waiting for its limiter
and in backoff, the allowed rates at the end, and, for the adaptive mode's median
round, the prefix's PUTs, 503s and the ranks' summed allowed rate second by second.
Every object is read back past the proxy and compared. Writes the figures to
``--out`` (default ``benchmarks/studies/results/ranks_under_limit.json``).

Each forked rank's first save costs it imports and a client (2-3 s with 16 ranks on two
cores, inside the timed step, in every mode). ``--warm`` makes one untimed save per
rank first, to a prefix of its own, so that the time is the limit's and the limiter's.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import cloudckpt
from benchmarks import server
from benchmarks.systems.ranks import run_ranks
from cloudckpt.store.retry import AdaptiveRate, RetryPolicy
from cloudckpt.testing.fault_proxy import FaultProxy

RETRYING = {"max_attempts": 30, "backoff_base": 0.05, "backoff_max": 2.0}
RESULTS = Path(__file__).with_name("results") / "ranks_under_limit.json"


def _value(rank: int, i: int) -> torch.Tensor:
    return torch.full((4096,), float(rank * 1000 + i))


def _instrument(stats: dict[str, Any]) -> None:
    """Count this rank's limiter waits, 503s, cuts and backoff (a forked rank only: the
    class attributes it replaces are this process's)."""
    reserve, throttled, succeeded = (
        AdaptiveRate.reserve,
        AdaptiveRate.throttled,
        AdaptiveRate.succeeded,
    )
    delay = RetryPolicy.delay

    def sample(limiter: AdaptiveRate) -> None:
        stats["limiter"] = limiter
        stats["rates"].append((time.monotonic(), limiter.rate))

    def reserve_(self: AdaptiveRate) -> tuple[float, float]:
        stamp, wait = reserve(self)
        stats["waited"] += wait
        stats["limiter"] = self
        return stamp, wait

    def throttled_(self: AdaptiveRate, stamp: float) -> None:
        throttled(self, stamp)
        sample(self)

    def succeeded_(self: AdaptiveRate) -> None:
        succeeded(self)
        sample(self)

    def delay_(self: RetryPolicy, attempt: int) -> float:
        seconds = delay(self, attempt)
        stats["backoff"] += seconds
        stats["503s"].append(time.monotonic())
        return seconds

    AdaptiveRate.reserve = reserve_  # type: ignore[method-assign]
    AdaptiveRate.throttled = throttled_  # type: ignore[method-assign]
    AdaptiveRate.succeeded = succeeded_  # type: ignore[method-assign]
    RetryPolicy.delay = delay_  # type: ignore[method-assign]


def _summary(ranks: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """One round's per-rank counters, summed or averaged, and its per-second timeline."""
    t0 = min(r["t0"] for r in ranks)
    final = [r["rates"][-1][1] if r["rates"] else None for r in ranks]
    engaged = [x for x in final if x is not None]
    waited = statistics.mean(r["waited"] for r in ranks)
    backoff = statistics.mean(r["backoff"] for r in ranks)
    timeline = []
    for second in range(int(seconds) + 1):
        lo, hi = t0 + second, t0 + second + 1
        oks = sum(lo <= t < hi for r in ranks for t in r["oks"])
        refused = sum(lo <= t < hi for r in ranks for t in r["503s"])
        allowed = 0.0
        limited = 0
        for r in ranks:  # each rank's allowed rate at the second's end (None: free)
            at = [x for t, x in r["rates"] if t < hi]
            if at and at[-1] is not None:
                allowed += at[-1]
                limited += 1
        timeline.append(
            {
                "second": second,
                "puts": oks,
                "503s": refused,
                "limited_ranks": limited,
                "allowed_sum": round(allowed, 2),
            }
        )
    return {
        "seconds": seconds,
        "rank_503s": sum(len(r["503s"]) for r in ranks),
        "cuts": sum(r["cuts"] for r in ranks),
        "waited_s": waited,
        "backoff_s": backoff,
        "sending_s": statistics.mean(r["elapsed"] for r in ranks) - waited - backoff,
        "limited_at_end": len(engaged),
        "allowed_sum_at_end": sum(engaged),
        "timeline": timeline,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--saves", type=int, default=20, help="objects per rank")
    p.add_argument("--rate", type=float, default=40.0, help="requests/s per prefix")
    p.add_argument("--reps", type=int, default=3, help="rounds of the modes")
    p.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    p.add_argument("--warm", action="store_true", help="one untimed save per rank first")
    args = p.parse_args()
    srv = server.start(log_level="INFO")
    bucket = "limit"
    modes: dict[str, dict[str, Any]] = {
        "adaptive": {"adaptive_rate": True},
        "plain": {"adaptive_rate": False},
        "static": {"adaptive_rate": False, "requests_per_second": args.rate / args.ranks},
        "unlimited": {"adaptive_rate": True},
    }
    load = []
    try:
        srv.make_bucket(bucket)
        limited = FaultProxy(
            srv.endpoint_url, prefix_rate=args.rate, prefix_burst=args.rate, max_requests=10**6
        )
        free = FaultProxy(srv.endpoint_url, max_requests=10**6)
        with limited as proxy, free, tempfile.TemporaryDirectory() as scratch:
            rows: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
            for rep in range(args.reps):
                order = list(modes)[rep % len(modes) :] + list(modes)[: rep % len(modes)]
                for mode in order:
                    knobs, prefix = modes[mode], f"{mode}-{rep}"
                    url = free.url if mode == "unlimited" else proxy.url
                    so = {**srv.storage_options(), "endpoint_url": url}
                    stats_dir = Path(scratch, prefix)
                    stats_dir.mkdir()

                    def setup(
                        rank: int,
                        world: int,
                        prefix: str = prefix,
                        knobs: Any = knobs,
                        so: Any = so,
                        stats_dir: Path = stats_dir,
                    ) -> Any:
                        stats: dict[str, Any] = {"waited": 0.0, "backoff": 0.0, "limiter": None}
                        stats.update({"503s": [], "oks": [], "rates": []})
                        _instrument(stats)
                        if args.warm:  # the first save's imports and client, untimed
                            cloudckpt.save({"t": _value(rank, 0)},
                                           f"s3://{bucket}/warm-{prefix}/r{rank}.pt",
                                           storage_options=so, **knobs, **RETRYING)  # fmt: skip
                            stats.update(waited=0.0, backoff=0.0, limiter=None)
                            for counted in ("503s", "oks", "rates"):
                                stats[counted].clear()

                        def step() -> None:
                            stats["t0"] = time.monotonic()
                            for i in range(args.saves):
                                cloudckpt.save(
                                    {"t": _value(rank, i)},
                                    f"s3://{bucket}/{prefix}/r{rank}-{i}.pt",
                                    storage_options=so,
                                    **knobs,
                                    **RETRYING,
                                )
                                stats["oks"].append(time.monotonic())
                            stats["elapsed"] = time.monotonic() - stats["t0"]

                        def check() -> None:
                            limiter = stats.pop("limiter")
                            stats["cuts"] = limiter.cuts if limiter is not None else 0
                            Path(stats_dir, f"{rank}.json").write_text(json.dumps(stats))

                        return step, check

                    figs = run_ranks(args.ranks, setup)
                    ranks = [
                        json.loads(Path(stats_dir, f"{r}.json").read_text())
                        for r in range(args.ranks)
                    ]
                    row = _summary(ranks, figs["seconds"])
                    row["proxy_503s"] = proxy.throttled[prefix]
                    rows[mode].append(row)
                    load.append(os.getloadavg()[0])
                    print(f"# round {rep} {mode}: {row['seconds']:.2f} s, "
                          f"{row['proxy_503s']} 503s", flush=True)  # fmt: skip
        client = srv.client()
        for mode in modes:
            for rep in range(args.reps):
                for r in range(args.ranks):
                    for i in range(args.saves):
                        key = f"{mode}-{rep}/r{r}-{i}.pt"
                        body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
                        got = torch.load(io.BytesIO(body), weights_only=True)["t"]
                        assert torch.equal(got, _value(r, i)), key
    finally:
        server.stop(srv)
    requests = args.ranks * args.saves
    ideal = max(0.0, requests - args.rate) / args.rate
    print(f"# {args.ranks} ranks x {args.saves} PUTs to one prefix, limit {args.rate:g}/s, "
          f"ideal {ideal:.2f} s, {args.reps} rounds, warm {args.warm}, "
          f"load average {statistics.mean(load):.1f}")  # fmt: skip
    print("mode       x ideal (median, range)  503s (median, range)  cuts  wait s  "
          "backoff s  send s  limited/allowed at end")  # fmt: skip
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__}
    result: dict[str, Any] = {"machine": machine, "ranks": args.ranks, "saves": args.saves,
                              "rate": args.rate, "reps": args.reps, "ideal_s": ideal,
                              "load_average": statistics.mean(load), "warm": args.warm,
                              "modes": {}}  # fmt: skip
    for mode, runs in rows.items():
        for row in runs:
            row["x_ideal"] = row["seconds"] / ideal
        ratios = sorted(r["x_ideal"] for r in runs)
        sent = sorted(r["proxy_503s"] for r in runs)
        med = sorted(runs, key=lambda r: r["x_ideal"])[len(runs) // 2]
        print(f"{mode:9s} {statistics.median(ratios):5.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"
              f"       {statistics.median(sent):5.0f} ({sent[0]}-{sent[-1]})"
              f"      {statistics.median(r['cuts'] for r in runs):4.0f}"
              f"  {statistics.median(r['waited_s'] for r in runs):6.2f}"
              f"  {statistics.median(r['backoff_s'] for r in runs):9.2f}"
              f"  {statistics.median(r['sending_s'] for r in runs):6.2f}"
              f"  {med['limited_at_end']}/{med['allowed_sum_at_end']:.1f}")  # fmt: skip
        result["modes"][mode] = {
            "x_ideal_median": statistics.median(ratios),
            "x_ideal_range": [ratios[0], ratios[-1]],
            "proxy_503s_median": statistics.median(sent),
            "rounds": runs,
        }
    print("# every object read back past the proxy and compared: all intact")
    runs = result["modes"]["adaptive"]["rounds"]
    med = sorted(runs, key=lambda r: r["x_ideal"])[len(runs) // 2]
    print("# adaptive, median round, by second: PUTs, 503s seen, limited ranks, allowed sum")
    for s in med["timeline"]:
        print(f"  {s['second']:3d} {s['puts']:4d} {s['503s']:4d} {s['limited_ranks']:3d} "
              f"{s['allowed_sum']:7.1f}")  # fmt: skip
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"# figures written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
