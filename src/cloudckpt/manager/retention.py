"""Retention as small composable policies: each names the checkpoints it wants to keep.

A checkpoint survives if ANY policy keeps it (so ``keep_last=2, keep_every_n_steps=1000``
keeps the two newest plus every thousandth). On top of the policies, :func:`to_delete`
never returns the newest committed checkpoint nor any step in ``protected`` (the one a
run restored from, saves still in flight). With no policy at all, nothing is deleted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..errors import ConfigError
from .marker import CheckpointInfo

__all__ = ["KeepEveryNSteps", "KeepLast", "KeepTopK", "RetentionPolicy", "to_delete"]


class RetentionPolicy(Protocol):
    """Given committed checkpoints (oldest step first), the steps this policy keeps."""

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]: ...


def positive(name: str, value: int) -> int:
    """``value`` if it is a positive int (not a bool); else ConfigError naming the option
    ``name``: the rule of every count the manager takes (retention, its local tier)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive integer")
    return value


@dataclass(frozen=True)
class KeepLast:
    """Keep the ``n`` highest steps."""

    n: int

    def __post_init__(self) -> None:
        positive("keep_last", self.n)

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        return {c.step for c in sorted(checkpoints, key=lambda c: c.step)[-self.n :]}


@dataclass(frozen=True)
class KeepEveryNSteps:
    """Keep every step that is a multiple of ``n`` (step 0 included)."""

    n: int

    def __post_init__(self) -> None:
        positive("keep_every_n_steps", self.n)

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        return {c.step for c in checkpoints if c.step % self.n == 0}


@dataclass(frozen=True)
class KeepTopK:
    """Keep the ``k`` best checkpoints by ``metric`` (``mode`` ``"min"`` or ``"max"``).

    Checkpoints without the metric, or with a NaN value, are never among the best. Ties
    go to the newer step, so the choice is the same on every call and every rank.
    """

    k: int
    metric: str
    mode: str = "min"

    def __post_init__(self) -> None:
        positive("keep_top_k", self.k)
        if not self.metric:
            raise ConfigError("keep_top_k needs metric= (the name of the metric to rank by)")
        if self.mode not in ("min", "max"):
            raise ConfigError(f"mode={self.mode!r} must be 'min' or 'max'")

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        sign = 1.0 if self.mode == "min" else -1.0
        ranked = [
            (sign * value, -c.step)
            for c in checkpoints
            if (value := c.metrics.get(self.metric)) is not None and not math.isnan(value)
        ]
        ranked.sort()
        return {-neg_step for _, neg_step in ranked[: self.k]}


def to_delete(
    checkpoints: Sequence[CheckpointInfo],
    policies: Sequence[RetentionPolicy],
    protected: Iterable[int] = (),
) -> list[int]:
    """Steps the policies let go, oldest first; never the newest nor a protected step."""
    if not policies or not checkpoints:
        return []
    keep: set[int] = set(protected)
    keep.add(max(c.step for c in checkpoints))
    for policy in policies:
        keep |= policy.keep(checkpoints)
    return sorted(c.step for c in checkpoints if c.step not in keep)
