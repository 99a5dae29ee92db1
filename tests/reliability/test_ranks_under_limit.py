"""Eight gloo ranks save to one prefix at once behind a per-prefix request limit (the
fault proxy answering 503 SlowDown past it, as S3 does): every save completes, every
object holds what its rank saved, and the limit did bite. How long it takes against
the ideal is measured in benchmarks/studies/ranks_under_limit.py, not here."""

from __future__ import annotations

import io
from typing import Any

import torch

import cloudckpt
from cloudckpt.testing.fault_proxy import FaultProxy
from ranks import run_ranks
from servers import unique_bucket_name

RANKS, SAVES, RATE = 8, 4, 10.0


def _value(rank: int, i: int) -> torch.Tensor:
    return torch.full((512,), float(rank * 100 + i))


def _save(rank: int, world: int, url: str, so: dict[str, Any]) -> None:
    for i in range(SAVES):
        cloudckpt.save(
            {"t": _value(rank, i)},
            f"{url}/r{rank}-{i}.pt",
            storage_options=so,
            max_attempts=30,
            backoff_base=0.05,
            backoff_max=1.0,
        )


def test_eight_ranks_behind_a_prefix_limit_all_commit(rclone_server: Any) -> None:
    bucket = rclone_server.make_bucket(unique_bucket_name("ranks-limit"))
    with FaultProxy(rclone_server.endpoint_url, prefix_rate=RATE, prefix_burst=RATE) as proxy:
        so = {**rclone_server.storage_options(), "endpoint_url": proxy.url}
        run_ranks(_save, RANKS, f"s3://{bucket}/run", so, timeout=300)
    assert proxy.throttled["run"] > 0  # 32 PUTs at once against 10 a second
    # Each PUT reached the server; one whose answer a busy machine lost may have been
    # sent again (idempotent), never every one of them.
    assert RANKS * SAVES <= proxy.forwarded["run"] < 2 * RANKS * SAVES, proxy.forwarded
    client = rclone_server.client()
    for r in range(RANKS):
        for i in range(SAVES):
            body = client.get_object(Bucket=bucket, Key=f"run/r{r}-{i}.pt")["Body"].read()
            assert torch.equal(torch.load(io.BytesIO(body), weights_only=True)["t"], _value(r, i))
