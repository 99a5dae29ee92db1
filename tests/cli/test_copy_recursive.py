"""``cloudckpt cp -r``: a whole prefix between stores, resumable, commit markers last;
``--dry-run`` for ``cp -r`` and ``rm``; the rate counts only the bytes a run moved.

The stores are real (the filesystem and moto); FaultyStore puts a failure at a chosen
request and records the order of writes.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from cloudckpt.cli import commands, main
from cloudckpt.engine.copy import COMMIT_MARKERS, CopyResult, copy_tree, plan_tree
from cloudckpt.errors import StorageError
from cloudckpt.manager import MARKER_NAME, CheckpointManager
from cloudckpt.options import MiB, resolve_options
from cloudckpt.store import Store, open_url
from faults import FaultyStore
from servers import S3Server, unique_bucket_name


def _call(*args: str) -> subprocess.CompletedProcess[str]:
    """``cloudckpt ARGS`` in this process (``main(argv)``), its output captured."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def _tree(root: Path) -> dict[str, bytes]:
    """A run with a managed step holding a DCP-like checkpoint and a big object."""
    files = {
        "step-000000001/big.bin": os.urandom(11 * MiB + 3),  # three 5 MiB parts
        "step-000000001/dcp/__0_0.distcp": os.urandom(2 * MiB),
        "step-000000001/dcp/.metadata": b"dcp metadata",
        "step-000000001/_CHECKPOINT.json": b"{}",
        "notes/readme.txt": b"hello",
    }
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return files


def _read_tree(store: Store, prefix: str) -> dict[str, bytes]:
    return {o.key[len(prefix) :]: store.get(o.key) for o in store.list(prefix)}


class _Recording(FaultyStore):
    """Records the key of every object made whole (a put or a completed upload)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.landed: list[str] = []

    def _put(self, key: str, *args: object) -> object:
        result = super()._put(key, *args)
        self.landed.append(key)
        return result

    def _complete_multipart(self, upload: object, *args: object) -> object:
        result = super()._complete_multipart(upload, *args)
        self.landed.append(upload.key)  # type: ignore[attr-defined]
        return result


def test_commit_markers_are_the_names_each_writer_commits_with() -> None:
    from cloudckpt.format.dcp.layout import METADATA_NAME
    from cloudckpt.format.safetensors import INDEX_SUFFIX
    from cloudckpt.megatron.layout import CONFIG_NAME

    assert COMMIT_MARKERS == (METADATA_NAME, INDEX_SUFFIX, CONFIG_NAME, MARKER_NAME)


def test_cp_r_disk_to_store_to_disk_markers_last(moto_server: S3Server, tmp_path: Path) -> None:
    bucket = moto_server.make_bucket(unique_bucket_name("cp-r"))
    files = _tree(tmp_path / "run")
    opts = resolve_options(
        part_size=5 * MiB, write_concurrency=2, storage_options=moto_server.storage_options()
    )
    src, src_key = open_url(str(tmp_path / "run"), opts.replace(storage_options={}))
    dst, dst_key = open_url(f"s3://{bucket}/copy/run", opts)
    recording = _Recording(dst)
    result = copy_tree(src, src_key, recording, dst_key, opts, state_dir=tmp_path / "state")
    assert _read_tree(dst, "copy/run/") == files
    assert len(result.copied) == len(files) and result.skipped == []
    assert result.moved_bytes == result.size == sum(map(len, files.values()))
    # Every data object was whole before any marker; the manager's marker came last.
    markers = [k for k in recording.landed if k.endswith((".metadata", MARKER_NAME))]
    assert (
        recording.landed[-2:]
        == markers
        == [
            "copy/run/step-000000001/dcp/.metadata",
            "copy/run/step-000000001/_CHECKPOINT.json",
        ]
    )

    # Store to store, then store to disk, through the command line.
    env = moto_server.env()
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        mp.setenv("CLOUDCKPT_STATE_DIR", str(tmp_path / "cli-state"))
        between = _call("cp", "-r", f"s3://{bucket}/copy/run", f"s3://{bucket}/again", "--json")
        assert between.returncode == 0, between.stderr
        summary = json.loads(between.stdout)
        assert (summary["copied"], summary["skipped"]) == (len(files), 0)
        assert summary["bytes"] == sum(map(len, files.values()))
        down = _call("cp", "-r", f"s3://{bucket}/again/", str(tmp_path / "down"))
        assert down.returncode == 0, down.stderr
    got = {
        p.relative_to(tmp_path / "down").as_posix(): p.read_bytes()
        for p in (tmp_path / "down").rglob("*")
        if p.is_file()
    }
    assert got == files


def test_cp_r_resumes_skipping_what_is_already_there(moto_server: S3Server, tmp_path: Path) -> None:
    bucket = moto_server.make_bucket(unique_bucket_name("cp-r-resume"))
    files = _tree(tmp_path / "run")
    opts = resolve_options(
        part_size=5 * MiB,
        write_concurrency=1,
        max_attempts=1,
        storage_options=moto_server.storage_options(),
    )
    src, src_key = open_url(str(tmp_path / "run"), opts.replace(storage_options={}))
    dst, dst_key = open_url(f"s3://{bucket}/run", opts)
    state = tmp_path / "state"
    faulty = FaultyStore(dst)
    # The small objects go first (one put each, several at once), then big.bin, whose
    # third part fails (its first two parts stay in the open upload); markers last.
    faulty.faults["upload_part"] = lambda n: StorageError("injected") if n == 3 else None
    with pytest.raises(StorageError, match="injected"):
        copy_tree(src, src_key, faulty, dst_key, opts, state_dir=state)
    small = ["notes/readme.txt", "step-000000001/dcp/__0_0.distcp"]
    assert [o.key for o in dst.list("run/")] == [f"run/{n}" for n in small]  # no marker

    plan = plan_tree(src, src_key, dst, dst_key)
    assert sorted(e.name for e in plan if e.skip) == small
    again = FaultyStore(dst)
    result = copy_tree(src, src_key, again, dst_key, opts, state_dir=state)
    assert sorted(e.name for e in result.skipped) == small
    assert again.calls["upload_part"] == 1  # big.bin's last part only
    assert result.resumed_bytes == 10 * MiB
    assert result.moved_bytes == result.size - 10 * MiB
    assert _read_tree(dst, "run/") == files
    # A third run finds everything there and moves nothing.
    third = FaultyStore(dst)
    done = copy_tree(src, src_key, third, dst_key, opts, state_dir=state)
    assert done.copied == [] and done.moved_bytes == 0
    assert "put" not in third.calls and "upload_part" not in third.calls


def test_cp_r_dry_run_lists_and_writes_nothing(tmp_path: Path) -> None:
    files = _tree(tmp_path / "run")
    (tmp_path / "out" / "notes").mkdir(parents=True)
    (tmp_path / "out" / "notes" / "readme.txt").write_bytes(b"hello")  # already there
    done = _call("cp", "-r", str(tmp_path / "run"), str(tmp_path / "out"), "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "would copy 4 object(s)" in done.stdout and "skipped 1" in done.stdout
    assert "step-000000001/big.bin" in done.stdout
    listing = _call("cp", "-r", str(tmp_path / "run"), str(tmp_path / "out"), "--dry-run", "--json")
    body = json.loads(listing.stdout)
    assert body["dry_run"] is True and (body["copied"], body["skipped"]) == (4, 1)
    assert body["objects"][-1] == {"name": "step-000000001/_CHECKPOINT.json", "size": 2,
                                   "action": "copy"}  # fmt: skip
    assert body["bytes"] == sum(len(v) for k, v in files.items() if k != "notes/readme.txt")
    assert sorted(p.name for p in (tmp_path / "out").rglob("*")) == ["notes", "readme.txt"]


def test_rm_dry_run_lists_marker_first_and_deletes_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    manager = CheckpointManager(str(run))
    manager.save(7, {"w": torch.ones(4)})
    step = run / "step-000000007"
    before = sorted(p.name for p in step.iterdir())
    done = _call("rm", "--dry-run", str(step), "--json")
    assert done.returncode == 0, done.stderr
    urls = [o["url"] for o in json.loads(done.stdout)["would_remove"]]
    assert urls[0].endswith(f"step-000000007/{MARKER_NAME}") and len(urls) == len(before)
    tree = _call("rm", "-r", "--dry-run", str(run))
    assert tree.returncode == 0, tree.stderr
    assert f"step-000000007/{MARKER_NAME} (" in tree.stdout.splitlines()[0]
    assert "dry run: nothing removed" in tree.stdout
    assert sorted(p.name for p in step.iterdir()) == before


def test_the_rate_counts_only_the_bytes_moved(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "a.bin").write_bytes(b"x")

    def resumed(*args: object, **kwargs: object) -> CopyResult:
        return CopyResult("src", "dst", size=100_000_000, seconds=1.0, resumed_bytes=90_000_000)

    monkeypatch.setattr(commands, "copy_object", resumed)
    done = _call("cp", str(tmp_path / "a.bin"), str(tmp_path / "b.bin"))
    assert done.returncode == 0, done.stderr
    assert "10.0 MB/s" in done.stdout, done.stdout

    def nothing_moved(*args: object, **kwargs: object) -> CopyResult:
        return CopyResult("src", "dst", size=100_000_000, seconds=1.0, resumed_bytes=100_000_000)

    monkeypatch.setattr(commands, "copy_object", nothing_moved)
    done = _call("cp", str(tmp_path / "a.bin"), str(tmp_path / "b.bin"))
    assert done.returncode == 0 and "MB/s" not in done.stdout, done.stdout


def test_cp_r_copies_small_objects_several_at_once(tmp_path: Path) -> None:
    """Small objects go several at a time: the first two puts meet at a barrier, which a
    copy of one object after another would never reach (BrokenBarrierError)."""
    import threading

    root = tmp_path / "src"
    files = {f"step-000000001/shard-{i}.bin": os.urandom(1000 + i) for i in range(6)}
    files["step-000000001/_CHECKPOINT.json"] = b"{}"
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    opts = resolve_options(write_concurrency=4)
    src, src_key = open_url(str(root), opts)
    dst, dst_key = open_url(str(tmp_path / "dst"), opts)
    meet = threading.Barrier(2, timeout=60)

    def first_two_meet(n: int) -> None:
        if n <= 2:
            meet.wait()

    faulty = FaultyStore(dst)
    faulty.faults["put"] = first_two_meet
    copy_tree(src, src_key, faulty, dst_key, opts)
    assert _read_tree(dst, dst_key.rstrip("/") + "/") == files
