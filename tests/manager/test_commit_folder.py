"""``manager.folders.commit_folder``, the upload and commit of Accelerate and DeepSpeed
saves, against moto: the marker records exactly the files this save's ranks wrote, so
two runs saving one step to one URL never commit a mix of both (issue 42)."""

from __future__ import annotations

import logging
import multiprocessing
import re
from pathlib import Path
from typing import Any

import pytest

from cloudckpt.engine.remove import remove_checkpoint
from cloudckpt.errors import CorruptCheckpointError, NotFoundError
from cloudckpt.format.commit import read_committed
from cloudckpt.manager import CheckpointInfo, CheckpointManager, folders
from cloudckpt.manager.folders import commit_folder, run_group, step_prefix
from cloudckpt.manager.marker import Written, check_remote, marker_key
from servers import S3Server, unique_bucket_name

STEP = 3
#: What this save writes into its local folder (uploaded by commit_folder).
FOLDER = {"model.safetensors": b"ours: weights" * 50, "sub/optimizer.bin": b"ours: moments" * 30}
#: What this save streams under the step's prefix itself (DeepSpeed's checkpoint engine).
STREAMED = {"global_step3/mp_rank_00_model_states.pt": b"ours: model states" * 40}
#: Another run's file of the same step, landing under the prefix during this save.
OTHER = "random_states_7.pkl"


def run(server: S3Server, name: str) -> CheckpointManager:
    bucket = server.make_bucket(unique_bucket_name(name))
    return CheckpointManager(f"s3://{bucket}/run", storage_options=server.storage_options())


def local_folder(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def stream(m: CheckpointManager, files: dict[str, bytes]) -> dict[str, int]:
    """Write ``files`` under the step's prefix, as DeepSpeed's checkpoint engine does."""
    for name, data in files.items():
        m.store.put(step_prefix(m, STEP) + name, data)
    return {name: len(data) for name, data in files.items()}


def committed_bytes(m: CheckpointManager, info: CheckpointInfo) -> dict[str, bytes]:
    """Each file the marker lists, read back from the bucket (checked against it first)."""
    prefix = step_prefix(m, info.step)
    check_remote(m.store, prefix, info)
    return {f.name: bytes(m.store.get(prefix + f.name)) for f in info.files}


def save(m: CheckpointManager, root: Path, **options: Any) -> CheckpointInfo:
    """``commit_folder`` of FOLDER (written under ``root``) as step STEP, on one process."""
    return commit_folder(
        m, STEP, local_folder(root, FOLDER), kind="test", metadata={}, group=None, **options
    )


def nothing_committed(m: CheckpointManager) -> bool:
    return read_committed(m.store, marker_key(m.root_key, STEP)) is None and m.list() == []


def test_another_runs_file_under_the_prefix_stays_out_of_the_marker(
    moto_server: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    m = run(moto_server, "commit-other")
    written = stream(m, STREAMED)
    m.store.put(step_prefix(m, STEP) + OTHER, b"the other run's RNG state")
    caplog.set_level(logging.WARNING, logger="cloudckpt")
    info = save(m, tmp_path, written=written)
    ours = {**FOLDER, **STREAMED}
    assert sorted(f.name for f in info.files) == sorted(ours)
    assert info.size == sum(len(d) for d in ours.values())
    assert all(f.etag for f in info.files)  # the bucket's ETags, as a listing commit records
    again = CheckpointManager(m.root_url, storage_options=moto_server.storage_options())
    assert again.info(STEP).files == info.files
    assert committed_bytes(again, again.info(STEP)) == ours
    assert any(OTHER in r.getMessage() and "left out" in r.getMessage() for r in caplog.records)


def test_a_file_another_save_rewrote_fails_the_commit(
    moto_server: S3Server, tmp_path: Path
) -> None:
    m = run(moto_server, "commit-rewritten")
    written = stream(m, STREAMED)
    name = next(iter(STREAMED))
    m.store.put(step_prefix(m, STEP) + name, b"the other run's model states")
    with pytest.raises(
        CorruptCheckpointError, match=re.escape(name) + " holds 28 bytes.* wrote 720 "
    ):
        save(m, tmp_path, written=written)
    assert nothing_committed(m)


def test_a_streamed_file_another_save_rewrote_at_the_same_size_fails_the_commit(
    moto_server: S3Server, tmp_path: Path
) -> None:
    """Two runs saving one step with the same shapes write files of the same sizes: the
    ETag each write got tells ours from theirs (DeepSpeed's streamed files)."""
    m = run(moto_server, "commit-same-size")
    written = {
        name: Written(len(data), m.store.put(step_prefix(m, STEP) + name, data))
        for name, data in STREAMED.items()
    }
    name, data = next(iter(STREAMED.items()))
    m.store.put(step_prefix(m, STEP) + name, b"T" * len(data))  # theirs, the same size
    with pytest.raises(CorruptCheckpointError, match=re.escape(name) + " is not the object"):
        save(m, tmp_path, written=written)
    assert nothing_committed(m)


def test_an_uploaded_file_rewritten_at_the_same_size_before_the_commit_fails_it(
    moto_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another run's save lands on a file of ours between our upload and our commit."""
    m = run(moto_server, "commit-same-size-upload")
    real = folders.commit_step
    name = "model.safetensors"

    def theirs_first(*args: Any, **kwargs: Any) -> CheckpointInfo:
        m.store.put(step_prefix(m, STEP) + name, b"T" * len(FOLDER[name]))
        return real(*args, **kwargs)

    monkeypatch.setattr(folders, "commit_step", theirs_first)
    with pytest.raises(CorruptCheckpointError, match=re.escape(name) + " is not the object"):
        save(m, tmp_path)
    assert nothing_committed(m)


def test_a_file_another_save_removed_fails_the_commit(
    moto_server: S3Server, tmp_path: Path
) -> None:
    """Two saves of one step interleaved: ours streamed its files, then the other save
    cleared the prefix (as each save's preparation does) and wrote its own."""
    m = run(moto_server, "commit-removed")
    written = stream(m, STREAMED)
    name = next(iter(STREAMED))
    remove_checkpoint(m.store, step_prefix(m, STEP), m.options)
    m.store.put(step_prefix(m, STEP) + OTHER, b"the other run's RNG state")
    with pytest.raises(NotFoundError, match=re.escape(f"{name}, written by this save")):
        save(m, tmp_path, written=written)
    assert nothing_committed(m)


def test_clear_first_removes_an_uncommitted_try_before_the_upload(
    moto_server: S3Server, tmp_path: Path
) -> None:
    m = run(moto_server, "commit-clear")
    m.store.put(step_prefix(m, STEP) + OTHER, b"an earlier try")
    info = save(m, tmp_path, clear_first=True)
    assert committed_bytes(m, info) == FOLDER
    listed = {o.key.rsplit("/", 1)[-1] for o in m.store.list(step_prefix(m, STEP))}
    assert OTHER not in listed


def _two_ranks(
    rank: int, world: int, url: str, options: dict[str, Any], root: Path, out: Any
) -> None:
    """Each rank: a folder holding a file both ranks wrote and one of its own; rank 1 also
    streams a file. Rank 0 plants another run's file before the collective commit."""
    m = CheckpointManager(url, storage_options=options)
    files = {"shared.json": b'{"config": 1}', f"rank_{rank}.bin": f"rank {rank} ".encode() * 9}
    folder = local_folder(root / f"rank-{rank}", files)
    written = {}
    if rank == 1:
        written = stream(m, {"global_step3/zero_pp_rank_1_optim_states.pt": b"r1 optim" * 11})
    else:
        m.store.put(step_prefix(m, STEP) + OTHER, b"the other run's RNG state")
    info = commit_folder(
        m, STEP, folder, kind="test", metadata={}, group=run_group(), written=written
    )
    out.put((rank, sorted((f.name, f.size) for f in info.files)))


def test_two_ranks_commit_exactly_their_files_once(moto_server: S3Server, tmp_path: Path) -> None:
    from ranks import run_ranks

    m = run(moto_server, "commit-ranks")
    results = multiprocessing.get_context("fork").SimpleQueue()
    options = moto_server.storage_options()
    run_ranks(_two_ranks, 2, m.root_url, options, tmp_path, results, timeout=120)
    got = dict(results.get() for _ in range(2))
    expected = [
        ("global_step3/zero_pp_rank_1_optim_states.pt", 88),
        ("rank_0.bin", 63),
        ("rank_1.bin", 63),
        ("shared.json", 13),
    ]
    assert got == {0: expected, 1: expected}
    info = m.info(STEP)
    assert sorted((f.name, f.size) for f in info.files) == expected
    data = committed_bytes(m, info)
    assert data["rank_1.bin"] == b"rank 1 " * 9 and data["shared.json"] == b'{"config": 1}'
    # The file both ranks listed was uploaded by rank 0 alone: rank 1's copy is gone.
    assert not (tmp_path / "rank-1" / "shared.json").exists()
    assert (tmp_path / "rank-0" / "shared.json").exists()


def test_check_remote_names_a_missing_resized_or_rewritten_file(
    moto_server: S3Server, tmp_path: Path
) -> None:
    m = run(moto_server, "commit-check")
    info = save(m, tmp_path)
    prefix = step_prefix(m, STEP)
    url = m.store.url(prefix + "sub/optimizer.bin")
    check_remote(m.store, prefix, info)
    same_size = b"theirs moment" * 30
    assert len(same_size) == len(FOLDER["sub/optimizer.bin"])
    m.store.put(prefix + "sub/optimizer.bin", same_size)
    with pytest.raises(CorruptCheckpointError, match=re.escape(url) + ".*step 3.*ETag"):
        check_remote(m.store, prefix, info)
    m.store.put(prefix + "sub/optimizer.bin", b"short")
    with pytest.raises(CorruptCheckpointError, match=re.escape(url) + " holds 5 bytes"):
        check_remote(m.store, prefix, info)
    m.store.delete(prefix + "sub/optimizer.bin")
    with pytest.raises(NotFoundError, match=re.escape(f"{url} is missing: its marker {info.url}")):
        check_remote(m.store, prefix, info)
