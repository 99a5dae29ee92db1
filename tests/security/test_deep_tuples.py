"""Tuples nested deeper than the interpreter can hash (found while measuring a C
unpickler for DCP's ``.metadata``): a pickle of ``{((((...),),),): None}`` nested a
million deep is about 1 MB, and ``pickle.loads``, torch's weights-only unpickler and the
boundary before this fix all crash on it (CPython's tuple hash recurses with no depth
check; SIGSEGV past about 150,000 levels on an 8 MiB stack). Each load runs in a forked
child, where a crash fails the test instead of the session.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import craft
from test_memory_safety_repro import _outcome, in_child

import cloudckpt
from cloudckpt.format.dcp.metadata import decode_metadata
from cloudckpt.format.torch.restricted_pickle import MAX_TUPLE_DEPTH

#: Deep enough to crash any unbounded hash on an 8 MiB stack, by a wide margin.
CRASH_DEPTH = 1_000_000


def nested_key_pickle(depth: int, *, opcode: bytes = b"\x85") -> bytes:
    """A protocol-2 pickle of ``{key: None}``, ``key`` an empty tuple wrapped ``depth``
    times by ``opcode`` (TUPLE1; TUPLE2 and TUPLE3 pair it with ints)."""
    extra = {b"\x85": b"", b"\x86": b"K\x01", b"\x87": b"K\x01K\x02"}[opcode]
    return b"\x80\x02}" + b")" + (extra + opcode) * depth + b"Ns."


def _decode(payload: bytes) -> dict[str, Any]:
    return _outcome(lambda: decode_metadata(payload, "s3://b/run/.metadata"))


def _load_file(path: str) -> dict[str, Any]:
    return _outcome(lambda: cloudckpt.load(path))


@pytest.mark.parametrize("opcode", [b"\x85", b"\x86", b"\x87"], ids=["TUPLE1", "TUPLE2", "TUPLE3"])
def test_metadata_with_a_key_nested_a_million_deep_is_refused(opcode):
    seen = in_child(_decode, nested_key_pickle(CRASH_DEPTH, opcode=opcode))
    assert seen.get("refused") == "UnsafeCheckpointError", seen
    assert f"nested more than {MAX_TUPLE_DEPTH} deep" in seen["message"]


def test_mark_tuples_nested_a_million_deep_are_refused():
    # TUPLE (MARK, items, TUPLE): protocol 0's way, outside the .metadata policy but in
    # torch's opcodes, so through a checkpoint's data.pkl
    payload = b"\x80\x02}" + b"(" * CRASH_DEPTH + b")" + b"t" * CRASH_DEPTH + b"Ns."
    seen = in_child(_decode_torch_pickle, payload)
    assert seen.get("refused") == "UnsafeCheckpointError", seen


def _decode_torch_pickle(pkl: bytes) -> dict[str, Any]:
    from cloudckpt.format.torch.unpickle import load_torch_bytes

    return _outcome(lambda: load_torch_bytes(craft.torch_archive(pkl)))


def test_a_checkpoint_whose_key_nests_a_million_deep_is_refused(tmp_path):
    path = tmp_path / "deep.pt"
    path.write_bytes(craft.torch_archive(nested_key_pickle(CRASH_DEPTH)))
    seen = in_child(_load_file, str(path))
    assert seen.get("refused") == "UnsafeCheckpointError", seen
    assert seen["typed"]


def _depth(key: tuple[Any, ...]) -> int:
    """How deep ``key`` nests (``((),)`` is 2), without recursing."""
    depth = 1
    while key:
        (key,) = key
        depth += 1
    return depth


def test_tuples_nested_up_to_the_bound_load_as_torch_loads_them(tmp_path):
    path = tmp_path / "ok.pt"
    key: tuple[Any, ...] = ()
    for _ in range(200):
        key = (key,)
    torch.save({"w": torch.arange(4.0), "deep": {key: 1}}, path)  # torch's own writer
    ours, theirs = cloudckpt.load(str(path)), torch.load(path, weights_only=True)
    assert list(ours["deep"]) == list(theirs["deep"]) == [key]
    assert torch.equal(ours["w"], theirs["w"])
    # at the bound (the pickler itself cannot write one this deep: built by hand)
    path.write_bytes(craft.torch_archive(nested_key_pickle(MAX_TUPLE_DEPTH - 1)))
    ours, theirs = cloudckpt.load(str(path)), torch.load(path, weights_only=True)
    (mine,), (torchs,) = ours, theirs
    assert _depth(mine) == _depth(torchs) == MAX_TUPLE_DEPTH and hash(mine) == hash(torchs)
    # one level more is refused
    path.write_bytes(craft.torch_archive(nested_key_pickle(MAX_TUPLE_DEPTH)))
    with pytest.raises(cloudckpt.errors.UnsafeCheckpointError, match="nested more than"):
        cloudckpt.load(str(path))
