"""``.metadata`` from every writer CloudStorageReader reads, through the allow-list.

Each checkpoint here is written by the real writer: torch's ``FileSystemWriter``,
megatron-core's ``dist_checkpointing.save`` (the installed release, in a subprocess), and
megatron-core 0.15.3 (``data/megatron-0.15.3``, written by ``megatron_writer.py`` with
that release). Legacy ``TensorProperties`` are pickled with the class torch still ships
under its old name.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import megatron_writer  # imports megatron-core only inside its functions
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from cloudckpt.dcp import CloudStorageReader
from cloudckpt.errors import CorruptCheckpointError, UnsafeCheckpointError
from cloudckpt.format.dcp.metadata import MCoreMetadata, MCoreSavePlan, decode_metadata
from dcp_compat import SINGLE

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

HERE = Path(__file__).parent
MEGATRON_015 = HERE / "data" / "megatron-0.15.3"
_MCORE = "megatron.core.dist_checkpointing.strategies.torch"


def _objects(value: Any, seen: set[int] | None = None) -> Iterator[Any]:
    """Every object reachable from a decoded ``.metadata``."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return
    seen.add(id(value))
    yield value
    children: Any = ()
    if isinstance(value, dict):
        children = [*value.keys(), *value.values()]
    elif isinstance(value, (list, tuple)):
        children = value
    elif hasattr(value, "__dict__"):
        children = list(vars(value).values())
    for child in children:
        yield from _objects(child, seen)


def _types(metadata: Metadata) -> set[type]:
    return {type(o) for o in _objects(metadata)}


def _decode(path: Path) -> Metadata:
    return decode_metadata((path / ".metadata").read_bytes(), f"file://{path}/.metadata")


# -- torch's FileSystemWriter --------------------------------------------------------------


def test_file_system_writer_checkpoint_loads_with_a_load_id(tmp_path: Path) -> None:
    state = {"w": torch.randn(8, 3), "n": {"b": torch.arange(4)}, "step": 3}
    writer = FileSystemWriter(str(tmp_path))
    dcp.save(state, storage_writer=writer, planner=DefaultSavePlanner(), **SINGLE)
    reader = CloudStorageReader(str(tmp_path))
    out = {"w": torch.zeros(8, 3), "n": {"b": torch.zeros(4, dtype=torch.int64)}, "step": 0}
    dcp.load(out, storage_reader=reader, **SINGLE)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["n"]["b"], state["n"]["b"])
    assert out["step"] == 3
    metadata = reader.read_metadata()
    assert metadata.storage_meta is not None
    assert metadata.storage_meta.save_id == writer.save_id
    assert metadata.storage_meta.load_id == reader.load_id  # as FileSystemReader sets it
    first = reader.load_id
    reader.reset()  # a new load, a new id
    again = reader.read_metadata().storage_meta
    assert again is not None and again.load_id == reader.load_id != first


def test_metadata_without_storage_meta_gets_one_with_the_load_id(tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(2)}, storage_writer=FileSystemWriter(str(tmp_path)), **SINGLE)
    metadata = pickle.loads((tmp_path / ".metadata").read_bytes())  # our own file
    metadata.storage_meta = None
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))
    reader = CloudStorageReader(str(tmp_path))
    meta = reader.read_metadata().storage_meta
    assert meta is not None and meta.load_id == reader.load_id and meta.save_id is None


def test_legacy_tensor_properties_decode_as_todays(tmp_path: Path) -> None:
    """torch < 2.3 pickled TensorProperties from the sharded-tensor module."""
    from torch.distributed._shard.sharded_tensor.metadata import (
        TensorProperties as LegacyTensorProperties,
    )

    state = {
        "w": torch.randn(5, 4).double(),
        "c": torch.ones(2, 3).to(memory_format=torch.contiguous_format),
    }
    dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path)), **SINGLE)
    metadata = pickle.loads((tmp_path / ".metadata").read_bytes())
    for md in metadata.state_dict_metadata.values():
        md.properties = LegacyTensorProperties(dtype=md.properties.dtype)
    payload = pickle.dumps(metadata)
    assert b"torch.distributed._shard.sharded_tensor.metadata" in payload
    assert b"MEM_FORMAT_ENCODING" in payload
    (tmp_path / ".metadata").write_bytes(payload)
    decoded = _decode(tmp_path)
    properties = decoded.state_dict_metadata["w"].properties
    assert type(properties) is TensorProperties and properties.dtype == torch.float64
    assert properties.memory_format == torch.contiguous_format
    out = {"w": torch.zeros(5, 4, dtype=torch.float64), "c": torch.zeros(2, 3)}
    dcp.load(out, storage_reader=CloudStorageReader(str(tmp_path)), **SINGLE)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["c"], state["c"])


# -- megatron-core ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def megatron_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of megatron_writer.state() by the installed megatron-core's own save."""
    pytest.importorskip("megatron.core.dist_checkpointing")
    out = tmp_path_factory.mktemp("megatron") / "ckpt"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, str(HERE / "megatron_writer.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def _load_megatron(path: Path) -> dict[str, Any]:
    """The tensor and the sharded object of megatron_writer.state(), by dcp.load."""
    out: dict[str, Any] = {"w": torch.zeros(4, 3), "obj/shard_0_1": None}
    dcp.load(out, storage_reader=CloudStorageReader(str(path)), **SINGLE)
    return out


def test_megatron_checkpoint_with_all_local_plans(megatron_checkpoint: Path) -> None:
    metadata = _decode(megatron_checkpoint)
    plans = metadata.all_local_plans  # type: ignore[attr-defined]
    # megatron-core 0.15 writes its own SavePlan subclass (decoded as cloudckpt's stand-in)
    from megatron.core import package_info

    legacy = tuple(int(v) for v in package_info.__version__.split(".")[:2]) < (0, 16)
    assert [type(p) for p in plans] == [MCoreSavePlan if legacy else SavePlan]
    assert {WriteItem, WriteItemType, TensorWriteData} <= _types(metadata)
    assert {i.index.fqn for i in plans[0].items} == {"w", "obj/shard_0_1"}
    out = _load_megatron(megatron_checkpoint)
    assert torch.equal(out["w"], megatron_writer.WEIGHT)
    assert out["obj/shard_0_1"] == [megatron_writer.OBJECT]  # megatron saves a list


def test_megatron_checkpoint_loads_with_megatrons_load_planner(megatron_checkpoint: Path) -> None:
    """As TorchDistLoadShardedStrategy.load does it, with its MCoreLoadPlanner."""
    from megatron.core.dist_checkpointing.strategies.torch import MCoreLoadPlanner

    out: dict[str, Any] = {"w": torch.zeros(4, 3)}
    dcp.load(
        out,
        storage_reader=CloudStorageReader(str(megatron_checkpoint)),
        planner=MCoreLoadPlanner(),
        **SINGLE,
    )
    assert torch.equal(out["w"], megatron_writer.WEIGHT)


@pytest.fixture
def without_megatron(monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing megatron-core fails from here on, as where it is not installed."""
    for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "megatron", None)


@pytest.mark.usefixtures("without_megatron")
def test_megatron_015_checkpoint_reads_without_megatron(tmp_path: Path) -> None:
    """megatron-core 0.15's MCoreMetadata and MCoreSavePlan decode to stand-ins that keep
    their fields, on torch's base classes."""
    path = tmp_path / "ckpt"
    shutil.copytree(MEGATRON_015, path)
    metadata = _decode(path)
    assert type(metadata) is MCoreMetadata and isinstance(metadata, Metadata)
    assert metadata.mcore_data == {}
    (plan,) = metadata.all_local_plans  # type: ignore[attr-defined]
    assert type(plan) is MCoreSavePlan and isinstance(plan, SavePlan) and plan.mcore_data == {}
    assert {WriteItem, WriteItemType, TensorWriteData} <= _types(metadata)
    out = _load_megatron(path)
    assert torch.equal(out["w"], megatron_writer.WEIGHT)
    assert out["obj/shard_0_1"] == [megatron_writer.OBJECT]  # megatron saves a list


def test_every_megatron_class_is_named_in_the_fixture() -> None:
    """The 0.15.3 fixture names megatron-core's classes by their module, as it wrote them."""
    payload = (MEGATRON_015 / ".metadata").read_bytes()
    assert _MCORE.encode() in payload
    assert b"MCoreMetadata" in payload and b"MCoreSavePlan" in payload


# -- the allow-list refuses its near misses -------------------------------------------------


def _global_pickle(module: str, name: str) -> bytes:
    """A pickle that calls ``module.name()``: GLOBAL, EMPTY_TUPLE, REDUCE."""
    return b"\x80\x02c" + module.encode() + b"\n" + name.encode() + b"\n)R."


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("os", "system"),
        ("torch.distributed.checkpoint.planner", "LoadPlan"),
        ("torch.distributed.checkpoint.planner", "ReadItem"),
        ("torch.distributed.checkpoint.planner", "SavePlanner"),
        ("torch.distributed.checkpoint.planner", "BytesIOWriteData"),
        ("torch.distributed.checkpoint.metadata", "StatefulT"),
        ("torch.distributed.checkpoint.metadata", "os"),
        ("torch.distributed.checkpoint.metadata", "field"),
        ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
        ("torch.distributed.checkpoint.filesystem", "FileSystemReader"),
        ("torch.distributed._shard.sharded_tensor.metadata", "ShardMetadata"),
        (_MCORE, "MCoreSavePlanner"),
        (_MCORE, "MCoreLoadPlanner"),
        (_MCORE, "TorchDistLoadShardedStrategy"),
        ("megatron.core.dist_checkpointing.strategies", "MCoreMetadata"),
    ],
)
def test_near_misses_are_refused(module: str, name: str) -> None:
    with pytest.raises(UnsafeCheckpointError, match=rf"mem://x/\.metadata: .*{module}\.{name}"):
        decode_metadata(_global_pickle(module, name), "mem://x/.metadata")


def test_a_megatron_metadata_naming_another_planner_class_is_refused(
    megatron_checkpoint: Path, tmp_path: Path
) -> None:
    """megatron-core's real file with its save plan class turned into a load plan (same
    module, same name length so the pickle's frames still add up)."""
    payload = (megatron_checkpoint / ".metadata").read_bytes()
    if b"\x8c\x08SavePlan" in payload:  # megatron-core 0.16: torch's SavePlan
        swapped, refused = payload.replace(b"\x8c\x08SavePlan", b"\x8c\x08LoadPlan"), "planner"
    else:  # megatron-core 0.15: its own MCoreSavePlan
        swapped = payload.replace(b"\x8c\rMCoreSavePlan", b"\x8c\rMCoreLoadPlan")
        refused = "torch"
    assert swapped != payload
    path = tmp_path / "ckpt"
    shutil.copytree(megatron_checkpoint, path)
    (path / ".metadata").write_bytes(swapped)
    with pytest.raises(
        UnsafeCheckpointError, match=rf"{path}/\.metadata: .*{refused}\.\w*LoadPlan"
    ):
        CloudStorageReader(str(path)).read_metadata()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("all_local_plans", {"a": 1}, "all_local_plans is not a list"),
        ("all_local_plans", [1], "all_local_plans is not a list"),
        ("mcore_data", [1], "mcore_data is not a map"),
        ("mcore_data", {"w": 3}, "mcore_data is not a map"),
    ],
)
def test_damaged_megatron_fields_are_corrupt(
    tmp_path: Path, field: str, value: Any, message: str
) -> None:
    dcp.save({"w": torch.ones(2)}, storage_writer=FileSystemWriter(str(tmp_path)), **SINGLE)
    metadata = pickle.loads((tmp_path / ".metadata").read_bytes())  # torch's own file
    setattr(metadata, field, value)
    with pytest.raises(CorruptCheckpointError, match=message):
        decode_metadata(pickle.dumps(metadata), "mem://.metadata")


def test_stand_ins_keep_torchs_fields() -> None:
    fields = {f.name for f in dataclasses.fields(MCoreMetadata)}
    assert fields == {f.name for f in dataclasses.fields(Metadata)} | {"mcore_data"}
    fields = {f.name for f in dataclasses.fields(MCoreSavePlan)}
    assert fields == {f.name for f in dataclasses.fields(SavePlan)} | {"mcore_data"}
