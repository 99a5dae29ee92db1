"""No write through a link at any depth; JSON from a store read with a size cap (issue 39,
item 6).

Links: whoever can write inside a destination directory can plant a symbolic link there
(``./dest/step-1 -> /elsewhere``). Every path that writes local files from stored bytes
(``cp -r``, the filesystem store itself, a local tier's saves, restores and drains,
``fetch_latest``, NeMo's context download) refuses it with UnsafePathError naming the
path and the link, and nothing appears outside. The directory the caller names may
itself be a link: only what lies inside it is checked.

Caps: a commit marker, a tier's run file, a layout or safetensors index larger than its
cap is refused as CorruptCheckpointError naming its URL and the cap, from its size
alone: not one of its bytes is read. The oversized files are sparse (no disk used).

Files and links are built here; the stores are real (the filesystem, and moto for
``cp -r s3://...``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from cloudckpt.cli import main
from cloudckpt.engine.copy import DestinationIsSymlinkError, copy_tree
from cloudckpt.engine.drain import RUN_FILE, read_owner
from cloudckpt.errors import CorruptCheckpointError, StorageError, UnsafePathError
from cloudckpt.format.commit import commit_marker, read_committed
from cloudckpt.manager import MARKER_NAME, CheckpointManager
from cloudckpt.manager.marker import commit_step, list_checkpoints, read_marker, step_dir
from cloudckpt.options import MiB, resolve_options
from cloudckpt.store import Store, open_url
from cloudckpt.store.local import LocalStore
from cloudckpt.store.paths import MAX_INDEX_BYTES, MAX_RECORD_BYTES
from servers import S3Server, unique_bucket_name

STEP = step_dir(1)
#: Over the small-object limit of ``cp -r`` (8 MiB): copied by the resumable download.
LARGE = 9 * MiB


def _cli(*args: str) -> tuple[int, str]:
    """``cloudckpt ARGS`` in this process: the exit code and what it wrote to stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, err.getvalue()


def _write(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def _run(size: int) -> dict[str, bytes]:
    """A run's step: a data file of ``size`` bytes one level down, a marker beside it."""
    return {
        f"{STEP}/dcp/__0_0.distcp": os.urandom(size),
        f"{STEP}/dcp/.metadata": b"dcp metadata",
        f"{STEP}/{MARKER_NAME}": b"{}",
    }


def _files_under(path: Path) -> list[str]:
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*"))


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """The directory a planted link points at: nothing may ever be written there."""
    path = tmp_path / "elsewhere"
    path.mkdir()
    (path / "victim.bin").write_bytes(b"precious")
    return path


def _untouched(outside: Path) -> None:
    assert _files_under(outside) == ["victim.bin"]
    assert (outside / "victim.bin").read_bytes() == b"precious"


# -- cp -r -----------------------------------------------------------------------------------


SIZES = pytest.mark.parametrize("size", [1000, LARGE], ids=["small", "large"])


@SIZES
def test_cp_r_refuses_a_linked_subdirectory(tmp_path: Path, outside: Path, size: int) -> None:
    _write(tmp_path / "src", _run(size))
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / STEP).symlink_to(outside, target_is_directory=True)

    code, err = _cli("cp", "-r", str(tmp_path / "src"), str(dest))
    assert code == 2, err  # a usage error: nothing to resume
    assert "symbolic link" in err and str(dest / STEP) in err and str(outside) in err
    _untouched(outside)

    src, src_key = open_url(str(tmp_path / "src"), resolve_options())
    dst, dst_key = open_url(str(dest), resolve_options())
    with pytest.raises(UnsafePathError) as info:
        copy_tree(src, src_key, dst, dst_key, resolve_options())
    assert (info.value.path, info.value.link) == (str(dest / STEP), str(outside))
    _untouched(outside)
    assert (dest / STEP).is_symlink()


def test_cp_r_from_s3_refuses_a_linked_subdirectory(
    moto_server: S3Server, tmp_path: Path, outside: Path
) -> None:
    """The report's case: ``cloudckpt cp -r s3://b/ckpt/ ./dest/`` with ``dest/step-1``
    linking elsewhere."""
    bucket = moto_server.make_bucket(unique_bucket_name("links"))
    opts = resolve_options(storage_options=moto_server.storage_options())
    store, _ = open_url(f"s3://{bucket}/ckpt", opts)
    for name, data in _run(LARGE).items():
        store.put(f"ckpt/{name}", data)
    store.put("ckpt/notes.txt", b"hello")
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / STEP).symlink_to(outside, target_is_directory=True)

    with pytest.MonkeyPatch.context() as mp:
        for k, v in moto_server.env().items():
            mp.setenv(k, v)
        mp.setenv("CLOUDCKPT_STATE_DIR", str(tmp_path / "state"))
        code, err = _cli("cp", "-r", f"s3://{bucket}/ckpt/", f"{dest}/")
    assert code == 2, err
    assert str(dest / STEP) in err
    _untouched(outside)


@SIZES
def test_cp_r_refuses_a_linked_file_where_one_is_written(
    tmp_path: Path, outside: Path, size: int
) -> None:
    files = _run(size)
    _write(tmp_path / "src", files)
    dest = tmp_path / "dest"
    (dest / STEP / "dcp").mkdir(parents=True)
    link = dest / STEP / "dcp" / "__0_0.distcp"
    link.symlink_to(outside / "victim.bin")

    code, err = _cli("cp", "-r", str(tmp_path / "src"), str(dest))
    assert code == 2, err
    assert str(link) in err
    _untouched(outside)
    assert link.is_symlink()

    src, src_key = open_url(str(tmp_path / "src"), resolve_options())
    dst, dst_key = open_url(str(dest), resolve_options())
    with pytest.raises(DestinationIsSymlinkError):  # an UnsafePathError
        copy_tree(src, src_key, dst, dst_key, resolve_options())
    _untouched(outside)


@SIZES
def test_cp_r_refuses_a_link_two_levels_deep(tmp_path: Path, outside: Path, size: int) -> None:
    _write(tmp_path / "src", _run(size))
    dest = tmp_path / "dest"
    (dest / STEP).mkdir(parents=True)
    (dest / STEP / "dcp").symlink_to(outside, target_is_directory=True)

    code, err = _cli("cp", "-r", str(tmp_path / "src"), str(dest))
    assert code == 2, err
    assert str(dest / STEP / "dcp") in err
    _untouched(outside)


@SIZES
def test_cp_r_follows_the_destination_it_is_given(tmp_path: Path, size: int) -> None:
    """The root rule: the directory named may be a link; the copy lands in its target."""
    files = _run(size)
    _write(tmp_path / "src", files)
    real = tmp_path / "real"
    real.mkdir()
    named = tmp_path / "named"
    named.symlink_to(real, target_is_directory=True)

    code, err = _cli("cp", "-r", str(tmp_path / "src"), str(named))
    assert code == 0, err
    assert {n: (real / n).read_bytes() for n in files} == files


# -- the filesystem store ------------------------------------------------------------------


@pytest.mark.parametrize("dangling", [False, True], ids=["to-a-directory", "dangling"])
def test_the_local_store_writes_nothing_through_a_link_under_its_root(
    tmp_path: Path, outside: Path, dangling: bool
) -> None:
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (root / "a" / "b").symlink_to(tmp_path / "nowhere" if dangling else outside)
    store = LocalStore(root)

    with pytest.raises(UnsafePathError, match="symbolic link") as info:
        store.put("a/b/new.bin", b"data")
    assert info.value.path == str(root / "a" / "b")
    with pytest.raises(UnsafePathError):
        store.put("a/b/c/d/new.bin", b"data", if_none_match=True)
    with pytest.raises(UnsafePathError):
        store.create_multipart("a/b/new.bin")
    with pytest.raises(UnsafePathError):
        store.delete("a/b/victim.bin")
    with pytest.raises(UnsafePathError):
        store.make_dirs("a/b/c/")
    _untouched(outside)
    assert not (tmp_path / "nowhere").exists()


def test_the_local_store_follows_its_root_and_replaces_a_linked_object(
    tmp_path: Path, outside: Path
) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "root").symlink_to(real, target_is_directory=True)
    store = LocalStore(tmp_path / "root")  # the root itself: followed
    store.put("step/x.bin", b"x")
    assert (real / "step" / "x.bin").read_bytes() == b"x"

    (real / "step" / "y.bin").symlink_to(outside / "victim.bin")
    store.put("step/y.bin", b"new")  # the rename replaces the link, never writes through
    assert not (real / "step" / "y.bin").is_symlink()
    assert (real / "step" / "y.bin").read_bytes() == b"new"
    upload = store.create_multipart("step/z.bin")
    (real / "step" / "z.bin").symlink_to(outside / "victim.bin")
    part = store.upload_part(upload, 1, b"zz", 0)
    store.complete_multipart(upload, [part])
    assert (real / "step" / "z.bin").read_bytes() == b"zz"
    _untouched(outside)


# -- local tiers ---------------------------------------------------------------------------


def _state() -> dict[str, Any]:
    return {"w": torch.arange(16, dtype=torch.float32)}


def test_a_tier_save_is_refused_through_a_linked_step(tmp_path: Path, outside: Path) -> None:
    tier = tmp_path / "tier"
    m = CheckpointManager(str(tmp_path / "bucket" / "run"), local_dir=tier)
    (tier / STEP).symlink_to(outside, target_is_directory=True)
    with pytest.raises(UnsafePathError) as info:
        m.save(1, _state())
    assert info.value.path == str(tier.resolve() / STEP)
    _untouched(outside)
    assert not (tmp_path / "bucket" / "run" / STEP).exists()


def test_a_tier_restore_writes_nothing_through_a_link(tmp_path: Path, outside: Path) -> None:
    """A step coming back into the tier (from a peer's copy, manager/peers.py) arrives
    through the tier's store: a linked ``step-N`` is refused, for a put and an upload."""
    tier = tmp_path / "tier"
    m = CheckpointManager(str(tmp_path / "bucket" / "run"), local_dir=tier)
    assert m._tier is not None
    store = m._tier.store
    (tier / step_dir(2)).symlink_to(outside, target_is_directory=True)
    with pytest.raises(UnsafePathError):
        store.create_multipart(f"{step_dir(2)}/state.pt")
    with pytest.raises(UnsafePathError):
        store.put(f"{step_dir(2)}/{MARKER_NAME}", b"{}")
    _untouched(outside)


def test_a_drain_writes_nothing_through_a_link_in_the_bucket_directory(
    tmp_path: Path, outside: Path
) -> None:
    """A drain to a filesystem run root: the run root is the user's, ``step-N`` below it
    linking elsewhere is refused, and the bucket stays uncommitted."""
    tier, bucket = tmp_path / "tier", tmp_path / "bucket" / "run"
    m = CheckpointManager(str(bucket), local_dir=tier)
    bucket.mkdir(parents=True, exist_ok=True)
    (bucket / STEP).symlink_to(outside, target_is_directory=True)
    m.save(1, _state())  # committed locally; the drain runs in the background
    with pytest.raises(StorageError, match="drain of step 1") as info:
        m.drain()
    # The drainer names the step and keeps the refusal as it came.
    assert "UnsafePathError" in str(info.value) and str(bucket / STEP) in str(info.value)
    assert m.list()[0].tiers == ("local",)  # not committed in the bucket
    _untouched(outside)


# -- fetch_latest ----------------------------------------------------------------------------


@pytest.fixture
def committed_run(tmp_path: Path) -> str:
    """A run at a filesystem URL with step 1 committed: a file at the top and one below."""
    run = tmp_path / "bucket" / "run"
    _write(run / STEP, {"model.txt": b"m" * 100, "sub/optim.txt": b"o" * 10})
    store, key = open_url(str(run), resolve_options())
    commit_step(store, f"{key}/{STEP}/", 1, "object", {}, {})
    return str(run)


def _fetch(url: str, local: Path) -> str | None:
    from cloudckpt.hf import fetch_latest

    return fetch_latest(url, local)


@pytest.mark.parametrize(
    "planted",
    [".checkpoint-1.cloudckpt-fetch", ".checkpoint-1.cloudckpt-fetch/sub", "checkpoint-1"],
    ids=["hidden-folder", "two-levels", "target"],
)
def test_fetch_latest_refuses_a_link_in_local_dir(
    committed_run: str, tmp_path: Path, outside: Path, planted: str
) -> None:
    local = tmp_path / "local"
    (local / planted).parent.mkdir(parents=True)
    (local / planted).symlink_to(outside, target_is_directory=True)
    with pytest.raises(UnsafePathError) as info:
        _fetch(committed_run, local)
    assert info.value.path.endswith(planted) and info.value.link == str(outside)
    _untouched(outside)


def test_fetch_latest_follows_the_local_dir_it_is_given(committed_run: str, tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "local").symlink_to(real, target_is_directory=True)
    got = _fetch(committed_run, tmp_path / "local")
    assert got is not None
    assert (real / "checkpoint-1" / "sub" / "optim.txt").read_bytes() == b"o" * 10


# -- NeMo's context download ---------------------------------------------------------------


def test_nemo_context_download_writes_nothing_through_a_link(tmp_path: Path, outside: Path) -> None:
    from cloudckpt.nemo.paths import download_tree

    _write(tmp_path / "ctx", {"io.json": b"{}", "model/config.yaml": b"a: 1"})
    local = tmp_path / "local"
    local.mkdir()
    (local / "model").symlink_to(outside, target_is_directory=True)
    with pytest.raises(UnsafePathError):
        download_tree(str(tmp_path / "ctx"), local)
    _untouched(outside)


# -- size caps -------------------------------------------------------------------------------


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, int]]]:
    """Every read a store makes (its key and the bytes asked for), on every store."""
    seen: list[tuple[str, int]] = []
    real_get, real_range, real_into = Store.get, Store.get_range, Store.read_into

    def get(self: Store, key: str) -> bytes:
        data = real_get(self, key)
        seen.append((key, len(data)))
        return data

    def get_range(self: Store, key: str, start: int, end: int) -> bytes:
        seen.append((key, end - start))
        return real_range(self, key, start, end)

    def read_into(self: Store, key: str, start: int, buffers: Any) -> None:
        seen.append((key, sum(memoryview(b).nbytes for b in buffers)))
        real_into(self, key, start, buffers)

    monkeypatch.setattr(Store, "get", get)
    monkeypatch.setattr(Store, "get_range", get_range)
    monkeypatch.setattr(Store, "read_into", read_into)
    yield seen


def _sparse(path: Path, size: int, head: bytes = b"{") -> None:
    """A file of ``size`` bytes that takes no disk: ``head``, then a hole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)


def _no_bytes_of(key: str, reads: list[tuple[str, int]]) -> None:
    assert [n for k, n in reads if k.endswith(key)] == []


def test_an_oversized_manager_marker_is_refused_unread(
    tmp_path: Path, reads: list[tuple[str, int]]
) -> None:
    _sparse(tmp_path / STEP / MARKER_NAME, MAX_RECORD_BYTES + 1)
    store = LocalStore(tmp_path)
    with pytest.raises(CorruptCheckpointError) as info:
        read_marker(store, f"{STEP}/{MARKER_NAME}")
    assert store.url(f"{STEP}/{MARKER_NAME}") in str(info.value)
    assert str(MAX_RECORD_BYTES) in str(info.value)
    # A listing skips it: it proves no commit, and is not read either.
    assert list_checkpoints(store, "", resolve_options()) == []
    _no_bytes_of(MARKER_NAME, reads)


def test_an_oversized_tier_run_file_is_refused_unread(
    tmp_path: Path, reads: list[tuple[str, int]]
) -> None:
    _sparse(tmp_path / "tier" / RUN_FILE, MAX_RECORD_BYTES + 1)
    with pytest.raises(CorruptCheckpointError, match=str(MAX_RECORD_BYTES)):
        read_owner(LocalStore(tmp_path / "tier"))
    with pytest.raises(CorruptCheckpointError):  # a manager never adopts the directory
        CheckpointManager(str(tmp_path / "bucket"), local_dir=tmp_path / "tier")
    _no_bytes_of(RUN_FILE, reads)


def test_an_oversized_megatron_metadata_json_is_refused_unread(
    tmp_path: Path, reads: list[tuple[str, int]]
) -> None:
    _sparse(tmp_path / "ck" / "metadata.json", MAX_RECORD_BYTES + 1)
    with pytest.raises(CorruptCheckpointError, match=str(MAX_RECORD_BYTES)):
        read_committed(LocalStore(tmp_path), "ck/metadata.json")  # megatron/load.py's read
    _no_bytes_of("metadata.json", reads)


def test_a_marker_read_back_is_capped_at_its_own_size(
    tmp_path: Path, reads: list[tuple[str, int]]
) -> None:
    """A create-only commit that lost the race reads back at most its own bytes."""
    _sparse(tmp_path / "ck" / ".metadata", 5 * MiB)
    with pytest.raises(Exception, match="another save committed"):
        commit_marker(LocalStore(tmp_path), "ck/.metadata", b"marker of this save")
    _no_bytes_of(".metadata", reads)


def test_an_oversized_dcp_layout_index_is_refused_unread(
    tmp_path: Path, reads: list[tuple[str, int]]
) -> None:
    from cloudckpt.dcp.commit_read import layout_document
    from cloudckpt.dcp.location import CheckpointLocation
    from cloudckpt.format.dcp.layout import layout_name

    _sparse(tmp_path / "ck" / layout_name(None), MAX_INDEX_BYTES + 1)
    location = CheckpointLocation.resolve(str(tmp_path / "ck"))
    with pytest.raises(CorruptCheckpointError, match=str(MAX_INDEX_BYTES)):
        layout_document(location, None)
    _no_bytes_of(layout_name(None), reads)


def test_an_oversized_safetensors_index_is_refused_unread(
    tmp_path: Path, reads: list[tuple[str, int]]
) -> None:
    from cloudckpt.format.safetensors import MAX_HEADER_SIZE, read_index

    name = "ck/model.safetensors.index.json"
    _sparse(tmp_path / name, MAX_HEADER_SIZE + 1)
    with pytest.raises(CorruptCheckpointError, match=str(MAX_HEADER_SIZE)):
        read_index(LocalStore(tmp_path), name)
    _no_bytes_of("index.json", reads)


def test_documents_under_the_cap_still_read(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    body = json.dumps({"format": "cloudckpt.tier/1", "root_url": "s3://b/run"}).encode()
    store.put(RUN_FILE, body)
    assert read_owner(store) == "s3://b/run"
    assert read_committed(store, "absent.json") is None
