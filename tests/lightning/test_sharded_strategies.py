"""Lightning's sharded strategies on cloudckpt: real ``Trainer.fit`` runs on gloo ranks.

Each run is forked on its ranks by tests/ranks.py, whose process group Lightning adopts
(``LOCAL_RANK`` set: the processes are made outside it). A run on 2 ranks saves top-k
and ``last`` sharded checkpoints; a run on 1 rank resumes from ``ckpt_path="last"``,
and the model and optimizer states it restored are the ones the first run ended with.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("lightning")

import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

import cloudckpt
from cloudckpt.errors import ConfigError
from cloudckpt.lightning import (
    CloudCheckpointIO,
    CloudFileSystem,
    CloudFSDPStrategy,
    CloudModelCheckpoint,
    CloudModelParallelStrategy,
)
from docs_examples import docs_examples, run_example
from ranks import run_ranks

WIDTH = 8


class Sharded(LightningModule):
    """A small MLP sharded in ``configure_model``: FSDP2's ``fully_shard`` on the
    data-parallel mesh (``kind="fsdp2"``), or FSDP's wrapper on CPU (``"fsdp"``).

    ``score`` logs the epoch, so top-k keeps the newest checkpoints. The full model and
    optimizer states are recorded when training starts, after any resume (to
    ``started``), and when it ends (to ``ended``)."""

    def __init__(self, kind: str, started: str = "", ended: str = "") -> None:
        super().__init__()
        self.kind, self.started, self.ended = kind, started, ended
        self.net = torch.nn.Sequential(
            torch.nn.Linear(WIDTH, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )

    def configure_model(self) -> None:
        if self.kind == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)
        else:
            from torch.distributed.fsdp import FullyShardedDataParallel

            self.net = FullyShardedDataParallel(self.net, device_id=torch.device("cpu"))

    def on_train_start(self) -> None:
        if self.started:
            self.save_full_state(self.started)

    def on_train_end(self) -> None:
        if self.ended:
            self.save_full_state(self.ended)

    def save_full_state(self, path: str) -> None:
        """Every rank takes part; rank 0 writes the gathered states to ``path``."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        # Gathered on every rank: FSDP's CPU offload of a full state fails on CPU ranks.
        full = StateDictOptions(full_state_dict=True, cpu_offload=False)
        model = get_model_state_dict(self.trainer.model, options=full)
        optim = get_optimizer_state_dict(
            self.trainer.model, self.trainer.optimizers[0], options=full
        )
        if self.trainer.is_global_zero:
            torch.save({"model": model, "optim": optim["state"], "epoch": self.current_epoch}, path)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        self.log("score", float(self.current_epoch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(32, WIDTH, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)

    def val_dataloader(self):
        x = torch.zeros(4, WIDTH)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def fit(rank, world_size, kind, dirpath, opts, epochs, resume, started, ended):
    """One rank of a run: ``epochs`` epochs, resumed from ``last`` if ``resume``."""
    os.environ["LOCAL_RANK"] = str(rank)  # Lightning joins the group tests/ranks.py made
    os.environ["NODE_RANK"] = "0"
    if kind == "fsdp2":
        strategy = CloudModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)
    else:
        strategy = CloudFSDPStrategy()
    trainer = Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            CloudModelCheckpoint(
                dirpath=dirpath,
                filename="{epoch}",
                monitor="score",
                mode="max",
                save_top_k=2,
                save_last=True,
                storage_options=opts or None,
            )
        ],
        plugins=[CloudCheckpointIO(storage_options=opts)] if opts else [],
    )
    trainer.fit(Sharded(kind, started, ended), ckpt_path="last" if resume else None)


def objects(s3, bucket):
    listing = s3.client().list_objects_v2(Bucket=bucket, Prefix="run/")
    return {o["Key"][4:] for o in listing.get("Contents", [])}


def checkpoints(names):
    """Each checkpoint (top-level name) and the objects under it."""
    found: dict[str, set[str]] = {}
    for name in names:
        top, _, inside = name.partition("/")
        found.setdefault(top, set()).add(inside)
    return found


def assert_same_state(saved, restored):
    assert saved["optim"], "Adam's state (step, moments) was saved"
    assert restored["model"].keys() == saved["model"].keys()
    for key, tensor in saved["model"].items():
        assert torch.equal(restored["model"][key], tensor), key
    assert restored["optim"].keys() == saved["optim"].keys()
    for key, state in saved["optim"].items():
        for name, value in state.items():
            assert torch.equal(
                torch.as_tensor(restored["optim"][key][name]), torch.as_tensor(value)
            )


SHARDED = {".metadata", ".cloudckpt-layout.json", "meta.pt"}


@pytest.mark.parametrize("kind", ["fsdp2", "fsdp"])
def test_two_ranks_save_top_k_and_last_then_one_rank_resumes(
    moto_server, tmp_path, kind, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # where a path mistaken for local would land
    bucket = moto_server.make_bucket(f"lt-sharded-{kind}")
    dirpath = f"s3://{bucket}/run"
    opts = moto_server.storage_options()
    ended, started = str(tmp_path / "ended.pt"), str(tmp_path / "started.pt")

    run_ranks(fit, 2, kind, dirpath, opts, 3, False, "", ended)
    found = checkpoints(objects(moto_server, bucket))
    assert set(found) == {"epoch=1.ckpt", "epoch=2.ckpt", "last.ckpt"}  # epoch=0 rotated out
    for name, inside in found.items():
        assert inside == SHARDED | {"__0_0.distcp", "__1_0.distcp"}, name
    assert not (tmp_path / "s3:").exists()
    meta = cloudckpt.load(f"{dirpath}/last.ckpt/meta.pt", storage_options=opts, weights_only=False)
    assert meta["epoch"] == 2 and "state_dict" not in meta and "optimizer_states" not in meta

    run_ranks(fit, 1, kind, dirpath, opts, 4, True, started, "")
    restored = torch.load(started)
    assert restored["epoch"] == 3
    assert_same_state(torch.load(ended), restored)
    found = checkpoints(objects(moto_server, bucket))
    assert set(found) == {"epoch=2.ckpt", "epoch=3.ckpt", "last.ckpt"}
    # last.ckpt was saved again by one rank: the two-rank save's files went with it
    assert found["last.ckpt"] == SHARDED | {"__0_0.distcp"}


def test_a_local_dirpath_rotates_sharded_folders(tmp_path):
    dirpath = tmp_path / "run"
    ended, started = str(tmp_path / "ended.pt"), str(tmp_path / "started.pt")
    run_ranks(fit, 2, "fsdp2", str(dirpath), {}, 3, False, "", ended)
    assert sorted(p.name for p in dirpath.iterdir()) == [
        "epoch=1.ckpt",
        "epoch=2.ckpt",
        "last.ckpt",
    ]
    assert (dirpath / "last.ckpt" / ".metadata").is_file()
    run_ranks(fit, 1, "fsdp2", str(dirpath), {}, 4, True, started, "")
    assert_same_state(torch.load(ended), torch.load(started))
    assert sorted(p.name for p in dirpath.iterdir()) == [
        "epoch=2.ckpt",
        "epoch=3.ckpt",
        "last.ckpt",
    ]


def test_full_checkpoints_at_a_url_are_refused_by_name():
    strategy = CloudModelParallelStrategy(save_distributed_checkpoint=False)
    strategy.broadcast = lambda obj, src=0: obj  # no process group needed to refuse
    with pytest.raises(ConfigError, match="save_distributed_checkpoint=True"):
        strategy.save_checkpoint({}, "s3://bucket/run/last.ckpt")
    assert not Path("s3:").exists()


def test_last_finds_only_committed_sharded_prefixes(moto_server):
    bucket = moto_server.make_bucket("lt-sharded-last")
    client = moto_server.client()
    for key in ("last.ckpt/.metadata", "last.ckpt/__0_0.distcp", "last-v1.ckpt/__0_0.distcp"):
        client.put_object(Bucket=bucket, Key=f"run/{key}", Body=b"x")
    callback = CloudModelCheckpoint(
        dirpath=f"s3://{bucket}/run", storage_options=moto_server.storage_options()
    )
    # last-v1.ckpt has no .metadata: a save that never committed
    assert callback._find_last_checkpoints(None) == {f"cloudckpt://s3://{bucket}/run/last.ckpt"}
    # Of several, Lightning resumes the newest by this time: when the marker was written.
    marker = client.head_object(Bucket=bucket, Key="run/last.ckpt/.metadata")["LastModified"]
    assert CloudFileSystem().modified(f"s3://{bucket}/run/last.ckpt") == marker


def test_checkpoint_io_removes_a_sharded_folder_metadata_first(moto_server, tmp_path):
    """Lightning's own sharded strategies hand CloudCheckpointIO a folder to remove: the
    whole prefix goes, .metadata first, in a bucket and in a local directory."""
    bucket = moto_server.make_bucket("lt-sharded-remove")
    client = moto_server.client()
    for key in (".metadata", "__0_0.distcp", "__1_0.distcp"):
        client.put_object(Bucket=bucket, Key=f"run/epoch=0.ckpt/{key}", Body=b"x")
    client.put_object(Bucket=bucket, Key="run/epoch=1.ckpt/.metadata", Body=b"x")
    io = CloudCheckpointIO(storage_options=moto_server.storage_options())
    io.remove_checkpoint(f"s3://{bucket}/run/epoch=0.ckpt")
    left = [o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]]
    assert left == ["run/epoch=1.ckpt/.metadata"]  # the neighbour is untouched

    folder = tmp_path / "epoch=0.ckpt"
    folder.mkdir()
    for name in (".metadata", "__0_0.distcp"):
        (folder / name).write_bytes(b"x")
    io.remove_checkpoint(str(folder))
    assert not folder.exists() and tmp_path.is_dir()


def test_the_docs_examples_run(moto_server, tmp_path):
    examples = docs_examples("Lightning: FSDP and ModelParallel strategies")
    assert len(examples) == 2
    for code, name, run in zip(examples, ("docs-mp", "docs-fsdp"), ("run1", "run2"), strict=True):
        bucket = run_example(moto_server, code, tmp_path, name)
        listing = moto_server.client().list_objects_v2(Bucket=bucket)
        found = checkpoints(o["Key"].removeprefix(f"{run}/") for o in listing["Contents"])
        assert len(found) == 3 and "last.ckpt" in found, sorted(found)  # top 2 and last
        assert all(".metadata" in inside for inside in found.values())
    assert not (tmp_path / "s3:").exists()
