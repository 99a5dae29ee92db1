"""A Ray Train ``TorchTrainer`` (2 CPU workers, DDP over gloo) saving through
``cloudckpt.ray`` to an S3 server; run in a process of its own by tests/ray.

    python run_ray.py STORAGE_URL WORKDIR PLAN_JSON

``PLAN_JSON`` is a list of fits run one after the other on one local Ray (2 CPUs, no
dashboard, shut down at the end): each ``{"name", "steps", "every", "kind",
"kill_at", "max_failures", "num_to_keep", "local"}``. ``local``: the run's storage is
``WORKDIR/local`` on Ray's local filesystem instead of ``STORAGE_URL``. ``kill_at``: on
its first attempt rank 0 ``kill -9``s itself in the save of that step, after the
payload is written and before the marker (the commit). Rank 0 appends what it did to
``WORKDIR/NAME.jsonl``: one ``{"restored": step}`` per start, one ``{"step", "loss"}``
per training step; the driver writes ``WORKDIR/results.json`` (each fit's checkpoint
path, error and time, the peak RSS of Ray's processes, Ray's session folder).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import ray
import ray.train
import torch
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import cloudckpt.ray
from cloudckpt.manager.manager import CheckpointManager


def train_func(config: dict) -> None:
    """Train a tiny model on fixed data; restore first, save every ``every`` steps."""
    rank = ray.train.get_context().get_world_rank()
    log = Path(config["workdir"]) / f"{config['name']}.jsonl"
    kill_at = config.get("kill_at")
    once = Path(config["workdir"]) / f"{config['name']}.killed"
    if kill_at is not None and rank == 0 and not once.exists():
        commit = CheckpointManager._commit

        def killing_commit(self, step, *args, **kwargs):
            if step == kill_at:  # the payload is written; the marker is not
                once.touch()
                os.kill(os.getpid(), signal.SIGKILL)
            return commit(self, step, *args, **kwargs)

        CheckpointManager._commit = killing_commit  # type: ignore[method-assign]

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    ddp = ray.train.torch.prepare_model(model)
    start = 0
    if config.get("kind") == "dcp":  # every rank saves and loads its part (DCP)
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state, "step": 0}
        if cloudckpt.ray.restore(kind="dcp", state=state) is not None:
            set_state_dict(
                model,
                optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
            )
            start = int(state["step"])
    else:  # DDP: one object, written by rank 0
        found = cloudckpt.ray.restore()
        if found is not None:
            model.load_state_dict(found["model"])
            optimizer.load_state_dict(found["optimizer"])
            start = int(found["step"])
    if rank == 0:
        with log.open("a") as f:
            f.write(json.dumps({"restored": start}) + "\n")
    for step in range(start + 1, config["steps"] + 1):
        g = torch.Generator().manual_seed(step * 10 + rank)
        x = torch.randn(16, 8, generator=g)
        y = x.sum(dim=1, keepdim=True).sin()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0:
            with log.open("a") as f:
                f.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
        if step % config["every"] == 0:
            if config.get("kind") == "dcp":
                model_state, optim_state = get_state_dict(model, optimizer)
                state = {"model": model_state, "optimizer": optim_state, "step": step}
            else:
                state = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": step,
                }
            cloudckpt.ray.report(
                {"loss": loss.item(), "step": step},
                state,
                step=step,
                kind=config.get("kind", "object"),
            )


def rss_mb() -> float:
    """Resident memory of this process and its children (Ray's), in MB."""
    total = 0
    me = os.getpid()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().split()
            if int(pid) != me and int(stat[3]) != me and not _descends(int(pid), me):
                continue
            total += int(stat[23]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e6


def _descends(pid: int, ancestor: int) -> bool:
    for _ in range(10):
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
    return False


def main() -> None:
    storage_url, workdir, plan = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    fs, path = cloudckpt.ray.storage(storage_url)
    results = []
    peak = 0.0
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=80 * 1024 * 1024,
        log_to_driver=os.environ.get("RAY_TEST_LOGS") == "1",
    )
    session = ray._private.worker._global_node.get_session_dir_path()
    try:
        for fit in plan:
            started = time.monotonic()
            trainer = TorchTrainer(
                train_func,
                train_loop_config={**fit, "workdir": str(workdir)},
                scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                run_config=RunConfig(
                    name=fit["name"],
                    # "local": a folder on this machine, Ray's local filesystem
                    storage_path=str(workdir / "local") if fit.get("local") else path,
                    storage_filesystem=None if fit.get("local") else fs,
                    checkpoint_config=CheckpointConfig(num_to_keep=fit.get("num_to_keep")),
                    failure_config=FailureConfig(max_failures=fit.get("max_failures", 0)),
                ),
            )
            error = None
            checkpoint = None
            try:
                result = trainer.fit()
                checkpoint = result.checkpoint.path if result.checkpoint else None
            except Exception as exc:  # reported to the test
                error = f"{type(exc).__name__}: {exc}"
            peak = max(peak, rss_mb())
            results.append(
                {
                    "name": fit["name"],
                    "checkpoint": checkpoint,
                    "error": error,
                    "seconds": time.monotonic() - started,
                }
            )
    finally:
        ray.shutdown()
    summary = {"fits": results, "peak_rss_mb": peak, "session": session}
    (workdir / "results.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
