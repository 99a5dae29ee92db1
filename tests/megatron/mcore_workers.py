"""Code that runs inside the Megatron test ranks: a tiny real GPTModel on CPU and gloo.

The model is megatron-core's ``GPTModel`` with the local (no Transformer Engine) layer
spec and a gated linear unit, so its sharded state dict holds real
``ShardedTensorFactory`` objects with local closures (the seed problem). A resharded
load is checked two ways: TP2 -> TP1 -> TP2 must give back the TP2 state exactly, and
a TP1 load must equal what megatron's own loader makes of the same checkpoint.

The optimizer is ``torch.optim.Adam`` mapped to sharded tensors with megatron-core's own
``dist_checkpointing.optimizer`` helpers, as megatron's ``FP32Optimizer`` does (its
class itself allocates CUDA tensors).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import cloudckpt
import cloudckpt.megatron as cm
from cloudckpt.engine.staging import get_pool
from cloudckpt.errors import AlreadyExistsError, UnpicklableError
from cloudckpt.options import TransferOptions
from cloudckpt.store import open_url

VOCAB, SEQ = 128, 32


def build_gpt(tp: int, seed: int = 1234) -> Any:
    """A 2-layer GPTModel on ``tp`` tensor-parallel ranks (the rest data-parallel)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        use_cpu_initialization=True,
        gated_linear_unit=True,
        params_dtype=torch.float32,
        bias_activation_fusion=False,
    )
    torch.manual_seed(seed)
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
    )


def adam_for(model: Any, steps: int) -> torch.optim.Adam:
    """Adam over the model, with ``steps`` steps of deterministic gradients taken."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(steps):
        for i, p in enumerate(model.parameters()):
            p.grad = torch.full_like(p, 0.01 * (i + 1) * (step + 1))
        opt.step()
    return opt


def _init_adam_state(opt: torch.optim.Adam) -> None:
    for group in opt.param_groups:
        for p in group["params"]:
            if p not in opt.state:
                opt.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }


def optimizer_sharded(model_sharded: dict[str, Any], opt: torch.optim.Adam) -> dict[str, Any]:
    """Adam's state as sharded tensors keyed like the model's (megatron's mapping)."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    _init_adam_state(opt)
    state = opt.state_dict()  # its per-parameter dicts are the optimizer's own: copy them
    state["state"] = {k: dict(v) for k, v in state["state"].items()}
    params = [p for g in opt.param_groups for p in g["params"]]
    id_map = get_param_id_to_sharded_param_map(model_sharded, params)
    steps = {float(s.pop("step")) for s in state["state"].values()}
    optim_state_to_sharding_state(state, id_map)
    state["state"]["common_step"] = steps.pop()
    return state


def restore_optimizer(opt: torch.optim.Adam, loaded: dict[str, Any]) -> None:
    """Load what :func:`optimizer_sharded`'s layout loaded back into ``opt``."""
    step = loaded["state"].pop("common_step")
    for s in loaded["state"].values():
        s["step"] = torch.tensor(step)
    opt.load_state_dict(loaded)


def full_state(model: Any, opt: torch.optim.Adam | None = None) -> dict[str, Any]:
    """The model (and optimizer) state as plain dicts of tensors, for comparisons."""
    out: dict[str, Any] = {
        f"model.{k}": v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)
    }
    if opt is not None:
        for i, (_, s) in enumerate(sorted(opt.state_dict()["state"].items())):
            for name, value in s.items():
                out[f"opt.{i}.{name}"] = value.clone() if torch.is_tensor(value) else value
    return out


def assert_same(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: keys differ: {got.keys() ^ want.keys()}"
    for k, v in want.items():
        if torch.is_tensor(v):
            assert torch.equal(got[k], v), f"{what}: {k} differs"
        else:
            assert got[k] == v, f"{what}: {k}: {got[k]!r} != {v!r}"


def checkpoint_state(model: Any, opt: torch.optim.Adam) -> dict[str, Any]:
    """What a training loop checkpoints: model and optimizer, one sharded state dict."""
    model_sharded = model.sharded_state_dict()
    return {"model": model_sharded, "optimizer": optimizer_sharded(model_sharded, opt)}


def load_into(model: Any, opt: torch.optim.Adam, url: str, so: dict[str, Any]) -> dict[str, Any]:
    """Load a checkpoint into ``model`` and ``opt`` (any layout); return the common state."""
    state = cm.load(checkpoint_state(model, opt), url, storage_options=so)
    model.load_state_dict(state.pop("model"))
    restore_optimizer(opt, state.pop("optimizer"))
    return state


# ----------------------------------------------------------------------------- scenarios


def round_trip_and_reshard(rank: int, world: int, url: str, so: dict[str, Any]) -> None:
    """TP2 save (model + Adam), exact TP2 load, TP1 load, TP1 async save, TP2 load."""
    get_pool().clear()  # buffers a forked rank inherited from earlier tests' saves
    model = build_gpt(2)
    opt = adam_for(model, 2)
    want = full_state(model, opt)

    # The seed problem: torch.save of the sharded state dict fails on the factories.
    sharded = model.sharded_state_dict()
    try:
        torch.save(sharded, io.BytesIO())
    except (AttributeError, pickle.PicklingError) as exc:
        assert "Can't pickle local object" in str(exc) or "local" in str(exc), exc
    else:
        raise AssertionError("torch.save of a GLU model's sharded state dict should fail")
    try:
        cloudckpt.save(sharded, f"{url}-plain-{rank}.pt", storage_options=so)
    except UnpicklableError as exc:
        assert "sharded" in str(exc) and exc.path, exc
    else:
        raise AssertionError("cloudckpt.save of a sharded state dict should fail")

    # The working path.
    content = {"iteration": 7, "framework": "test"}
    assert cm.save(checkpoint_state(model, opt), f"{url}/tp2", content_metadata=content,
                   storage_options=so) is None  # fmt: skip
    assert cm.is_checkpoint(f"{url}/tp2", storage_options=so)
    assert cm.load_content_metadata(f"{url}/tp2", storage_options=so) == content

    fresh = build_gpt(2, seed=99)
    fresh_opt = adam_for(fresh, 1)
    common = load_into(fresh, fresh_opt, f"{url}/tp2", so)
    assert common["content_metadata"] == content
    assert_same(full_state(fresh, fresh_opt), want, f"rank {rank} TP2 -> TP2")

    # TP2 -> TP1 (2 ranks: TP1 x DP2, each rank holds the whole model).
    tp1 = build_gpt(1, seed=5)
    tp1_opt = adam_for(tp1, 1)
    load_into(tp1, tp1_opt, f"{url}/tp2", so)
    # (megatron_interop checks the TP1 state against megatron's own resharded load)

    # TP1 -> TP2, saved asynchronously.
    handle = cm.save(checkpoint_state(tp1, tp1_opt), f"{url}/tp1", async_save=True,
                     storage_options=so)  # fmt: skip
    assert handle is not None
    handle.result(timeout=120)
    assert handle.done() and handle.exception() is None
    # At TP1 x DP2 rank 1 holds replicas only: rank 0 writes them, rank 1 stages nothing.
    staged = get_pool().idle_bytes  # the staging buffer, back in the pool
    model_bytes = sum(p.numel() * p.element_size() for p in tp1.parameters())
    assert staged >= 3 * model_bytes if rank == 0 else staged <= 64, (rank, staged)
    back = build_gpt(2, seed=7)
    back_opt = adam_for(back, 1)
    load_into(back, back_opt, f"{url}/tp1", so)
    assert_same(full_state(back, back_opt), want, f"rank {rank} TP2 -> TP1 -> TP2")

    metadata = cm.load_tensors_metadata(f"{url}/tp1", storage_options=so)
    word = metadata["embedding.word_embeddings.weight"]
    assert tuple(word.global_shape) == (VOCAB, 64) and word.dtype == torch.float32


def async_save_while_training(rank: int, world: int, url: str, so: dict[str, Any]) -> None:
    """An async save runs while the loop changes the weights and runs its own collectives."""
    model = build_gpt(2)
    opt = adam_for(model, 1)
    want = full_state(model, opt)
    handle = cm.save(checkpoint_state(model, opt), url, async_save=True, storage_options=so)
    assert handle is not None
    steps = 0
    # The training loop: all-reduces on the default group, and in-place updates of the
    # very tensors being uploaded. Neither may block on, or leak into, the save. The
    # ranks stop together, once every rank's save is done (the reduced flag).
    while True:
        everyone_done = torch.tensor([1 if handle.done() else 0])
        dist.all_reduce(everyone_done, op=dist.ReduceOp.MIN)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        steps += 1
        if everyone_done.item() == 1 and steps >= 20:
            break
        assert steps < 1_000_000, "the save never finished"
    handle.result()
    assert (
        full_state(model)["model.embedding.word_embeddings.weight"]
        .ne(want["model.embedding.word_embeddings.weight"])
        .all()
    )
    fresh = build_gpt(2, seed=3)
    fresh_opt = adam_for(fresh, 1)
    load_into(fresh, fresh_opt, url, so)
    assert_same(full_state(fresh, fresh_opt), want, f"rank {rank}: state at save time")


def megatron_async_queue(rank: int, world: int, url: str, so: dict[str, Any]) -> None:
    """The handle, given to megatron-core's own AsyncCallsQueue, finalizes on every rank."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    # Megatron's queue synchronizes with CUDA calls; on CPU they become host operations.
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    model = build_gpt(2)
    opt = adam_for(model, 1)
    want = full_state(model, opt)
    queue = AsyncCallsQueue()
    handle = cm.save(checkpoint_state(model, opt), url, async_save=True, storage_options=so)
    assert handle is not None
    call = queue.schedule_async_request(handle.async_request())
    finalized = queue.maybe_finalize_async_calls(blocking=True)
    assert finalized == [call], finalized
    assert handle.done() and queue.get_num_unfinalized_calls() == 0
    assert cm.is_checkpoint(url, storage_options=so)
    fresh = build_gpt(2, seed=3)
    fresh_opt = adam_for(fresh, 1)
    load_into(fresh, fresh_opt, url, so)
    assert_same(full_state(fresh, fresh_opt), want, "after the queue finalized")


def queued_async_saves(rank: int, world: int, url: str, so: dict[str, Any]) -> None:
    """A second async save returns while the first still uploads; both commit, in order."""
    import importlib
    import threading

    # (the package's ``save`` function shadows its ``save`` module as an attribute)
    megatron_save = importlib.import_module("cloudckpt.megatron.save")

    gate = threading.Event()

    class HeldWriter(megatron_save.CloudStorageWriter):
        """The first save's writer: its upload waits for the gate (a stuck upload)."""

        def write_data(self, plan: Any, planner: Any) -> Any:
            if self.url.endswith("/first"):
                gate.wait(timeout=120)
            return super().write_data(plan, planner)

    megatron_save.CloudStorageWriter = HeldWriter  # type: ignore[misc]
    model = build_gpt(2)
    opt = adam_for(model, 1)
    want = full_state(model, opt)
    first = cm.save(checkpoint_state(model, opt), f"{url}/first", async_save=True,
                    storage_options=so)  # fmt: skip
    second = cm.save(checkpoint_state(model, opt), f"{url}/second", async_save=True,
                     storage_options=so)  # fmt: skip
    assert first is not None and second is not None
    # save() returned although the first upload can't finish: it was queued, not awaited.
    assert not first.done() and not second.done()
    gate.set()
    first.result(timeout=120)
    second.result(timeout=120)
    for name in ("first", "second"):
        fresh = build_gpt(2, seed=3)
        fresh_opt = adam_for(fresh, 1)
        load_into(fresh, fresh_opt, f"{url}/{name}", so)
        assert_same(full_state(fresh, fresh_opt), want, name)


def refused_save_fails_everywhere(rank: int, world: int, url: str, so: dict[str, Any]) -> None:
    """overwrite=False on a committed URL: every rank raises, the old checkpoint stays."""
    model = build_gpt(2)
    opt = adam_for(model, 1)
    want = full_state(model, opt)
    cm.save(checkpoint_state(model, opt), url, storage_options=so)
    changed = build_gpt(2, seed=11)
    changed_opt = adam_for(changed, 3)
    for async_save in (False, True):
        try:
            handle = cm.save(checkpoint_state(changed, changed_opt), url, overwrite=False,
                             async_save=async_save, storage_options=so)  # fmt: skip
            if handle is not None:
                handle.result(timeout=120)
        except AlreadyExistsError as exc:
            assert rank == 0 and url in str(exc), exc
        except cm.DistributedSaveError as exc:
            assert rank != 0 and exc.failures.keys() == {0}, exc
            assert "AlreadyExistsError" in str(exc) and url in str(exc), exc
        else:
            raise AssertionError(f"rank {rank}: overwrite=False saved over {url}")
    fresh = build_gpt(2, seed=3)
    fresh_opt = adam_for(fresh, 1)
    load_into(fresh, fresh_opt, url, so)
    assert_same(full_state(fresh, fresh_opt), want, "the committed checkpoint")


# ----------------------------------------------------------------------------- interop


def _cpu_friendly_megatron() -> None:
    """megatron-core's own writer synchronizes CUDA; on CPU those calls become no-ops."""
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]


def _copy_up(local: Path, url: str, so: dict[str, Any]) -> None:
    """Upload a local directory object by object (what `aws s3 cp --recursive` does)."""
    store, key = open_url(url, TransferOptions(storage_options=so))
    for path in sorted(local.rglob("*")):
        if path.is_file():
            store.put(f"{key}/{path.relative_to(local).as_posix()}", path.read_bytes())


def _copy_down(url: str, local: Path, so: dict[str, Any]) -> None:
    """Download every object under a URL into a local directory."""
    store, key = open_url(url, TransferOptions(storage_options=so))
    for info in store.list(key + "/"):
        target = local / info.key[len(key) + 1 :]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(store.get(info.key))


def megatron_interop(rank: int, world: int, url: str, so: dict[str, Any], tmp: str) -> None:
    """megatron's writer -> upload -> cloudckpt loads; cloudckpt -> download -> megatron loads."""
    from megatron.core import dist_checkpointing

    _cpu_friendly_megatron()
    tmp_dir = Path(tmp)
    model = build_gpt(2)
    opt = adam_for(model, 2)
    want = full_state(model, opt)

    theirs = tmp_dir / "by-megatron"
    if rank == 0:
        theirs.mkdir()
    dist.barrier()
    dist_checkpointing.save(checkpoint_state(model, opt), str(theirs))
    dist.barrier()
    if rank == 0:
        _copy_up(theirs, f"{url}/by-megatron", so)
    dist.barrier()
    fresh = build_gpt(2, seed=21)
    fresh_opt = adam_for(fresh, 1)
    load_into(fresh, fresh_opt, f"{url}/by-megatron", so)
    assert_same(full_state(fresh, fresh_opt), want, "megatron's checkpoint read by cloudckpt")
    # ... and resharded to TP1 on the way, exactly as megatron's own loader reshards it.
    tp1 = build_gpt(1, seed=22)
    tp1_opt = adam_for(tp1, 1)
    load_into(tp1, tp1_opt, f"{url}/by-megatron", so)
    reference = build_gpt(1, seed=24)
    reference_opt = adam_for(reference, 1)
    state = dist_checkpointing.load(checkpoint_state(reference, reference_opt), str(theirs))
    reference.load_state_dict(state.pop("model"))
    restore_optimizer(reference_opt, state.pop("optimizer"))
    assert_same(
        full_state(tp1, tp1_opt),
        full_state(reference, reference_opt),
        "megatron's TP2 checkpoint at TP1, cloudckpt vs megatron",
    )

    model = build_gpt(2)
    opt = adam_for(model, 2)
    cm.save(checkpoint_state(model, opt), f"{url}/by-cloudckpt", storage_options=so)
    ours = tmp_dir / "by-cloudckpt"
    if rank == 0:
        _copy_down(f"{url}/by-cloudckpt", ours, so)
    dist.barrier()
    assert dist_checkpointing.check_is_distributed_checkpoint(str(ours))
    other = build_gpt(2, seed=23)
    other_opt = adam_for(other, 1)
    state = dist_checkpointing.load(checkpoint_state(other, other_opt), str(ours))
    other.load_state_dict(state.pop("model"))
    restore_optimizer(other_opt, state.pop("optimizer"))
    assert_same(full_state(other, other_opt), want, "cloudckpt's checkpoint read by megatron")


def msc_interop(rank: int, world: int, url: str, so: dict[str, Any], msc_url: str) -> None:
    """Megatron with multi-storage-client writes ``msc_url`` (= ``url``); cloudckpt loads it.

    ``MSC_CONFIG`` (set by the test) maps the ``msc://`` profile onto the bucket.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.msc_utils import MultiStorageClientFeature

    _cpu_friendly_megatron()
    MultiStorageClientFeature.enable()
    try:
        model = build_gpt(2)
        opt = adam_for(model, 2)
        want = full_state(model, opt)
        dist_checkpointing.save(checkpoint_state(model, opt), msc_url)
        dist.barrier()
    finally:
        MultiStorageClientFeature.disable()
    fresh = build_gpt(2, seed=31)
    fresh_opt = adam_for(fresh, 1)
    load_into(fresh, fresh_opt, url, so)
    assert_same(full_state(fresh, fresh_opt), want, "megatron + MSC's checkpoint")


__all__ = [
    "async_save_while_training",
    "build_gpt",
    "megatron_async_queue",
    "megatron_interop",
    "msc_interop",
    "queued_async_saves",
    "refused_save_fails_everywhere",
    "round_trip_and_reshard",
]
