"""The commit marker's encoding and step naming."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from cloudckpt.errors import CorruptCheckpointError
from cloudckpt.manager.marker import (
    CheckpointInfo,
    FileEntry,
    decode_marker,
    encode_marker,
    parse_step,
    step_dir,
)


def test_roundtrip_keeps_non_finite_metrics_as_portable_json() -> None:
    info = CheckpointInfo(
        step=7,
        url="s3://b/run/step-000000007/",
        time=123.5,
        size=10,
        kind="object",
        files=(FileEntry("state.pt", 10, '"abc"'),),
        metrics={"loss": math.nan, "grad": math.inf, "acc": 0.25},
        metadata={"epoch": 3},
        library_version="0.1.0",
    )
    data = encode_marker(info)
    json.loads(data, parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))
    back = decode_marker(data, "s3://b/run/step-000000007/_CHECKPOINT.json")
    assert back.url == info.url
    assert back.files == info.files and back.metadata == {"epoch": 3}
    assert math.isnan(back.metrics["loss"]) and back.metrics["grad"] == math.inf
    assert back.metrics["acc"] == 0.25 and back.step == 7 and back.size == 10


def test_ranks_are_written_only_where_recorded() -> None:
    plain = CheckpointInfo(step=1, url="s3://b/r/step-000000001/", time=1.0, size=1, kind="dcp")
    assert "ranks" not in json.loads(encode_marker(plain))  # as markers before the field
    ranked = dataclasses.replace(plain, ranks=4)
    back = decode_marker(encode_marker(ranked), "s3://b/r/step-000000001/_CHECKPOINT.json")
    assert back.ranks == 4
    assert decode_marker(encode_marker(plain), "s3://b/m.json").ranks == 0
    bad = json.loads(encode_marker(ranked))
    bad["ranks"] = -1
    with pytest.raises(CorruptCheckpointError, match="ranks"):
        decode_marker(json.dumps(bad).encode(), "s3://b/m.json")


@pytest.mark.parametrize(
    "data",
    [b"", b"{", b"[]", b'{"format": "other"}', b'{"format": "cloudckpt.checkpoint/1", "step": 1}'],
)
def test_malformed_marker_is_corrupt(data: bytes) -> None:
    with pytest.raises(CorruptCheckpointError, match=r"s3://b/m\.json"):
        decode_marker(data, "s3://b/m.json")


def test_step_names_sort_and_parse() -> None:
    assert step_dir(123) == "step-000000123"
    assert sorted([step_dir(10), step_dir(9)]) == [step_dir(9), step_dir(10)]
    assert parse_step("step-000000123") == 123
    assert parse_step("step-12345678901") == 12345678901
    assert parse_step("step-x") is None and parse_step("steps-1") is None
