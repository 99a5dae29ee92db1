"""Code that runs inside the NeMo test ranks (2 gloo ranks on CPU, or 1 for the fit loop).

The checkpoints are what NeMo's ``MegatronStrategy.save_checkpoint`` hands its
checkpoint I/O: Lightning's dict with ``state_dict`` emptied, the model's sharded state
under ``sharded_state_dict`` and the optimizer's under ``optimizer``; loads ask for the
model under ``state_dict``, as ``MegatronStrategy.load_checkpoint`` does. The model is
tests/megatron's tiny real GPTModel (TP=2, gated linear unit).

megatron-core's ``AsyncCallsQueue`` synchronizes with CUDA calls; on CPU the tests turn
them into host operations (:func:`cpu_friendly_megatron`), in the ranks only.
"""

from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace
from typing import Any

import mcore_workers as w
import torch
import torch.distributed as dist

import cloudckpt.megatron as cm
from cloudckpt.errors import NotFoundError
from cloudckpt.options import TransferOptions
from cloudckpt.store import open_url

CONTENT = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def cpu_friendly_megatron() -> None:
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]


def names_under(url: str, so: dict[str, Any]) -> list[str]:
    store, key = open_url(url, TransferOptions(storage_options=so))
    return sorted(o.key[len(key) + 1 :] for o in store.list(key + "/"))


def nemo_checkpoint(model: Any, opt: torch.optim.Adam, step: int) -> dict[str, Any]:
    """What MegatronStrategy.save_checkpoint gives the checkpoint I/O (Lightning's keys)."""
    sharded = model.sharded_state_dict()
    return {
        "epoch": 0,
        "global_step": step,
        "pytorch-lightning_version": "2.4.0",
        "state_dict": OrderedDict(),
        "sharded_state_dict": sharded,
        "optimizer": [w.optimizer_sharded(sharded, opt)],
        "loops": {"fit_loop": {"epoch_loop.batch_progress": {"total": {"completed": step}}}},
        "callbacks": {"ModelCheckpoint{}": {"best_model_score": torch.tensor(0.5), "dirpath": "x"}},
        "lr_schedulers": [{"base_lrs": [1e-3], "last_epoch": step}],
    }


def nemo_load_request(model: Any, opt: torch.optim.Adam) -> dict[str, Any]:
    """What MegatronStrategy.load_checkpoint asks the checkpoint I/O for."""
    sharded = model.sharded_state_dict()
    return {"state_dict": sharded, "optimizer": [w.optimizer_sharded(sharded, opt)]}


def restore(model: Any, opt: torch.optim.Adam, loaded: dict[str, Any]) -> None:
    model.load_state_dict(loaded["state_dict"])
    w.restore_optimizer(opt, loaded["optimizer"][0])


def checkpoint_io_round_trip(rank: int, world: int, url: str, so: dict[str, Any]) -> None:
    """Save, content metadata, strict handling, load, removal: NeMo's calls, in order."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from torch.distributed.checkpoint.api import CheckpointException

    from cloudckpt.nemo import CloudMegatronCheckpointIO
    from cloudckpt.nemo.checkpoint_io import DEFAULT_CONTENT_METADATA

    io = CloudMegatronCheckpointIO(storage_options=so)
    model = w.build_gpt(2)
    opt = w.adam_for(model, 2)
    want = w.full_state(model, opt)
    path = f"{url}/step=5.ckpt"
    assert io.save_checkpoint(nemo_checkpoint(model, opt, 5), path,
                              storage_options={"content_metadata": CONTENT}) is None  # fmt: skip
    assert cm.is_checkpoint(f"{url}/step=5/weights", storage_options=so)
    assert not cm.is_checkpoint(f"{url}/step=5", storage_options=so)
    for where in (f"{url}/step=5", f"{url}/step=5/weights", path):
        assert io.load_content_metadata(where) == CONTENT, where

    # A checkpoint saved without content metadata: NeMo's back-compat default.
    io.save_checkpoint(nemo_checkpoint(model, opt, 6), f"{url}/step=6.ckpt")
    assert io.load_content_metadata(f"{url}/step=6") == DEFAULT_CONTENT_METADATA

    # MegatronStrategy.load_checkpoint: the model under "state_dict", strict as given.
    fresh = w.build_gpt(2, seed=9)
    fresh_opt = w.adam_for(fresh, 1)
    loaded = io.load_checkpoint(f"{url}/step=5/weights", nemo_load_request(fresh, fresh_opt))
    assert loaded["global_step"] == 5 and loaded["content_metadata"] == CONTENT
    assert loaded["lr_schedulers"] == [{"base_lrs": [1e-3], "last_epoch": 5}]
    restore(fresh, fresh_opt, loaded)
    w.assert_same(w.full_state(fresh, fresh_opt), want, f"rank {rank} round trip")

    # A key the checkpoint lacks: strict=True fails, strict=False drops it (NeMo's
    # adjust_non_strict_load), RETURN_UNEXPECTED reports it.
    other = w.build_gpt(2, seed=3)

    def with_extra() -> dict[str, Any]:
        request = {"state_dict": other.sharded_state_dict()}
        request["state_dict"]["extra.weight"] = ShardedTensor.from_rank_offsets(
            "extra.weight", torch.zeros(4), replica_id=rank
        )
        return request

    try:
        io.load_checkpoint(f"{url}/step=5", with_extra(), strict=True)
    except CheckpointException as exc:  # what megatron's own load raises (a BaseException)
        assert "extra.weight" in str(exc), exc
    else:
        raise AssertionError("strict=True loaded a key the checkpoint lacks")
    lenient = io.load_checkpoint(f"{url}/step=5", with_extra(), strict=False)
    assert "extra.weight" not in lenient["state_dict"]
    _, _, unexpected = io.load_checkpoint(
        f"{url}/step=5", with_extra(), strict=StrictHandling.RETURN_UNEXPECTED
    )
    assert set(unexpected) == {"extra.weight"}, unexpected

    try:
        io.load_checkpoint(f"{url}/step=7", nemo_load_request(fresh, fresh_opt))
    except NotFoundError as exc:
        assert f"{url}/step=7" in str(exc), exc
    else:
        raise AssertionError("loaded a checkpoint that was never saved")

    dist.barrier()
    if rank == 0:  # Lightning removes on rank 0 only
        io.remove_checkpoint(path)
    dist.barrier()
    assert names_under(f"{url}/step=5", so) == []
    assert cm.is_checkpoint(f"{url}/step=6/weights", storage_options=so)


def async_wrapper_and_finalizer(rank: int, world: int, url: str, so: dict[str, Any]) -> None:
    """Two async saves through the wrapper; NeMo's AsyncFinalizerCallback finalizes them."""
    from nemo.utils.callbacks.dist_ckpt_io import (
        AsyncFinalizableCheckpointIO,
        AsyncFinalizerCallback,
    )

    from cloudckpt.nemo import cloud_checkpoint_io

    cpu_friendly_megatron()
    io = cloud_checkpoint_io(async_save=True, storage_options=so)
    assert isinstance(io, AsyncFinalizableCheckpointIO)
    trainer = SimpleNamespace(strategy=SimpleNamespace(checkpoint_io=io))
    callback = AsyncFinalizerCallback()
    model = w.build_gpt(2)
    opt = w.adam_for(model, 1)
    wanted = []
    finalized: list[tuple[str, bool]] = []
    for step in (1, 2):
        wanted.append(w.full_state(model, opt))
        where = f"{url}/step={step}"

        def finalize(where: str = where) -> None:  # NeMo's ModelCheckpoint passes one of these
            finalized.append((where, cm.is_checkpoint(f"{where}/weights", storage_options=so)))

        io.save_checkpoint(nemo_checkpoint(model, opt, step), f"{where}.ckpt",
                           {"finalize_fn": finalize, "content_metadata": CONTENT})  # fmt: skip
        with torch.no_grad():  # training goes on while the upload runs
            for p in model.parameters():
                p.add_(1.0)
        callback.on_train_batch_end(trainer)
    callback.on_train_end(trainer)
    assert finalized == [(f"{url}/step=1", True), (f"{url}/step=2", True)], finalized
    assert io.async_calls_queue.get_num_unfinalized_calls() == 0
    for step, want in zip((1, 2), wanted, strict=True):
        fresh = w.build_gpt(2, seed=4)
        fresh_opt = w.adam_for(fresh, 1)
        restore(
            fresh,
            fresh_opt,
            io.load_checkpoint(f"{url}/step={step}", nemo_load_request(fresh, fresh_opt)),
        )
        w.assert_same(w.full_state(fresh, fresh_opt), want, f"rank {rank} step {step}")

    # A save that fails (no such bucket) fails finalization on every rank, and NeMo's
    # finalize function (which would clear the unfinished marker) never runs.
    missing = "s3://cloudckpt-no-such-bucket-nemo/run/step=3.ckpt"
    called = []
    io.save_checkpoint(nemo_checkpoint(model, opt, 3), missing,
                       {"finalize_fn": lambda: called.append(1)})  # fmt: skip
    try:
        callback.on_train_end(trainer)
    except Exception as exc:
        assert "no-such-bucket" in str(exc) or "NoSuchBucket" in str(exc), exc
    else:
        raise AssertionError("a failed async save finalized without an error")
    assert called == []


# --------------------------------------------------------------------- a real fit loop


def _fit_parts() -> Any:
    """A one-rank stand-in for MegatronStrategy (which needs CUDA) and a tiny module."""
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    def sharded(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {k: ShardedTensor.from_rank_offsets(k, v, replica_id=0) for k, v in tensors.items()}

    class ShardedCPUStrategy(pl.strategies.SingleDeviceStrategy):  # type: ignore[misc]
        """MegatronStrategy's checkpoint calls: sharded save, content metadata, load."""

        async_save = True

        def save_checkpoint(
            self, checkpoint: Any, filepath: Any, storage_options: Any = None
        ) -> None:
            checkpoint["sharded_state_dict"] = sharded(checkpoint.pop("state_dict"))
            checkpoint["state_dict"] = OrderedDict()
            options = {**(storage_options or {}), "content_metadata": CONTENT}
            self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=options)

        def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
            unwrapped = self.checkpoint_io
            while isinstance(unwrapped, _WrappingCheckpointIO):
                unwrapped = unwrapped.checkpoint_io
            assert unwrapped.load_content_metadata(checkpoint_path) == CONTENT
            own = self.lightning_module.state_dict()
            request = {"state_dict": sharded({k: torch.empty_like(v) for k, v in own.items()})}
            return self.checkpoint_io.load_checkpoint(checkpoint_path, request, strict=True)

        def remove_checkpoint(self, filepath: Any) -> None:
            raise AssertionError(f"MegatronStrategy.remove_checkpoint is local-only: {filepath}")

    class Tiny(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 4)
            self.first_step: int | None = None

        def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
            if self.first_step is None:
                self.first_step = self.trainer.global_step
            loss = self.layer(batch).pow(2).mean()
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-2)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(torch.randn(64, 4), batch_size=4)

    return pl, ShardedCPUStrategy, Tiny


def fit_then_resume(
    rank: int, world: int, url: str, so: dict[str, Any], log_dir: str, local_dir: str | None = None
) -> None:
    """NeMo's ModelCheckpoint + AsyncFinalizerCallback + CloudAutoResume in Lightning fits
    (with ``local_dir``: through a local tier, drained at the trainer's teardown)."""
    from pathlib import Path

    from nemo.utils.app_state import AppState
    from nemo.utils.callbacks.dist_ckpt_io import AsyncFinalizerCallback

    from cloudckpt.nemo import CloudAutoResume, CloudModelCheckpoint, cloud_checkpoint_io

    cpu_friendly_megatron()
    pl, ShardedCPUStrategy, Tiny = _fit_parts()
    AppState().log_dir = Path(log_dir)

    def run(max_steps: int, resume: Any = None) -> Any:
        ckpt = CloudModelCheckpoint(dirpath=url, storage_options=so, monitor="step", mode="max",
                                    save_top_k=2, every_n_train_steps=1, save_last=True,
                                    filename="{step}", always_save_context=False,
                                    save_context_on_train_end=False,
                                    save_optim_on_train_end=True)  # fmt: skip
        ckpt.CHECKPOINT_NAME_LAST = "{step}-last"  # what NeMoLogger sets
        strategy = ShardedCPUStrategy(
            device=torch.device("cpu"),
            checkpoint_io=cloud_checkpoint_io(True, storage_options=so, local_dir=local_dir),
        )
        trainer = pl.Trainer(strategy=strategy, max_steps=max_steps, logger=False,
                             callbacks=[ckpt, AsyncFinalizerCallback()], enable_progress_bar=False,
                             enable_model_summary=False, limit_val_batches=0,
                             default_root_dir=log_dir)  # fmt: skip
        model = Tiny()
        if resume is not None:
            resume.setup(trainer, model)
        trainer.fit(model)
        return trainer, model

    run(4)
    assert names_dirs(url, so) == ["step=3", "step=4", "step=4-last"], names_dirs(url, so)
    for name in ("step=3", "step=4", "step=4-last"):  # committed: drained by teardown
        assert cm.is_checkpoint(f"{url}/{name}/weights", storage_options=so), name

    resume = CloudAutoResume(resume_if_exists=True, resume_from_directory=url, storage_options=so)
    trainer, model = run(6, resume)
    assert trainer.ckpt_path == f"{url}/step=4-last/weights", trainer.ckpt_path
    assert model.first_step == 4 and trainer.global_step == 6
    # top-2 and the -last rotation removed the older ones, the resumed -last included.
    assert names_dirs(url, so) == ["step=5", "step=6", "step=6-last"], names_dirs(url, so)
    for name in ("step=5", "step=6", "step=6-last"):
        assert cm.is_checkpoint(f"{url}/{name}/weights", storage_options=so), name


def names_dirs(url: str, so: dict[str, Any]) -> list[str]:
    """The top-level names under ``url`` (checkpoint directories and markers)."""
    return sorted({name.split("/", 1)[0] for name in names_under(url, so)})


__all__ = [
    "async_wrapper_and_finalizer",
    "checkpoint_io_round_trip",
    "cpu_friendly_megatron",
    "fit_then_resume",
]
