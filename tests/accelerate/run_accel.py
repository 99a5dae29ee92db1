"""A small Accelerate training loop saving through ``cloudckpt.accelerate`` (the tests
run it as one process or as several gloo ranks, each a process of its own).

    python run_accel.py URL STORAGE_OPTIONS_JSON --max-steps 12 --save-every 4 \\
        [--resume] [--block-at N] [--kill-before-commit N] [--fail-upload RANK:STEP]
        [--async] [--report PATH]
        [--local-dir DIR [--drain | --drain-only] [--kill-after-local STEP] [--fast]]

Losses are deterministic: the batches are a function of the step and the rank, and
dropout draws from the RNG states accelerate saves and restores.

``--local-dir DIR``: every save and load goes through the manager's local tier, rank R's
in ``DIR/rank-R`` (each rank a node of its own); ``--drain`` waits for the drains at the
end (the report's ``drain_error`` names the error of one that failed: no background
drain is left running into the exit), ``--drain-only`` drains and exits;
``--kill-after-local STEP`` dies by SIGKILL once STEP is committed locally (the drains
before it done); ``--fast``: two attempts and short timeouts, for a bucket that refuses.
The report's ``sources`` says where the restore read the step's files: ``file`` (a
local tier), ``s3`` (the bucket).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

import cloudckpt.accelerate as cloud_accel
import cloudckpt.manager.folders as cloud_folders
from cloudckpt import TransferOptions
from cloudckpt.accelerate import load_state, save_state
from cloudckpt.errors import CloudCkptError, StorageError


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("storage_options")
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--block-at", type=int, default=None)
    p.add_argument("--kill-before-commit", type=int, default=None)
    p.add_argument("--fail-upload", default=None, help="RANK:STEP whose upload fails")
    p.add_argument("--async", dest="async_save", action="store_true")
    p.add_argument("--report", default=None)
    p.add_argument("--local-dir", default=None, help="local_dir: DIR/rank-R for rank R")
    p.add_argument("--drain", action="store_true", help="drain() after the loop")
    p.add_argument("--drain-only", action="store_true", help="drain() and exit")
    p.add_argument("--kill-after-local", type=int, default=None)
    p.add_argument("--fast", action="store_true", help="two attempts, short timeouts")
    return p.parse_args()


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def main() -> None:
    args = parse()
    storage_options = json.loads(args.storage_options)
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    set_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    tier: dict[str, object] = {}
    if args.local_dir is not None:
        tier["local_dir"] = os.path.join(args.local_dir, f"rank-{accelerator.process_index}")
    if args.fast:
        tier["options"] = TransferOptions(
            max_attempts=2,
            backoff_base=0.05,
            backoff_max=0.2,
            connect_timeout=1.0,
            request_timeout=2.0,
        )
    if args.drain_only:
        cloud_accel.drain(args.url, storage_options=storage_options, **tier)  # type: ignore[arg-type]
        accelerator.end_training()
        return
    if args.kill_after_local is not None:
        from cloudckpt.manager.tiers import LocalTier

        real_local_commit = LocalTier.commit

        def local_commit(self, step, *rest, **kw):  # type: ignore[no-untyped-def]
            if step == args.kill_after_local:  # the drains before it done, then die
                for _, manager in cloud_accel._tiered.values():
                    manager._tiered.drainer.wait()
            info = real_local_commit(self, step, *rest, **kw)
            if step == args.kill_after_local:
                os.kill(os.getpid(), signal.SIGKILL)  # committed locally, not drained
            return info

        LocalTier.commit = local_commit  # type: ignore[method-assign]
    sources: set[str] = set()
    real_copy_tree = cloud_accel.copy_tree

    def copy_from(src, src_prefix, *rest, **kw):  # type: ignore[no-untyped-def]
        copied = real_copy_tree(src, src_prefix, *rest, **kw)
        sources.add(src.url(src_prefix).split("://", 1)[0])  # file: a local tier
        if getattr(src, "remote_reads", (0, 0))[0]:  # a view of both tiers: the bucket served
            sources.add("s3")
        return copied

    cloud_accel.copy_tree = copy_from  # type: ignore[assignment]
    start = 0
    resumed_from = None
    if args.resume:
        info = load_state(accelerator, args.url, storage_options=storage_options, **tier)  # type: ignore[arg-type]
        if info is not None:
            start, resumed_from = info.step, info.step
    if args.kill_before_commit is not None:
        real_commit = cloud_folders.commit_step

        def commit_or_die(store, prefix, step, *rest, **kw):  # type: ignore[no-untyped-def]
            if step == args.kill_before_commit:
                os.kill(os.getpid(), signal.SIGKILL)  # every rank's payload is uploaded
            return real_commit(store, prefix, step, *rest, **kw)

        cloud_folders.commit_step = commit_or_die  # type: ignore[assignment]
    if args.fail_upload is not None:
        bad_rank, bad_step = (int(v) for v in args.fail_upload.split(":"))
        real_copy = cloud_folders.copy_tree

        def copy_or_fail(src, src_prefix, dst, dst_prefix, *rest, **kw):  # type: ignore[no-untyped-def]
            if accelerator.process_index == bad_rank and f"step-{bad_step:09d}/" in dst_prefix:
                raise StorageError(f"refused upload to {dst_prefix}")
            return real_copy(src, src_prefix, dst, dst_prefix, *rest, **kw)

        cloud_folders.copy_tree = copy_or_fail  # type: ignore[assignment]
    losses = []
    handles = []
    for step in range(start + 1, args.max_steps + 1):
        if step == args.block_at:
            for h in handles:
                h.result()
            threading.Event().wait()  # killed here by the test
        model.train()
        x, y = batch(step, accelerator.process_index)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        losses.append([step, loss.item()])
        if step % args.save_every == 0:
            try:
                saved = save_state(
                    accelerator,
                    args.url,
                    step=step,
                    async_save=args.async_save,
                    storage_options=storage_options,
                    **tier,  # type: ignore[arg-type]
                )
            except CloudCkptError as exc:  # the report says which error each rank raised
                with open(f"{args.report}.{accelerator.process_index}", "w") as f:
                    json.dump({"error": type(exc).__name__, "message": str(exc)}, f)
                raise SystemExit(3) from exc
            if args.async_save:
                handles.append(saved)
    for h in handles:
        h.result()
    drain_error = None
    if args.drain:
        try:
            cloud_accel.drain(args.url, storage_options=storage_options, **tier)  # type: ignore[arg-type]
        except CloudCkptError as exc:  # the bucket away: raised on every rank alike
            drain_error = type(exc).__name__
    if args.report:
        path = f"{args.report}.{accelerator.process_index}"
        report = {
            "losses": losses,
            "resumed_from": resumed_from,
            "sources": sorted(sources),
            "drain_error": drain_error,
        }
        with open(path, "w") as f:
            json.dump(report, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
