"""cloudckpt.megatron's single-process surface: the backend record, missing or foreign
checkpoints, and the errors a user gets before any rank does collective work."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from cloudckpt import megatron as cm
from cloudckpt.errors import (
    CloudCkptError,
    CorruptCheckpointError,
    NotFoundError,
    UnsupportedFormatError,
)
from cloudckpt.megatron import mcore
from cloudckpt.megatron.layout import BackendRecord, decode_config, encode_config

pytestmark = pytest.mark.filterwarnings("ignore")


def test_the_backend_record_is_megatrons_json() -> None:
    assert json.loads(encode_config()) == {
        "sharded_backend": "torch_dist",
        "sharded_backend_version": 1,
        "common_backend": "torch",
        "common_backend_version": 1,
    }
    assert decode_config(encode_config(), "u") == BackendRecord()


@pytest.mark.parametrize(
    ("payload", "error", "match"),
    [
        (b"{", CorruptCheckpointError, "not valid JSON"),
        (b"[1]", CorruptCheckpointError, "not a JSON object"),
        (b'{"sharded_backend_version": 1}', CorruptCheckpointError, "sharded_backend"),
        (
            b'{"sharded_backend": "zarr", "sharded_backend_version": 1}',
            UnsupportedFormatError,
            "'zarr'",
        ),
    ],
)
def test_a_bad_or_foreign_backend_record_is_named(
    payload: bytes, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        decode_config(payload, "s3://b/ckpt/metadata.json")


def test_a_prefix_without_metadata_json_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(b"half a save")
    assert not cm.is_checkpoint(tmp_path)
    with pytest.raises(NotFoundError, match=r"no committed Megatron checkpoint .*metadata\.json"):
        cm.load({}, str(tmp_path))
    with pytest.raises(NotFoundError, match="no committed Megatron checkpoint"):
        cm.load_common_state_dict(str(tmp_path))


def test_a_zarr_checkpoint_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "metadata.json").write_text(
        json.dumps({"sharded_backend": "zarr", "sharded_backend_version": 1})
    )
    with pytest.raises(UnsupportedFormatError, match=r"'zarr'.*torch_dist"):
        cm.load({}, str(tmp_path))


def test_save_without_a_process_group_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(CloudCkptError, match="init_process_group"):
        cm.save({}, str(tmp_path / "ckpt"))


def test_without_megatron_core_the_error_names_the_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(mcore, "_names", None)
    for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "megatron", None)
    with pytest.raises(ImportError, match=r"megatron-core >= 0\.15"):
        cm.load({}, "memory://bucket/ckpt")
