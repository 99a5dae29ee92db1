"""Manifests from storage are data, never code or paths out of the checkpoint."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

import cloudckpt
from cloudckpt import errors
from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter
from dcp_compat import SINGLE


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch pwned-by-metadata",))


def test_dcp_metadata_cannot_run_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = str(tmp_path / "ckpt")
    dcp.save({"w": torch.ones(3)}, storage_writer=CloudStorageWriter(url), **SINGLE)
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    with pytest.raises(errors.UnsafeCheckpointError, match="refusing to load it"):
        CloudStorageReader(url).read_metadata()
    # DCP reports a rank's failure as a CheckpointException (a BaseException) holding it.
    with pytest.raises(BaseException, match="refusing to load it"):
        dcp.load({"w": torch.zeros(3)}, storage_reader=CloudStorageReader(url), **SINGLE)
    assert not (tmp_path / "pwned-by-metadata").exists()


def _save_with_escaping_paths(tmp_path) -> str:
    """A DCP checkpoint whose .metadata points every item at ``../outside.distcp``."""
    url = str(tmp_path / "ckpt")
    dcp.save({"w": torch.ones(3)}, storage_writer=CloudStorageWriter(url), **SINGLE)
    meta_path = tmp_path / "ckpt" / ".metadata"
    metadata = pickle.loads(meta_path.read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../outside.distcp"
    meta_path.write_bytes(pickle.dumps(metadata))
    return url


def test_dcp_metadata_paths_cannot_leave_the_checkpoint(tmp_path):
    url = _save_with_escaping_paths(tmp_path)
    # The layout index would refuse the rewritten .metadata by its CRC-32 first; without
    # it (a FileSystemWriter checkpoint, or one crafted whole) the path check refuses it.
    (tmp_path / "ckpt" / ".cloudckpt-layout.json").unlink()
    (tmp_path / "outside.distcp").write_bytes(b"x" * 4096)
    with pytest.raises(BaseException, match="unsafe object key"):
        dcp.load({"w": torch.zeros(3)}, storage_reader=CloudStorageReader(url), **SINGLE)


def test_a_tampered_dcp_metadata_fails_the_layout_crc(tmp_path):
    url = _save_with_escaping_paths(tmp_path)
    with pytest.raises(errors.ChecksumError, match=r"\.metadata fails the CRC-32 check"):
        CloudStorageReader(url).read_metadata()


@pytest.mark.parametrize("opcode", [b"r\xff\xff\xff\x7f", b"p4000000000\n", b"q\xff"])
def test_dcp_metadata_memo_indexes_cannot_allocate_without_bound(tmp_path, opcode):
    """One flipped bit makes an opcode LONG_BINPUT; the C unpickler would zero-fill a
    memo of twice its index (32 GiB here). The boundary's memo is a dict: one entry,
    and the payload is refused as what it is (not Metadata, or an opcode outside the
    policy), with a typed error and no allocation."""
    from cloudckpt.format.dcp.metadata import decode_metadata

    refused = (errors.CorruptCheckpointError, errors.UnsafeCheckpointError)
    payload = b"\x80\x04N" + opcode + b"."
    with pytest.raises(refused):
        decode_metadata(payload, "mem://.metadata")
    url = str(tmp_path / "ckpt")
    dcp.save({"w": torch.ones(3)}, storage_writer=CloudStorageWriter(url), **SINGLE)
    (tmp_path / "ckpt" / ".metadata").write_bytes(payload)
    with pytest.raises(refused):
        CloudStorageReader(url).read_metadata()


@pytest.mark.parametrize("name", ["../other/state.pt", "/etc/passwd", "a//b", "x/../../y"])
def test_manager_markers_with_escaping_file_names_are_refused(tmp_path, name):
    manager = cloudckpt.CheckpointManager(tmp_path / "run")
    manager.save(1, {"w": torch.ones(2)})
    marker = next((tmp_path / "run").rglob("_CHECKPOINT.json"))
    body = json.loads(marker.read_text())
    body["files"][0]["name"] = name
    marker.write_text(json.dumps(body))
    from cloudckpt.manager.marker import decode_marker

    with pytest.raises(errors.CorruptCheckpointError, match="unsafe object key"):
        decode_marker(marker.read_bytes(), marker.as_uri())
