"""The trust boundary (format/torch/unpickle.py) on every path that turns stored bytes into
objects, each case checked against ``torch.load(weights_only=True)`` where torch reads
the same bytes. Hostile archives are built here, opcode by opcode."""

from __future__ import annotations

import collections
import gc
import json
import pathlib
import zipfile
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

import cloudckpt
from cloudckpt import errors
from cloudckpt.format.dcp.metadata import decode_metadata
from cloudckpt.format.torch import unpickle as boundary


def _archive(pkl: bytes, path: Path, records: dict[str, bytes] | None = None) -> Path:
    """A torch-layout zip archive (stored records) whose data.pkl is ``pkl``."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pkl)
        zf.writestr("archive/byteorder", "little")
        for key, data in (records or {}).items():
            zf.writestr(f"archive/data/{key}", data)
        zf.writestr("archive/version", "3\n")
    return path


def _refused_by_both(path: Path) -> errors.CloudCkptError:
    with pytest.raises(Exception):  # noqa: B017 - torch raises several types
        torch.load(path, weights_only=True)
    with pytest.raises(errors.CloudCkptError) as ours:
        cloudckpt.load(str(path))
    return ours.value


# PROTO 2, then a storage persistent id: ('storage', <class>, '0', 'cpu', 4) over 16 bytes.
_STORAGE = (
    b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x04tQ"
)


def test_build_on_an_allowed_function_is_refused_and_changes_nothing(tmp_path):
    """BUILD onto ``torch._utils._rebuild_parameter``: slot state would set its
    ``__defaults__`` process-wide, breaking every later load."""
    before = torch._utils._rebuild_parameter.__defaults__
    pkl = b"\x80\x02ctorch._utils\n_rebuild_parameter\nN}X\x0c\x00\x00\x00__defaults__(K\x01t" + (
        b"s\x86b."
    )
    error = _refused_by_both(_archive(pkl, tmp_path / "poison.pt"))
    assert isinstance(error, errors.UnsafeCheckpointError)
    assert torch._utils._rebuild_parameter.__defaults__ == before
    path = tmp_path / "good.pt"
    torch.save({"p": torch.nn.Parameter(torch.ones(2))}, path)
    assert torch.equal(cloudckpt.load(str(path))["p"], torch.ones(2))


def test_build_on_a_storage_class_stand_in_is_refused(tmp_path):
    """BUILD onto the object torch's allow-list gives for ``torch.FloatStorage``
    (its ``_dtype`` decides how every later float32 checkpoint is read)."""
    pkl = b"\x80\x02ctorch\nFloatStorage\nN}X\x06\x00\x00\x00_dtypectorch\nint8\ns\x86b."
    error = _refused_by_both(_archive(pkl, tmp_path / "poison.pt"))
    assert isinstance(error, errors.UnsafeCheckpointError)
    path = tmp_path / "good.pt"
    torch.save({"w": torch.arange(4, dtype=torch.float32)}, path)
    assert cloudckpt.load(str(path))["w"].dtype == torch.float32


def test_newobj_ex_with_a_pointer_is_refused_not_a_crash(tmp_path):
    """NEWOBJ_EX torch.Tensor(cdata=<int>): the C unpickler made a pointer of it."""
    pkl = b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00" + (
        b"ctorch\nTensor\n)}X\x05\x00\x00\x00cdataJ\x41\x41\x41\x41s\x92."
    )
    error = _refused_by_both(_archive(pkl, tmp_path / "ptr.pt"))
    assert isinstance(error, errors.UnsafeCheckpointError)
    assert "NEWOBJ_EX" in str(error) or "FRAME" in str(error)


@pytest.mark.parametrize(
    ("name", "pkl"),
    [
        # OBJ: MARK, class, args, OBJ (calls the class)
        ("obj", b"\x80\x02(ccollections\nOrderedDict\no."),
        # INST: MARK, args, INST module name
        ("inst", b"\x80\x02(icollections\nOrderedDict\n."),
        # EXT1 code 1 (whatever copyreg maps it to)
        ("ext1", b"\x80\x02\x82\x01."),
        # ADDITEMS onto a tensor (calls tensor.add)
        ("additems", b"\x80\x02ctorch\nTensor\n)\x81(K\x01\x90."),
        # APPEND onto a bytearray built by REDUCE
        ("append_bytearray", b"\x80\x02c__builtin__\nbytearray\n)RK\x01a."),
        # BUILD with slot state onto an OrderedDict
        ("od_slots", b"\x80\x02ccollections\nOrderedDict\n)RN}X\x01\x00\x00\x00xK\x01s\x86b."),
    ],
)
def test_what_torch_refuses_cloudckpt_refuses(tmp_path, name, pkl):
    path = _archive(pkl, tmp_path / f"{name}.pt", {"0": bytes(16)})
    error = _refused_by_both(path)
    assert "weights_only=False" not in str(error) or isinstance(error, errors.UnsafeCheckpointError)


@pytest.mark.parametrize(
    ("name", "pkl"),
    [
        # a persistent id whose storage type is a tensor (cached forever before)
        (
            "tensor_storage_type",
            b"\x80\x02(X\x07\x00\x00\x00storagectorch\nTensor\n)\x81"
            b"X\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x04tQ.",
        ),
        # bytearray(2**30) through REDUCE: 1 GiB of zeros
        ("bytearray_size", b"\x80\x02c__builtin__\nbytearray\nJ\x00\x00\x00\x40\x85R."),
    ],
)
def test_where_torch_allocates_what_the_file_asks_cloudckpt_refuses(tmp_path, name, pkl):
    """Stricter than torch: a tensor as a storage type (torch reads its dtype), and the
    size constructors of bytearray, tensors and storages (torch allocates 1 GiB here)."""
    path = _archive(pkl, tmp_path / f"{name}.pt", {"0": bytes(16)})
    with pytest.raises(
        errors.UnsafeCheckpointError if name == "bytearray_size" else errors.CloudCkptError
    ):
        cloudckpt.load(str(path))


def test_a_storage_type_that_is_a_tensor_leaves_no_cache_behind(tmp_path):
    path = _archive(
        b"\x80\x02(X\x07\x00\x00\x00storagectorch\nTensor\n)\x81"
        b"X\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x04tQ.",
        tmp_path / "t.pt",
        {"0": bytes(16)},
    )
    with pytest.raises(errors.CloudCkptError):
        cloudckpt.load(str(path))
    from cloudckpt.format.torch import restricted_pickle

    module_state = [
        v for m in (boundary, restricted_pickle) for v in vars(m).values() if isinstance(v, dict)
    ]
    assert not any(isinstance(k, torch.Tensor) for d in module_state for k in d)


def test_memory_stays_bounded_over_hostile_and_benign_loads(tmp_path):
    """125 loads of hostile and benign files in one process: RSS grows by under 10 MiB."""
    benign = tmp_path / "benign.pt"
    torch.save({f"w{i}": torch.randn(256) for i in range(50)}, benign)
    hostile = [
        _archive(
            b"\x80\x02(X\x07\x00\x00\x00storagectorch\nTensor\n)\x81"
            b"X\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x04tQ.",
            tmp_path / "t.pt",
            {"0": bytes(4 << 20)},
        ),
        _archive(b"\x80\x02ctorch\nFloatStorage\nJ\x00\x00\x00\x40\x85R.", tmp_path / "s.pt"),
    ]
    # LONG_BINPUT 2**31-1: valid (torch loads it too); the C unpickler zero-filled 32 GiB.
    memo = _archive(b"\x80\x02K\x07r\xff\xff\xff\x7f.", tmp_path / "memo.pt")

    def round_() -> None:
        for path in hostile:
            with pytest.raises(errors.CloudCkptError):
                cloudckpt.load(str(path))
        assert cloudckpt.load(str(memo)) == 7
        assert len(cloudckpt.load(str(benign))) == 50

    for _ in range(5):  # warm: allocator pools, lazy imports
        round_()
    gc.collect()
    start = psutil.Process().memory_info().rss
    for _ in range(25):
        round_()  # 5 loads each: 125 in all
    gc.collect()
    grown = psutil.Process().memory_info().rss - start
    assert grown < 10 << 20, f"RSS grew {grown / 2**20:.1f} MiB over 125 loads"


def test_damage_is_corrupt_and_never_advises_turning_safety_off(tmp_path):
    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(3)}, good)
    data = good.read_bytes()
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(bytes(data[: len(data) // 2]))
    json_file = tmp_path / "state.json"
    json_file.write_text(json.dumps({"w": [1, 2, 3]}))
    text_file = tmp_path / "notes.pt"
    text_file.write_text("not a checkpoint\n")
    for path in (truncated, json_file, text_file):
        with pytest.raises(errors.CorruptCheckpointError) as info:
            cloudckpt.load(str(path))
        assert not isinstance(info.value, errors.UnsafeCheckpointError), path
        assert "weights_only=False" not in str(info.value), path


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_a_device_that_is_not_there_is_named_with_map_location(tmp_path):
    path = tmp_path / "w.pt"
    torch.save({"w": torch.ones(3)}, path)
    with pytest.raises(errors.ConfigError) as info:
        cloudckpt.load(str(path), map_location="cuda")
    assert not isinstance(info.value, errors.UnsafeCheckpointError)
    assert "map_location='cuda'" in str(info.value)
    assert "weights_only" not in str(info.value)


def test_the_switch_sends_archives_through_torchs_unpickler(tmp_path, monkeypatch):
    from torch import _weights_only_unpickler as wo

    path = tmp_path / "w.pt"
    state = collections.OrderedDict(a=torch.randn(4), b=[1, 2.5, "x"])
    torch.save(state, path)
    calls: list[int] = []
    real = wo.Unpickler.load

    def counted(self: Any) -> Any:
        calls.append(1)
        return real(self)

    monkeypatch.setattr(wo.Unpickler, "load", counted)
    ours = cloudckpt.load(str(path))
    assert not calls
    monkeypatch.setenv("CLOUDCKPT_UNPICKLER", "torch")
    theirs = cloudckpt.load(str(path))
    assert len(calls) == 1
    monkeypatch.delenv("CLOUDCKPT_UNPICKLER")
    cloudckpt.set_unpickler("torch")
    try:
        cloudckpt.load(str(path))
    finally:
        cloudckpt.set_unpickler(None)
    assert len(calls) == 2
    assert torch.equal(ours["a"], theirs["a"]) and ours["b"] == theirs["b"]
    hostile = _archive(b"\x80\x02cos\nsystem\n(X\x04\x00\x00\x00truetR.", tmp_path / "h.pt")
    monkeypatch.setenv("CLOUDCKPT_UNPICKLER", "torch")
    with pytest.raises(errors.UnsafeCheckpointError, match=r"os\.system"):
        cloudckpt.load(str(hostile))
    monkeypatch.setenv("CLOUDCKPT_UNPICKLER", "pickle")
    with pytest.raises(errors.ConfigError, match="CLOUDCKPT_UNPICKLER"):
        cloudckpt.load(str(path))
    with pytest.raises(errors.ConfigError):
        cloudckpt.set_unpickler("pickle")


def _metadata_pickle_building_onto(module: str, name: str) -> bytes:
    """Protocol 4: STACK_GLOBAL module.name, then BUILD (None, {attr: 1}) onto it."""

    def text(s: str) -> bytes:
        return b"\x8c" + bytes([len(s)]) + s.encode()

    return (
        b"\x80\x04"
        + text(module)
        + text(name)
        + b"\x93N}"
        + text("cloudckpt_poisoned")
        + b"K\x01s\x86b."
    )


@pytest.mark.parametrize(
    ("module", "name", "cls"),
    [
        ("pathlib", "PosixPath", pathlib.PosixPath),
        ("torch.distributed.checkpoint.metadata", "Metadata", Metadata),
    ],
)
def test_dcp_metadata_cannot_mutate_the_classes_it_may_name(module, name, cls):
    with pytest.raises(errors.UnsafeCheckpointError, match="BUILD"):
        decode_metadata(_metadata_pickle_building_onto(module, name), "mem://x/.metadata")
    assert not hasattr(cls, "cloudckpt_poisoned")


def test_a_lightning_load_refuses_a_hostile_checkpoint(tmp_path):
    from cloudckpt.lightning import CloudCheckpointIO

    marker = tmp_path / "ran"
    path = _archive(
        b"\x80\x02cos\nsystem\n(X" + len(f"touch {marker}").to_bytes(4, "little")
        + f"touch {marker}".encode() + b"tR.",
        tmp_path / "last.ckpt",
    )  # fmt: skip
    with pytest.raises(errors.UnsafeCheckpointError, match=r"os\.system"):
        CloudCheckpointIO().load_checkpoint(str(path))
    assert not marker.exists()


def test_a_megatron_common_state_is_loaded_through_the_boundary(tmp_path):
    from cloudckpt.megatron import load_common_state_dict
    from cloudckpt.megatron.layout import encode_config

    (tmp_path / "metadata.json").write_bytes(encode_config())
    _archive(b"\x80\x02ctorch._utils\n_rebuild_parameter\nN}b.", tmp_path / "common.pt")
    with pytest.raises(errors.UnsafeCheckpointError, match="BUILD"):
        load_common_state_dict(str(tmp_path))
    torch.save({"iteration": 7, "args": None}, tmp_path / "common.pt")
    assert load_common_state_dict(str(tmp_path)) == {"iteration": 7, "args": None}


def test_dcp_byte_items_never_reach_a_full_unpickle(tmp_path, monkeypatch):
    """A byte item that makes torch's weights-only check raise TypeError (not an
    UnpicklingError) was once handed to the planner's torch.load(weights_only=False)."""
    import torch.distributed.checkpoint as dcp

    from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter

    url = str(tmp_path / "ckpt")
    dcp.save(
        {"w": torch.ones(2), "extra": {"note": "x"}},
        storage_writer=CloudStorageWriter(url),
        no_dist=True,
    )
    full_loads: list[Any] = []
    real = torch.load

    def watched(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("weights_only") is False:
            full_loads.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", watched)
    state: dict[str, Any] = {"w": torch.zeros(2), "extra": {"note": ""}}
    dcp.load(state, storage_reader=CloudStorageReader(url), no_dist=True)
    assert state["extra"] == {"note": "x"} and torch.equal(state["w"], torch.ones(2))
    assert not full_loads
    # The hostile byte item: BUILD (False, None, None) onto a tensor, then os.system.
    pkl = (
        b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n(" + _STORAGE + b"K\x00K\x04\x85K\x01\x85"
        b"\x89ccollections\nOrderedDict\n)RtR(\x89NNtbcos\nsystem\n(X\x04\x00\x00\x00truetR."
    )
    _archive(pkl, tmp_path / "h.pt", {"0": bytes(16)})
    with pytest.raises(errors.CloudCkptError):  # set_(False, None, None) fails: refused
        boundary.load_torch_bytes((tmp_path / "h.pt").read_bytes())
    assert not full_loads


def test_a_sparse_tensor_with_indices_out_of_range_is_refused_as_torch_refuses_it(tmp_path):
    """torch validates sparse tensors after unpickling where invariant checks are on
    (their indices would be read out of bounds later); so does the boundary, through
    torch's own queue, which it leaves empty."""
    bad = torch.sparse_coo_tensor(
        torch.tensor([[7]]), torch.tensor([1.0]), (4,), check_invariants=False
    )
    path = tmp_path / "sparse.pt"
    torch.save({"s": bad}, path)
    with torch.sparse.check_sparse_tensor_invariants():  # torch checks only when asked
        with pytest.raises(RuntimeError):
            torch.load(path, weights_only=True)
        with pytest.raises(errors.CorruptCheckpointError, match="sparse"):
            cloudckpt.load(str(path))
    assert not torch._utils._sparse_tensors_to_validate
    ours, theirs = cloudckpt.load(str(path)), torch.load(path, weights_only=True)
    assert torch.equal(ours["s"]._indices(), theirs["s"]._indices())


@pytest.mark.parametrize("device", [b"meta", b"cuda"])
@pytest.mark.parametrize("through", ["file", "bytes"])
def test_a_device_rebuild_gets_the_bytes_and_the_map_location_torch_gives_it(
    tmp_path, through, device
):
    """``_rebuild_device_tensor_from_cpu_tensor(t, uint8, 'meta', False)`` copies ``t``
    when it runs, to the device ``map_location`` maps 'meta' to: after the record's bytes
    are in, and to 'cpu' under map_location='cpu', as in torch.load."""
    pkl = (
        b"\x80\x02ctorch._utils\n_rebuild_device_tensor_from_cpu_tensor\n("
        b"ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storagectorch\n"
        b"BFloat16Storage\nX\x01\x00\x00\x003X\x03\x00\x00\x00cpuK\x04tQK\x00K\x04\x85"
        b"K\x01\x85\x89ccollections\nOrderedDict\n)RtRctorch\nuint8\n"
        b"X\x04\x00\x00\x00" + device + b"\x89tR."
    )
    record = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16).view(torch.uint8)
    path = _archive(pkl, tmp_path / "device.pt", {"3": bytes(record.tolist())})
    theirs = torch.load(path, weights_only=True, map_location="cpu")
    if through == "file":
        ours = cloudckpt.load(str(path), map_location="cpu")
    else:
        ours = boundary.load_torch_bytes(path.read_bytes(), map_location="cpu")
    assert ours.device == theirs.device == torch.device("cpu")
    assert torch.equal(ours, theirs) and theirs.abs().sum() > 0
