"""torchtitan's own CheckpointManager code on cloudckpt (cloudckpt.torchtitan), on 2 gloo
CPU ranks against moto: save, async save, a run killed after a committed step and
resumed in fresh processes, and a 2-rank checkpoint loaded on 1 rank.

Each run is ``titan_run.py`` in its own processes (`make test-torchtitan`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Not "torchtitan" alone: without it, this folder would pass for that package.
pytest.importorskip("torchtitan.components.checkpoint")

import torch

from cloudckpt.errors import ConfigError
from cloudckpt.torchtitan import CloudCheckpointManager
from docs_examples import docs_examples, run_example
from servers import unique_bucket_name

SCRIPT = str(Path(__file__).with_name("titan_run.py"))


def titan_cmd(s3, url: str, report: Path, *extra: str) -> list[str]:
    report.mkdir(exist_ok=True)
    opts = json.dumps(s3.storage_options())
    return [sys.executable, SCRIPT, url, opts, str(report), *extra]


def run_titan(s3, url: str, report: Path, *extra: str) -> None:
    out = subprocess.run(
        titan_cmd(s3, url, report, *extra), capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-6000:]


def keys(s3, bucket: str) -> list[str]:
    listing = s3.client().list_objects_v2(Bucket=bucket, Prefix="run/")
    return sorted(o["Key"].removeprefix("run/") for o in listing.get("Contents", []))


def committed(s3, bucket: str) -> list[int]:
    """The steps whose marker is in the bucket, read with the server's own client."""
    marked = [k.split("/")[0] for k in keys(s3, bucket) if k.endswith("/_CHECKPOINT.json")]
    return sorted(int(d.removeprefix("step-")) for d in marked)


def assert_same_state(saved: Path, loaded: Path) -> None:
    """Every state torchtitan checkpoints (model, optimizer, lr scheduler, dataloader,
    train step) as the resumed run loaded it equals what the saving run held."""
    before, after = torch.load(saved), torch.load(loaded)
    assert set(after) == {"model", "optimizer", "lr_scheduler", "dataloader", "step"}
    assert after["optimizer"], "no optimizer state was restored"
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_sync_save_prunes_in_the_bucket_and_loads_on_one_rank(moto_server, tmp_path):
    bucket = moto_server.make_bucket(unique_bucket_name("titan-sync"))
    url = f"s3://{bucket}/run"
    run_titan(moto_server, url, tmp_path / "a", "--steps", "6", "--interval", "2", "--keep", "2")
    assert committed(moto_server, bucket) == [4, 6]  # keep_latest_k=2 in the bucket
    assert "step-000000006/.metadata" in keys(moto_server, bucket)  # the DCP commit

    # Saved by 2 ranks, resumed by 1 (resharded): the newest committed step, whole.
    run_titan(moto_server, url, tmp_path / "b", "--world", "1", "--steps", "7")
    assert_same_state(tmp_path / "a" / "state-6.pt", tmp_path / "b" / "loaded.pt")
    assert torch.load(tmp_path / "b" / "loaded.pt")["step"] == 6


def test_async_save_commits_each_step_and_resumes_on_two_ranks(moto_server, tmp_path):
    bucket = moto_server.make_bucket(unique_bucket_name("titan-async"))
    url = f"s3://{bucket}/run"
    run_titan(
        moto_server, url, tmp_path / "a", "--async", "--steps", "5", "--interval", "1",
        "--keep", "3",
    )  # fmt: skip
    assert committed(moto_server, bucket) == [3, 4, 5]

    run_titan(moto_server, url, tmp_path / "b", "--async", "--steps", "6", "--interval", "1")
    assert_same_state(tmp_path / "a" / "state-5.pt", tmp_path / "b" / "loaded.pt")
    assert committed(moto_server, bucket) == [3, 4, 5, 6]  # keep_latest_k=0: keep all


def test_run_killed_after_a_committed_step_resumes_from_it(moto_server, tmp_path):
    bucket = moto_server.make_bucket(unique_bucket_name("titan-kill"))
    url = f"s3://{bucket}/run"
    cmd = titan_cmd(
        moto_server, url, tmp_path / "a", "--async", "--steps", "8", "--interval", "2",
        "--keep", "2", "--hang-after", "4",
    )  # fmt: skip
    # A session of its own: kill -9 reaches the launcher and both ranks at once.
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 240
        while committed(moto_server, bucket) != [2, 4]:
            assert proc.poll() is None, proc.stderr.read().decode()[-6000:]
            assert time.monotonic() < deadline, "step 4 never committed"
            time.sleep(0.1)  # poll the bucket
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL

    run_titan(moto_server, url, tmp_path / "b", "--async", "--steps", "6", "--interval", "2")
    assert_same_state(tmp_path / "a" / "state-4.pt", tmp_path / "b" / "loaded.pt")
    assert committed(moto_server, bucket) == [2, 4, 6]


def test_a_fresh_run_starts_from_initial_load_path_in_another_bucket_run(moto_server, tmp_path):
    bucket = moto_server.make_bucket(unique_bucket_name("titan-init"))
    run_titan(moto_server, f"s3://{bucket}/base", tmp_path / "a", "--steps", "2")
    base_step = f"s3://{bucket}/base/step-000000002/"
    # "run/" holds nothing committed: the model (only) comes from the other run's step.
    run_titan(moto_server, f"s3://{bucket}/run", tmp_path / "b", "--initial", base_step)
    saved, loaded = (
        torch.load(tmp_path / "a" / "state-2.pt"),
        torch.load(tmp_path / "b" / "loaded.pt"),
    )
    torch.testing.assert_close(loaded["model"], saved["model"], rtol=0, atol=0)
    assert loaded["step"] == 0 and loaded["dataloader"] == {"batches": 0}
    assert committed(moto_server, bucket) == [2, 4]  # the new run's own steps


def test_the_docs_example_runs(moto_server, tmp_path):
    """The torchtitan section of docs/integrations.md, as written, on the local server."""
    bucket = run_example(moto_server, docs_examples("torchtitan")[0], tmp_path, "titan-docs")
    listing = moto_server.client().list_objects_v2(Bucket=bucket, Prefix="titan-run/")
    markers = [o["Key"] for o in listing["Contents"] if o["Key"].endswith("_CHECKPOINT.json")]
    assert sorted(markers) == [
        f"titan-run/checkpoint/step-0000000{n}/_CHECKPOINT.json" for n in (20, 30)
    ]


def test_unsupported_modes_are_refused_by_name():
    for change, named in (
        ({"async_mode": "async_with_pinned_mem"}, "async_with_pinned_mem"),
        ({"last_save_in_hf": True, "folder": "/tmp/unused"}, "last_save_in_hf"),
    ):
        config = CloudCheckpointManager.Config(
            enable=True, **{"folder": "s3://bucket/run", **change}
        )
        with pytest.raises(ConfigError, match=named):
            config.build(
                dataloader=None,
                model_parts=[torch.nn.Linear(1, 1)],
                optimizers=None,
                lr_schedulers=None,
                states={},
                sd_adapter=None,
            )


def test_the_config_builds_this_class():
    config = CloudCheckpointManager.Config(enable=False, folder="s3://bucket/run")
    manager = config.build(
        dataloader=None,
        model_parts=[],
        optimizers=None,
        lr_schedulers=None,
        states={},
        sd_adapter=None,
    )
    assert type(manager) is CloudCheckpointManager
    assert CloudCheckpointManager.__module__ == "cloudckpt.torchtitan"
