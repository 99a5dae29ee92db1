"""Hand-made pickles and torch archives, for the trust boundary's tests (issue 29).

Three parts, all code (no binary fixtures):

* :data:`ops`: a tiny assembler over pickle's opcodes. Each opcode is an attribute:
  the ones without an argument are the opcode's bytes (``ops.MARK``, ``ops.REDUCE``),
  the ones with an argument are functions (``ops.GLOBAL("torch", "Tensor")``,
  ``ops.BININT(5)``, ``ops.BINUNICODE("x")``). Lower-case helpers build what
  ``torch.save`` writes: ``ops.int_(n)``, ``ops.str_(s)``, ``ops.tuple_(...)``,
  ``ops.storage(...)`` (a storage persistent id), ``ops.tensor_v2(...)``.
  :func:`assemble` puts ``PROTO`` in front and ``STOP`` behind.
* :func:`torch_archive`: a ``data.pkl`` (and storage records) wrapped into a zip laid
  out as ``torch.save`` lays it out (same records, same order, stored, data aligned to
  64 bytes with the ``FB`` padding field); :func:`read_archive` and
  :func:`rewrite_archive` take a real ``torch.save`` output apart and put it back with
  a replaced ``data.pkl``.
* :data:`HOSTILE`: the named hostile payloads, one function per attack, its docstring
  saying what it attacks; :func:`payload` builds one as a :class:`Payload`.
"""

from __future__ import annotations

import io
import struct
import zipfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "HOSTILE",
    "Payload",
    "assemble",
    "ops",
    "payload",
    "read_archive",
    "rewrite_archive",
    "torch_archive",
]


# --- the assembler ----------------------------------------------------------------------


def _text(s: str | bytes) -> bytes:
    return s.encode("utf-8", "surrogatepass") if isinstance(s, str) else s


class _Ops:
    """Pickle opcodes as bytes (no argument) or functions (with one); see the module
    docstring. Arguments are encoded as the opcode defines them, without range checks
    beyond what ``struct`` enforces, so out-of-range values are easy to write."""

    # Stack and memo
    MARK = b"("
    STOP = b"."
    POP = b"0"
    POP_MARK = b"1"
    DUP = b"2"
    MEMOIZE = b"\x94"
    # Constants
    NONE = b"N"
    NEWTRUE = b"\x88"
    NEWFALSE = b"\x89"
    # Containers
    EMPTY_TUPLE = b")"
    TUPLE = b"t"
    TUPLE1 = b"\x85"
    TUPLE2 = b"\x86"
    TUPLE3 = b"\x87"
    EMPTY_LIST = b"]"
    LIST = b"l"
    APPEND = b"a"
    APPENDS = b"e"
    EMPTY_DICT = b"}"
    DICT = b"d"
    SETITEM = b"s"
    SETITEMS = b"u"
    EMPTY_SET = b"\x8f"
    ADDITEMS = b"\x90"
    FROZENSET = b"\x91"
    # Calls and objects
    STACK_GLOBAL = b"\x93"
    REDUCE = b"R"
    BUILD = b"b"
    OBJ = b"o"
    NEWOBJ = b"\x81"
    NEWOBJ_EX = b"\x92"
    BINPERSID = b"Q"
    NEXT_BUFFER = b"\x97"
    READONLY_BUFFER = b"\x98"

    @staticmethod
    def raw(data: bytes) -> bytes:
        """Bytes as they are (a half opcode, a damaged argument)."""
        return bytes(data)

    @staticmethod
    def PROTO(n: int) -> bytes:
        return b"\x80" + bytes([n & 0xFF])

    @staticmethod
    def FRAME(n: int) -> bytes:
        return b"\x95" + struct.pack("<Q", n)

    @staticmethod
    def BININT(n: int) -> bytes:
        return b"J" + struct.pack("<i", n)

    @staticmethod
    def BININT1(n: int) -> bytes:
        return b"K" + bytes([n & 0xFF])

    @staticmethod
    def BININT2(n: int) -> bytes:
        return b"M" + struct.pack("<H", n)

    @staticmethod
    def LONG1(n: int) -> bytes:
        data = _long_bytes(n)
        return b"\x8a" + bytes([len(data)]) + data

    @staticmethod
    def LONG4(n: int) -> bytes:
        data = _long_bytes(n)
        return b"\x8b" + struct.pack("<i", len(data)) + data

    @staticmethod
    def INT(n: int) -> bytes:
        return b"I" + str(n).encode() + b"\n"

    @staticmethod
    def LONG(n: int) -> bytes:
        return b"L" + str(n).encode() + b"L\n"

    @staticmethod
    def BINFLOAT(x: float) -> bytes:
        return b"G" + struct.pack(">d", x)

    @staticmethod
    def FLOAT(x: float) -> bytes:
        return b"F" + repr(x).encode() + b"\n"

    @staticmethod
    def SHORT_BINSTRING(s: str | bytes) -> bytes:
        data = _text(s)
        return b"U" + bytes([len(data)]) + data

    @staticmethod
    def BINSTRING(s: str | bytes) -> bytes:
        data = _text(s)
        return b"T" + struct.pack("<i", len(data)) + data

    @staticmethod
    def STRING(s: str) -> bytes:
        return b"S" + repr(s).encode() + b"\n"

    @staticmethod
    def UNICODE(s: str) -> bytes:
        return b"V" + s.encode("raw-unicode-escape") + b"\n"

    @staticmethod
    def BINUNICODE(s: str | bytes) -> bytes:
        data = _text(s)
        return b"X" + struct.pack("<I", len(data)) + data

    @staticmethod
    def SHORT_BINUNICODE(s: str | bytes) -> bytes:
        data = _text(s)
        return b"\x8c" + bytes([len(data)]) + data

    @staticmethod
    def BINUNICODE8(s: str | bytes) -> bytes:
        data = _text(s)
        return b"\x8d" + struct.pack("<Q", len(data)) + data

    @staticmethod
    def SHORT_BINBYTES(b: bytes) -> bytes:
        return b"C" + bytes([len(b)]) + b

    @staticmethod
    def BINBYTES(b: bytes) -> bytes:
        return b"B" + struct.pack("<I", len(b)) + b

    @staticmethod
    def BINBYTES8(b: bytes) -> bytes:
        return b"\x8e" + struct.pack("<Q", len(b)) + b

    @staticmethod
    def BYTEARRAY8(b: bytes) -> bytes:
        return b"\x96" + struct.pack("<Q", len(b)) + b

    @staticmethod
    def GLOBAL(module: str, name: str) -> bytes:
        return b"c" + _text(module) + b"\n" + _text(name) + b"\n"

    @staticmethod
    def INST(module: str, name: str) -> bytes:
        return b"i" + _text(module) + b"\n" + _text(name) + b"\n"

    @staticmethod
    def PERSID(pid: str) -> bytes:
        return b"P" + _text(pid) + b"\n"

    @staticmethod
    def BINGET(i: int) -> bytes:
        return b"h" + bytes([i & 0xFF])

    @staticmethod
    def LONG_BINGET(i: int) -> bytes:
        return b"j" + struct.pack("<I", i & 0xFFFFFFFF)

    @staticmethod
    def BINPUT(i: int) -> bytes:
        return b"q" + bytes([i & 0xFF])

    @staticmethod
    def LONG_BINPUT(i: int) -> bytes:
        return b"r" + struct.pack("<I", i & 0xFFFFFFFF)

    @staticmethod
    def GET(i: int) -> bytes:
        return b"g" + str(i).encode() + b"\n"

    @staticmethod
    def PUT(i: int) -> bytes:
        return b"p" + str(i).encode() + b"\n"

    @staticmethod
    def EXT1(code: int) -> bytes:
        return b"\x82" + bytes([code & 0xFF])

    @staticmethod
    def EXT2(code: int) -> bytes:
        return b"\x83" + struct.pack("<H", code)

    @staticmethod
    def EXT4(code: int) -> bytes:
        return b"\x84" + struct.pack("<i", code)

    # --- what torch.save writes (protocol 2) -------------------------------------------

    @staticmethod
    def int_(n: int) -> bytes:
        """An integer as pickle's protocol 2 writes it."""
        if 0 <= n < 256:
            return ops.BININT1(n)
        if 0 <= n < 65536:
            return ops.BININT2(n)
        if -(2**31) <= n < 2**31:
            return ops.BININT(n)
        return ops.LONG1(n)

    @staticmethod
    def str_(s: str) -> bytes:
        return ops.BINUNICODE(s)

    @staticmethod
    def bool_(b: bool) -> bytes:
        return ops.NEWTRUE if b else ops.NEWFALSE

    @staticmethod
    def tuple_(*parts: bytes) -> bytes:
        """A tuple of the values ``parts`` push (TUPLE1-3 for the short ones)."""
        if not parts:
            return ops.EMPTY_TUPLE
        if len(parts) <= 3:
            return b"".join(parts) + (ops.TUPLE1, ops.TUPLE2, ops.TUPLE3)[len(parts) - 1]
        return ops.MARK + b"".join(parts) + ops.TUPLE

    @staticmethod
    def ints(values: Iterable[int]) -> bytes:
        """A tuple of integers (a size or a stride)."""
        return ops.tuple_(*(ops.int_(v) for v in values))

    @staticmethod
    def list_(*parts: bytes) -> bytes:
        return ops.EMPTY_LIST + (ops.MARK + b"".join(parts) + ops.APPENDS if parts else b"")

    @staticmethod
    def dict_(*pairs: tuple[bytes, bytes]) -> bytes:
        body = b"".join(k + v for k, v in pairs)
        return ops.EMPTY_DICT + (ops.MARK + body + ops.SETITEMS if pairs else b"")

    @staticmethod
    def call(module: str, name: str, *args: bytes) -> bytes:
        """``module.name(*args)`` by GLOBAL and REDUCE."""
        return ops.GLOBAL(module, name) + ops.tuple_(*args) + ops.REDUCE

    @staticmethod
    def ordered_dict() -> bytes:
        return ops.call("collections", "OrderedDict")

    @staticmethod
    def storage(
        storage_class: str = "FloatStorage",
        key: str = "0",
        location: str = "cpu",
        numel: int = 4,
        module: str = "torch",
    ) -> bytes:
        """The persistent id torch.save writes for a storage, and BINPERSID."""
        return (
            ops.MARK
            + ops.str_("storage")
            + ops.GLOBAL(module, storage_class)
            + ops.str_(key)
            + ops.str_(location)
            + ops.int_(numel)
            + ops.TUPLE
            + ops.BINPERSID
        )

    @staticmethod
    def tensor_v2(
        storage: bytes,
        offset: int = 0,
        size: Iterable[int] = (4,),
        stride: Iterable[int] = (1,),
        requires_grad: bool = False,
    ) -> bytes:
        """``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, rg, hooks)``."""
        return ops.call(
            "torch._utils",
            "_rebuild_tensor_v2",
            storage,
            ops.int_(offset),
            ops.ints(size),
            ops.ints(stride),
            ops.bool_(requires_grad),
            ops.ordered_dict(),
        )


def _long_bytes(n: int) -> bytes:
    """Two's complement little-endian, as pickle's ``encode_long``."""
    if n == 0:
        return b""
    data = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    if n < 0 and len(data) > 1 and data[-1] == 0xFF and data[-2] & 0x80:
        data = data[:-1]
    return data


ops = _Ops()


def assemble(*parts: bytes, proto: int | None = 2, stop: bool = True) -> bytes:
    """``PROTO proto`` (unless None), the parts, and ``STOP`` (unless ``stop`` is False)."""
    head = ops.PROTO(proto) if proto is not None else b""
    return head + b"".join(parts) + (ops.STOP if stop else b"")


# --- torch archives ---------------------------------------------------------------------

#: The records torch.save writes around data.pkl and the storages, in its order, with a
#: fixed serialization id (torch writes a random one) so archives are reproducible.
_HEAD_RECORDS = ((".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little"))
_TAIL_RECORDS = (("version", b"3\n"), (".data/serialization_id", b"0" * 40))
_ALIGNMENT = 64


def _aligned_info(zf: zipfile.ZipFile, name: str) -> zipfile.ZipInfo:
    """A stored record whose data starts on a 64-byte boundary, padded as torch pads
    (miniz's writer in torch: an extra field ``FB`` of ``Z`` bytes)."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    offset = zf.fp.tell() if zf.fp is not None else 0
    start = offset + 30 + len(name.encode()) + 4
    pad = (-start) % _ALIGNMENT
    info.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
    return info


def write_archive(records: Iterable[tuple[str, bytes]]) -> bytes:
    """A zip of ``records`` (full names, in order), stored and aligned as torch does."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, data in records:
            zf.writestr(_aligned_info(zf, name), data)
    return buf.getvalue()


def torch_archive(
    pkl: bytes,
    storages: Mapping[str, bytes] | None = None,
    *,
    prefix: str = "archive",
    byteorder: bytes = b"little",
) -> bytes:
    """``pkl`` as the ``data.pkl`` of a torch.save archive holding ``storages``
    (``{key: bytes}``, written as ``data/<key>``), laid out as torch.save lays it out."""
    records = [(f"{prefix}/data.pkl", pkl)]
    for name, data in _HEAD_RECORDS:
        records.append((f"{prefix}/{name}", byteorder if name == "byteorder" else data))
    for key, data in (storages or {}).items():
        records.append((f"{prefix}/data/{key}", data))
    records += [(f"{prefix}/{name}", data) for name, data in _TAIL_RECORDS]
    return write_archive(records)


@dataclass
class Archive:
    """A torch archive taken apart: its prefix, data.pkl, storages, other records."""

    prefix: str
    pkl: bytes
    storages: dict[str, bytes]
    records: list[tuple[str, bytes]]  # every record in order (full names)


def read_archive(data: bytes) -> Archive:
    """Take a ``torch.save`` output apart (a zip with one ``<prefix>/data.pkl``)."""
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        records = [(i.filename, zf.read(i)) for i in zf.infolist()]
    names = [n for n, _ in records if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(names) != 1:
        raise ValueError("not a torch archive")
    prefix = names[0][: -len("/data.pkl")]
    storages = {n[len(prefix) + 6 :]: d for n, d in records if n.startswith(f"{prefix}/data/")}
    return Archive(prefix, dict(records)[names[0]], storages, records)


def rewrite_archive(
    data: bytes, *, pkl: bytes | None = None, storages: Mapping[str, bytes] | None = None
) -> bytes:
    """A real ``torch.save`` output with its ``data.pkl`` replaced by ``pkl`` and, if
    given, its storage records by ``storages``; every other record kept in its place
    (the serialization id made fixed). Written stored and aligned as torch writes."""
    found = read_archive(data)
    out: list[tuple[str, bytes]] = []
    data_dir = f"{found.prefix}/data/"
    for name, body in found.records:
        if name == f"{found.prefix}/data.pkl" and pkl is not None:
            body = pkl
        elif name.startswith(data_dir) and storages is not None:
            continue
        elif name.endswith("/.data/serialization_id"):
            body = _TAIL_RECORDS[1][1]
        if name == f"{found.prefix}/version" and storages is not None:
            out += [(data_dir + k, v) for k, v in storages.items()]
        out.append((name, body))
    return write_archive(out)


# --- hostile payloads -------------------------------------------------------------------

#: The command the payloads that would run code run: ``touch <marker>``.
DEFAULT_MARKER = "/tmp/cloudckpt-security-marker"


@dataclass(frozen=True)
class Payload:
    """One hostile file.

    ``target``: ``"archive"`` (``data`` is a whole torch archive, for
    ``load_torch_bytes``/``cloudckpt.load``) or ``"metadata"`` (``data`` is a DCP
    ``.metadata`` pickle, for ``decode_metadata``). ``pkl``: the pickle inside.
    ``torch_refuses``: what ``torch.load(weights_only=True)`` does with the pickle (as
    an archive's data.pkl); where False, cloudckpt is stricter than torch on purpose
    (docs/security.md) and must refuse anyway. ``extensions``: copyreg extension codes
    ``(module, name, code)`` registered in the loading process first (the EXT attacks
    need a registry that names something). ``marker``: a file the payload creates if
    any code of its choosing runs."""

    name: str
    target: str
    data: bytes
    pkl: bytes
    attack: str
    torch_refuses: bool = True
    extensions: tuple[tuple[str, str, int], ...] = ()
    marker: str | None = None


@dataclass(frozen=True)
class _Spec:
    func: Callable[[str], Any]
    target: str
    torch_refuses: bool
    extensions: tuple[tuple[str, str, int], ...]
    runs_code: bool


#: name -> the function that builds it (see :func:`payload`).
HOSTILE: dict[str, _Spec] = {}


def _hostile(
    target: str = "archive",
    *,
    torch_refuses: bool = True,
    extensions: tuple[tuple[str, str, int], ...] = (),
    runs_code: bool = False,
) -> Callable[[Callable[[str], Any]], Callable[[str], Any]]:
    def register(func: Callable[[str], Any]) -> Callable[[str], Any]:
        HOSTILE[func.__name__] = _Spec(func, target, torch_refuses, extensions, runs_code)
        return func

    return register


#: The storage records every hostile archive holds: ``data/0``, 4 float32 (16 bytes).
STORAGES = {"0": struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)}


def payload(name: str, marker: str = DEFAULT_MARKER) -> Payload:
    """The hostile payload ``name`` (a key of :data:`HOSTILE`), as a file's bytes."""
    spec = HOSTILE[name]
    built = spec.func(marker)
    pkl, storages = built if isinstance(built, tuple) else (built, STORAGES)
    data = torch_archive(pkl, storages) if spec.target == "archive" else pkl
    return Payload(
        name=name,
        target=spec.target,
        data=data,
        pkl=pkl,
        attack=" ".join((spec.func.__doc__ or "").split()),
        torch_refuses=spec.torch_refuses,
        extensions=spec.extensions,
        marker=marker if spec.runs_code else None,
    )


def _touch(marker: str) -> bytes:
    return ops.str_(f"touch {marker}")


def _tensor() -> bytes:
    """A float32 tensor of 4 over ``data/0``."""
    return ops.tensor_v2(ops.storage("FloatStorage", "0", "cpu", 4), 0, (4,), (1,))


@_hostile()
def newobj_ex_tensor_cdata(marker: str) -> bytes:
    """NEWOBJ_EX ``torch.Tensor(cdata=<int>)``: the C unpickler passes keyword
    arguments to ``Tensor.__new__``, which takes ``cdata`` as a raw pointer (SIGSEGV)."""
    return assemble(
        ops.GLOBAL("torch", "Tensor"),
        ops.EMPTY_TUPLE,
        ops.dict_((ops.str_("cdata"), ops.BININT(0x41414141))),
        ops.NEWOBJ_EX,
    )


@_hostile()
def newobj_ex_untyped_storage_allocator(marker: str) -> bytes:
    """NEWOBJ_EX ``torch.UntypedStorage(16, allocator=<int>)``: an integer taken as
    the address of an allocator object."""
    return assemble(
        ops.GLOBAL("torch.storage", "UntypedStorage"),
        ops.tuple_(ops.int_(16)),
        ops.dict_((ops.str_("allocator"), ops.BININT(0x41414141))),
        ops.NEWOBJ_EX,
    )


@_hostile()
def obj_opcode(marker: str) -> bytes:
    """OBJ: calls the class below the mark with the arguments above it, an opcode
    torch never runs (a second way to call an allowed class, unchecked)."""
    return assemble(ops.MARK, ops.GLOBAL("collections", "OrderedDict"), ops.list_(), ops.OBJ)


@_hostile()
def inst_opcode(marker: str) -> bytes:
    """INST: imports ``module.name`` by itself (no GLOBAL for find_class to see in a
    scan) and calls it with the arguments above the mark."""
    return assemble(ops.MARK, ops.INST("collections", "OrderedDict"))


@_hostile(runs_code=True)
def reduce_os_system(marker: str) -> bytes:
    """REDUCE of ``os.system`` (a non-allowed global): runs ``touch <marker>``."""
    return assemble(ops.call("os", "system", _touch(marker)))


@_hostile(runs_code=True)
def reduce_builtins_exec(marker: str) -> bytes:
    """REDUCE of ``builtins.exec`` (a non-allowed global, not in a blocked module):
    runs Python that creates the marker."""
    return assemble(ops.call("builtins", "exec", ops.str_(f"open({marker!r}, 'w').close()")))


@_hostile()
def build_storage_class_dtype(marker: str) -> bytes:
    """BUILD on an allowed class: the ``torch.FloatStorage`` object of torch's
    allow-list gets ``_dtype = torch.int8`` as slot state, so every later float32
    checkpoint in the process would be read as int8."""
    return assemble(
        ops.GLOBAL("torch", "FloatStorage"),
        ops.NONE,
        ops.dict_((ops.str_("_dtype"), ops.GLOBAL("torch", "int8"))),
        ops.TUPLE2,
        ops.BUILD,
    )


@_hostile()
def build_rebuild_parameter_defaults(marker: str) -> bytes:
    """BUILD on an allowed function: slot state sets
    ``torch._utils._rebuild_parameter.__defaults__`` process-wide."""
    return assemble(
        ops.GLOBAL("torch._utils", "_rebuild_parameter"),
        ops.NONE,
        ops.dict_((ops.str_("__defaults__"), ops.tuple_(ops.int_(1)))),
        ops.TUPLE2,
        ops.BUILD,
    )


@_hostile()
def build_false_none_none_on_tensor(marker: str) -> bytes:
    """BUILD ``(False, None, None)`` on a tensor: ``Tensor.set_(False, None, None)``, a
    legacy state torch's unpickler hands straight to ``set_``."""
    return assemble(_tensor(), ops.tuple_(ops.NEWFALSE, ops.NONE, ops.NONE), ops.BUILD)


@_hostile()
def additems_on_tensor(marker: str) -> bytes:
    """ADDITEMS on a tensor: the C unpickler calls the target's ``add`` for each item
    (``Tensor.add``), anything with an ``add`` attribute becomes callable."""
    return assemble(
        ops.GLOBAL("torch", "Tensor"),
        ops.EMPTY_TUPLE,
        ops.NEWOBJ,
        ops.MARK,
        ops.int_(1),
        ops.ADDITEMS,
    )


@_hostile()
def append_on_bytearray(marker: str) -> bytes:
    """APPEND on a bytearray built by REDUCE: the C unpickler calls the target's
    ``append`` (any object's ``append``/``extend``), where torch allows lists only."""
    return assemble(ops.call("builtins", "bytearray"), ops.int_(1), ops.APPEND)


@_hostile()
def build_slots_on_ordereddict(marker: str) -> bytes:
    """BUILD with slot state ``(None, {...})`` on an OrderedDict: the C unpickler
    ``setattr``s each slot item on the object (torch updates ``__dict__`` only)."""
    return assemble(
        ops.ordered_dict(),
        ops.NONE,
        ops.dict_((ops.str_("x"), ops.int_(1))),
        ops.TUPLE2,
        ops.BUILD,
    )


@_hostile(torch_refuses=False)
def persid_tensor_storage_type(marker: str) -> bytes:
    """A persistent id whose storage type is a tensor (``torch.Tensor()`` by NEWOBJ):
    torch reads its ``.dtype`` and loads; a loader that caches by storage class keeps
    the tensor forever. cloudckpt refuses it (stricter than torch, docs/security.md)."""
    return assemble(
        ops.MARK,
        ops.str_("storage"),
        ops.GLOBAL("torch", "Tensor"),
        ops.EMPTY_TUPLE,
        ops.NEWOBJ,
        ops.str_("0"),
        ops.str_("cpu"),
        ops.int_(4),
        ops.TUPLE,
        ops.BINPERSID,
    )


@_hostile()
def long_binput_huge_index(marker: str) -> bytes:
    """LONG_BINPUT 2**32-1: the C unpickler grows its memo (an array) to the index
    named, 32 GiB of pointers for 5 bytes of file, before anything refuses it."""
    return assemble(ops.int_(7), ops.LONG_BINPUT(2**32 - 1), ops.EXT1(1))


@_hostile(extensions=(("posix", "system", 0x7A),), runs_code=True)
def ext1_copyreg(marker: str) -> bytes:
    """EXT1: a copyreg extension code, looked up in the process's registry without
    find_class (here registered to ``posix.system``): runs ``touch <marker>``."""
    return assemble(ops.EXT1(0x7A), ops.tuple_(_touch(marker)), ops.REDUCE)


@_hostile(extensions=(("posix", "system", 0x7A7A),), runs_code=True)
def ext2_copyreg(marker: str) -> bytes:
    """EXT2: as :func:`ext1_copyreg` with a two-byte code."""
    return assemble(ops.EXT2(0x7A7A), ops.tuple_(_touch(marker)), ops.REDUCE)


@_hostile(extensions=(("posix", "system", 0x7A7A7A),), runs_code=True)
def ext4_copyreg(marker: str) -> bytes:
    """EXT4: as :func:`ext1_copyreg` with a four-byte code."""
    return assemble(ops.EXT4(0x7A7A7A), ops.tuple_(_touch(marker)), ops.REDUCE)


@_hostile(runs_code=True)
def stack_global_os_system(marker: str) -> bytes:
    """STACK_GLOBAL: the global's name comes from the stack (strings the pickle built),
    so a scan of GLOBAL lines misses it: ``os.system('touch <marker>')``."""
    return assemble(
        ops.str_("os"),
        ops.str_("system"),
        ops.STACK_GLOBAL,
        ops.tuple_(_touch(marker)),
        ops.REDUCE,
    )


@_hostile()
def frame_memoize(marker: str) -> bytes:
    """FRAME and MEMOIZE (protocol 4): a frame length the unpickler trusts to read
    ahead, and memo entries without an index in the file."""
    body = (
        ops.EMPTY_DICT
        + ops.MEMOIZE
        + ops.SHORT_BINUNICODE("a")
        + ops.MEMOIZE
        + ops.BININT1(1)
        + ops.SETITEM
    )
    return assemble(ops.FRAME(2**40), body, proto=4)


@_hostile()
def setitem_on_allowed_class(marker: str) -> bytes:
    """SETITEM on the ``collections.OrderedDict`` class itself (a global, not a dict)."""
    return assemble(
        ops.GLOBAL("collections", "OrderedDict"), ops.str_("k"), ops.int_(1), ops.SETITEM
    )


@_hostile()
def persid_not_a_storage(marker: str) -> bytes:
    """A persistent id that does not name a storage: ``('module', 'os', 'system')``."""
    return assemble(
        ops.tuple_(ops.str_("module"), ops.str_("os"), ops.str_("system")), ops.BINPERSID
    )


def _build_onto_then_refused(module: str, name: str, marker: str) -> bytes:
    """Protocol 4, as DCP writes ``.metadata``: BUILD slot state onto the global
    ``module.name``, then REDUCE ``os.system`` (refused) so the load fails after it."""
    return assemble(
        ops.SHORT_BINUNICODE(module),
        ops.SHORT_BINUNICODE(name),
        ops.STACK_GLOBAL,
        ops.NONE,
        ops.EMPTY_DICT,
        ops.SHORT_BINUNICODE("cloudckpt_poisoned"),
        ops.BININT1(1),
        ops.SETITEM,
        ops.TUPLE2,
        ops.BUILD,
        ops.call("os", "system", _touch(marker)),
        proto=4,
    )


@_hostile("metadata", runs_code=True)
def metadata_build_posixpath(marker: str) -> bytes:
    """A ``.metadata`` pickle that BUILDs onto ``pathlib.PosixPath`` (a class its
    allow-list names) before it is refused: the class would stay poisoned."""
    return _build_onto_then_refused("pathlib", "PosixPath", marker)


@_hostile("metadata", runs_code=True)
def metadata_build_dcp_class(marker: str) -> bytes:
    """A ``.metadata`` pickle that BUILDs onto DCP's ``Metadata`` class before it is
    refused: every later DCP load would see the poisoned attribute."""
    return _build_onto_then_refused("torch.distributed.checkpoint.metadata", "Metadata", marker)


@_hostile("metadata")
def metadata_build_storage_info_defaults(marker: str) -> bytes:
    """A ``.metadata`` pickle (protocol 2) that BUILDs ``__init__.__defaults__``-style
    slot state onto DCP's ``_StorageInfo`` class, then ends with a refused EXT1."""
    return assemble(
        ops.GLOBAL("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ops.NONE,
        ops.dict_((ops.str_("transform_descriptors"), ops.list_(ops.str_("zz")))),
        ops.TUPLE2,
        ops.BUILD,
        ops.EXT1(1),
    )


# Found by the differential fuzzer (fuzz.py) on the boundary as first landed.


@_hostile()
def rebuild_tensor_beyond_its_storage(marker: str) -> bytes:
    """``_rebuild_tensor_v2`` of 2**28 floats over a 16-byte storage record: torch
    refuses (a loaded storage cannot be resized); a loader whose storages are resizable
    grows the record's storage to 1 GiB for a file of a few hundred bytes."""
    return assemble(ops.tensor_v2(ops.storage("FloatStorage", "0", "cpu", 4), 0, (2**28,), (1,)))


@_hostile()
def rebuild_tensor_requires_grad_not_a_bool(marker: str) -> bytes:
    """``_rebuild_tensor_v2`` with ``requires_grad=2``: torch refuses (``requires_grad
    must be a bool``); a rebuild that only tests truthiness accepts what torch refuses."""
    return assemble(
        ops.call(
            "torch._utils",
            "_rebuild_tensor_v2",
            ops.storage("FloatStorage", "0", "cpu", 4),
            ops.int_(0),
            ops.ints((4,)),
            ops.ints((1,)),
            ops.int_(2),
            ops.ordered_dict(),
        )
    )


@_hostile()
def sparse_tensor_then_refused(marker: str) -> bytes:
    """A sparse COO tensor (``_rebuild_sparse_tensor``, which queues it in torch's
    process-wide ``_sparse_tensors_to_validate``), then an opcode torch refuses: a load
    that stops there must not leave the queue filled (it keeps the tensors alive and the
    next load, of another file, validates them)."""
    indices = ops.tensor_v2(ops.storage("LongStorage", "0", "cpu", 2), 0, (1, 2), (2, 1))
    values = ops.tensor_v2(ops.storage("FloatStorage", "1", "cpu", 2), 0, (2,), (1,))
    layout = ops.call("torch.serialization", "_get_layout", ops.str_("torch.sparse_coo"))
    sparse = ops.call(
        "torch._utils",
        "_rebuild_sparse_tensor",
        layout,
        ops.MARK + indices + values + ops.ints((4,)) + ops.NEWFALSE + ops.TUPLE,
    )
    storages = {"0": struct.pack("<2q", 0, 3), "1": struct.pack("<2f", 1.0, 2.0)}
    return assemble(sparse, ops.EXT1(1)), storages  # type: ignore[return-value]


@_hostile(torch_refuses=False)
def tensor_size_constructor_by_torch_size(marker: str) -> bytes:
    """``torch.FloatTensor(torch.Size([2**28]))``: the legacy size constructor given a
    ``torch.Size`` instead of an int allocates 1 GiB (uninitialized: heap bytes in the
    result for small sizes) for a file of a hundred bytes. torch loads it; cloudckpt
    promises never to run a size constructor (docs/security.md) and must refuse it."""
    return assemble(ops.call("torch", "FloatTensor", ops.call("torch", "Size", ops.ints((2**28,)))))


@_hostile()
def quantized_storage_tensor_converted(marker: str) -> bytes:
    """``_rebuild_device_tensor_from_cpu_tensor`` of a tensor rebuilt over a ``QInt8Storage``
    (a quantized dtype with no quantizer) to float32: torch refuses (an internal assert
    in its quantizer); converting such a tensor built another way can read through a
    null quantizer (SIGSEGV in ``cloudckpt.load``'s record-by-record path)."""
    tensor = ops.tensor_v2(ops.storage("QInt8Storage", "0", "cpu", 16), 0, (4,), (1,))
    return assemble(
        ops.call(
            "torch._utils",
            "_rebuild_device_tensor_from_cpu_tensor",
            tensor,
            ops.GLOBAL("torch", "float32"),
            ops.str_("cpu"),
            ops.NEWFALSE,
        )
    )
