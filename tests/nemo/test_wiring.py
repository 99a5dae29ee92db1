"""Wiring cloudckpt.nemo into a NeMo 2 recipe: the Fiddle configs a recipe holds.

A ``nemo.collections.llm`` recipe is a tree of ``nemo_run.Config`` (Fiddle) objects;
these build the same configs with Fiddle (nemo_run and the llm collection are not
installed here) and check what NeMo then does with the objects. Skipped unless NeMo 2
imports (``make test-nemo``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import nemo_env
import pytest

nemo_env.require()

import fiddle as fdl  # noqa: E402
import nemo.lightning as nl  # noqa: E402
from fiddle._src.experimental import serialization  # noqa: E402
from nemo.utils.callbacks import dist_ckpt_io  # noqa: E402

import cloudckpt.nemo as cn  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")

SECRET = "not-a-real-secret-but-never-in-io-json"


def _recipe_parts(async_save: bool) -> dict[str, Any]:
    """What llm.<model>.pretrain_recipe() holds, changed as docs/megatron.md says."""
    s = fdl.Config(nl.MegatronStrategy, ckpt_async_save=async_save)
    s.checkpoint_io = fdl.Config(
        cn.cloud_checkpoint_io,
        async_save=s.ckpt_async_save,
        storage_options={"aws_secret_access_key": SECRET},
    )
    # recipes.log.default.default_log's ModelCheckpoint and default_resume's AutoResume:
    ckpt = fdl.Config(
        nl.ModelCheckpoint,
        save_last=True,
        save_top_k=10,
        train_time_interval=fdl.Config(timedelta, minutes=15),
        filename="{model_name}--{val_loss:.2f}-{step}-{consumed_samples}",
    )
    resume = fdl.Config(nl.AutoResume, resume_if_exists=True, resume_ignore_no_checkpoint=True)
    fdl.update_callable(ckpt, cn.CloudModelCheckpoint)
    ckpt.dirpath = "s3://bucket/run1/checkpoints"
    fdl.update_callable(resume, cn.CloudAutoResume)
    return {"strategy": s, "ckpt": ckpt, "resume": resume}


@pytest.mark.parametrize("async_save", [True, False])
def test_the_recipe_configs_build_what_nemo_accepts(async_save: bool) -> None:
    built = fdl.build(_recipe_parts(async_save))
    strategy, ckpt = built["strategy"], built["ckpt"]
    wrapped = isinstance(strategy.checkpoint_io, dist_ckpt_io.AsyncFinalizableCheckpointIO)
    assert wrapped is async_save  # what NeMo's ModelCheckpoint and AsyncFinalizerCallback test
    assert isinstance(strategy.unwrapped_checkpoint_io, cn.CloudMegatronCheckpointIO)
    assert isinstance(strategy.unwrapped_checkpoint_io, dist_ckpt_io.AsyncCompatibleCheckpointIO)
    assert isinstance(ckpt, nl.ModelCheckpoint) and ckpt.dirpath == "s3://bucket/run1/checkpoints"
    assert ckpt.save_top_k == 10
    assert isinstance(built["resume"], cn.CloudAutoResume) and built["resume"].resume_if_exists

    # TrainerContext.io_dump serializes the trainer's constructor arguments into every
    # checkpoint's context/io.json: the IO is recorded without its store settings.
    trainer = nl.Trainer(strategy=strategy, devices=1, accelerator="cpu")
    dumped = serialization.dump_json(trainer.__io__)
    assert "CloudMegatronCheckpointIO" in dumped and SECRET not in dumped


@pytest.mark.skipif(dist_ckpt_io.HAVE_MEGATRON_CORE, reason="NeMo's own wrapper starts here")
def test_nemos_own_async_wrapper_refuses_this_megatron_core() -> None:
    from nemo.lightning.io.pl import MegatronCheckpointIO

    with pytest.raises(ImportError, match="tensorstore"):
        dist_ckpt_io.AsyncFinalizableCheckpointIO(MegatronCheckpointIO(async_save=True))
    assert cn.CloudAsyncFinalizableCheckpointIO(cn.CloudMegatronCheckpointIO(async_save=True))


def test_mismatched_async_flags_are_refused() -> None:
    with pytest.raises(ValueError, match="async_save=True"):
        cn.CloudAsyncFinalizableCheckpointIO(cn.CloudMegatronCheckpointIO(async_save=False))


def test_public_names_are_pinned() -> None:
    assert list(cn.__all__) == sorted(cn.__all__)
    assert set(cn.__all__) == {
        "CheckpointEntry",
        "CloudAsyncFinalizableCheckpointIO",
        "CloudAutoResume",
        "CloudMegatronCheckpointIO",
        "CloudModelCheckpoint",
        "cloud_checkpoint_io",
        "latest_checkpoint",
        "list_checkpoints",
    }
    assert all(getattr(cn, name) for name in cn.__all__)
