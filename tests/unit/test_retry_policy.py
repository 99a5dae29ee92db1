"""``RetryPolicy.delay``, called directly: full jitter under an envelope that doubles with
each attempt from ``backoff_base`` and stops at ``backoff_max``.

``delay`` draws from the ``random`` module; the fixture seeds it (and restores its state
afterwards), so every figure below is the same on every run.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterator

import pytest

from cloudckpt.errors import TransientError
from cloudckpt.store import retry
from cloudckpt.store.retry import RetryPolicy

DRAWS = 2000
POLICY = RetryPolicy(backoff_base=0.2, backoff_max=20.0)


@pytest.fixture(autouse=True)
def seeded(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The backoff's own generator, seeded: the statistics below are reproducible."""
    monkeypatch.setattr(retry, "_JITTER", random.Random(20261204))
    yield


def envelope(policy: RetryPolicy, attempt: int) -> float:
    """The largest delay before attempt ``attempt + 1``: base doubled per attempt, capped."""
    return min(policy.backoff_max, policy.backoff_base * 2.0**attempt)


def draws(policy: RetryPolicy, attempt: int) -> list[float]:
    return [policy.delay(attempt) for _ in range(DRAWS)]


@pytest.mark.parametrize("attempt", range(1, 12))
def test_every_delay_lies_between_zero_and_the_envelope(attempt: int) -> None:
    got = draws(POLICY, attempt)
    assert min(got) >= 0.0
    assert max(got) <= envelope(POLICY, attempt)


def test_the_envelope_doubles_with_each_attempt_up_to_the_cap() -> None:
    tops = [max(draws(POLICY, attempt)) for attempt in range(1, 8)]
    # 2,000 uniform draws: the largest lies within 1% of the top (else p < 1e-8).
    expected = [0.4, 0.8, 1.6, 3.2, 6.4, 12.8, 20.0]  # 0.2 s doubled; 25.6 s capped at 20 s
    for top, bound in zip(tops, expected, strict=True):
        assert 0.99 * bound <= top <= bound, (tops, expected)


@pytest.mark.parametrize("attempt", [7, 8, 10, 30, 60])
def test_past_the_cap_every_attempt_waits_up_to_backoff_max(attempt: int) -> None:
    got = draws(POLICY, attempt)
    assert max(got) <= POLICY.backoff_max
    assert max(got) >= 0.99 * POLICY.backoff_max  # the cap, not a smaller envelope


def test_a_cap_below_the_base_bounds_the_first_retry_too() -> None:
    policy = RetryPolicy(backoff_base=1.0, backoff_max=0.25)
    got = draws(policy, 1)
    assert max(got) <= 0.25
    assert max(got) >= 0.99 * 0.25


@pytest.mark.parametrize("attempt", [1, 4, 9])
def test_jitter_is_full_and_even_over_the_whole_range(attempt: int) -> None:
    """Full jitter: uniform over [0, envelope], not "equal jitter" over its top half."""
    top = envelope(POLICY, attempt)
    got = draws(POLICY, attempt)
    tenths = [0] * 10
    for d in got:
        tenths[min(9, int(d / top * 10))] += 1
    # Each tenth expects 200 of 2,000 draws (standard deviation ~13).
    assert all(130 <= n <= 270 for n in tenths), tenths
    assert min(got) <= 0.01 * top  # short waits happen: retries spread out, not in step
    assert abs(statistics.fmean(got) - top / 2) <= 0.05 * top


def test_draws_differ_from_call_to_call() -> None:
    got = draws(POLICY, 3)
    assert len(set(got)) == len(got)  # no two retries of a burst wait the same


def test_retries_leave_the_programs_random_stream_alone() -> None:
    """The jitter never draws from the module-level ``random`` functions: a training
    loop seeds and checkpoints that stream (Accelerate saves it), and a drain retrying
    in the background advanced it, so a continued run and a resumed one diverged."""
    random.seed(7)
    state = random.getstate()
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise TransientError("503 slow down")
        return "done"

    assert RetryPolicy(backoff_base=0.001, backoff_max=0.002).run(flaky, "put s3://b/k") == "done"
    assert draws(POLICY, 5) and len(calls) == 3
    assert random.getstate() == state


def test_a_policy_with_thousands_of_attempts_still_waits_at_most_backoff_max() -> None:
    policy = RetryPolicy(max_attempts=5000, backoff_base=0.2, backoff_max=20.0)
    assert 0.0 <= policy.delay(1500) <= 20.0
