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
