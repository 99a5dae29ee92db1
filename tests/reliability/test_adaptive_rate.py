"""Saves through a proxy that limits each key prefix's request rate, as S3 does.

Eight threads save the same objects twice in one run, to two prefixes the proxy limits
alike: once with plain retries (``adaptive_rate=False``), once with the default adaptive
rate. Both must complete with every object intact, each save's PUT having reached the
server. The test asserts what happened, not how many 503s each mode drew: that count
depends on how busy the machine is (on a busy 2-core machine: 42-79 with plain retries,
5-12 adaptive). The comparison is made on a fake clock in
tests/unit/test_adaptive_limiter.py (many ranks, each with its own limiter) and measured
on a real server by benchmarks/studies/ranks_under_limit.py.
"""

from __future__ import annotations

import io
import threading

import torch

import cloudckpt
from cloudckpt.testing.fault_proxy import FaultProxy
from servers import unique_bucket_name

#: The proxy's limit per prefix: requests per second, and the burst it allows.
RATE, BURST = 20.0, 5.0
#: Enough attempts that plain retries never run out; short backoffs (full jitter), so
#: the test is quick.
RETRYING = {"max_attempts": 20, "backoff_base": 0.05, "backoff_max": 1.0}
MODES = {"plain": False, "adaptive": True}


def _value(worker: int, i: int) -> torch.Tensor:
    return torch.full((256,), float(worker * 1000 + i))


def _save_many(url: str, storage: dict, adaptive: bool, workers: range, count: int) -> None:
    """``count`` saves per worker, one thread per worker, all to ``url``'s prefix."""
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            for i in range(count):
                cloudckpt.save(
                    {"t": _value(worker, i)},
                    f"{url}/o-{worker}-{i}.pt",
                    storage_options=storage,
                    adaptive_rate=adaptive,
                    **RETRYING,
                )
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)


def _check_all_saved(server, bucket: str, prefix: str, workers: int, count: int) -> None:
    """Every object is there and holds what was saved (read past the proxy, by torch)."""
    client = server.client()
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/")
    assert listed.get("KeyCount", 0) == workers * count
    for w in range(workers):
        for i in range(count):
            key = f"{prefix}/o-{w}-{i}.pt"
            data = client.get_object(Bucket=bucket, Key=key)["Body"].read()
            out = torch.load(io.BytesIO(data), weights_only=True)
            assert torch.equal(out["t"], _value(w, i)), key


def test_threads_behind_a_prefix_limit_all_commit_with_either_retry_mode(rclone_server):
    bucket = rclone_server.make_bucket(unique_bucket_name("adaptive-rate-threads"))
    workers, count = 8, 4
    with FaultProxy(rclone_server.endpoint_url, prefix_rate=RATE, prefix_burst=BURST) as proxy:
        storage = {**rclone_server.storage_options(), "endpoint_url": proxy.url}
        for prefix, adaptive in MODES.items():
            _save_many(f"s3://{bucket}/{prefix}", storage, adaptive, range(workers), count)
    saves = workers * count
    for prefix in MODES:
        _check_all_saved(rclone_server, bucket, prefix, workers, count)
        # Each save's one PUT got past the limit; a PUT whose answer a busy machine lost
        # may have been sent again (idempotent), never every one of them.
        assert saves <= proxy.forwarded[prefix] < 2 * saves, proxy.forwarded
    # 32 PUTs from 8 threads against a bucket of 5 refilled at 20 a second: the limit bit.
    assert sum(proxy.throttled.values()) > 0, proxy.throttled
