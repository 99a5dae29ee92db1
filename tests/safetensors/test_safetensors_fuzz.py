"""Fuzzed safetensors files, judged against the library: cloudckpt either loads exactly
what ``safetensors`` loads or raises CorruptCheckpointError / UnsupportedFormatError,
never another exception, and it reads every file the library reads (but those with a
duplicate key, which it refuses on purpose)."""

from __future__ import annotations

import json
import struct

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

import cloudckpt
from cloudckpt.errors import CorruptCheckpointError, UnsupportedFormatError
from cloudckpt.store import open_target

URL = "memory://st-fuzz/f.safetensors"
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = ["U8", "I16", "F32", "BF16", "F64", "BOOL", "F4", "F8_E4M3", "F6_E3M2", "X9", ""]


def _put(data: bytes) -> None:
    where = open_target(URL)
    where.store.put(where.key, data)


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _has_duplicates(data: bytes) -> bool:
    """Whether the header parses as JSON with a key repeated in some object."""
    found = []

    def hook(pairs):
        keys = [k for k, _ in pairs]
        found.append(len(keys) != len(set(keys)))
        return dict(pairs)

    try:
        n = int.from_bytes(data[:8], "little")
        json.loads(data[8 : 8 + n].decode(), object_pairs_hook=hook)
    except Exception:
        return False
    return any(found)


def judge(data: bytes) -> None:
    """cloudckpt's answer for ``data`` agrees with the library's."""
    _put(data)
    try:
        ours = cloudckpt.load(URL)
    except (CorruptCheckpointError, UnsupportedFormatError):
        ours = None
    try:
        theirs = st_load(data)
    except KeyError:  # a dtype the library writes but cannot read (F4...): no verdict
        return
    except Exception:
        theirs = None
    if ours is not None:
        assert theirs is not None, "cloudckpt read a file the library refuses"
        assert sorted(ours) == sorted(theirs)
        for k, v in theirs.items():
            assert ours[k].dtype == v.dtype and ours[k].shape == v.shape, k
            assert _bits(ours[k]) == _bits(v), k
    elif theirs is not None:
        assert _has_duplicates(data), "cloudckpt refused a file the library reads"


entry = st.tuples(
    st.sampled_from(["a", "b", "c", "é", "__metadata__"]),
    st.sampled_from(DTYPES),
    st.lists(st.integers(-1, 6), max_size=3),
    st.tuples(st.integers(-1, 48), st.integers(-1, 48)),
)


@SETTINGS
@given(
    entries=st.lists(entry, max_size=4),
    data_len=st.integers(0, 48),
    pad=st.sampled_from(["", " ", "   ", "\n", "\t", "x", "\x00"]),
)
@example(entries=[("a", "U8", [1], (0, 1)), ("a", "U8", [1], (1, 2))], data_len=2, pad="")
@example(entries=[("a", "F32", [2], (0, 8)), ("b", "U8", [0], (8, 8))], data_len=8, pad="  ")
def test_generated_headers_agree_with_the_library(entries, data_len, pad):
    parts = []
    for name, dtype, shape, (begin, end) in entries:
        info = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
        parts.append(f"{json.dumps(name)}:{json.dumps(info)}")
    header = ("{" + ",".join(parts) + "}" + pad).encode()
    judge(struct.pack("<Q", len(header)) + header + bytes(range(data_len)))


def _valid() -> bytes:
    g = torch.Generator().manual_seed(5)
    state = {
        "w": torch.randn(4, 5, generator=g),
        "h": torch.randn(7, generator=g).half(),
        "i": torch.arange(6, dtype=torch.int64),
        "m": torch.tensor([True, False, True]),
    }
    return st_save(state, metadata={"format": "pt", "note": "fuzz"})


VALID = _valid()
HEADER_END = 8 + int.from_bytes(VALID[:8], "little")
mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, HEADER_END - 1), st.integers(0, 7)),
    st.tuples(st.just("set"), st.integers(0, HEADER_END - 1), st.integers(0, 255)),
    st.tuples(st.just("truncate"), st.integers(0, len(VALID) - 1), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, len(VALID)), st.integers(1, 16)),
    st.tuples(st.just("length"), st.integers(0, 2**64 - 1), st.just(0)),
)


@SETTINGS
@given(ops=st.lists(mutation, min_size=1, max_size=3))
@example(ops=[("length", 2**63, 0)])
@example(ops=[("truncate", HEADER_END + 3, 0)])
def test_mutated_files_agree_with_the_library(ops):
    buf = bytearray(VALID)
    for op, pos, arg in ops:
        pos = min(pos, max(len(buf) - 1, 0)) if op != "length" else pos
        if op == "flip" and buf:
            buf[pos] ^= 1 << arg
        elif op == "set" and buf:
            buf[pos] = arg
        elif op == "truncate":
            del buf[pos:]
        elif op == "insert":
            buf[pos:pos] = b"\xff" * arg
        elif op == "length" and len(buf) >= 8:
            buf[:8] = struct.pack("<Q", pos)
    judge(bytes(buf))


def test_every_truncation_is_corrupt():
    for end in range(len(VALID)):
        _put(VALID[:end])
        try:
            cloudckpt.load(URL)
        except CorruptCheckpointError:
            continue
        raise AssertionError(f"a file cut at byte {end} loaded")
