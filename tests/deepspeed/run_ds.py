"""A small DeepSpeed training loop saving through ``cloudckpt.deepspeed`` (the tests run
it as one process or as several gloo ranks, each a process of its own, as torchrun
would start them).

    python run_ds.py URL STORAGE_OPTIONS_JSON --stage 2 --max-steps 12 --save-every 4 \\
        [--resume | --resume-strict] [--kill-in-save STEP] [--kill-before-commit STEP]
        [--fail-write RANK:STEP] [--load-step STEP] [--save-at S1,S2] [--keep-last N]
        [--module-only]
        [--async] [--local DIR] [--report PATH]
        [--tier DIR [--keep-local N] [--drain | --drain-only] [--kill-after-local STEP]
         [--kill-before-local STEP] [--shared-tier] [--fast] [--dump PATH]]

Losses are deterministic: the batches are a function of the step and the rank, and the
model has no dropout (DeepSpeed's checkpoint holds no RNG state). A failure of a
cloudckpt call is written to the report (the error's type and text) and exits with 3.

``--tier DIR``: every save and load goes through the manager's local tier, rank R's in
``DIR/rank-R`` (each rank a node of its own; ``--shared-tier``: every rank's in ``DIR``,
one node); ``--drain`` waits for the drains at the end, ``--drain-only`` does nothing
else.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("storage_options")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--resume", action="store_true", help="load the newest step, if any")
    p.add_argument("--resume-strict", action="store_true", help="load the newest step")
    p.add_argument("--kill-in-save", type=int, default=None, help="rank 1 dies writing STEP")
    p.add_argument("--kill-before-commit", type=int, default=None, help="rank 0 dies there")
    p.add_argument("--fail-write", default=None, help="RANK:STEP whose writes are refused")
    p.add_argument("--load-step", type=int, default=None, help="load STEP (not the newest)")
    p.add_argument("--save-at", default=None, help="save at these steps (comma-separated)")
    p.add_argument("--keep-last", type=int, default=None, help="save_checkpoint's keep_last")
    p.add_argument("--module-only", action="store_true", help="load_optimizer_states=False")
    p.add_argument("--async", dest="async_save", action="store_true")
    p.add_argument("--local", default=None, help="also save the last step with DeepSpeed here")
    p.add_argument("--report", default=None)
    p.add_argument("--tier", default=None, help="local_dir: DIR/rank-R for rank R")
    p.add_argument("--keep-local", type=int, default=None)
    p.add_argument("--drain", action="store_true", help="drain() after the loop")
    p.add_argument("--drain-only", action="store_true", help="drain() and exit")
    p.add_argument("--kill-after-local", type=int, default=None, help="die once STEP is local")
    p.add_argument("--kill-before-local", type=int, default=None, help="die before its marker")
    p.add_argument("--shared-tier", action="store_true", help="local_dir: DIR for every rank")
    p.add_argument("--fast", action="store_true", help="two attempts, short timeouts")
    p.add_argument("--dump", default=None, help="the engine's state at the end, to PATH.R")
    return p.parse_args()


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 6},
        },
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }


def start_deepspeed():  # type: ignore[no-untyped-def]
    import deepspeed
    import deepspeed.ops

    # The CPU accelerator compiles its shared-memory collectives with g++ on the first
    # init (about 100 s); gloo alone does for these tests.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def flat(obj: object, path: str = "") -> dict:
    """The tensors of ``obj`` (nested dicts, lists) by path, and its numbers and strings
    as their repr (an enum among them too)."""
    if isinstance(obj, dict):
        return {k: v for key, item in obj.items() for k, v in flat(item, f"{path}/{key}").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, item in enumerate(obj) for k, v in flat(item, f"{path}/{i}").items()}
    if isinstance(obj, torch.Tensor):
        return {path: obj}
    if isinstance(obj, (int, float, str, bool)):
        return {path: repr(obj)}
    return {}


def report(args: argparse.Namespace, rank: int, body: dict) -> None:
    if args.report:
        with open(f"{args.report}.{rank}", "w") as f:
            json.dump(body, f)


def main() -> None:
    args = parse()
    storage_options = json.loads(args.storage_options)
    torch.set_num_threads(1)
    deepspeed = start_deepspeed()
    import cloudckpt.deepspeed as cloud_ds
    import cloudckpt.manager.folders as cloud_folders
    from cloudckpt.deepspeed import load_checkpoint, save_checkpoint
    from cloudckpt.errors import CloudCkptError, StorageError

    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config(args.stage)
    )
    real_write = cloud_ds.write_object

    def write(obj, store, key, options, **kw):  # type: ignore[no-untyped-def]
        step = f"step-{args.kill_in_save:09d}/" if args.kill_in_save is not None else None
        if step is not None and step in key and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-save: rank 0 may have written
        if args.fail_write is not None:
            bad_rank, bad_step = (int(v) for v in args.fail_write.split(":"))
            if rank == bad_rank and f"step-{bad_step:09d}/" in key:
                raise StorageError(f"refused write of {key}")
        return real_write(obj, store, key, options, **kw)

    cloud_ds.write_object = write  # type: ignore[assignment]
    real_load = cloud_ds.load_object
    reads: dict[str, int] = {}

    def load(target, *a, **kw):  # type: ignore[no-untyped-def]
        name = target.key.split("/", 2)[-1]  # <tag>/<file>, under run/step-N/
        reads[name] = reads.get(name, 0) + 1
        return real_load(target, *a, **kw)

    cloud_ds.load_object = load  # type: ignore[assignment]
    real_commit = cloud_folders.commit_step

    def commit(store, prefix, step, *rest, **kw):  # type: ignore[no-untyped-def]
        if step == args.kill_before_commit:
            os.kill(os.getpid(), signal.SIGKILL)  # every rank's files are in the bucket
        return real_commit(store, prefix, step, *rest, **kw)

    cloud_folders.commit_step = commit  # type: ignore[assignment]
    sources: set[str] = set()

    def load_from(target, *a, **kw):  # type: ignore[no-untyped-def]
        sources.add(target.url.split("://", 1)[0])  # file: a local tier; s3: the bucket
        return load(target, *a, **kw)

    cloud_ds.load_object = load_from  # type: ignore[assignment]
    tier = {}
    if args.tier is not None:
        from cloudckpt.manager.tiers import LocalTier

        real_local_commit = LocalTier.commit

        def local_commit(self, step, *rest, **kw):  # type: ignore[no-untyped-def]
            if step == args.kill_before_local:
                os.kill(os.getpid(), signal.SIGKILL)  # every file written, no local marker
            if step == args.kill_after_local:  # the drains before it done, then die
                for _, manager in cloud_ds._tiered.values():
                    manager._tiered.drainer.wait()
            info = real_local_commit(self, step, *rest, **kw)
            if step == args.kill_after_local:
                os.kill(os.getpid(), signal.SIGKILL)  # committed locally, not drained
            return info

        LocalTier.commit = local_commit  # type: ignore[method-assign]
        shared = args.tier if args.shared_tier else os.path.join(args.tier, f"rank-{rank}")
        tier = {"local_dir": shared}
    if args.fast:
        from cloudckpt import TransferOptions

        fast = TransferOptions(
            max_attempts=2,
            backoff_base=0.05,
            backoff_max=0.2,
            connect_timeout=1.0,
            request_timeout=2.0,
        )
        tier["options"] = fast  # type: ignore[assignment]
    resumed_from = None
    save_seconds = []
    try:
        if args.drain_only:
            cloud_ds.drain(args.url, storage_options=storage_options, **tier)
            report(args, rank, {"drained": True})
            return
        if args.resume or args.resume_strict or args.load_step is not None:
            loaded = load_checkpoint(
                engine,
                args.url,
                step=args.load_step,
                missing_ok=args.resume,
                load_optimizer_states=not args.module_only,
                storage_options=storage_options,
                **tier,
            )
            if loaded is not None:
                resumed_from = loaded[0].step
                assert loaded[1]["seen"] == resumed_from, loaded[1]
        losses = []
        handles = []
        while engine.global_steps < args.max_steps:
            step = engine.global_steps + 1
            x, y = batch(step, rank)
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append([step, loss.item()])
            save_at = args.save_at is not None and step in {int(s) for s in args.save_at.split(",")}
            if save_at or (args.save_at is None and step % args.save_every == 0):
                if args.keep_local is not None:
                    tier["keep_local"] = args.keep_local
                started = time.monotonic()
                saved = save_checkpoint(
                    engine,
                    args.url,
                    client_state={"seen": step},
                    keep_last=args.keep_last,
                    async_save=args.async_save,
                    storage_options=storage_options,
                    **tier,
                )
                save_seconds.append(time.monotonic() - started)
                if args.async_save:
                    handles.append(saved)
        for handle in handles:
            handle.result()
        if args.drain:
            tier.pop("keep_local", None)
            cloud_ds.drain(args.url, storage_options=storage_options, **tier)
    except CloudCkptError as exc:  # the report says which error each rank raised
        report(args, rank, {"error": type(exc).__name__, "message": str(exc)})
        print(f"rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        raise SystemExit(3) from exc
    if args.local:
        engine.save_checkpoint(args.local)
    if args.dump:
        state = {"module": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict()}
        torch.save(flat(state), f"{args.dump}.{rank}")
    report(
        args,
        rank,
        {
            "losses": losses,
            "resumed_from": resumed_from,
            "global_steps": engine.global_steps,
            "reads": reads,
            "sources": sorted(sources),
            "save_seconds": save_seconds,
        },
    )


if __name__ == "__main__":
    main()
