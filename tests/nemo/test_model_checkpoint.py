"""cloudckpt.nemo.CloudModelCheckpoint: NeMo's ModelCheckpoint with an s3:// dirpath.

One test runs Lightning fits (a tiny module on CPU, a one-rank stand-in for
MegatronStrategy's checkpoint calls, since MegatronStrategy needs CUDA) with NeMo's
ModelCheckpoint logic, AsyncFinalizerCallback and megatron-core's queue, then resumes
with CloudAutoResume. The others check each override against the store directly.
Skipped unless NeMo 2 imports (``make test-nemo``).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import nemo_env
import pytest

nemo_env.require()

import nemo_workers as nw  # noqa: E402

from cloudckpt.lightning.fs import register_options  # noqa: E402
from cloudckpt.nemo import CloudModelCheckpoint  # noqa: E402
from cloudckpt.nemo.paths import touch  # noqa: E402
from ranks import run_ranks  # noqa: E402
from servers import unique_bucket_name  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


def test_fit_saves_rotates_and_resumes_on_s3(moto_server: Any, tmp_path: Path) -> None:
    so = moto_server.storage_options()
    url = f"s3://{moto_server.make_bucket('nemo-fit')}/run/checkpoints"
    run_ranks(nw.fit_then_resume, 1, url, so, str(tmp_path), timeout=600)
    assert not list(tmp_path.rglob("*unfinished*")), "a marker was written to local disk"


def test_fit_with_a_local_tier_drains_and_resumes(moto_server: Any, tmp_path: Path) -> None:
    """The same fits with CloudMegatronCheckpointIO(local_dir=...): each save commits
    locally, drains in the background; the teardown leaves nothing undrained."""
    so = moto_server.storage_options()
    url = f"s3://{moto_server.make_bucket('nemo-fit-tier')}/run/checkpoints"
    local, logs = tmp_path / "local", tmp_path / "logs"
    logs.mkdir()
    run_ranks(nw.fit_then_resume, 1, url, so, str(logs), str(local), timeout=600)
    kept = sorted(p.name for p in local.iterdir() if p.is_dir() and p.name != "_DRAINS")
    assert kept == ["step=5", "step=6", "step=6-last"], kept  # the removed ones went too


def _trainer(ckpt_path: str | None = None, async_save: bool = False) -> Any:
    strategy = SimpleNamespace(broadcast=lambda x: x, async_save=async_save)
    return SimpleNamespace(strategy=strategy, ckpt_path=ckpt_path, callbacks=[])


def _put(url: str, *names: str) -> None:
    for name in names:
        touch(f"{url}/{name}")


@pytest.fixture
def remote(moto_server: Any) -> tuple[str, dict[str, Any]]:
    so = moto_server.storage_options()
    url = f"s3://{moto_server.make_bucket(unique_bucket_name())}/run/checkpoints"
    register_options(url, storage_options=so)  # for the test's own writes (_put)
    return url, so


def test_setup_removes_unfinished_checkpoints_and_their_markers(remote: Any) -> None:
    url, so = remote
    _put(url, "a/weights/metadata.json", "a/context/io.json", "b/weights/metadata.json",
         "b-unfinished", "c-unfinished")  # fmt: skip
    ckpt = CloudModelCheckpoint(dirpath=url, storage_options=so)
    ckpt.setup(_trainer(), None, stage="fit")
    assert nw.names_under(url, so) == ["a/context/io.json", "a/weights/metadata.json"]


def test_markers_and_removal_on_the_store(remote: Any) -> None:
    url, so = remote
    ckpt = CloudModelCheckpoint(dirpath=url, storage_options=so, save_top_k=1)
    ckpt.setup(_trainer(), None, stage="fit")
    path = f"{url}/step=1.ckpt"
    ckpt.set_checkpoint_unfinished_marker(path)
    assert ckpt.is_checkpoint_unfinished(path)
    assert nw.names_under(url, so) == ["step=1-unfinished"]
    ckpt.remove_checkpoint_unfinished_marker(path)
    assert not ckpt.is_checkpoint_unfinished(path)

    _put(url, "step=1/weights/metadata.json", "step=1/weights/__0_0.distcp", "step=1/context/x")
    assert ckpt.file_exists(path, _trainer())
    assert not ckpt.file_exists(f"{url}/step=2.ckpt", _trainer())
    ckpt._remove_checkpoint(_trainer(), path)
    assert nw.names_under(url, so) == []

    # Async: deferred until the save in flight is finalized (NeMo's finalize_fn does it).
    _put(url, "step=2/weights/metadata.json")
    ckpt.async_save = True
    ckpt._remove_checkpoint(_trainer(async_save=True), f"{url}/step=2.ckpt")
    assert nw.names_under(url, so) == ["step=2/weights/metadata.json"]
    assert ckpt.deferred_ckpts_to_remove == [[f"{url}/step=2.ckpt"]]


def test_which_previous_checkpoints_may_be_removed(remote: Any) -> None:
    url, so = remote
    ckpt = CloudModelCheckpoint(dirpath=url, storage_options=so)
    resumed = _trainer(ckpt_path=f"{url}/step=4-last/weights")
    assert ckpt._should_remove_checkpoint(resumed, f"{url}/step=3.ckpt", f"{url}/step=5.ckpt")
    assert not ckpt._should_remove_checkpoint(resumed, f"{url}/a.ckpt", f"{url}/a.ckpt")
    assert not ckpt._should_remove_checkpoint(resumed, "s3://elsewhere/x.ckpt", f"{url}/b.ckpt")
    # The checkpoint the run resumed from: only a newer -last replaces it.
    assert not ckpt._should_remove_checkpoint(
        resumed, f"{url}/step=4-last.ckpt", f"{url}/step=5.ckpt"
    )
    assert ckpt._should_remove_checkpoint(
        resumed, f"{url}/step=4-last.ckpt", f"{url}/step=5-last.ckpt"
    )


def test_top_k_bookkeeping_lists_the_store(remote: Any) -> None:
    url, so = remote
    _put(url, "step=1/weights/metadata.json", "step=2/weights/metadata.json",
         "step=3/weights/x", "step=3-unfinished")  # fmt: skip
    ckpt = CloudModelCheckpoint(dirpath=url, storage_options=so, monitor="step", mode="max")
    assert list(ckpt._saved_checkpoint_paths) == [f"{url}/step=1", f"{url}/step=2"]
    ckpt.best_k_models = {f"{url}/step={i}.ckpt": float(i) for i in (1, 2, 3, 9)}
    ckpt._remove_invalid_entries_from_topk()
    assert list(ckpt.best_k_models) == [f"{url}/step=1.ckpt", f"{url}/step=2.ckpt"]
    assert ckpt.best_model_path == f"{url}/step=2.ckpt"
    assert ckpt.kth_best_model_path == f"{url}/step=1.ckpt"
    ckpt._del_model_without_trainer(f"{url}/step=1")
    assert nw.names_dirs(url, so) == ["step=2", "step=3", "step=3-unfinished"]


def test_the_context_is_uploaded_before_the_weights(
    remote: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nemo.lightning.io import pl as nemo_pl

    url, so = remote
    seen: list[list[str]] = []

    class Context:
        def io_dump(self, output: Path, yaml_attrs: list[str]) -> None:
            output.mkdir(parents=True)
            (output / "io.json").write_text("{}")
            (output / "model.yaml").write_text("model: {}")

    monkeypatch.setattr(
        nemo_pl.TrainerContext, "from_trainer", classmethod(lambda cls, t: Context())
    )
    ckpt = CloudModelCheckpoint(dirpath=url, storage_options=so)
    ckpt.setup(_trainer(), None, stage="fit")
    # What NeMo's _save_checkpoint does after the marker: stop there and look.
    monkeypatch.setattr(
        "nemo.lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint._save_checkpoint",
        lambda self, trainer, filepath: seen.append(nw.names_under(url, so)),
    )
    ckpt._save_checkpoint(_trainer(), f"{url}/step=1.ckpt")
    assert seen == [["step=1-unfinished", "step=1/context/io.json", "step=1/context/model.yaml"]]
    assert ckpt.always_save_context


def test_a_local_dirpath_is_nemos_class_unchanged(tmp_path: Path) -> None:
    ckpt = CloudModelCheckpoint(dirpath=str(tmp_path / "ckpts"))
    path = tmp_path / "ckpts" / "step=1.ckpt"
    ckpt.set_checkpoint_unfinished_marker(path)
    assert (tmp_path / "ckpts" / "step=1-unfinished").is_file()
    assert ckpt.is_checkpoint_unfinished(str(path))


def test_save_last_link_is_refused_for_a_url(remote: Any) -> None:
    url, so = remote
    ckpt = CloudModelCheckpoint(dirpath=url, storage_options=so, save_last="link")
    with pytest.raises(ValueError, match="link"):
        ckpt.setup(_trainer(), None, stage="fit")
