"""CloudMegatronCheckpointIO(local_dir=...): NeMo checkpoints saved to node-local disk,
drained to the bucket in the background, resumed from local copies.

Two forked gloo ranks, one local directory each (as on two nodes), a real GPTModel
(TP=2) saved and loaded as MegatronStrategy does; the bucket is reached through a
proxy that records every request. The Trainer run with a local tier is in
test_model_checkpoint.py. Skipped unless NeMo 2 imports (``make test-nemo``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nemo_env
import pytest

nemo_env.require()

import tier_workers as tw  # noqa: E402

import cloudckpt.megatron as cm  # noqa: E402
from cloudckpt.errors import NotFoundError  # noqa: E402
from cloudckpt.lightning.fs import register_options, target_for  # noqa: E402
from cloudckpt.megatron.layout import encode_config  # noqa: E402
from cloudckpt.nemo import CloudMegatronCheckpointIO, latest_checkpoint  # noqa: E402
from ranks import run_ranks  # noqa: E402
from servers import S3Server, recorded_bucket  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")

TIMEOUT = 300


@pytest.fixture
def bucket(moto_server: S3Server) -> Iterator[tuple[str, dict[str, str], list[tuple[str, str]]]]:
    with recorded_bucket(moto_server) as (name, options, seen):
        yield f"s3://{name}/run/checkpoints", options, seen


def _weight_gets(seen: list[tuple[str, str]], name: str) -> list[str]:
    return [path for method, path in seen if method == "GET" and f"/{name}/weights/" in path]


def test_saves_drain_and_resume_from_local(bucket: Any, tmp_path: Path) -> None:
    url, so, seen = bucket
    root = str(tmp_path)
    run_ranks(tw.save_and_drain, 2, url, so, root, timeout=TIMEOUT)

    seen.clear()
    run_ranks(tw.load_local, 2, url, so, root, timeout=TIMEOUT)
    assert _weight_gets(seen, "step=2") == []  # every weight file came from local disk

    # The node's copy loses a data file: every rank reads the bucket (and says so).
    copy = Path(tw.local_dir(root, None), "step=2", "weights")
    next(p for p in copy.iterdir() if p.suffix == ".distcp").unlink()
    seen.clear()
    run_ranks(tw.load_with_a_copy_missing, 2, url, so, root, timeout=TIMEOUT)
    assert _weight_gets(seen, "step=2"), "the fallback load read nothing from the bucket"


def test_removals_never_leave_an_orphan(bucket: Any, tmp_path: Path) -> None:
    url, so, _ = bucket
    run_ranks(tw.removals_race_drains, 2, url, so, str(tmp_path), timeout=TIMEOUT)


def test_a_drain_cut_short_is_finished_by_the_next_io(bucket: Any, tmp_path: Path) -> None:
    url, so, _ = bucket
    run_ranks(tw.drain_cut_short, 2, url, so, str(tmp_path), timeout=TIMEOUT)
    weights = f"{url}/step=1/weights"
    names = tw.names_under(weights, so)
    assert any(n.endswith(".distcp") for n in names) and "metadata.json" not in names, names
    assert not cm.is_checkpoint(weights, storage_options=so)
    run_ranks(tw.next_io_finishes, 2, url, so, str(tmp_path), timeout=TIMEOUT)


def test_a_failed_drain_is_retried_by_drain(bucket: Any, tmp_path: Path) -> None:
    url, so, _ = bucket
    run_ranks(tw.failed_drain_retried, 2, url, so, str(tmp_path), timeout=TIMEOUT)


def test_a_name_saved_again_while_it_drains_waits_for_that_drain(
    bucket: Any, tmp_path: Path
) -> None:
    url, so, _ = bucket
    run_ranks(tw.resave_while_draining, 2, url, so, str(tmp_path), timeout=TIMEOUT)


def test_a_save_removes_what_a_killed_save_of_its_name_left(bucket: Any, tmp_path: Path) -> None:
    url, so, _ = bucket
    run_ranks(tw.resave_after_a_killed_save, 2, url, so, str(tmp_path), timeout=TIMEOUT)


def test_a_context_without_weights_is_not_committed(bucket: Any) -> None:
    """CloudModelCheckpoint uploads context/ before the weights; with a local tier the
    bucket holds it alone until the drain: neither resume nor load takes it."""
    url, so, _ = bucket
    register_options(url, storage_options=so)

    def put(key: str, data: bytes = b"x") -> None:
        where = target_for(f"{url}/{key}")
        where.store.put(where.key, data)

    put("step=1-last/weights/__0_0.distcp")
    put("step=1-last/weights/metadata.json", encode_config())
    put("step=2-last/context/io.json", b"{}")  # its weights are still draining
    put("step=2-last/weights/__0_0.distcp")
    assert latest_checkpoint(url) == f"{url}/step=1-last"
    with pytest.raises(NotFoundError, match="step=2-last"):
        CloudMegatronCheckpointIO(storage_options=so)._committed(f"{url}/step=2-last")


def test_a_full_local_tier_refuses_the_save_on_every_rank(bucket: Any, tmp_path: Path) -> None:
    url, so, _ = bucket
    run_ranks(tw.full_tier, 2, url, so, str(tmp_path), timeout=TIMEOUT)


def _heads(seen: list[tuple[str, str]]) -> list[str]:
    """The bucket's commit markers asked for (HEAD of ``weights/metadata.json``)."""
    return [p for m, p in seen if m == "HEAD" and p.endswith("/weights/metadata.json")]


def test_whether_a_copy_is_drained_is_read_from_its_record_not_the_bucket(
    bucket: Any, tmp_path: Path
) -> None:
    url, so, seen = bucket
    run_ranks(tw.drained_by_the_record, 2, url, so, str(tmp_path), timeout=TIMEOUT)
    assert _heads(seen) == []


def test_a_local_tier_of_the_previous_release_keeps_working(bucket: Any, tmp_path: Path) -> None:
    url, so, seen = bucket
    run_ranks(tw.tier_of_the_previous_release, 2, url, so, str(tmp_path), timeout=TIMEOUT)
    seen.clear()
    run_ranks(tw.previous_release_resumed, 2, url, so, str(tmp_path), timeout=TIMEOUT)
    assert _heads(seen) == []  # its records answer, not the bucket
    assert cm.is_checkpoint(f"{url}/step=2/weights", storage_options=so)


def test_a_dead_writers_temp_file_is_swept_by_the_next_save_and_retention(
    bucket: Any, tmp_path: Path
) -> None:
    url, so, _ = bucket
    run_ranks(tw.leftovers_swept, 2, url, so, str(tmp_path), timeout=TIMEOUT)


def test_a_copy_without_a_record_never_keeps_another_saves_objects(
    bucket: Any, tmp_path: Path
) -> None:
    """A local copy committed without a drain record (an earlier release's) whose name
    the bucket holds from another, older save (same sizes, other bytes, and an object
    none of the copy's files): its drain keeps nothing by time or size, so the bucket
    commits the local copy's bytes only."""
    url, so, _ = bucket
    run_ranks(tw.copy_without_a_record, 2, url, so, str(tmp_path), timeout=TIMEOUT)
    register_options(url, storage_options=so)
    stray = target_for(f"{url}/step=1/weights/__9_0.distcp")
    stray.store.put(stray.key, b"another save's shard")
    run_ranks(tw.record_less_copy_drained, 2, url, so, str(tmp_path), timeout=TIMEOUT)
    assert "__9_0.distcp" not in tw.names_under(f"{url}/step=1/weights", so)


def test_a_newer_commit_of_the_name_in_the_bucket_is_loaded_and_never_drained_over(
    bucket: Any, tmp_path: Path
) -> None:
    """A local copy of step=1 that was never drained, then another save of step=1 to the
    bucket: the load reads the bucket's newer commit and the drain keeps it (both ranks;
    the other save's weights are what a plain IO reads back)."""
    url, so, _ = bucket
    run_ranks(tw.a_newer_bucket_commit_of_the_name, 2, url, so, str(tmp_path), timeout=TIMEOUT)


def test_a_drained_copy_is_told_from_another_save_of_its_name_by_its_whole_record(
    bucket: Any, tmp_path: Path
) -> None:
    url, so, _ = bucket
    run_ranks(
        tw.a_drained_copy_then_a_newer_bucket_commit, 2, url, so, str(tmp_path), timeout=TIMEOUT
    )


def test_a_bucket_time_in_whole_seconds_counts_as_newer_within_its_second() -> None:
    from cloudckpt.nemo.tier import newer_in_bucket

    assert newer_in_bucket(100.0, 100.5)  # S3: any moment of second 100
    assert not newer_in_bucket(100.0, 101.2)
    assert newer_in_bucket(101.0, 100.9)
    assert not newer_in_bucket(100.4, 100.5)  # a clock with sub-second times: as it is
    assert newer_in_bucket(100.6, 100.5)
