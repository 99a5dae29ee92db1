"""The adaptive request rate (store/retry.py AdaptiveRate) on a fake clock.

The last tests simulate many ranks, each with its own limiter, saving to one prefix of
a store that throttles above a token bucket (S3's 3,500 PUT/s): the numbers in
docs/scale.md come from ``python tests/unit/test_adaptive_limiter.py``.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from typing import Any

import pytest

from cloudckpt import errors
from cloudckpt.store import retry
from cloudckpt.store.retry import DECREASE, FLOOR, AdaptiveRate, RetryPolicy


class Clock:
    """Seconds that pass only when a test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _sending(limiter: AdaptiveRate, clock: Clock, rate: float, seconds: float) -> None:
    """Let requests through at ``rate`` per second for ``seconds`` (answers not given)."""
    for _ in range(int(rate * seconds)):
        limiter.reserve()
        clock.now += 1 / rate


def test_unthrottled_it_only_counts():
    clock = Clock()
    limiter = AdaptiveRate(clock=clock)
    for _ in range(1000):
        _, wait = limiter.reserve()
        assert wait == 0.0
        limiter.succeeded()
        clock.now += 0.01
    assert limiter.rate is None and limiter.cuts == 0
    assert limiter.sending_rate() == pytest.approx(100, rel=0.02)


def test_the_first_throttle_halves_the_rate_being_sent():
    clock = Clock()
    limiter = AdaptiveRate(clock=clock)
    _sending(limiter, clock, 40, 2)
    stamp, _ = limiter.reserve()
    limiter.throttled(stamp)
    assert limiter.rate == pytest.approx(40 * DECREASE, rel=0.05)
    assert limiter.cuts == 1


def test_a_burst_of_throttles_from_requests_in_flight_cuts_once():
    clock = Clock()
    limiter = AdaptiveRate(clock=clock)
    _sending(limiter, clock, 64, 1)
    in_flight = [limiter.reserve()[0] for _ in range(32)]
    clock.now += 0.05
    for stamp in in_flight:  # every answer arrives after the first cut
        limiter.throttled(stamp)
    assert limiter.cuts == 1
    first = limiter.rate
    clock.now += 0.01
    stamp, _ = limiter.reserve()  # the first sent after the cut answers for the old rate
    clock.now += 0.01
    limiter.throttled(stamp)
    assert limiter.cuts == 1
    stamp, _ = limiter.reserve()  # the next one answers for the new rate: cut again
    clock.now += 0.01
    limiter.throttled(stamp)
    assert limiter.cuts == 2
    assert first is not None and limiter.rate == pytest.approx(first * DECREASE)


def test_engaged_it_paces_requests_at_the_allowed_rate():
    clock = Clock()
    limiter = AdaptiveRate(clock=clock)
    _sending(limiter, clock, 20, 1)
    limiter.throttled(limiter.reserve()[0])
    rate = limiter.rate
    assert rate is not None
    waits = [limiter.reserve()[1] for _ in range(5)]  # five at one instant
    assert waits == pytest.approx([i / rate for i in range(5)])


def test_a_rise_in_the_rate_shortens_the_very_next_gap():
    clock = Clock()
    limiter = AdaptiveRate(clock=clock)
    _sending(limiter, clock, 2, 2)
    limiter.throttled(limiter.reserve()[0])
    clock.now += limiter.reserve()[1]  # this request's slot starts now
    low = limiter.rate
    limiter.succeeded()
    assert low is not None and limiter.rate is not None and limiter.rate > low
    assert limiter.reserve()[1] == pytest.approx(1 / limiter.rate)  # not 1 / low


def test_repeated_throttles_stop_at_the_floor():
    clock = Clock()
    limiter = AdaptiveRate(clock=clock)
    _sending(limiter, clock, 100, 1)
    for _ in range(20):
        stamp, wait = limiter.reserve()
        clock.now += wait + 0.01
        limiter.throttled(stamp)
    assert limiter.cuts == 20 // retry.HOLD_REQUESTS  # one request in flight at a time
    assert limiter.rate == FLOOR


def test_successes_climb_back_to_the_rate_before_the_cut_in_recover_seconds():
    clock = Clock()
    limiter = AdaptiveRate(clock=clock)
    _sending(limiter, clock, 40, 2)
    limiter.throttled(limiter.reserve()[0])
    cut = limiter.rate
    assert cut is not None
    climbed = 0.0
    while limiter.rate is not None and limiter.rate < 39.9:  # one answer per slot
        _, wait = limiter.reserve()
        clock.now += wait
        climbed += wait
        limiter.succeeded()
    assert climbed == pytest.approx(retry.RECOVER_SECONDS, rel=0.1)


def test_it_steps_aside_once_well_past_the_rate_that_was_throttled():
    clock = Clock()
    limiter = AdaptiveRate(clock=clock)
    _sending(limiter, clock, 40, 2)
    limiter.throttled(limiter.reserve()[0])
    for _ in range(10_000):
        if limiter.rate is None:
            break
        _, wait = limiter.reserve()
        clock.now += wait
        limiter.succeeded()
    assert limiter.rate is None  # released: requests are counted only, never waited for
    assert limiter.reserve()[1] == 0.0


def test_it_never_allows_more_than_its_ceiling():
    clock = Clock()
    limiter = AdaptiveRate(ceiling=10.0, clock=clock)
    _sending(limiter, clock, 50, 1)  # sent past the ceiling (the static limit's burst)
    limiter.throttled(limiter.reserve()[0])
    assert limiter.rate == pytest.approx(10.0 * DECREASE)
    for _ in range(1000):
        if limiter.rate is None:
            break
        assert limiter.rate < 10.0
        _, wait = limiter.reserve()
        clock.now += wait
        limiter.succeeded()
    assert limiter.rate is None  # at the ceiling the static token bucket governs alone


def _throttling(times: int) -> Callable[[], str]:
    calls = iter(range(times + 1))

    def fn() -> str:
        if next(calls) < times:
            raise errors.ThrottledError("put s3://b/k: SlowDown")
        return "done"

    return fn


def test_the_policy_engages_the_scope_limiter_on_throttles_only():
    fast = {"backoff_base": 0.001, "backoff_max": 0.002}
    assert RetryPolicy(**fast).run(_throttling(1), "put", scope="t|throttled") == "done"
    assert retry.adaptive_limiter("t|throttled").cuts == 1

    failures = [errors.TransientError("put s3://b/k: InternalError")]

    def internal_then_done() -> str:
        if failures:
            raise failures.pop()
        return "done"

    assert RetryPolicy(**fast).run(internal_then_done, "put", scope="t|5xx") == "done"
    assert retry.adaptive_limiter("t|5xx").rate is None  # a 500 is no request to slow down

    off = RetryPolicy(adaptive_rate=False, **fast)
    assert off.run(_throttling(1), "put", scope="t|off") == "done"
    assert retry.adaptive_limiter("t|off").cuts == 0


def test_throttled_errors_are_transient_and_mapped_from_the_stores_codes():
    from cloudckpt.store.status import error_for

    assert issubclass(errors.ThrottledError, errors.TransientError)
    assert isinstance(error_for(429, "", "", url="gs://b/k", root_url="gs://b", op="put"),
                      errors.ThrottledError)  # fmt: skip
    five_hundred = error_for(503, "", "", url="gs://b/k", root_url="gs://b", op="put")
    assert type(five_hundred) is errors.TransientError  # GCS's 503 is a backend error
    from cloudckpt.store import s3

    slow = error_for(503, "SlowDown", "x", url="s3://b/k", root_url="s3://b", op="put",
                     codes=s3._CODES)  # fmt: skip
    assert isinstance(slow, errors.ThrottledError) and "SlowDown" in str(slow)
    from cloudckpt.store import azure

    assert azure._CODES["ServerBusy"] is errors.ThrottledError
    assert s3._CODES["InternalError"] is errors.TransientError


def test_the_option_is_validated():
    from cloudckpt.options import TransferOptions

    assert TransferOptions().adaptive_rate is True
    with pytest.raises(errors.ConfigError, match="adaptive_rate"):
        TransferOptions(adaptive_rate="yes")  # type: ignore[arg-type]
    assert RetryPolicy.from_options(TransferOptions(adaptive_rate=False)).adaptive_rate is False


# -- many ranks, simulated ---------------------------------------------------------------


def simulate(
    ranks: int,
    *,
    adaptive: bool,
    parts: int = 16,
    concurrency: int = 10,
    seconds_per_part: float = 0.625,
    limit: float = 3500.0,
    seed: int = 0,
    policy: RetryPolicy | None = None,
) -> dict[str, Any]:
    """``ranks`` processes each upload ``parts`` parts, ``concurrency`` at a time, to one
    prefix the store limits to ``limit`` requests per second (a token bucket holding
    one second's worth). A part takes ``seconds_per_part`` (64 MiB at 1 GiB/s per rank,
    10 streams: 16 PUT/s per rank); a 503 comes back in 20 ms. Retries are ``policy``'s
    (by default 10 attempts, full jitter from 0.2 s); each rank has its own limiter.
    ``admitted[s]``: the requests the store took in second ``s``."""
    rng = random.Random(seed)
    clock = Clock()
    policy = policy or RetryPolicy()
    limiters = [AdaptiveRate(clock=clock) if adaptive else None for _ in range(ranks)]
    todo = [parts] * ranks
    tokens, stamp = limit, clock.now
    events: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
    order = itertools.count()
    out: dict[str, Any] = {"parts": 0, "throttled": 0, "failed": 0}
    admitted: list[float] = []

    def at(t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(events, (t, next(order), fn, args))

    def attempt(rank: int, tries: int) -> None:
        limiter = limiters[rank]
        sent, wait = limiter.reserve() if limiter is not None else (clock.now, 0.0)
        at(clock.now + wait, arrive, rank, tries, sent)

    def arrive(rank: int, tries: int, sent: float) -> None:
        nonlocal tokens, stamp
        tokens, stamp = min(limit, tokens + (clock.now - stamp) * limit), clock.now
        if tokens >= 1:
            tokens -= 1
            admitted.append(clock.now - start)
            at(clock.now + seconds_per_part * rng.uniform(0.8, 1.2), answered, rank)
        else:
            at(clock.now + 0.02, throttled, rank, tries, sent)

    def answered(rank: int) -> None:
        out["parts"] += 1
        if (limiter := limiters[rank]) is not None:
            limiter.succeeded()
        next_part(rank)

    def throttled(rank: int, tries: int, sent: float) -> None:
        out["throttled"] += 1
        if (limiter := limiters[rank]) is not None:
            limiter.throttled(sent)
        if tries + 1 >= policy.max_attempts:
            out["failed"] += 1  # RetriesExhaustedError: this rank's save fails
            next_part(rank)
            return
        delay = policy.delay(tries + 1)  # as RetryPolicy.run: after the (tries + 1)-th failure
        at(clock.now + delay, attempt, rank, tries + 1)

    def next_part(rank: int) -> None:
        if todo[rank]:
            todo[rank] -= 1
            attempt(rank, 0)

    start = clock.now
    for rank in range(ranks):
        for _ in range(concurrency):
            at(start + rng.uniform(0, 0.05), next_part, rank)
    jitter = retry._JITTER
    retry._JITTER = random.Random(seed)  # RetryPolicy.delay's own generator, seeded
    try:
        while events:
            clock.now, _, fn, args = heapq.heappop(events)
            fn(*args)
    finally:
        retry._JITTER = jitter
    out["seconds"] = clock.now - start
    out["admitted"] = [0] * (int(out["seconds"]) + 1)
    for t in admitted:
        out["admitted"][int(t)] += 1
    out["ideal"] = max(ranks * parts / limit, parts / concurrency * seconds_per_part)
    return out


@pytest.mark.parametrize("ranks", [8, 128])
def test_under_the_limit_nothing_is_throttled(ranks):
    for adaptive in (False, True):
        out = simulate(ranks, adaptive=adaptive)
        assert out["throttled"] == 0 and out["parts"] == ranks * 16


def test_1024_ranks_draw_fewer_503s_and_finish_sooner_with_adaptive_rate():
    plain = simulate(1024, adaptive=False)
    adaptive = simulate(1024, adaptive=True)
    assert adaptive["failed"] == 0 and adaptive["parts"] == 1024 * 16
    assert adaptive["throttled"] * 1.5 < plain["throttled"]
    assert adaptive["seconds"] < 0.8 * plain["seconds"]


#: benchmarks/studies/ranks_under_limit.py on a fake clock: 16 ranks each saving 20
#: small objects one after the other (5 a second each when nothing is throttled: twice
#: what a limit of 40 a second leaves them), with the study's short backoff.
ONE_AT_A_TIME = {
    "parts": 20,
    "concurrency": 1,
    "seconds_per_part": 0.2,
    "limit": 40.0,
    "policy": RetryPolicy(max_attempts=30, backoff_base=0.05, backoff_max=2.0),
}


@pytest.mark.parametrize("seed", range(4))
def test_16_ranks_sending_one_request_at_a_time_keep_the_prefix_at_its_limit(seed):
    out = simulate(16, adaptive=True, seed=seed, **ONE_AT_A_TIME)
    assert out["failed"] == 0 and out["parts"] == 16 * 20
    limit = ONE_AT_A_TIME["limit"]
    ideal = (16 * 20 - limit) / limit  # after the bucket's one second's worth
    # The seconds after the opening burst until the ideal end: the limiters' aggregate
    # neither starves the prefix (several ranks cut at once) nor floods it.
    busy = out["admitted"][1 : int(ideal)]
    assert sum(busy) / len(busy) >= 0.9 * limit, out["admitted"]
    assert out["throttled"] <= 0.3 * out["parts"]
    assert out["seconds"] <= 1.4 * ideal, out["admitted"]  # seconds of the fake clock


if __name__ == "__main__":
    print(
        "| ranks | parts per rank | mode | 503s | 503s per part | failed parts | seconds | ideal |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for n, p in ((8, 64), (128, 64), (1024, 16), (1024, 64)):
        for mode in (False, True):
            r = simulate(n, adaptive=mode, parts=p)
            print(
                f"| {n} | {p} | {'adaptive' if mode else 'plain'} | {r['throttled']:,} | "
                f"{r['throttled'] / (n * p):.2f} | {r['failed']} | {r['seconds']:.1f} | "
                f"{r['ideal']:.1f} |"
            )
