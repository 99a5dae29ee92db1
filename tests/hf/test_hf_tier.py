"""The Hugging Face callback on its local tier: real Trainers (one process) against a
moto S3 server, with the bucket away (a port where nothing listens, then a proxy to the
server started there), a restart that resumes from the tier, and a Trainer writing a
committed step's folder again in place."""

from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from run_train import losses, tiny_trainer
from transformers import TrainerCallback

from cloudckpt import CheckpointManager
from cloudckpt.errors import AlreadyExistsError, StorageError
from cloudckpt.hf import CloudCheckpointCallback, default_tier, fetch_latest
from cloudckpt.manager import MARKER_NAME
from cloudckpt.options import TransferOptions
from cloudckpt.testing.fault_proxy import FaultProxy
from ranks import HOST
from servers import free_port, unique_bucket_name

#: A bucket that is away fails a request fast: two attempts, short waits and timeouts.
FAST = TransferOptions(
    max_attempts=2, backoff_base=0.05, backoff_max=0.2, connect_timeout=1.0, request_timeout=2.0
)


class StopAt(TrainerCallback):
    """End training after step ``at`` (its save done), as a preempted job would."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            control.should_training_stop = True


def committed(server, url):
    return [c.step for c in CheckpointManager(url, storage_options=server.storage_options()).list()]


def tier_of(out: Path, url: str) -> Path:
    """The callback's default local tier of the run ``url`` under ``out``."""
    return default_tier(out, CheckpointManager(url).root_url)


def tier_steps(tier: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in tier.glob("step-*") if (p / MARKER_NAME).exists())


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_saves_go_on_in_the_tier_while_the_bucket_is_away_and_a_restart_resumes_there(
    moto_server, tmp_path, caplog
):
    """Every connection to the bucket refused: train() runs to its end, each checkpoint
    committed in output_dir/_cloudckpt-tier (a WARNING says the bucket is away), and
    only the final drain raises. With the bucket back, a restart on the same output_dir
    resumes from the tier's newest step (its files linked, not downloaded) with the
    losses of an uninterrupted run, and its drains commit every step in the bucket."""
    bucket = moto_server.make_bucket(unique_bucket_name("hf-tier-away"))
    url, opts = f"s3://{bucket}/run", moto_server.storage_options()
    base = tiny_trainer(str(tmp_path / "base"), 12)
    base.train()

    port = free_port()
    away = {**opts, "endpoint_url": f"http://{HOST}:{port}"}
    out = tmp_path / "out"
    first = tiny_trainer(
        str(out),
        12,  # the same learning-rate schedule as the uninterrupted run
        [CloudCheckpointCallback(url, options=FAST, storage_options=away), StopAt(8)],
    )
    with (
        caplog.at_level(logging.WARNING, logger="cloudckpt"),
        pytest.raises(StorageError, match=r"unreachable|refused|Connect"),
    ):
        first.train()
    assert losses(first) == losses(base)[:8]  # every step ran
    tier = tier_of(out, url)
    assert tier.parent == out / "_cloudckpt-tier"
    assert tier_steps(tier) == [4, 8]  # both kept: neither drained
    assert any("unreachable" in r.getMessage() for r in caplog.records)
    assert committed(moto_server, url) == []
    # The tier's files are the Trainer's, linked: no bytes copied.
    for name in ("model.safetensors", "optimizer.pt"):
        tier_file = tier / "step-000000008" / name
        assert tier_file.samefile(out / "checkpoint-8" / name)

    with FaultProxy(moto_server.endpoint_url, port=port):
        resumed = tiny_trainer(
            str(out), 12, [CloudCheckpointCallback(url, options=FAST, storage_options=away)]
        )
        path = fetch_latest(url, out, storage_options=away)  # other options: its own
        assert path == str(out / "checkpoint-8")
        resumed.train(resume_from_checkpoint=path)
    assert losses(resumed)[-4:] == losses(base)[8:]
    assert committed(moto_server, url) == [8, 12]  # 4 and 8 drained, then save_total_limit=2
    info = CheckpointManager(url, storage_options=opts).info(12)
    assert info.kind == "hf-trainer" and info.metadata == {"folder": "checkpoint-12"}
    # A machine without the tier fetches step 12 from the bucket, byte for byte the same.
    fetched = Path(fetch_latest(url, tmp_path / "elsewhere", storage_options=opts))
    for f in info.files:
        assert digest(fetched / f.name) == digest(out / "checkpoint-12" / f.name), f.name


def test_a_committed_step_written_again_by_the_trainer_keeps_its_bytes(moto_server, tmp_path):
    """Run A commits steps 4 and 8 (its tier's step 8: hard links of the Trainer's
    checkpoint-8). Run B, another URL from scratch on the same output_dir, has a tier of
    its own and writes checkpoint-8 again in place with other values: checkpoint-8's
    files first get bytes of their own (WARNING), so A's committed copy keeps A's bytes,
    and B commits its own. Run A started again from scratch has its save of step 8
    refused: it is committed."""
    bucket = moto_server.make_bucket(unique_bucket_name("hf-tier-rewrite"))
    opts = moto_server.storage_options()
    url_a, url_b = f"s3://{bucket}/a", f"s3://{bucket}/b"
    out = tmp_path / "out"
    first = tiny_trainer(str(out), 8, [CloudCheckpointCallback(url_a, storage_options=opts)])
    first.train()
    assert committed(moto_server, url_a) == [4, 8]
    step8 = tier_of(out, url_a) / "step-000000008"
    before = {p.name: digest(p) for p in step8.iterdir() if p.name != MARKER_NAME}

    def from_scratch(url):
        return tiny_trainer(
            str(out),
            8,
            [CloudCheckpointCallback(url, storage_options=opts)],
            save_steps=8,
            learning_rate=5e-2,  # other weights at step 8
        )

    from_scratch(url_b).train()
    rewritten = {n: digest(out / "checkpoint-8" / n) for n in before}
    assert rewritten["model.safetensors"] != before["model.safetensors"]
    assert {p.name: digest(p) for p in step8.iterdir() if p.name != MARKER_NAME} == before
    assert committed(moto_server, url_b) == [8]
    for url, expected in ((url_a, before), (url_b, rewritten)):
        fetched = Path(fetch_latest(url, tmp_path / f"elsewhere-{url[-1]}", storage_options=opts))
        assert {n: digest(fetched / n) for n in expected} == expected, url

    with pytest.raises(AlreadyExistsError, match="step 8 is already committed"):
        from_scratch(url_a).train()
    assert {p.name: digest(p) for p in step8.iterdir() if p.name != MARKER_NAME} == before


def test_files_an_earlier_save_left_in_the_folder_are_not_committed(moto_server, tmp_path, caplog):
    """Run A saves full checkpoints; run B (another URL, from scratch, on the same
    output_dir) saves the model only. The Trainer does not empty checkpoint-N before it
    writes, so A's optimizer, scheduler and RNG files stay in the folders B saves into:
    B's commits leave them out (WARNING naming them), in the tier and the bucket, and
    what B's fetch returns holds B's files only."""
    bucket = moto_server.make_bucket(unique_bucket_name("hf-tier-stale"))
    opts = moto_server.storage_options()
    url_a, url_b = f"s3://{bucket}/a", f"s3://{bucket}/b"
    out = tmp_path / "out"
    tiny_trainer(str(out), 8, [CloudCheckpointCallback(url_a, storage_options=opts)]).train()
    run_b = tiny_trainer(
        str(out), 8, [CloudCheckpointCallback(url_b, storage_options=opts)], save_only_model=True
    )
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        run_b.train()
    assert any("left there by an earlier save" in r.getMessage() for r in caplog.records)
    a_only = {"optimizer.pt", "scheduler.pt", "rng_state.pth"}
    for step in (4, 8):
        assert a_only <= {p.name for p in (out / f"checkpoint-{step}").iterdir()}  # A's, left
        names = {f.name for f in CheckpointManager(url_b, storage_options=opts).info(step).files}
        assert "model.safetensors" in names and not names & a_only, (step, names)
    held = {p.name for p in (tier_of(out, url_b) / "step-000000008").iterdir()}  # kept
    assert "model.safetensors" in held and not held & a_only
    fetched = Path(fetch_latest(url_b, tmp_path / "elsewhere", storage_options=opts))
    assert not {p.name for p in fetched.iterdir()} & a_only


def test_the_tier_is_left_out_of_what_push_to_hub_uploads(moto_server, tmp_path):
    """The Trainer's push_to_hub uploads output_dir but the paths its ignore patterns
    match (transformers' trainer.py passes ["_*", "checkpoint-*"] to upload_folder, on
    top of huggingface_hub's defaults): none of the tier's files is among the rest."""
    from huggingface_hub.utils import filter_repo_objects

    bucket = moto_server.make_bucket(unique_bucket_name("hf-tier-hub"))
    url, opts = f"s3://{bucket}/run", moto_server.storage_options()
    out = tmp_path / "out"
    tiny_trainer(str(out), 4, [CloudCheckpointCallback(url, storage_options=opts)]).train()
    paths = [p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()]
    assert any(p.startswith("_cloudckpt-tier/") for p in paths)
    pushed = list(filter_repo_objects(paths, ignore_patterns=["_*", "checkpoint-*"]))
    assert not [p for p in pushed if "cloudckpt" in p], pushed


def test_links_inside_a_checkpoint_folder_are_refused_by_the_fetch_and_the_save(
    moto_server, tmp_path
):
    """fetch_latest into a checkpoint-N already there whose file or subfolder is a
    symbolic link (holding the right bytes) refuses it, from the tier and from the
    bucket; a Trainer about to save into a checkpoint-N that is a link to another run's
    folder stops with UnsafePathError, and that run's committed tier copy keeps its
    bytes."""
    from cloudckpt.errors import UnsafePathError

    bucket = moto_server.make_bucket(unique_bucket_name("hf-tier-links"))
    opts = moto_server.storage_options()
    url_a, url_b = f"s3://{bucket}/a", f"s3://{bucket}/b"
    out_a = tmp_path / "a"
    tiny_trainer(str(out_a), 4, [CloudCheckpointCallback(url_a, storage_options=opts)]).train()
    real = out_a / "checkpoint-4"

    def linked_copy(where: Path, what: str) -> Path:
        """``where/checkpoint-4``: a copy of the real folder with ``what`` a link to the
        real one's."""
        folder = where / "checkpoint-4"
        shutil.copytree(real, folder)
        target = folder / what
        shutil.rmtree(target) if target.is_dir() else target.unlink()
        target.symlink_to(real / what)
        return folder

    # From the bucket (no tier under the folder): a linked file.
    linked_copy(tmp_path / "b1", "model.safetensors")
    with pytest.raises(UnsafePathError, match=r"model\.safetensors is a symbolic link"):
        fetch_latest(url_a, tmp_path / "b1", storage_options=opts)
    # From the tier: a linked file, in the Trainer's own output_dir.
    moved = real.rename(tmp_path / "real-4")
    real = moved
    linked_copy(out_a, "model.safetensors")
    with pytest.raises(UnsafePathError, match=r"model\.safetensors is a symbolic link"):
        fetch_latest(url_a, out_a, storage_options=opts)

    out_b = tmp_path / "b"
    out_b.mkdir()
    (out_b / "checkpoint-4").symlink_to(out_a / "checkpoint-4")
    tier_a = tier_of(out_a, url_a) / "step-000000004"
    before = {p.name: digest(p) for p in tier_a.iterdir()}
    run_b = tiny_trainer(
        str(out_b), 4, [CloudCheckpointCallback(url_b, storage_options=opts)], learning_rate=5e-2
    )
    with pytest.raises(UnsafePathError, match="checkpoint-4 is a symbolic link"):
        run_b.train()
    assert {p.name: digest(p) for p in tier_a.iterdir()} == before
