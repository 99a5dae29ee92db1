"""cloudckpt.nemo.CloudAutoResume and latest_checkpoint: resuming from an s3:// directory.

NeMo's AutoResume lists with pathlib and finds nothing at ``s3://...`` (the run
silently trains from scratch); these check that the newest *committed* checkpoint is
found, with NeMo's rules for ``-last``/``-end`` and unfinished markers. Skipped unless
NeMo 2 imports (``make test-nemo``).
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import nemo_env
import pytest

nemo_env.require()

from cloudckpt.lightning.fs import register_options, target_for  # noqa: E402
from cloudckpt.megatron.layout import encode_config  # noqa: E402
from cloudckpt.nemo import CloudAutoResume, latest_checkpoint, list_checkpoints  # noqa: E402
from ranks import run_ranks  # noqa: E402
from servers import unique_bucket_name  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


def _put(url: str, name: str, data: bytes = b"x") -> None:
    where = target_for(f"{url}/{name}")
    where.store.put(where.key, data)


def _commit(url: str, name: str) -> None:
    _put(url, f"{name}/weights/__0_0.distcp")
    _put(url, f"{name}/weights/metadata.json", encode_config())


@pytest.fixture
def remote(moto_server: Any) -> str:
    url = f"s3://{moto_server.make_bucket(unique_bucket_name())}/run/checkpoints"
    register_options(url, storage_options=moto_server.storage_options())
    return url


@pytest.fixture
def several(remote: str) -> str:
    """Checkpoints as a crashed run leaves them, committed in the order listed."""
    _commit(remote, "m--step=9-last")
    time.sleep(1.1)  # object mtimes have one-second resolution on some stores
    _commit(remote, "m--step=10-last")  # newest committed; sorts before step=9 by name
    _commit(remote, "m--step=10")  # a top-k checkpoint, not a -last one
    _put(remote, "m--step=11-last/weights/__0_0.distcp")  # the save died: no commit
    time.sleep(1.1)
    _commit(remote, "m--step=12-last")  # committed, but NeMo never finalized it:
    _put(remote, "m--step=12-last-unfinished")  # its marker is still there
    _put(remote, "m--step=10-last/context/io.json", b"{}")
    return remote


def test_the_newest_committed_checkpoint_is_found(several: str) -> None:
    assert latest_checkpoint(several) == f"{several}/m--step=10-last"
    by_name = {e.name: e for e in list_checkpoints(several)}
    assert (
        not by_name["m--step=11-last"].finished and by_name["m--step=11-last"].committed_at is None
    )
    assert by_name["m--step=12-last"].unfinished and not by_name["m--step=12-last"].finished
    resume = CloudAutoResume(resume_if_exists=True, resume_from_directory=several)
    assert resume.get_trainer_ckpt_path() == f"{several}/m--step=10-last/weights"


def test_setup_hands_the_trainer_a_url(several: str) -> None:
    from nemo.utils.app_state import AppState

    callback = SimpleNamespace(dirpath=several, last_model_path="")
    trainer = SimpleNamespace(checkpoint_callback=callback, ckpt_path=None)
    CloudAutoResume(resume_if_exists=True).setup(trainer)  # directory: the callback's
    assert trainer.ckpt_path == f"{several}/m--step=10-last/weights"
    assert callback.last_model_path == trainer.ckpt_path
    assert AppState().restore is True


def test_resume_from_path_and_its_context(several: str) -> None:
    resume = CloudAutoResume(resume_from_path=f"{several}/m--step=10-last")
    assert resume.get_trainer_ckpt_path() == f"{several}/m--step=10-last/weights"
    context = resume.get_context_path()
    assert isinstance(context, Path) and (context / "io.json").read_text() == "{}"


def test_nemos_rules_for_unfinished_end_and_missing(remote: str) -> None:
    def find(**kwargs: Any) -> Any:
        return CloudAutoResume(resume_if_exists=True, resume_from_directory=remote, **kwargs)

    with pytest.raises(FileNotFoundError, match="no checkpoints"):
        find().get_trainer_ckpt_path()
    assert find(resume_ignore_no_checkpoint=True).get_trainer_ckpt_path() is None
    assert CloudAutoResume(resume_from_directory=remote).get_trainer_ckpt_path() is None

    _put(remote, "m--step=1-last/weights/__0_0.distcp")  # only an uncommitted -last
    with pytest.raises(ValueError, match="unfinished"):
        find(resume_ignore_no_checkpoint=True).get_trainer_ckpt_path()
    _commit(remote, "m--step=1-last")
    _commit(remote, "m--step=2-end")
    with pytest.raises(ValueError, match="already completed"):
        find().get_trainer_ckpt_path()
    assert find(resume_past_end=True).get_trainer_ckpt_path() == f"{remote}/m--step=2-end/weights"


def test_a_local_directory_is_nemos_class_unchanged(tmp_path: Path) -> None:
    (tmp_path / "m--step=3-last" / "weights").mkdir(parents=True)
    resume = CloudAutoResume(resume_if_exists=True, resume_from_directory=str(tmp_path))
    assert resume.get_trainer_ckpt_path() == tmp_path / "m--step=3-last" / "weights"


def _latest_on_every_rank(rank: int, world: int, url: str, so: dict[str, Any]) -> None:
    register_options(url, storage_options=so if rank == 0 else {"endpoint_url": "http://0.0.0.0:9"})
    # Only rank 0 reaches the store (the others' endpoint is unusable); all get its answer.
    assert latest_checkpoint(url) == f"{url}/m--step=10-last"


def test_rank_zero_lists_and_broadcasts(several: str, moto_server: Any) -> None:
    run_ranks(_latest_on_every_rank, 2, several, moto_server.storage_options(), timeout=120)


def _local_commit(local_dir: Path, dirpath: str, name: str, step: int) -> None:
    """``name`` committed in the local tier of ``dirpath`` as the I/O commits it (the
    manager's marker over its ``weights/`` folder) and not drained."""
    from cloudckpt.manager.tiers import LocalTier
    from cloudckpt.options import TransferOptions

    tier = LocalTier(local_dir, dirpath, TransferOptions(), None, 1, payload="weights/")
    tier.store.put(f"{name}/weights/__0_0.distcp", b"x")
    tier.store.put(f"{name}/weights/metadata.json", encode_config())
    tier.commit(step, "megatron", {}, {"nemo_name": name}, key=name)


def test_a_checkpoint_committed_in_the_local_tier_only_is_resumed(
    several: str, tmp_path: Path
) -> None:
    """A ``-last`` committed locally whose drain has not committed the bucket's copy is
    the newest: found through the trainer's I/O (or ``local_dir``), never taken for an
    unfinished one; the bucket alone still gives its own newest."""
    from cloudckpt.nemo import CloudMegatronCheckpointIO

    local = tmp_path / "node"
    _local_commit(local, several, "m--step=11-last", 11)  # the bucket's copy: no commit
    io = CloudMegatronCheckpointIO(local_dir=local)
    callback = SimpleNamespace(dirpath=several, last_model_path="")
    trainer = SimpleNamespace(
        checkpoint_callback=callback, ckpt_path=None, strategy=SimpleNamespace(checkpoint_io=io)
    )
    CloudAutoResume(resume_if_exists=True).setup(trainer)  # before: step=10, the bucket's
    assert trainer.ckpt_path == f"{several}/m--step=11-last/weights"

    def find(**kwargs: Any) -> Any:
        resume = CloudAutoResume(resume_if_exists=True, resume_from_directory=several, **kwargs)
        return resume.get_trainer_ckpt_path()

    assert find(local_dir=local) == f"{several}/m--step=11-last/weights"
    assert find() == f"{several}/m--step=10-last/weights"
    other = tmp_path / "other"  # a tier of another dirpath is not read
    _local_commit(other, f"{several}-elsewhere", "m--step=13-last", 13)
    assert find(local_dir=other) == f"{several}/m--step=10-last/weights"


def test_a_bucket_that_is_away_resumes_from_the_local_tier(
    remote: str, moto_server: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The bucket refusing connections: the local tier's newest ``-last`` is resumed
    (WARNING); with nothing there the bucket's error is raised, never a fresh start."""
    from servers import free_port

    refused = {**moto_server.storage_options(), "endpoint_url": f"http://127.0.0.1:{free_port()}"}
    register_options(remote, storage_options=refused, max_attempts=1)
    local = tmp_path / "node"
    _local_commit(local, remote, "m--step=4-last", 4)
    caplog.set_level("WARNING", logger="cloudckpt")

    def find(where: Path) -> Any:
        return CloudAutoResume(
            resume_if_exists=True,
            resume_from_directory=remote,
            resume_ignore_no_checkpoint=True,
            local_dir=where,
        ).get_trainer_ckpt_path()

    assert find(local) == f"{remote}/m--step=4-last/weights"
    assert any("unreachable" in r.getMessage() for r in caplog.records)
    with pytest.raises(Exception, match="connect"):
        find(tmp_path / "empty")
