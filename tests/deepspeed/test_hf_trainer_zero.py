"""The Hugging Face Trainer under its own DeepSpeed integration
(``TrainingArguments(deepspeed=...)``: ZeRO-2, torch Adam, fp32) with
``cloudckpt.hf.CloudCheckpointCallback`` on 2 gloo processes against a moto S3 server:
a worker killed by ``kill -9`` mid-save leaves the previous checkpoint the newest
committed, and the run resumed from ``fetch_latest`` logs the same losses step by step
as an uninterrupted one. The processes run tests/hf/run_train.py with ``--zero 2``
(which also says how accelerate is made to take its DeepSpeed path on a CPU-only host);
the environment is ``make test-deepspeed``'s, which sees transformers and accelerate."""

from __future__ import annotations

import sys

import pytest

# tests/ is on sys.path, where tests/deepspeed reads as a namespace package named
# deepspeed: skip unless the real package imports, and leave no namespace package behind.
try:
    pytest.importorskip("deepspeed.runtime.engine")
except pytest.skip.Exception:
    sys.modules.pop("deepspeed", None)
    raise
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from cloudckpt import CheckpointManager
from cloudckpt.cli import main as cli_main
from hf.test_hf_ranks import committed, finish, launch, reports, succeed
from servers import unique_bucket_name

ZERO2 = ("--zero", "2")


def test_zero2_worker_killed_mid_save_leaves_the_previous_checkpoint_and_resumes(
    moto_server, tmp_path, monkeypatch, capsys
):
    bucket = moto_server.make_bucket(unique_bucket_name("hf-zero2-kill"))
    base_url, url = f"s3://{bucket}/base", f"s3://{bucket}/run"
    base_run = launch(moto_server, base_url, tmp_path / "base", 12, *ZERO2, report=tmp_path / "a")
    # Rank 1 uploads its files of step 8 (its ZeRO optimizer shard, rng_state_1.pth),
    # then is killed (SIGKILL) before the ranks settle: nothing commits step 8.
    # Each rank a node of its own (its own output_dir and local tier), so rank 1 sends
    # its own files.
    killed = launch(
        moto_server,
        url,
        tmp_path / "killed",
        12,
        *ZERO2,
        "--kill-in-upload",
        "1:8",
        "--output-per-rank",
    )
    codes, errors = finish(killed[1:])
    assert codes == [-9], errors
    # Rank 0's collectives fail once the dead peer's connection drops (torchrun would
    # end it then): so does this test, if it is still there a minute later.
    codes, errors = finish(killed[:1], timeout=60)
    assert codes[0] != 0, errors
    succeed(base_run)
    base = reports(tmp_path / "a")
    assert [step for step, _ in base[0]["losses"]] == list(range(1, 13))
    assert base[0]["losses"] == base[1]["losses"]  # the Trainer logs the mean over ranks
    assert committed(moto_server, base_url) == [8, 12]

    assert committed(moto_server, url) == [4]  # step 8 is not committed...
    store = CheckpointManager(url, storage_options=moto_server.storage_options()).store
    names = {o.key.partition("step-000000008/")[2] for o in store.list("run/step-000000008/")}
    shard = "global_step8/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    assert shard in names and "_CHECKPOINT.json" not in names  # ...rank 1's bytes are

    # Resumed as if each rank were a node of its own: each fetches the whole checkpoint
    # into its own output_dir (DeepSpeed's load reads every rank's shard), and uploads
    # only what it wrote (rank 1: its ZeRO shard and RNG state).
    resumed = launch(
        moto_server,
        url,
        tmp_path / "resumed",
        12,
        *ZERO2,
        "--resume",
        "--output-per-rank",
        report=tmp_path / "b",
    )
    succeed(resumed)
    for r, report in enumerate(reports(tmp_path / "b")):
        assert report["resumed_from"] == str(tmp_path / "resumed" / f"rank-{r}" / "checkpoint-4")
        assert report["losses"] == base[r]["losses"], r  # step by step
    rank1 = tmp_path / "resumed" / "rank-1" / "checkpoint-12"
    assert sorted(p.relative_to(rank1).as_posix() for p in rank1.rglob("*") if p.is_file()) == [
        "global_step12/zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "rng_state_1.pth",
    ]
    assert committed(moto_server, url) == [8, 12]  # save_total_limit=2 in the bucket too

    info = CheckpointManager(url, storage_options=moto_server.storage_options()).latest()
    assert info is not None and info.kind == "hf-trainer"
    assert info.metadata == {"folder": "checkpoint-12", "world_size": 2}
    names = {f.name for f in info.files}
    assert {
        "latest",
        "model.safetensors",
        "rng_state_0.pth",
        "rng_state_1.pth",
        "global_step12/mp_rank_00_model_states.pt",
        "global_step12/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "global_step12/zero_pp_rank_1_mp_rank_00_optim_states.pt",
    } <= names
    assert len(names) == len(info.files)  # each file uploaded once
    for name, value in moto_server.env().items():
        monkeypatch.setenv(name, value)
    assert cli_main(["verify", url]) == 0
    assert cli_main(["ls", url]) == 0
    assert "hf-trainer" in capsys.readouterr().out
