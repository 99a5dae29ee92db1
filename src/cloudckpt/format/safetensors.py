"""The safetensors format: the dtype table, the header (parse, validate, encode), sharding.

A file is ``N`` (8 bytes, little-endian u64), ``N`` bytes of UTF-8 JSON (the header,
padded with spaces so the data starts at a multiple of 8), then the data: every
tensor's bytes, little-endian, row-major, back to back. The header maps each name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the data)
and may hold ``"__metadata__"``, a str -> str map. A sharded checkpoint is
``{stem}-00001-of-0000N.safetensors``... and ``{stem}.safetensors.index.json``
(``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``), as Hugging Face
writes it.

Validation follows the safetensors library's own rules, so a file it refuses is
refused here: a header of at most 100 MB inside the file, valid UTF-8 JSON, known
dtypes, offsets that tile the data with no gap or overlap up to the file's last byte,
and each tensor's byte count equal to its shape times its dtype's size. One rule is
stricter: a header with a duplicate key (which the library reads, the last one
winning) is refused, since two readers could take different tensors from it. Every
check is on integers and the header's text: nothing is allocated from a declared size
before it has been checked against the file's real size. Nothing here reads storage;
``engine/safetensors.py`` does.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import (
    ConfigError,
    CorruptCheckpointError,
    InvalidURLError,
    SerializationError,
    UnsupportedFormatError,
)
from ..store import Store, join_key
from ..store.paths import head_object, read_capped
from .commit import SAFETENSORS_INDEX_SUFFIX

__all__ = [
    "DTYPES",
    "HEADER_PROBE",
    "INDEX_SUFFIX",
    "MAX_HEADER_SIZE",
    "METADATA_KEY",
    "DType",
    "Header",
    "TensorEntry",
    "dtype_of",
    "encode_header",
    "encode_index",
    "header_length",
    "is_safetensors_url",
    "is_shard_name",
    "load_json",
    "parse_header",
    "parse_index",
    "parse_shard_size",
    "plan_shards",
    "read_header",
    "read_index",
    "shard_names",
]

#: The safetensors library refuses larger headers; so does cloudckpt.
MAX_HEADER_SIZE = 100_000_000
#: The first read of a file: its length field and, usually, its whole header.
HEADER_PROBE = 64 * 1024
METADATA_KEY = "__metadata__"
INDEX_SUFFIX = SAFETENSORS_INDEX_SUFFIX
_LEN = struct.Struct("<Q")
_ALIGN = 8
_MAX_DIM = 2**63 - 1


@dataclass(frozen=True)
class DType:
    """One safetensors dtype: bits per element, and the torch dtype it is (if any).

    ``pack`` elements of the file make one torch element (``F4``: torch's
    ``float4_e2m1fn_x2`` holds two), so the last dimension differs by that factor.
    """

    name: str
    bits: int
    torch_name: str | None
    pack: int = 1

    @property
    def torch(self) -> torch.dtype | None:
        """The torch dtype, or None where this torch has none."""
        found = getattr(torch, self.torch_name, None) if self.torch_name else None
        return found if isinstance(found, torch.dtype) else None


#: In the safetensors library's order (its writer puts tensors of later dtypes first,
#: which keeps every tensor aligned to its element size).
DTYPES: tuple[DType, ...] = (
    DType("BOOL", 8, "bool"),
    DType("F4", 4, "float4_e2m1fn_x2", pack=2),
    DType("F6_E2M3", 6, None),
    DType("F6_E3M2", 6, None),
    DType("U8", 8, "uint8"),
    DType("I8", 8, "int8"),
    DType("F8_E5M2", 8, "float8_e5m2"),
    DType("F8_E4M3", 8, "float8_e4m3fn"),
    DType("F8_E8M0", 8, "float8_e8m0fnu"),
    DType("F8_E4M3FNUZ", 8, "float8_e4m3fnuz"),
    DType("F8_E5M2FNUZ", 8, "float8_e5m2fnuz"),
    DType("I16", 16, "int16"),
    DType("U16", 16, "uint16"),
    DType("F16", 16, "float16"),
    DType("BF16", 16, "bfloat16"),
    DType("I32", 32, "int32"),
    DType("U32", 32, "uint32"),
    DType("F32", 32, "float32"),
    DType("C64", 64, "complex64"),
    DType("F64", 64, "float64"),
    DType("I64", 64, "int64"),
    DType("U64", 64, "uint64"),
)
_BY_NAME = {d.name: d for d in DTYPES}
_RANK = {d.name: i for i, d in enumerate(DTYPES)}


def dtype_of(tensor_dtype: torch.dtype, where: str) -> DType:
    """The safetensors dtype of a torch dtype; SerializationError when it has none."""
    for d in DTYPES:
        if d.torch is not None and d.torch == tensor_dtype:
            return d
    raise SerializationError(
        f"{where}: dtype {tensor_dtype} has no safetensors equivalent "
        f"(supported: {', '.join(str(d.torch) for d in DTYPES if d.torch is not None)})"
    )


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a header: its dtype, its shape in the file, its data offsets."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    def torch_shape(self, url: str) -> tuple[int, ...]:
        """The shape of the torch tensor holding it (``F4``: half the last dimension)."""
        if self.dtype.pack == 1:
            return self.shape
        if not self.shape or self.shape[-1] % self.dtype.pack:
            raise UnsupportedFormatError(
                f"{url}: tensor {self.name!r} of dtype {self.dtype.name} has shape "
                f"{list(self.shape)}; its last dimension must be a multiple of "
                f"{self.dtype.pack}"
            )
        return (*self.shape[:-1], self.shape[-1] // self.dtype.pack)


@dataclass(frozen=True)
class Header:
    """A validated header: tensors in data order, the metadata, where the data starts."""

    tensors: dict[str, TensorEntry]
    metadata: dict[str, str] | None
    data_start: int


def _corrupt(url: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{url} is not a valid safetensors file: {what}")


def header_length(prefix: bytes, size: int, url: str) -> int:
    """The header length ``N`` from a file's first bytes, checked against its ``size``."""
    if size < _LEN.size or len(prefix) < _LEN.size:
        raise _corrupt(url, f"{size} bytes, shorter than the 8-byte header length")
    (n,) = _LEN.unpack_from(prefix)
    if n > MAX_HEADER_SIZE:
        raise _corrupt(url, f"declared header of {n} bytes exceeds {MAX_HEADER_SIZE}")
    if _LEN.size + n > size:
        raise _corrupt(url, f"declared header of {n} bytes runs past the end ({size} bytes)")
    return int(n)


def _no_duplicates(url: str) -> Any:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise _corrupt(url, f"duplicate key {k!r} in the header")
            out[k] = v
        return out

    return hook


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def load_json(raw: bytes | bytearray | memoryview, url: str, what: str) -> Any:
    """JSON text as Python values: strict UTF-8, no duplicate keys, no NaN/Infinity."""
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptCheckpointError(f"{url}: the {what} is not UTF-8 ({exc})") from None
    try:
        return json.loads(
            text, object_pairs_hook=_no_duplicates(url), parse_constant=_refuse_constant
        )
    except CorruptCheckpointError:
        raise
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{url}: the {what} is not valid JSON ({exc})") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_text(value: Any) -> bool:
    """A str that is valid Unicode (JSON's ``\\ud800`` escapes give lone surrogates)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _entry(name: str, info: Any, url: str) -> TensorEntry:
    if not _is_text(name):
        raise _corrupt(url, f"tensor name {name!r} is not valid Unicode")
    if not isinstance(info, dict):
        raise _corrupt(url, f"tensor {name!r} is described by a {type(info).__name__}")
    dtype_name, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    dtype = _BY_NAME.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise _corrupt(url, f"tensor {name!r} has unknown dtype {dtype_name!r}")
    if not isinstance(shape, list) or not all(_is_int(d) and 0 <= d <= _MAX_DIM for d in shape):
        raise _corrupt(url, f"tensor {name!r} has an invalid shape {shape!r:.200}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise _corrupt(url, f"tensor {name!r} has invalid data_offsets {offsets!r:.200}")
    begin, end = offsets
    # Stop multiplying once the product passes the byte count (no huge integers).
    limit = (end - begin) * 8
    bits = 0 if 0 in shape else dtype.bits
    for d in shape:
        if bits > limit:
            break
        bits *= d
    if bits != limit:
        raise _corrupt(
            url,
            f"tensor {name!r} ({dtype.name}, shape {shape}) does not match its "
            f"{end - begin} bytes at data_offsets {offsets}",
        )
    return TensorEntry(name, dtype, tuple(shape), begin, end)


def parse_header(raw: bytes | bytearray | memoryview, size: int, url: str) -> Header:
    """The header bytes (``N`` of them, after the length) of a ``size``-byte file, checked.

    Raises CorruptCheckpointError for anything the safetensors library would refuse.
    """
    data_start = _LEN.size + len(raw)
    obj = load_json(raw, url, "header")
    if not isinstance(obj, dict):
        raise _corrupt(url, "the header is not a JSON object")
    metadata = obj.pop(METADATA_KEY, None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(map(_is_text, [*metadata, *metadata.values()]))
    ):
        raise _corrupt(url, "__metadata__ is not a map of strings to strings")
    entries = sorted((_entry(k, v, url) for k, v in obj.items()), key=lambda e: (e.begin, e.end))
    pos = 0
    for e in entries:
        if e.begin != pos:
            what = "overlaps the previous tensor" if e.begin < pos else "leaves a gap before it"
            raise _corrupt(url, f"tensor {e.name!r} at data_offsets [{e.begin}, {e.end}] {what}")
        pos = e.end
    if data_start + pos != size:
        raise _corrupt(
            url,
            f"the tensors end at byte {data_start + pos} but the file has {size} bytes",
        )
    return Header({e.name: e for e in entries}, metadata, data_start)


def encode_header(
    tensors: Iterable[tuple[str, torch.dtype, Sequence[int], int]],
    metadata: Mapping[str, str] | None,
    where: str,
) -> tuple[bytes, list[str]]:
    """The length field and header of a file holding ``(name, dtype, shape, nbytes)``
    tensors, and the names in the order their bytes must follow.

    The layout is the safetensors library's: tensors by dtype (widest first), then by
    name, the header padded with spaces to a multiple of 8; the same tensors and
    metadata give the same bytes as ``safetensors.torch.save``.
    """
    specs = []
    for name, tdtype, shape, nbytes in tensors:
        d = dtype_of(tdtype, f"{where}: tensor {name!r}")
        file_shape = tuple(shape)
        if d.pack != 1:
            if not file_shape:
                raise SerializationError(f"{where}: tensor {name!r} of {tdtype} has no dimension")
            file_shape = (*file_shape[:-1], file_shape[-1] * d.pack)
        specs.append((name, d, file_shape, nbytes))
    specs.sort(key=lambda s: (-_RANK[s[1].name], s[0]))
    body: dict[str, Any] = {}
    if metadata is not None:
        body[METADATA_KEY] = dict(metadata)
    pos = 0
    for name, d, file_shape, nbytes in specs:
        body[name] = {
            "dtype": d.name,
            "shape": list(file_shape),
            "data_offsets": [pos, pos + nbytes],
        }
        pos += nbytes
    try:
        text = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise SerializationError(f"{where}: a tensor name is not valid Unicode: {exc}") from None
    text += b" " * (-len(text) % _ALIGN)
    if len(text) > MAX_HEADER_SIZE:
        raise SerializationError(
            f"{where}: the header would be {len(text)} bytes, over the {MAX_HEADER_SIZE} "
            "readers accept; shard the state (max_shard_size=) or shorten the names"
        )
    return _LEN.pack(len(text)) + text, [s[0] for s in specs]


# -- sharded checkpoints -------------------------------------------------------------------

_SHARD = re.compile(r"(.*)-\d{5}-of-\d{5}\.safetensors")
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def is_safetensors_url(url: str) -> bool:
    """Whether ``url`` names a safetensors file or a sharded checkpoint's index."""
    return url.endswith(".safetensors") or url.endswith(INDEX_SUFFIX)


def parse_shard_size(value: int | str) -> int:
    """``max_shard_size`` in bytes: an int, or ``"5GB"`` (10**9, as transformers and
    huggingface_hub read it), ``"500MiB"`` (2**20), ``"1.5GB"``, ``"1000000"``."""
    if _is_int(value):
        size = int(value)
    else:
        m = _SIZE.match(value) if isinstance(value, str) else None
        unit = _UNITS.get(m.group(2).lower()) if m else None
        if m is None or unit is None:
            raise ConfigError(
                f"max_shard_size={value!r} is not a size (e.g. 5GB, 500MiB, 1000000000)"
            )
        size = int(float(m.group(1)) * unit)
    if size < 1:
        raise ConfigError(f"max_shard_size={value!r} must be at least one byte")
    return size


def plan_shards(sizes: Sequence[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Names grouped into shards of at most ``max_shard_size`` bytes of tensor data, in
    order, as huggingface_hub splits them (a larger tensor gets a shard of its own)."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, n in sizes:
        if n > max_shard_size:
            shards.append([name])
            continue
        if current and current_size + n > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += n
    if current or not shards:
        shards.append(current)
    return shards


def shard_names(stem: str, count: int) -> list[str]:
    """``{stem}-00001-of-0000N.safetensors``... (``{stem}.safetensors`` for one shard)."""
    if count == 1:
        return [f"{stem}.safetensors"]
    return [f"{stem}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def is_shard_name(name: str, stem: str | None = None) -> bool:
    """Whether ``name`` is a shard's file name (of ``stem``, when given)."""
    m = _SHARD.fullmatch(name)
    return m is not None and (stem is None or m.group(1) == stem)


def encode_index(
    weight_map: Mapping[str, str], total_size: int, metadata: Mapping[str, Any] | None = None
) -> bytes:
    """The index as transformers writes it (sorted keys, two-space indent); ``metadata``
    adds fields beside ``total_size`` (readers ignore what they do not know)."""
    index = {
        "metadata": {**(metadata or {}), "total_size": total_size},
        "weight_map": dict(weight_map),
    }
    return (json.dumps(index, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


def parse_index(raw: bytes, url: str) -> dict[str, str]:
    """An index's ``weight_map`` (tensor name -> file name), checked for shape only;
    the caller checks each file name as a key."""
    obj = load_json(raw, url, "index")
    weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(v, str) and v for v in weight_map.values()
    ):
        raise CorruptCheckpointError(
            f"{url} is not a safetensors index: it needs a 'weight_map' of tensor names to "
            "file names"
        )
    return weight_map


def read_header(store: Store, key: str) -> tuple[Header, bytes]:
    """One file's header, validated, and the bytes read for it (the probe: the first
    ``HEADER_PROBE`` bytes, and the rest of a longer header; one or two ranged reads)."""
    url = store.url(key)
    size = head_object(store, key).size
    probe = store.get_range(key, 0, min(size, HEADER_PROBE)) if size else b""
    end = 8 + header_length(probe, size, url)
    if end > len(probe):  # the rest of the header, and the first tensors with it
        probe += store.get_range(key, len(probe), min(size, end + HEADER_PROBE))
    return parse_header(memoryview(probe)[8:end], size, url), probe


def read_index(store: Store, key: str) -> dict[str, list[str]]:
    """Shard key -> the tensor names an index assigns to it, in the index's order; a
    shard outside the index's folder is refused."""
    url = store.url(key)
    size = head_object(store, key).size  # its errors say what a prefix's URL holds
    raw = read_capped(store, key, MAX_HEADER_SIZE, size=size, what="safetensors index")
    weight_map = parse_index(raw, url)
    folder = key.rpartition("/")[0]
    files: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        try:
            shard = join_key(folder, file, url)
        except InvalidURLError:
            raise CorruptCheckpointError(
                f"{url}: weight_map sends {name!r} to {file!r}, outside the index's folder"
            ) from None
        files.setdefault(shard, []).append(name)
    return files
