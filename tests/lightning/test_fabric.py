"""Lightning Fabric on cloudckpt: ``Fabric(plugins=[CloudCheckpointIO()])`` saves and
loads ``s3://`` checkpoints, in one process and on 2 DDP ranks (gloo)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("lightning")

import torch
from lightning.fabric import Fabric

import cloudckpt
from cloudckpt.lightning import CloudCheckpointIO
from docs_examples import docs_examples, run_example
from ranks import run_ranks


def trained(fabric: Fabric, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model and its Adam optimizer set up by ``fabric``, after one step."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    loss = model(torch.randn(8, 4)).square().mean()
    fabric.backward(loss)
    optimizer.step()
    return model, optimizer


def assert_same(a: torch.nn.Module, b: torch.nn.Module, oa, ob) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert sa and sa.keys() == sb.keys()
    for key in sa:
        for name in sa[key]:
            assert torch.equal(torch.as_tensor(sa[key][name]), torch.as_tensor(sb[key][name]))


def test_fabric_saves_and_loads_a_url_in_one_process(moto_server):
    bucket = moto_server.make_bucket("fabric-one")
    url = f"s3://{bucket}/run/step-1.ckpt"
    opts = moto_server.storage_options()
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[CloudCheckpointIO(storage_options=opts)])
    model, optimizer = trained(fabric, seed=0)
    fabric.save(url, {"model": model, "optimizer": optimizer, "step": 1})

    saved = cloudckpt.load(url, storage_options=opts)  # a plain torch archive
    assert saved["step"] == 1 and set(saved) == {"model", "optimizer", "step"}

    other, other_optimizer = trained(fabric, seed=1)  # different weights and moments
    state = {"model": other, "optimizer": other_optimizer, "step": 0}
    remainder = fabric.load(url, state)
    assert remainder == {} and state["step"] == 1
    assert_same(model, other, optimizer, other_optimizer)


def ddp_rank(rank: int, world_size: int, url: str, opts: dict, out: str) -> None:
    """One rank: save from the DDP model, load into a fresh one, report what rank 0 saw."""
    os.environ["LOCAL_RANK"] = str(rank)  # Fabric joins the group tests/ranks.py made
    os.environ["NODE_RANK"] = "0"
    fabric = Fabric(
        accelerator="cpu",
        devices=world_size,
        strategy="ddp",
        plugins=[CloudCheckpointIO(storage_options=opts)],
    )
    fabric.launch()
    model, optimizer = trained(fabric, seed=0)
    fabric.save(url, {"model": model, "optimizer": optimizer, "rank": fabric.global_rank})
    other, other_optimizer = trained(fabric, seed=1)
    state = {"model": other, "optimizer": other_optimizer}
    remainder = fabric.load(url, state)
    assert remainder == {"rank": 0}  # rank 0 wrote the checkpoint, once
    assert_same(model, other, optimizer, other_optimizer)
    with open(f"{out}.{rank}", "w") as f:
        f.write(str(fabric.world_size))


def test_fabric_ddp_on_two_ranks_saves_once_and_every_rank_loads(moto_server, tmp_path):
    bucket = moto_server.make_bucket("fabric-ddp")
    url = f"s3://{bucket}/run/step-1.ckpt"
    out = str(tmp_path / "done")
    run_ranks(ddp_rank, 2, url, moto_server.storage_options(), out)
    assert [(tmp_path / f"done.{r}").read_text() for r in (0, 1)] == ["2", "2"]
    listing = moto_server.client().list_objects_v2(Bucket=bucket)
    assert [o["Key"] for o in listing["Contents"]] == ["run/step-1.ckpt"]


def shard(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """Fabric's ``parallelize_fn``: FSDP2 over the data-parallel ranks."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(model[0], mesh=mesh["data_parallel"])
    return fully_shard(model, mesh=mesh["data_parallel"])


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The gathered model and optimizer states, on every rank."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True, cpu_offload=False)
    return {
        "model": get_model_state_dict(model, options=full),
        "optim": get_optimizer_state_dict(model, optimizer, options=full)["state"],
    }


def sharded_rank(rank, world_size, kind, url, opts, save, out):
    """One rank of a Fabric run: train a step and save (``save``), or load into a fresh
    model; rank 0 writes the gathered states it ended with to ``out``."""
    from cloudckpt.lightning import CloudFabricFSDPStrategy, CloudFabricModelParallelStrategy

    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    if kind == "fsdp2":
        strategy = CloudFabricModelParallelStrategy(
            parallelize_fn=shard,
            data_parallel_size=world_size,
            tensor_parallel_size=1,
            storage_options=opts,
        )
    else:
        strategy = CloudFabricFSDPStrategy(storage_options=opts)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0 if save else 1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    if kind == "fsdp":  # wrapped here: the strategy's own wrapping asks for an accelerator
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.1))
    steps = {"done": 0}
    if save:
        fabric.backward(model(torch.randn(8, 4)).square().mean())
        optimizer.step()
        fabric.save(url, {"model": model, "optimizer": optimizer, "steps": {"done": 1}})
    else:
        state = {"model": model, "optimizer": optimizer, "steps": steps}
        assert fabric.load(url, state) == {}
        steps = state["steps"]
    gathered = full_state(model, optimizer)
    if rank == 0:
        torch.save({**gathered, "steps": steps}, out)


@pytest.mark.parametrize("kind", ["fsdp2", "fsdp"])
def test_fabric_sharded_saves_on_two_ranks_and_loads_on_one(moto_server, tmp_path, kind):
    bucket = moto_server.make_bucket(f"fabric-{kind}")
    url = f"s3://{bucket}/run/step-1"
    opts = moto_server.storage_options()
    saved, loaded = str(tmp_path / "saved.pt"), str(tmp_path / "loaded.pt")
    run_ranks(sharded_rank, 2, kind, url, opts, True, saved)
    listing = moto_server.client().list_objects_v2(Bucket=bucket)
    assert {o["Key"] for o in listing["Contents"]} == {
        f"run/step-1/{name}"
        for name in (
            ".metadata",
            ".cloudckpt-layout.json",
            "meta.pt",
            "__0_0.distcp",
            "__1_0.distcp",
        )
    }
    run_ranks(sharded_rank, 1, kind, url, opts, False, loaded)
    before, after = torch.load(saved), torch.load(loaded)
    assert after["steps"] == {"done": 1}
    assert before["optim"] and before["model"].keys() == after["model"].keys()
    for key, tensor in before["model"].items():
        assert torch.equal(after["model"][key], tensor), key
    for key, state in before["optim"].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(after["optim"][key][name]), torch.as_tensor(value))


def test_the_docs_examples_run(moto_server, tmp_path):
    examples = docs_examples("Lightning Fabric")
    assert len(examples) == 2
    for code, name, keys in zip(
        examples,
        ("docs-fabric-ddp", "docs-fabric-mp"),
        (
            ["fabric/step-100.ckpt"],
            [
                f"fabric/step-200/{n}"
                for n in (
                    "__0_0.distcp",
                    "__1_0.distcp",
                    ".metadata",
                    "meta.pt",
                    ".cloudckpt-layout.json",
                )
            ],
        ),
        strict=True,
    ):
        bucket = run_example(moto_server, code, tmp_path, name)
        listing = moto_server.client().list_objects_v2(Bucket=bucket)
        assert sorted(o["Key"] for o in listing["Contents"]) == sorted(keys)
