"""The four files an outside tester got through the trust boundary with (issue 39), each
built here by code, each run where a crash would show (a forked child), each asserting
what must hold and, where torch refuses or bounds it, that torch does.

1. ``data.pkl`` BUILDs a plain tensor with a 3-item state ``(storage, offset, size)``:
   ``Tensor.set_`` resizes the storage (freed under the reader threads of
   ``cloudckpt.load``: false CRC errors, crashes; a 4 MiB record back as 4 GiB with
   ``keys=``, ``share=True`` or ``load_torch_bytes``). torch refuses: its storages
   cannot be resized.
2. A DCP ``.metadata`` calls an allowed enum (``_MEM_FORMAT_ENCODING(0)``, a member
   every load shares) and BUILDs the result: the member changes process-wide.
3. ``FloatTensor(32768, 16384, True)``: a legacy size constructor with a bool among the
   sizes, 2 GiB from a file of about 1 KiB (the refusal of size constructors tested
   ``type(a) is int``). torch runs it; cloudckpt promises not to (docs/security.md).
4. A 64-byte storage viewed as 2**27 elements with stride 0 inside
   ``_rebuild_device_tensor_from_cpu_tensor`` (to float64): torch copies it once
   (+1 GiB); cloudckpt.load must not hold more than that and the file at its peak
   (it copied it twice: +2 GiB).
"""

from __future__ import annotations

import gc
import io
import multiprocessing
import os
import re
import resource
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import craft
from craft import ops

import cloudckpt
from cloudckpt import errors

MiB = 1 << 20
#: What a load may hold at its peak beyond torch's peak and the file (threads, buffers).
SLACK = 64 * MiB


# --- running in a child -------------------------------------------------------------------


def _child_main(conn: Any, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    # A forked child cannot use the OpenMP threads of a parent that ran parallel torch
    # ops (in a whole test session it has): one thread, so no op waits for them.
    torch.set_num_threads(1)
    # Nor should its collections walk the heap it inherited (gigabytes by the middle of
    # a session): each full collection would touch, and copy, every page of it.
    gc.freeze()
    try:
        result = ("ok", fn(*args))
    except BaseException as exc:  # reported to the parent, whatever it is
        result = ("raised", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}")
    conn.send(result)
    conn.close()
    os._exit(0)


def in_child(fn: Callable[..., Any], *args: Any, timeout: float = 300) -> Any:
    """``fn(*args)`` in a forked process: its result, or a failed test where it raised,
    crashed or hung (a crash is what some of these files caused)."""
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_main, args=(send, fn, args), daemon=True)
    proc.start()
    send.close()
    try:
        if not recv.poll(timeout):
            proc.kill()
            pytest.fail(f"{fn.__name__} hung (over {timeout:.0f} s)")
        kind, value = recv.recv()
    except EOFError:
        proc.join(10)
        pytest.fail(f"{fn.__name__} crashed: exit code {proc.exitcode} (a signal if negative)")
    finally:
        proc.join(10)
    if kind != "ok":
        pytest.fail(f"{fn.__name__} raised in the child: {value}")
    return value


def _outcome(load: Callable[[], Any]) -> dict[str, Any]:
    """What a load did: refused (its error's type, whether a CloudCkptError, its text),
    or accepted (the bytes of storage in its result)."""
    try:
        result = load()
    except Exception as exc:
        return {
            "refused": type(exc).__name__,
            "typed": isinstance(exc, errors.CloudCkptError),
            "crc": isinstance(exc, errors.ChecksumError) or "CRC" in str(exc),
            "message": str(exc)[:400],
        }
    return {"accepted": _storage_bytes(result)}


def _storage_bytes(obj: Any) -> int:
    """Bytes of the distinct storages of the tensors in ``obj`` (nested containers)."""
    seen: dict[int, int] = {}
    work = [obj]
    while work:
        x = work.pop()
        if isinstance(x, torch.Tensor):
            s = x.untyped_storage()
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        elif isinstance(x, dict):
            work += list(x.values())
        elif isinstance(x, (list, tuple)):
            work += list(x)
    return sum(seen.values())


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        found = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    assert found is not None
    return int(found.group(1)) * 1024


def _peak(load: Callable[[], Any]) -> dict[str, Any]:
    """``load``'s outcome and how far this process's resident memory rose meanwhile
    (the kernel's high-water mark, reset first; ``ru_maxrss`` where it cannot be)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        base, field = _rss("VmRSS"), "VmHWM"
    except OSError:
        base, field = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, ""
    found = _outcome(load)
    top = _rss(field) if field else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    found["peak"] = max(top - base, 0)
    return found


def _must_refuse(found: dict[str, Any], what: str) -> None:
    assert "accepted" not in found, (
        f"{what}: cloudckpt accepted it (a result of {found['accepted']} bytes of storage)"
    )
    assert found["typed"], f"{what}: not a CloudCkptError: {found['refused']}: {found['message']}"
    assert not found["crc"], f"{what}: a CRC error on a file whose CRCs are right: {found}"


# --- 1. BUILD (storage, offset, size) on a plain tensor -----------------------------------

RECORD_ELEMENTS = 1 << 20  # a 4 MiB float32 record: read straight into its storage


def _resize_file(tmp_path: Path) -> Path:
    """``{'w': t}``, t over a 4 MiB record, then ``BUILD`` of t with
    ``(storage, 0, (2**30,))``: ``t.set_(storage, 0, (2**30,))`` makes the storage
    4 GiB (torch: "Trying to resize storage that is not resizable")."""
    n = RECORD_ELEMENTS
    storage = ops.storage("FloatStorage", "0", "cpu", n) + ops.BINPUT(1)
    tensor = ops.call(
        "torch._utils",
        "_rebuild_tensor_v2",
        storage,
        ops.int_(0),
        ops.ints([n]),
        ops.ints([1]),
        ops.NEWFALSE,
        ops.ordered_dict(),
    )
    state = ops.BINGET(1) + ops.int_(0) + ops.ints([2**30]) + ops.TUPLE3
    pkl = craft.assemble(
        ops.EMPTY_DICT, ops.BINPUT(0), ops.str_("w"), tensor, state, ops.BUILD, ops.SETITEM
    )
    data = craft.torch_archive(pkl, {"0": bytes(range(256)) * (4 * n // 256)})
    path = tmp_path / "resize.pt"
    path.write_bytes(data)
    return path


def test_torch_refuses_the_resizing_build(tmp_path):
    path = _resize_file(tmp_path)
    with pytest.raises(RuntimeError, match="not resizable"):
        torch.load(path, weights_only=True)


@pytest.mark.parametrize("run", range(6))
def test_the_resizing_build_is_refused_under_the_reader_threads(tmp_path, run):
    """cloudckpt.load of the file (the 4 MiB record read by the reader threads while
    data.pkl is unpickled): a typed refusal, never a CRC error (the CRCs are right),
    never a crash; six runs, as the race does not show every time."""
    path = _resize_file(tmp_path)
    found = in_child(lambda: _outcome(lambda: cloudckpt.load(str(path), map_location="cpu")))
    _must_refuse(found, f"cloudckpt.load, run {run}")


@pytest.mark.parametrize("entry", ["keys", "bytes", "mmap"])
def test_the_resizing_build_is_refused_by_every_entry(tmp_path, entry):
    """``keys=`` (storages allocated before the reads), ``load_torch_bytes`` (storages
    of its own) and ``mmap=True``: a typed refusal, not a 4 GiB storage."""
    from cloudckpt.format.torch.unpickle import load_torch_bytes

    path = _resize_file(tmp_path)
    loads = {
        "keys": lambda: cloudckpt.load(str(path), map_location="cpu", keys=["w"]),
        "bytes": lambda: load_torch_bytes(path.read_bytes(), map_location="cpu"),
        "mmap": lambda: cloudckpt.load(str(path), map_location="cpu", mmap=True),
    }
    _must_refuse(in_child(lambda: _outcome(loads[entry])), entry)


def _shared_rank(rank: int, world_size: int, path: str) -> None:
    found = _outcome(lambda: cloudckpt.load(path, map_location="cpu", share=True))
    _must_refuse(found, f"share=True, rank {rank}")


def test_the_resizing_build_is_refused_by_a_shared_load(tmp_path):
    """``share=True`` on two gloo ranks (each rank reads half the records into storages
    allocated before the reads): both refuse, with a typed error."""
    from ranks import run_ranks

    run_ranks(_shared_rank, 2, str(_resize_file(tmp_path)), timeout=120)


# --- 2. BUILD on an enum member an allowed call returned (DCP .metadata) ------------------

_DCP_MD = "torch.distributed.checkpoint.metadata"


def _enum_build_metadata(newobj: bool) -> bytes:
    """A ``Metadata`` (no tensors) holding ``_MEM_FORMAT_ENCODING(0)`` BUILT with
    ``{'cloudckpt_poisoned': True}``: the member every load shares."""
    member = ops.GLOBAL(_DCP_MD, "_MEM_FORMAT_ENCODING") + ops.tuple_(ops.int_(0))
    member += ops.NEWOBJ if newobj else ops.REDUCE
    member += ops.dict_((ops.str_("cloudckpt_poisoned"), ops.NEWTRUE)) + ops.BUILD
    state = ops.dict_((ops.str_("state_dict_metadata"), ops.EMPTY_DICT), (ops.str_("held"), member))
    metadata = ops.GLOBAL(_DCP_MD, "Metadata") + ops.EMPTY_TUPLE + ops.NEWOBJ + state + ops.BUILD
    return craft.assemble(metadata)


def _enum_build(payload: bytes, where: str, how: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    member = _MEM_FORMAT_ENCODING(0)
    before = dict(vars(member))
    if how == "decode":
        from cloudckpt.format.dcp.metadata import decode_metadata

        found = _outcome(lambda: decode_metadata(payload, where + "/.metadata"))
    else:
        from cloudckpt.dcp import CloudStorageReader

        found = _outcome(lambda: CloudStorageReader(where).read_metadata())
    found["changed"] = sorted(set(vars(member).items()) ^ set(before.items()), key=str)
    found["after"] = sorted(map(str, vars(member)))
    return found


@pytest.mark.parametrize("how", ["decode", "reader"])
@pytest.mark.parametrize("newobj", [False, True], ids=["reduce", "newobj"])
def test_a_build_on_an_enum_member_changes_nothing(tmp_path, newobj, how):
    """decode_metadata and CloudStorageReader.read_metadata of a checkpoint directory:
    the member's ``__dict__`` is what it was (and the load is refused, typed)."""
    payload = _enum_build_metadata(newobj)
    (tmp_path / ".metadata").write_bytes(payload)
    found = in_child(_enum_build, payload, str(tmp_path), how)
    assert not found["changed"], f"_MEM_FORMAT_ENCODING(0) changed: {found['changed']}"
    _must_refuse(found, how)


# --- 3. a legacy size constructor with a bool among the sizes ------------------------------


def _size_constructor_file(tmp_path: Path) -> Path:
    call = ops.GLOBAL("torch", "FloatTensor") + ops.MARK
    call += ops.int_(32768) + ops.int_(16384) + ops.NEWTRUE + ops.TUPLE + ops.REDUCE
    pkl = craft.assemble(ops.dict_((ops.str_("w"), call)))
    path = tmp_path / "size.pt"
    path.write_bytes(craft.torch_archive(pkl, {}))
    return path


def test_a_size_constructor_with_a_bool_is_refused(tmp_path):
    """``FloatTensor(32768, 16384, True)``: 2 GiB of float32 under torch.load (which
    runs it); cloudckpt refuses it (UnsafeCheckpointError) and its peak stays small."""
    path = _size_constructor_file(tmp_path)
    assert path.stat().st_size < 2048  # (the tester's was 864 bytes)
    found = in_child(lambda: _peak(lambda: cloudckpt.load(str(path), map_location="cpu")))
    _must_refuse(found, "cloudckpt.load")
    assert found["refused"] == "UnsafeCheckpointError", found
    assert found["peak"] < SLACK, (
        f"peak {found['peak'] / MiB:.0f} MiB for a {path.stat().st_size}-byte file"
    )


# --- 4. a stride-0 view copied by a device rebuild -----------------------------------------

_EXPANDED = 2**27  # elements: 1 GiB of float64 from 16 floats


def _expanded_copy_file(tmp_path: Path) -> Path:
    """``{'w': _rebuild_device_tensor_from_cpu_tensor(v, float64, 'cpu', False)}``, v a
    view of a 64-byte storage as 2**27 elements with stride 0."""
    view = ops.tensor_v2(ops.storage("FloatStorage", "0", "cpu", 16), 0, [_EXPANDED], [0])
    copy = ops.call(
        "torch._utils",
        "_rebuild_device_tensor_from_cpu_tensor",
        view,
        ops.GLOBAL("torch", "float64"),
        ops.str_("cpu"),
        ops.NEWFALSE,
    )
    pkl = craft.assemble(ops.dict_((ops.str_("w"), copy)))
    path = tmp_path / "expanded.pt"
    path.write_bytes(craft.torch_archive(pkl, {"0": bytes(64)}))
    return path


def test_torch_copies_the_expanded_view_once(tmp_path):
    path = _expanded_copy_file(tmp_path)
    found = in_child(
        lambda: _peak(
            lambda: torch.load(io.BytesIO(path.read_bytes()), map_location="cpu", weights_only=True)
        )
    )
    assert found.get("accepted") == _EXPANDED * 8, found
    assert found["peak"] < _EXPANDED * 8 + SLACK, f"torch's peak {found['peak'] / MiB:.0f} MiB"


@pytest.mark.parametrize("entry", ["load", "keys", "bytes"])
def test_the_expanded_view_costs_no_more_than_under_torch(tmp_path, entry):
    """cloudckpt's peak over the load is at most torch's (one copy, 1 GiB) plus the
    file; a refusal is fine too (stricter than torch)."""
    from cloudckpt.format.torch.unpickle import load_torch_bytes

    path = _expanded_copy_file(tmp_path)
    loads = {
        "load": lambda: cloudckpt.load(str(path), map_location="cpu"),
        "keys": lambda: cloudckpt.load(str(path), map_location="cpu", keys=["w"]),
        "bytes": lambda: load_torch_bytes(path.read_bytes(), map_location="cpu"),
    }
    theirs = in_child(
        lambda: _peak(
            lambda: torch.load(io.BytesIO(path.read_bytes()), map_location="cpu", weights_only=True)
        )
    )
    ours = in_child(lambda: _peak(loads[entry]))
    if "refused" in ours:
        assert ours["typed"], ours
    allowed = theirs["peak"] + path.stat().st_size + SLACK
    assert ours["peak"] <= allowed, (
        f"{entry}: cloudckpt's peak {ours['peak'] / MiB:.0f} MiB, torch's "
        f"{theirs['peak'] / MiB:.0f} MiB ({ours})"
    )
