"""Retention policies and the delete decision, on plain CheckpointInfo lists (no store)."""

from __future__ import annotations

import math

import pytest

from cloudckpt.errors import ConfigError
from cloudckpt.manager.marker import CheckpointInfo
from cloudckpt.manager.retention import KeepEveryNSteps, KeepLast, KeepTopK, to_delete


def ckpt(step: int, **metrics: float) -> CheckpointInfo:
    return CheckpointInfo(
        step=step, url=f"s3://b/r/step-{step}/", time=0.0, size=1, kind="object", metrics=metrics
    )


def test_keep_last_keeps_highest_steps() -> None:
    found = [ckpt(s) for s in (5, 1, 3, 2)]
    assert KeepLast(2).keep(found) == {3, 5}
    assert to_delete(sorted(found, key=lambda c: c.step), [KeepLast(2)]) == [1, 2]


def test_keep_every_n_steps() -> None:
    found = [ckpt(s) for s in range(0, 50, 5)]
    assert KeepEveryNSteps(20).keep(found) == {0, 20, 40}
    # The newest (45) is never deleted even though no policy keeps it.
    assert to_delete(found, [KeepEveryNSteps(20)]) == [5, 10, 15, 25, 30, 35]


def test_policies_combine_as_union() -> None:
    found = [ckpt(s) for s in range(10)]
    assert to_delete(found, [KeepLast(2), KeepEveryNSteps(4)]) == [1, 2, 3, 5, 6, 7]


def test_top_k_min_and_max() -> None:
    found = [ckpt(1, loss=0.5), ckpt(2, loss=0.1), ckpt(3, loss=0.9), ckpt(4, loss=0.3)]
    assert KeepTopK(2, "loss", "min").keep(found) == {2, 4}
    assert KeepTopK(2, "loss", "max").keep(found) == {1, 3}


def test_top_k_ties_go_to_the_newer_step() -> None:
    found = [ckpt(1, acc=0.8), ckpt(2, acc=0.8), ckpt(3, acc=0.8), ckpt(4, acc=0.1)]
    assert KeepTopK(2, "acc", "max").keep(found) == {2, 3}
    # Same answer whatever the input order (every rank decides alike).
    assert KeepTopK(2, "acc", "max").keep(list(reversed(found))) == {2, 3}


def test_top_k_never_prefers_nan_or_missing_metric() -> None:
    found = [
        ckpt(1, loss=math.nan),
        ckpt(2, loss=0.4),
        ckpt(3),
        ckpt(4, loss=0.2),
        ckpt(5, loss=math.nan),
    ]
    assert KeepTopK(2, "loss").keep(found) == {2, 4}
    assert KeepTopK(2, "loss", "max").keep(found) == {2, 4}
    # Step 5 (NaN) survives only as the newest; 1 and 3 go.
    assert to_delete(found, [KeepTopK(2, "loss")]) == [1, 3]


def test_newest_and_protected_are_never_deleted() -> None:
    found = [ckpt(s, loss=float(s)) for s in range(1, 6)]
    assert to_delete(found, [KeepTopK(1, "loss")], protected={2}) == [3, 4]


def test_no_policy_deletes_nothing() -> None:
    assert to_delete([ckpt(s) for s in range(5)], []) == []


@pytest.mark.parametrize(
    "make",
    [
        lambda: KeepLast(0),
        lambda: KeepEveryNSteps(-1),
        lambda: KeepTopK(1, ""),
        lambda: KeepTopK(1, "loss", "best"),
        lambda: KeepLast(True),
    ],
)
def test_bad_policy_arguments(make: object) -> None:
    with pytest.raises(ConfigError):
        make()  # type: ignore[operator]
