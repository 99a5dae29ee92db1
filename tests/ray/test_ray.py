"""Ray Train with ``cloudckpt.ray``: a real ``TorchTrainer`` (2 CPU workers, DDP over
gloo, one local Ray with 2 CPUs) saving to a moto S3 server through the run's storage
path. A ``kill -9`` of rank 0 in a save, after its payload and before its commit, then
Ray's restart (``FailureConfig(max_failures=1)``) and a new ``fit()`` of the same run:
the same losses step by step as an uninterrupted run, the killed save never seen,
Ray's ``num_to_keep`` applied to every committed step; the same with a DCP state dict
saved by every rank. And the docs example as written.

Ray runs in a process of its own (run_ray.py), shut down at its end; the test checks
that none of that Ray's processes is left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# tests/ is on sys.path, where this folder reads as a namespace package named ray:
# skip unless the real package imports, and leave no namespace package behind.
try:
    pytest.importorskip("ray.train.torch")
except pytest.skip.Exception:
    sys.modules.pop("ray", None)
    raise

from cloudckpt import CheckpointManager
from cloudckpt.cli import main as cli_main
from docs_examples import docs_examples, run_example
from servers import unique_bucket_name

SCRIPT = str(Path(__file__).with_name("run_ray.py"))


def ray_processes(session: str) -> list[str]:
    """Command lines of running processes that belong to the Ray session ``session``."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if session in cmd or session.encode() in env:
            found.append(f"{pid}: {cmd[:200]}")
    return found


def losses(path: Path) -> tuple[list[int], dict[int, float]]:
    """The steps each start restored, and the last loss logged for each step."""
    restored, by_step = [], {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "restored" in record:
            restored.append(record["restored"])
        else:
            by_step[record["step"]] = record["loss"]
    return restored, by_step


@pytest.fixture(scope="module")
def ray_run(moto_server, tmp_path_factory):
    """One local Ray, four fits, shut down: DDP uninterrupted to step 10 (``base``);
    DDP killed in the save of step 6 and restarted by Ray, to step 8, then a new
    ``fit()`` of the same run to step 10 (``crash``); DCP killed in the save of step 4
    and restarted, to step 6 (``dcp``); Ray's ``num_to_keep=2`` for those. DDP to step 4
    in a local folder, ``num_to_keep=1`` (``local``)."""
    tmp = tmp_path_factory.mktemp("ray")
    bucket = moto_server.make_bucket(unique_bucket_name("ray"))
    storage = f"s3://{bucket}/runs"
    base = {"steps": 10, "every": 2, "num_to_keep": 2}
    plan = [
        {"name": "base", **base},
        # rank 0 is killed in the save of step 6, between its payload and its marker
        {"name": "crash", **base, "steps": 8, "kill_at": 6, "max_failures": 1},
        {"name": "crash", **base},  # a new fit() of the same run goes on to step 10
        {"name": "dcp", **base, "steps": 6, "kill_at": 4, "max_failures": 1, "kind": "dcp"},
        {"name": "local", **base, "steps": 4, "num_to_keep": 1, "local": True},
    ]
    out = subprocess.run(
        [sys.executable, SCRIPT, storage, str(tmp), json.dumps(plan)],
        capture_output=True,
        text=True,
        timeout=540,
        env={**os.environ, **moto_server.env()},
        check=False,
    )
    assert out.returncode == 0, out.stderr[-6000:]
    report = json.loads((tmp / "results.json").read_text())
    return tmp, storage, report


def test_ray_shut_down_and_fits_succeeded(ray_run):
    tmp, storage, report = ray_run
    assert ray_processes(report["session"]) == []
    fits = report["fits"]
    assert [f["error"] for f in fits] == [None] * 5, fits
    path = storage.removeprefix("s3://")
    assert [f["checkpoint"] for f in fits] == [
        f"{path}/base/step-000000010",
        f"{path}/crash/step-000000008",
        f"{path}/crash/step-000000010",
        f"{path}/dcp/step-000000006",
        f"{tmp}/local/local/step-000000004",
    ]


def test_kill_mid_save_then_restart_resumes_same_losses(ray_run):
    tmp, _, _ = ray_run
    base_restored, base_losses = losses(tmp / "base.jsonl")
    restored, crash_losses = losses(tmp / "crash.jsonl")
    assert base_restored == [0]
    # The killed save of step 6 never committed: Ray's restart resumed from step 4, the
    # newest committed (committed before the kill; Ray may not have taken its report
    # yet), and the second fit() from step 8.
    assert restored == [0, 4, 8]
    assert sorted(base_losses) == list(range(1, 11))
    assert crash_losses == base_losses  # step by step, the re-run steps included


def test_dcp_kill_mid_save_then_restart(ray_run):
    tmp, _, _ = ray_run
    lines = [json.loads(line) for line in (tmp / "dcp.jsonl").read_text().splitlines()]
    cut = lines.index({"restored": 2})  # the kill in step 4's save: step 2 is the newest
    first = {r["step"]: r["loss"] for r in lines[:cut] if "step" in r}
    again = {r["step"]: r["loss"] for r in lines[cut:] if "step" in r}
    assert sorted(first) == [1, 2, 3, 4] and sorted(again) == [3, 4, 5, 6]
    assert all(again[s] == first[s] for s in (3, 4))  # the same losses after the restart


def test_retention_is_rays_and_steps_are_cloudckpt_checkpoints(ray_run, moto_server, monkeypatch):
    _, storage, _ = ray_run
    # Ray's num_to_keep=2 deleted the older step folders, the crash run's step 4 among
    # them (committed before the kill, reported to Ray on the restart); what is left is
    # committed and verifies.
    options = moto_server.storage_options()
    for name in ("base", "crash", "dcp"):
        manager = CheckpointManager(f"{storage}/{name}", storage_options=options)
        steps = [c.step for c in manager.list()]
        assert steps == ([4, 6] if name == "dcp" else [8, 10]), (name, steps)
    for name, value in moto_server.env().items():
        monkeypatch.setenv(name, value)
    assert cli_main(["verify", f"{storage}/crash/step-000000010/"]) == 0
    assert cli_main(["verify", f"{storage}/dcp/step-000000006/"]) == 0


def test_local_storage_path(ray_run):
    tmp, _, _ = ray_run
    steps = [c.step for c in CheckpointManager(tmp / "local" / "local").list()]
    assert steps == [4]  # Ray's num_to_keep=1 removed step 2's folder
    assert sorted(p.name for p in (tmp / "local" / "local").glob("step-*")) == ["step-000000004"]


def test_docs_example(moto_server, tmp_path):
    (code,) = docs_examples("Ray Train")
    run_example(moto_server, code, tmp_path, "ray-docs")


def test_storage_filesystem(moto_server, monkeypatch):
    """``storage()``: Ray's filesystem for an s3:// URL, rooted at the bucket, picklable
    (Ray sends it to every worker) with the endpoint cloudckpt's workers take from it,
    and a ``delete_dir`` (Ray's retention) that removes a step's marker first."""
    import pickle

    import pyarrow.fs

    import cloudckpt.ray

    for name, value in moto_server.env().items():
        monkeypatch.setenv(name, value)
    bucket = moto_server.make_bucket(unique_bucket_name("rayfs"))
    fs, path = cloudckpt.ray.storage(f"s3://{bucket}/runs/")
    assert path == f"{bucket}/runs" and fs.type_name == "py::cloudckpt+s3"
    again = pickle.loads(pickle.dumps(fs))
    assert again == fs
    opts = cloudckpt.ray._filesystem_options(again)
    assert opts["endpoint_url"] == moto_server.endpoint_url
    assert opts["region_name"] == moto_server.region

    step = f"{path}/run1/step-000000002"
    for name in ("state.pt", "_CHECKPOINT.json"):
        with fs.open_output_stream(f"{step}/{name}") as f:
            f.write(b"x")
    deleted = []
    inner = fs.handler.fs

    class Recording:  # the wrapped filesystem, recording what is deleted, in order
        def __getattr__(self, name):
            return getattr(inner, name)

        def delete_file(self, p):
            deleted.append(p.rsplit("/", 1)[-1])
            inner.delete_file(p)

        def delete_dir(self, p):
            deleted.append("dir")
            inner.delete_dir(p)

    fs.handler.fs = Recording()
    fs.delete_dir(step)
    assert deleted == ["_CHECKPOINT.json", "dir"]
    assert inner.get_file_info(step).type == pyarrow.fs.FileType.NotFound
