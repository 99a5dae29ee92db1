"""The main job end to end: train a small model, checkpoint it to an object store, resume.

    make demo                            # against a local S3 server the demo starts itself
    make demo URL=s3://bucket/prefix     # any S3-compatible store (AWS_* env vars)
    make demo URL=./demo-checkpoints     # a directory (or a file://, gs://, az:// URL)

Without ``--url`` the demo starts ``rclone serve s3`` (or moto, whichever the dev
dependencies provide) on 127.0.0.1 through ``cloudckpt.testing``, points the standard
``AWS_*`` variables at it, and stops it at the end, also on Ctrl-C or an error. Then:

1. trains a small MLP on synthetic data, saving a checkpoint (model, optimizer, step)
   every few steps: each is streamed up as a multipart upload, with a progress bar;
2. loads the last one into a fresh model and optimizer with parallel ranged reads, and
   checks it bit for bit; a plain GET of the object loads with ``torch.load`` too;
3. runs on the way a long job would: a ``CheckpointManager`` with async saves (training
   goes on while they upload), keep-last retention, and resume from the newest one;
4. lists and checks that run from a shell: ``cloudckpt ls`` and ``cloudckpt verify``;
5. adds a local tier (a temporary directory standing in for node-local NVMe): a save
   committed there, drained to the bucket in the background, ``cloudckpt ls --local``
   showing both tiers, a restore from the local copy, then, the local copy removed, a
   restore from the bucket.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

import cloudckpt
from cloudckpt.errors import ConfigError
from cloudckpt.testing import S3Server, launch, stop

PART_SIZE = 16 << 20  # small parts, so that even this small model is a multipart upload
# AWS_* variables that only say where configuration lives (or to skip the metadata service).
KEEP_AWS_ENV = {"AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_EC2_METADATA_DISABLED"}


def build(width: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The demo's model and optimizer, the same every time (seeded)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 10)
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def start_local_server() -> S3Server:
    """``rclone serve s3`` (else moto) on 127.0.0.1, with ``AWS_*`` pointing at it."""
    try:  # DEBUG: rclone logs every request, so the demo can count them
        server = launch("rclone", log_level="DEBUG")
    except ConfigError:
        try:
            server = launch("moto")
        except ConfigError as exc:
            raise SystemExit(
                f"no local S3 server to run the demo against ({exc}); "
                "install the dev dependencies (make venv) or pass --url DIR"
            ) from None
    # The user's profile, token or endpoint must not mix with the server's credentials.
    for key in [k for k in os.environ if k.startswith("AWS_") and k not in KEEP_AWS_ENV]:
        del os.environ[key]
    os.environ.update(server.env())
    print(f"local S3 server: {server.version} at {server.endpoint_url} (cloudckpt.testing)")
    return server


def requests_since(server: S3Server | None, offset: int) -> str:
    """A ", N requests" suffix: what the demo's own server served since log ``offset``."""
    if server is None:
        return ""
    count = server.count_requests(offset)
    return f", {count} request{'s' if count != 1 else ''}"


def train(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """One optimizer step; the loss."""
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def run(root: str, args: argparse.Namespace, server: S3Server | None) -> None:
    """Steps 1 to 4 of the module docstring, with checkpoints under ``root``."""
    model, opt = build(args.width)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.1f}M parameters; checkpoints go to {root}")
    x, y = torch.randn(512, 256), torch.randint(0, 10, (512,))
    url = None
    for step in range(1, args.steps + 1):
        loss = train(model, opt, x, y)
        if step % args.every == 0:
            url = f"{root}/step-{step:06d}.pt"
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
            offset = server.log_offset() if server is not None else 0
            result = cloudckpt.save(state, url, progress=True, part_size=PART_SIZE)
            parts = math.ceil(result.size / PART_SIZE)
            print(
                f"step {step}: loss {loss:.4f}; saved {result.size / 2**20:.0f} MiB in "
                f"{result.seconds:.2f} s ({result.throughput / 2**30:.2f} GiB/s), "
                + (f"{parts} parts" if parts > 1 else "one part")
                + requests_since(server, offset)
            )
    assert url is not None, "--steps must be at least --every"

    # Resume: a fresh model and optimizer, restored from the last checkpoint.
    offset = server.log_offset() if server is not None else 0
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
    print(
        f"loaded step {state['step']} in {seconds:.2f} s with ranged reads in parallel"
        f"{requests_since(server, offset)}; weights identical: {same}"
    )
    if not same:
        raise SystemExit("restored weights differ from the trained ones")
    # The object is a standard torch.save archive: torch.load reads it directly.
    if server is not None:
        bucket, key = url.removeprefix("s3://").split("/", 1)
        body = server.client().get_object(Bucket=bucket, Key=key)["Body"].read()
        plain = torch.load(io.BytesIO(body), weights_only=True)
        print(f"a plain S3 GET (boto3) and torch.load read the same object: step {plain['step']}")
    elif "://" not in url or url.startswith("file://"):
        plain = torch.load(url.removeprefix("file://"), weights_only=True)
        print(f"torch.load reads the same file: step {plain['step']}")

    # A long run: async saves through a manager that keeps the newest two.
    manager = cloudckpt.CheckpointManager(f"{root}/managed", keep_last=2, part_size=PART_SIZE)
    first = manager.latest()
    start = first.step if first is not None else 0
    if first is not None:  # a previous demo left checkpoints: resume from the newest
        state = manager.restore()
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    stalls, handle = [], None
    for step in range(start + 1, start + args.steps + 1):
        loss = train(model, opt, x, y)
        if step % args.every == 0:
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
            handle = manager.async_save(step, state, metrics={"loss": loss})
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

    # The same run from a shell (the environment carries the endpoint and credentials).
    for command in ("ls", "verify"):
        print(f"\n$ cloudckpt {command} {manager.root_url}", flush=True)
        done = subprocess.run([sys.executable, "-m", "cloudckpt", command, manager.root_url])
        if done.returncode != 0:
            raise SystemExit(f"cloudckpt {command} exited with {done.returncode}")

    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": kept[-1]}
    with tempfile.TemporaryDirectory(prefix="cloudckpt-demo-tier-") as local_dir:
        tiered(f"{root}/tiered", local_dir, state, args.width, server)


def tiered(
    root: str, local_dir: str, state: dict[str, Any], width: int, server: S3Server | None
) -> None:
    """Step 5: a local tier in ``local_dir`` drained to ``root``; restores from each tier."""
    manager = cloudckpt.CheckpointManager(root, local_dir=local_dir, part_size=PART_SIZE)
    print(f"\nlocal tier: {local_dir}, drained to {manager.root_url}")
    latest = manager.latest()  # a previous demo's steps stay in the bucket: go past them
    step = max(state["step"], latest.step + 1 if latest is not None else 0)
    started = time.perf_counter()
    info = manager.save(step, {**state, "step": step})
    print(
        f"step {step}: committed to the local tier in {time.perf_counter() - started:.2f} s; "
        "the bucket gets the same bytes in the background"
    )
    started = time.perf_counter()
    manager.drain()
    print(
        f"drain() waited {time.perf_counter() - started:.2f} s: step {step} is committed in "
        "the bucket too"
    )
    command = ["cloudckpt", "ls", "--local", local_dir, manager.root_url]
    print(f"$ {' '.join(command)}", flush=True)
    done = subprocess.run([sys.executable, "-m", *command])
    if done.returncode != 0:
        raise SystemExit(f"cloudckpt ls --local exited with {done.returncode}")

    def restore(where: str) -> None:
        offset = server.log_offset() if server is not None else 0
        started = time.perf_counter()
        restored = manager.restore(step)
        seconds = time.perf_counter() - started
        model, _ = build(width)
        model.load_state_dict(restored["model"])
        same = all(
            torch.equal(a, b)
            for a, b in zip(state["model"].values(), model.state_dict().values(), strict=True)
        )
        print(
            f"restored step {step} from {where} in {seconds:.2f} s"
            f"{requests_since(server, offset)}; weights identical: {same}"
        )
        if not same:
            raise SystemExit(f"the weights restored from {where} differ from the saved ones")

    restore("the local tier")
    shutil.rmtree(info.url.removeprefix("file://"))
    print(f"removed the local copy {info.url}")
    restore("the bucket")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--url",
        help="where to checkpoint: a directory or any store URL (default: a local S3 "
        "server started for the demo)",
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--width", type=int, default=2048, help="hidden width (model size)")
    args = parser.parse_args()
    # SIGTERM unwinds like Ctrl-C, so the local server is stopped either way.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    if args.url:
        url = args.url if "://" in args.url else os.path.abspath(args.url)
        run(url.rstrip("/"), args, server=None)
        return
    server = start_local_server()
    try:
        bucket = server.make_bucket("demo")
        run(f"s3://{bucket}/run", args, server)
    finally:
        stop(server)
        print("local S3 server stopped")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the local server was stopped on the way out
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
