"""Client and server CPU per ranged GET, by the route an S3 store's read takes.

Usage::

    .venv/bin/python -m benchmarks.studies.request_cost              # ~1 min
    .venv/bin/python -m benchmarks.studies.request_cost --count 200 --reps 3

Starts ``rclone serve s3`` on tmpfs (benchmarks/server.py), stores one 8 MiB object,
and reads ranges of it with ``S3Store.read_into`` by three routes, interleaved, each
``--reps`` times: ``client`` (the botocore client's GetObject, the fallback), ``session``
(signed once per object, sent through botocore's HTTP session: the route when a proxy
is configured) and ``direct`` (signed once, sent on the connection pool: the default).
Prints the median CPU milliseconds per request of this process and of the server.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from benchmarks import server as srv
from cloudckpt.options import resolve_options
from cloudckpt.store import open_url

OBJECT = 8 * 1024 * 1024
SIZES = {"1 byte": 1, "256 KiB": 256 * 1024, "4 MiB": 4 * 1024 * 1024}
ROUTES = ("client", "session", "direct")


def _server_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=300, help="requests per measurement")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    server = srv.start(log_level="NOTICE")
    try:
        server.make_bucket("cost")
        options = server.storage_options()
        store, key = open_url("s3://cost/obj", resolve_options(storage_options=options))
        store.put(key, os.urandom(OBJECT))
        fast = store._fast_reads
        pools = fast._pools
        print(f"# {server.version}; {args.count} GETs per measurement, median of {args.reps}")
        print("| request | route | client CPU ms/GET | server CPU ms/GET |")
        print("|---|---|---:|---:|")
        for label, size in SIZES.items():
            buf = memoryview(bytearray(size))
            starts = [(i * 65_537) % (OBJECT - size + 1) for i in range(args.count)]
            client: dict[str, list[float]] = {r: [] for r in ROUTES}
            served: dict[str, list[float]] = {r: [] for r in ROUTES}
            for _ in range(args.reps):
                for route in ROUTES:
                    fast.enabled = route != "client"
                    fast._pools = pools if route == "direct" else None
                    for start in starts[:10]:  # warm the route's connections
                        store.read_into(key, start, [buf])
                    c0, s0 = time.process_time(), _server_cpu(server.process.pid)
                    for start in starts:
                        store.read_into(key, start, [buf])
                    c1, s1 = time.process_time(), _server_cpu(server.process.pid)
                    client[route].append((c1 - c0) / args.count * 1e3)
                    served[route].append((s1 - s0) / args.count * 1e3)
            for route in ROUTES:
                c, s = statistics.median(client[route]), statistics.median(served[route])
                print(f"| {label} | {route} | {c:.2f} | {s:.2f} |")
    finally:
        srv.stop(server)


if __name__ == "__main__":
    main()
