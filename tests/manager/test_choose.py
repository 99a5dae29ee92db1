"""manager/choose.py: the step a restore on several ranks loads, from the facts alone."""

from __future__ import annotations

import pytest

from cloudckpt.errors import NotFoundError
from cloudckpt.manager.choose import Choice, RankHolds, choose_step
from cloudckpt.manager.peers import Ring

ROOT = "s3://bucket/run/"


def _ranks(*whole: set[int]) -> list[RankHolds]:
    return [RankHolds(frozenset(w)) for w in whole]


def test_nothing_anywhere_starts_fresh() -> None:
    assert choose_step(_ranks(set(), set()), set(), root_url=ROOT) is None


def test_the_newest_step_every_rank_holds_wins_over_an_older_bucket() -> None:
    assert choose_step(_ranks({3, 5}, {3, 5}), {3}) == Choice(5)


def test_the_bucket_newer_than_every_local_tier_wins() -> None:
    assert choose_step(_ranks({3}, {3}), {3, 4}) == Choice(4)


def test_one_ranks_copy_missing_or_corrupt_falls_back() -> None:
    # A corrupt copy is not whole (LocalTier.whole_steps): the rank says it lacks it.
    holds = _ranks({4, 5}, {4})
    assert choose_step(holds, set()) == Choice(4)  # the newest step every rank has
    assert choose_step(holds, {5}) == Choice(5)  # the lacking rank reads the bucket's


def test_steps_differing_between_ranks_agree_on_the_newest_common_one() -> None:
    assert choose_step(_ranks({1, 3, 5}, {1, 3, 4}, {1, 2, 3}), set()) == Choice(3)
    assert choose_step(_ranks({5}, {4}), set(), root_url=ROOT) is None


def test_a_step_asked_for_is_taken_from_either_tier_or_refused() -> None:
    holds = _ranks({2, 5}, {2})
    assert choose_step(holds, {7}, step=2) == Choice(2)
    assert choose_step(holds, {7}, step=7) == Choice(7)
    with pytest.raises(NotFoundError, match=r"step 5 is neither in the bucket at "
                       r"s3://bucket/run/step-000000005/"):  # fmt: skip
        choose_step(holds, {7}, step=5, root_url=ROOT)


def test_a_step_another_world_saved_needs_the_bucket() -> None:
    holds = [RankHolds(frozenset({6}), other_world=frozenset({6})), RankHolds(frozenset({6}))]
    with pytest.raises(NotFoundError, match=r"step\(s\) \[6\] are only in the local tiers"):
        choose_step(holds, set(), root_url=ROOT)
    assert choose_step(holds, {6}) == Choice(6)
    assert choose_step(holds, {2}) == Choice(2)
    assert choose_step(holds, set(), step=6) == Choice(6)  # asked for: it is tried


def test_a_directory_lacking_the_step_gets_it_from_its_peer() -> None:
    # Two nodes; node 0 keeps node 1's copy (rank 1's steps 4 and 5).
    ring = Ring(ranks=(0, 1), dirs=(("a", "/t"), ("b", "/t")), me=1)
    holds = [RankHolds(frozenset({4, 5}), {1: [4, 5]}), RankHolds(frozenset({4}))]
    assert choose_step(holds, set(), ring=ring) == Choice(5, fill=(1,))
    assert choose_step(holds, set()) == Choice(4)  # no peer copies: only what both hold
    alone = [RankHolds(frozenset({4, 5}), {1: [4]}), RankHolds(frozenset({4}))]
    assert choose_step(alone, set(), ring=ring) == Choice(4)  # the peer lacks 5 too
