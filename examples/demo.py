"""The main job end to end: train a small model, checkpoint it with cloudckpt, resume.

    make demo                            # checkpoints into ./demo-checkpoints
    make demo URL=s3://bucket/prefix     # any S3-compatible store (AWS_* env vars)

Trains a small MLP on synthetic data, saves a checkpoint (model + optimizer + step)
every few steps with a progress bar, then loads the last one into a fresh model and
optimizer, checks it matches bit for bit, and reports save/load throughput. Then the
same run again the way a long job would: a CheckpointManager with async saves (training
goes on while they upload), keep-last retention, and resume from the newest one.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn

import cloudckpt


def build(width: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 10)
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--url",
        default=os.path.abspath("demo-checkpoints"),
        help="where to checkpoint: a directory, file:// or s3:// URL",
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--width", type=int, default=2048, help="hidden width (model size)")
    args = parser.parse_args()

    model, opt = build(args.width)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.1f}M parameters; checkpoints go to {args.url}")
    x, y = torch.randn(512, 256), torch.randint(0, 10, (512,))
    url = None
    for step in range(1, args.steps + 1):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % args.every == 0:
            url = f"{args.url.rstrip('/')}/step-{step:06d}.pt"
            state = {
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "step": step,
                "loss": loss.item(),
            }
            result = cloudckpt.save(state, url, progress=True, part_size=16 << 20)
            print(
                f"step {step}: loss {loss.item():.4f}; saved {result.size / 2**20:.0f} MiB "
                f"in {result.seconds:.2f} s ({result.throughput / 2**30:.2f} GiB/s)"
            )
    assert url is not None, "--steps must be at least --every"

    # Resume: a fresh model and optimizer, restored from the last checkpoint.
    started = time.perf_counter()
    state = cloudckpt.load(url, map_location="cpu", progress=True)
    seconds = time.perf_counter() - started
    fresh, fresh_opt = build(args.width)
    fresh.load_state_dict(state["model"])
    fresh_opt.load_state_dict(state["optimizer"])
    same = all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True)
    )
    print(f"loaded {url} (step {state['step']}) in {seconds:.2f} s; weights identical: {same}")
    if not same:
        raise SystemExit("restored weights differ from the trained ones")
    # The object is a standard torch.save archive: torch.load reads it directly.
    if "://" not in url or url.startswith("file://"):
        plain = torch.load(url.removeprefix("file://"), weights_only=True)
        print(f"torch.load reads the same file: step {plain['step']}")

    # A long run: async saves through a manager that keeps the newest two.
    managed = f"{args.url.rstrip('/')}/managed"
    manager = cloudckpt.CheckpointManager(managed, keep_last=2, part_size=16 << 20)
    first = manager.latest()
    start = first.step if first is not None else 0
    if first is not None:  # a previous demo left checkpoints: resume from the newest
        state = manager.restore()
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    stalls, handle = [], None
    for step in range(start + 1, start + args.steps + 1):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % args.every == 0:
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
            handle = manager.async_save(step, state, metrics={"loss": loss.item()})
            stalls.append(handle.stall_seconds)
    assert handle is not None
    handle.result()
    kept = [c.step for c in manager.list()]
    print(
        f"manager: async saves stalled training {max(stalls) * 1000:.0f} ms at most; "
        f"kept steps {kept} under {manager.root_url}"
        + (f" (step {start} stays: this run resumed from it)" if start else "")
    )
    resumed = manager.restore()
    print(f"resume in two lines: CheckpointManager(url).restore() -> step {resumed['step']}")


if __name__ == "__main__":
    main()
