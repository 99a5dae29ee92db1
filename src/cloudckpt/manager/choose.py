"""Choosing the step a restore on several ranks loads: a pure function of the facts.

With a local tier on several ranks, every rank must load the same step. Each rank
says what its directory holds whole (:class:`RankHolds`); the bucket's committed steps
come from one listing. :func:`choose_step` turns those facts into the step every rank
loads and the directories that must first get it back from their peer copy; it sends
no request and runs no collective. ``TieredRun.restore_ranks`` (manager/tiered.py) gathers the
facts (one ``agree``), calls it, and acts on the answer (the peer transfer, the load,
the fallback to the bucket when a local copy fails to load).

The rules:

- a step is *local* when every rank holds it whole, or (``replicate_to_peer``) the
  directory lacking it can get it from the peer that keeps its copy;
- a local step saved by another number of ranks is a candidate only when the bucket
  has it too (DCP reshards: a rank may need files no directory here holds);
- every step the bucket holds is a candidate (a rank without a whole local copy reads
  the bucket's);
- the newest candidate wins; a step asked for is taken when it is a candidate or local;
- nothing anywhere (no step asked): None, and the restore starts fresh.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field

from ..errors import NotFoundError
from .marker import DamagedMarker, step_dir
from .peers import Ring

__all__ = ["Choice", "RankHolds", "choose_step"]


@dataclass(frozen=True)
class RankHolds:
    """What one rank's local tier holds, as it tells the others."""

    #: The steps whole in its directory (every file there at its marker's size): a
    #: missing or corrupt copy is not here.
    whole: frozenset[int] = frozenset()
    #: With ``replicate_to_peer``, the copies its directory keeps for its peer: the
    #: sending owner's global rank -> the steps held whole.
    peer_copies: Mapping[int, Sequence[int]] = field(default_factory=dict)
    #: Its whole steps that another number of ranks saved.
    other_world: frozenset[int] = frozenset()
    #: The steps of its directory whose marker is damaged (never candidates here; told
    #: so that every rank refuses to start fresh, or warns of a fallback, alike).
    damaged: tuple[DamagedMarker, ...] = ()


@dataclass(frozen=True)
class Choice:
    """The step every rank loads."""

    step: int
    #: Group indexes of the directory owners that must receive the step from their
    #: peer before it is loaded (empty: none, or the step is read from the bucket).
    fill: tuple[int, ...] = ()


def choose_step(
    holds: Sequence[RankHolds],
    bucket: Set[int],
    *,
    step: int | None = None,
    ring: Ring | None = None,
    root_url: str = "",
) -> Choice | None:
    """The step to restore from what each rank (``holds``, in group order) and the
    ``bucket`` (its committed steps) hold: ``step`` when given, else the newest
    candidate (module docstring). ``ring``: the directories' peer layout, when they
    keep copies of each other. None when no step is asked and no tier holds any;
    NotFoundError naming ``root_url`` when the step asked for is in no tier, or when
    the local steps are only ones this number of ranks can't restore."""
    whole = [h.whole for h in holds]
    foreign: set[int] = set().union(*(h.other_world for h in holds))

    def lacking(s: int) -> list[int] | None:
        """The directories (their owners) that must get ``s`` from their peer for
        every rank to hold it locally; None when some rank can't."""
        need: set[int] = set()
        for i, have in enumerate(whole):
            if s in have:
                continue
            if ring is None:
                return None
            owner = ring.owner_of(i)
            holder = ring.holder_of(owner)
            if holder is None or s not in holds[holder].peer_copies.get(ring.ranks[owner], ()):
                return None
            need.add(owner)
        return sorted(need)

    everywhere = set().union(*whole, *(s for h in holds for s in h.peer_copies.values()))
    local = {s for s in everywhere if lacking(s) is not None}
    candidates = {s for s in local if s in bucket or s not in foreign} | set(bucket)
    if step is not None:
        if step not in candidates and step not in local:
            raise NotFoundError(
                f"step {step} is neither in the bucket at {root_url}{step_dir(step)}/ nor "
                "whole in every rank's local tier"
            )
    elif not candidates:
        unread = sorted(local - candidates)
        if not unread:
            return None
        raise NotFoundError(
            f"no committed checkpoint under {root_url} that {len(holds)} rank(s) can "
            f"restore: step(s) {unread} are only in the local tiers, saved by another "
            "number of ranks (drain them from a job of that size, or restore them there)"
        )
    chosen = step if step is not None else max(candidates)
    return Choice(chosen, tuple(lacking(chosen) or ()))
