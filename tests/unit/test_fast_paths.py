"""The fast paths of _runtime/ behind one switch (docs/runtime.md).

With ``CLOUDCKPT_FAST_PATHS=0`` or ``set_fast_paths(False)`` every trick is off and the
plain path gives the same results: the same archive bytes, the same loaded tensors
(values, dtypes, layouts, shared storages). With the tricks made to raise, the plain
path still works, so none of them is called. The probe registry turns a trick whose
check fails off, once, with a DEBUG record. And a save, load or snapshot leaves the
host's collector as it found it: enabled or not, its thresholds, its frozen objects.
"""

from __future__ import annotations

import collections
import ctypes
import gc
import io
import json
import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import cloudckpt
from cloudckpt._runtime import (
    fast_paths,
    gc_freeze,
    gcpause,
    memview,
    pages,
    probes,
    set_fast_paths,
    set_gc_freeze,
    switch,
)
from cloudckpt.engine import load as load_module
from cloudckpt.errors import ConfigError
from cloudckpt.format.dcp import tensor_archive
from cloudckpt.format.torch import archive_writer, unpickle, ziprecords
from dtypes import DTYPES

REPO = Path(__file__).resolve().parents[2]


# --- switching ---------------------------------------------------------------------------


@pytest.fixture
def fast_off() -> Iterator[None]:
    set_fast_paths(False)
    yield
    set_fast_paths(None)


@pytest.fixture
def fast_on() -> Iterator[None]:
    set_fast_paths(True)
    yield
    set_fast_paths(None)


@pytest.fixture
def freeze_opt_in() -> Iterator[None]:
    set_gc_freeze(True)
    yield
    set_gc_freeze(None)


_unfreeze, _enable = gc.unfreeze, gc.enable  # the real ones, for clean-ups


def _raiser(name: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"{name} was called with the fast paths off")

    return refuse


#: Every trick, by the module that holds it and its name there.
_TRICKS = {
    "memmove": (ctypes, "memmove"),
    "PyMemoryView_FromMemory": (memview, "_from_memory"),
    "PyObject_GetBuffer": (memview, "_get_buffer"),
    "copy_memory": (memview, "copy_memory"),
    "writable_view": (memview, "writable_view"),
    "buffer_address": (memview, "buffer_address"),
    "archive builder": (archive_writer, "_plan"),
    "one-tensor archive layout": (archive_writer, "_single"),
    "tensor archive builder": (tensor_archive, "_build"),
    "the serialization id's name hash": (ziprecords, "name_hash"),
    "fast rebuild": (unpickle, "_rebuilder"),
    "fast TypedStorage": (unpickle, "_new_object"),
    "gc.disable": (gc, "disable"),
    "gc.freeze": (gc, "freeze"),
    "gc.unfreeze": (gc, "unfreeze"),
}


@pytest.fixture
def tricks_refused(fast_off: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every trick raises: here and wherever a module of ours imported it by name."""
    import cloudckpt.dcp.reader
    import cloudckpt.dcp.slices
    import cloudckpt.dcp.writer
    import cloudckpt.engine.safetensors
    import cloudckpt.engine.staging  # noqa: F401

    for name, (module, attr) in _TRICKS.items():
        real = getattr(module, attr)
        refuse = _raiser(name)
        monkeypatch.setattr(module, attr, refuse)
        for loaded in list(sys.modules.values()):
            if getattr(loaded, "__name__", "").startswith("cloudckpt."):
                for key, value in list(vars(loaded).items()):
                    if value is real:
                        monkeypatch.setattr(loaded, key, refuse)
    monkeypatch.setattr(pages, "_call", [_raiser("madvise")])


def test_the_environment_variable_is_read_once_and_the_api_overrides_it(monkeypatch):
    monkeypatch.setenv(switch.FAST_PATHS_ENV, "0")
    set_fast_paths(None)
    try:
        assert not fast_paths()
        monkeypatch.setenv(switch.FAST_PATHS_ENV, "1")
        assert not fast_paths()  # read once
        set_fast_paths(True)
        assert fast_paths()
        set_fast_paths(None)  # follow the variable again, read anew
        assert fast_paths()
        for text, on in (("off", False), ("No", False), ("true", True), ("", True)):
            monkeypatch.setenv(switch.FAST_PATHS_ENV, text)
            set_fast_paths(None)
            assert fast_paths() is on
        monkeypatch.setenv(switch.FAST_PATHS_ENV, "fast")
        set_fast_paths(None)
        with pytest.raises(ConfigError, match="CLOUDCKPT_FAST_PATHS"):
            fast_paths()
    finally:
        set_fast_paths(None)


def test_the_gc_freeze_is_off_unless_asked_for(monkeypatch):
    monkeypatch.delenv(switch.GC_FREEZE_ENV, raising=False)
    set_gc_freeze(None)
    try:
        assert not gc_freeze()
        monkeypatch.setenv(switch.GC_FREEZE_ENV, "1")
        set_gc_freeze(None)
        assert gc_freeze()
        set_gc_freeze(False)
        assert not gc_freeze()
    finally:
        set_gc_freeze(None)


# --- the probe registry ----------------------------------------------------------------


def test_a_failed_check_turns_its_trick_off_once_and_logs_it_at_debug(fast_on, caplog):
    calls: list[int] = []

    def check() -> None:
        calls.append(1)
        raise ValueError("the bytes differ")

    probes.register("test_failing", check)
    with caplog.at_level(logging.DEBUG, logger="cloudckpt"):
        assert [probes.on("test_failing") for _ in range(3)] == [False] * 3
    assert calls == [1]
    records = [r for r in caplog.records if "test_failing" in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.DEBUG
    assert "the bytes differ" in records[0].getMessage()
    assert probes.results()["test_failing"] is False
    probes.forget("test_failing")
    assert probes.outcome("test_failing") is None
    assert not probes.on("test_failing") and calls == [1, 1]


def test_a_passing_check_runs_once_and_no_check_runs_with_the_fast_paths_off(monkeypatch):
    calls: list[int] = []
    probes.register("test_passing", lambda: calls.append(1))
    set_fast_paths(False)
    try:
        assert not probes.on("test_passing") and not calls
        set_fast_paths(True)
        assert probes.on("test_passing") and probes.on("test_passing")
        assert calls == [1]
        set_fast_paths(False)
        assert not probes.on("test_passing")  # the switch wins over a passed check
    finally:
        set_fast_paths(None)


def test_every_self_checking_trick_is_registered_and_passes_here(fast_on):
    found = cloudckpt._runtime.fast_path_checks()
    expected = {
        "fast_rebuild",
        "gil_held_copy",
        "madvise_populate",
        "memory_views",
        "torch_archive",
        "typed_storage",
    }
    assert expected <= set(found)
    for name in expected - {"madvise_populate"}:  # that one needs Linux 5.14+
        assert probes.on(name), name


def test_a_builder_that_disagrees_with_torch_save_is_off_and_saves_stay_torch_saves(
    fast_on, monkeypatch, tmp_path
):
    monkeypatch.setitem(probes._results, archive_writer.PROBE, None)  # run the check again
    monkeypatch.setattr(archive_writer, "torch_save", lambda obj: b"other bytes")
    assert not archive_writer.writer_on() and not tensor_archive.archive_builder_on()
    state = _state()
    cloudckpt.save(state, tmp_path / "a.pt")
    assert (tmp_path / "a.pt").read_bytes() == _torch_save(state)


# --- the same results both ways ---------------------------------------------------------


def _state() -> dict[str, Any]:
    """Every dtype, views and shared storages, a storage sent from its own memory, a
    Parameter, and plain Python values."""
    g = torch.Generator().manual_seed(0)
    state: dict[str, Any] = {
        str(dtype): torch.randint(0, 100, (6, 5), generator=g).to(dtype) for dtype in DTYPES
    }
    base = torch.randn(64, 64, generator=g)
    state.update(
        base=base,
        rows=base[8:24],
        transposed=base.t(),
        big=torch.randn(1 << 18, generator=g),  # 1 MiB: sent from its own memory
        param=torch.nn.Parameter(torch.randn(3, generator=g)),
        empty=torch.empty(0, dtype=torch.int64),
        scalar=torch.tensor(2.5),
        meta={"step": 7, "lr": 0.1, "nested": [torch.arange(5), (1, "x", None)]},
    )
    return state


def _torch_save(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _tensors(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{path}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{path}/{i}")


def _assert_same(got: Any, want: Any) -> None:
    """The same structure and values; tensors of the same type, dtype, layout, bytes and
    grad flag; storages shared between the same tensors."""
    assert _skeleton(got) == _skeleton(want)
    got_t, want_t = dict(_tensors(got)), dict(_tensors(want))
    assert got_t.keys() == want_t.keys()
    for path, w in want_t.items():
        g = got_t[path]
        assert type(g) is type(w), path
        assert (g.dtype, g.shape, g.stride(), g.storage_offset()) == (
            w.dtype,
            w.shape,
            w.stride(),
            w.storage_offset(),
        ), path
        assert g.requires_grad == w.requires_grad, path
        assert _bytes(g) == _bytes(w), path

    def sharing(tensors: dict[str, torch.Tensor]) -> set[frozenset[str]]:
        by_storage: dict[int, set[str]] = collections.defaultdict(set)
        for path, t in tensors.items():
            if t.numel():
                by_storage[t.untyped_storage().data_ptr()].add(path)
        return {frozenset(paths) for paths in by_storage.values()}

    assert sharing(got_t) == sharing(want_t)


def _bytes(t: torch.Tensor) -> bytes:
    """A tensor's elements' bytes, in order."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _skeleton(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return "tensor"
    if isinstance(obj, dict):
        return {k: _skeleton(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_skeleton(v) for v in obj)
    return obj


def test_save_and_load_give_the_same_results_with_the_tricks_refused(tricks_refused, tmp_path):
    state = _state()
    reference = _torch_save(state)
    cloudckpt.save(state, tmp_path / "off.pt")
    assert (tmp_path / "off.pt").read_bytes() == reference  # torch.save's bytes
    (tmp_path / "ref.pt").write_bytes(reference)
    _assert_same(cloudckpt.load(tmp_path / "ref.pt"), state)
    _assert_same(
        cloudckpt.load(tmp_path / "ref.pt", keys=["base", "rows"]),
        {
            "base": state["base"],
            "rows": state["rows"],
        },
    )
    cloudckpt.async_save(state, tmp_path / "async.pt").result()
    assert (tmp_path / "async.pt").read_bytes() == reference


def test_save_and_load_give_the_same_results_both_ways(tmp_path):
    state = _state()
    set_fast_paths(True)
    try:
        cloudckpt.save(state, tmp_path / "on.pt")
        loaded_on = cloudckpt.load(tmp_path / "on.pt")
        cloudckpt.async_save(state, tmp_path / "async-on.pt").result()
        set_fast_paths(False)
        cloudckpt.save(state, tmp_path / "off.pt")
        loaded_off = cloudckpt.load(tmp_path / "on.pt")
        cloudckpt.async_save(state, tmp_path / "async-off.pt").result()
    finally:
        set_fast_paths(None)
    on = (tmp_path / "on.pt").read_bytes()
    assert on == (tmp_path / "off.pt").read_bytes() == _torch_save(state)
    assert on == (tmp_path / "async-on.pt").read_bytes() == (tmp_path / "async-off.pt").read_bytes()
    _assert_same(loaded_on, state)
    _assert_same(loaded_off, state)


def _dcp_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    big = torch.randn(256, 512, generator=g)  # 512 KiB: read by slices, its own memory
    state: dict[str, Any] = {
        f"t_{str(dtype).split('.')[1]}": torch.randint(0, 100, (40,), generator=g).to(dtype)
        for dtype in DTYPES
    }
    state.update(
        big=big,
        shard=big[64:192],  # a view into a larger storage: its bytes alone are saved
        small=torch.randn(16, 16, generator=g),
        step=3,
        extra={"name": "run", "lr": 0.5},
    )
    return state


def _dcp_round_trip(tmp_path: Path, name: str, state: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter

    url = str(tmp_path / name)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=CloudStorageWriter(url))
        target: dict[str, Any] = {
            k: torch.empty_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)
        }
        target.update(step=0, extra={"name": "", "lr": 0.0})
        dcp.load(target, storage_reader=CloudStorageReader(url))
    return target


def test_a_dcp_save_and_load_give_the_same_results_both_ways(tmp_path):
    state = _dcp_state()
    set_fast_paths(True)
    try:
        on = _dcp_round_trip(tmp_path, "on", state)
        set_fast_paths(False)
        off = _dcp_round_trip(tmp_path, "off", state)
    finally:
        set_fast_paths(None)
    for got in (on, off):
        assert got["step"] == 3 and got["extra"] == state["extra"]
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                assert got[k].dtype == v.dtype and _bytes(got[k]) == _bytes(v), k
    # A tensor's archive is torch.save's either way: the data objects are alike.
    data_objects = sorted((tmp_path / "on").rglob("*.distcp"))
    assert data_objects
    for data in data_objects:
        twin = tmp_path / "off" / data.relative_to(tmp_path / "on")
        assert data.read_bytes() == twin.read_bytes(), data.name


def test_a_dcp_save_and_load_work_with_the_tricks_refused(tricks_refused, tmp_path):
    state = _dcp_state()
    got = _dcp_round_trip(tmp_path, "off", state)
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert _bytes(got[k]) == _bytes(v), k


def _st_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    state = {
        f"t.{str(dtype).split('.')[1]}": torch.randint(0, 100, (33, 7), generator=g).to(dtype)
        for dtype in DTYPES
        if not dtype.is_complex  # safetensors has no complex dtypes
    }
    state["big"] = torch.randn(1 << 18, generator=g)
    return state


def test_safetensors_give_the_same_results_both_ways(tmp_path):
    state = _st_state()
    set_fast_paths(True)
    try:
        cloudckpt.save_safetensors(state, tmp_path / "on.safetensors")
        loaded_on = cloudckpt.load_safetensors(tmp_path / "on.safetensors")
        set_fast_paths(False)
        cloudckpt.save_safetensors(state, tmp_path / "off.safetensors")
        loaded_off = cloudckpt.load_safetensors(tmp_path / "on.safetensors")
    finally:
        set_fast_paths(None)
    on = (tmp_path / "on.safetensors").read_bytes()
    assert on == (tmp_path / "off.safetensors").read_bytes()
    _assert_same(loaded_on, state)
    _assert_same(loaded_off, state)


def test_safetensors_work_with_the_tricks_refused(tricks_refused, tmp_path):
    state = _st_state()
    cloudckpt.save_safetensors(state, tmp_path / "m.safetensors")
    _assert_same(cloudckpt.load_safetensors(tmp_path / "m.safetensors"), state)


_CHILD = """
import hashlib, json, sys, torch, cloudckpt
from cloudckpt._runtime import fast_path_checks, fast_paths
assert not fast_paths()
state = torch.load(sys.argv[1], weights_only=True)
cloudckpt.save(state, sys.argv[2])
got = cloudckpt.load(sys.argv[3])
digest = hashlib.sha256()
for k in sorted(got):
    t = got[k].detach().contiguous()
    digest.update(k.encode() + str((t.dtype, t.shape)).encode())
    digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
print(json.dumps({"digest": digest.hexdigest(), "checks": fast_path_checks()}))
"""


def _digest(state: dict[str, torch.Tensor]) -> str:
    import hashlib

    digest = hashlib.sha256()
    for k in sorted(state):
        t = state[k].detach().contiguous()
        digest.update(k.encode() + str((t.dtype, t.shape)).encode())
        digest.update(_bytes(t))
    return digest.hexdigest()


def test_the_environment_variable_turns_them_off_in_a_fresh_process(tmp_path):
    state = {k: v for k, v in _state().items() if isinstance(v, torch.Tensor)}
    state = {k: v.detach().clone() for k, v in state.items()}  # one storage each
    torch.save(state, tmp_path / "state.pt")
    set_fast_paths(True)
    try:
        cloudckpt.save(state, tmp_path / "on.pt")
    finally:
        set_fast_paths(None)
    env = {**os.environ, switch.FAST_PATHS_ENV: "0"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    args = [str(tmp_path / "state.pt"), str(tmp_path / "off.pt"), str(tmp_path / "on.pt")]
    run = subprocess.run(
        [sys.executable, "-c", _CHILD, *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    answer = json.loads(run.stdout.strip().splitlines()[-1])
    assert not any(answer["checks"].values())  # no check ran: every trick stayed off
    assert (tmp_path / "off.pt").read_bytes() == (tmp_path / "on.pt").read_bytes()
    assert answer["digest"] == _digest(state)


# --- the host's collector ---------------------------------------------------------------


def _gc_state() -> tuple[bool, tuple[int, ...], int]:
    return gc.isenabled(), gc.get_threshold(), gc.get_freeze_count()


def _young() -> set[int]:
    return {id(o) for o in gc.get_objects(generation=0) + gc.get_objects(generation=1)}


def _many(n: int = 3000) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.randn(4) for i in range(n)}


@pytest.fixture
def host_gc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A host with its own thresholds (restored after), that never asks for a freeze."""
    threshold = gc.get_threshold()
    gc.set_threshold(1234, 11, 12)
    monkeypatch.setattr(gc, "freeze", _raiser("gc.freeze"))
    monkeypatch.setattr(gc, "unfreeze", _raiser("gc.unfreeze"))
    yield
    gc.set_threshold(*threshold)


def test_save_load_and_async_save_leave_the_collector_as_they_found_it(fast_on, host_gc, tmp_path):
    before = _gc_state()
    cloudckpt.save(_many(), tmp_path / "a.pt")
    assert _gc_state() == before
    cloudckpt.load(tmp_path / "a.pt")  # (gc.freeze would raise: nothing moved unasked)
    assert _gc_state() == before
    cloudckpt.async_save(_many(), tmp_path / "b.pt").result()
    assert _gc_state() == before
    cloudckpt.save_safetensors(_many(100), tmp_path / "m.safetensors")
    cloudckpt.load_safetensors(tmp_path / "m.safetensors")
    assert _gc_state() == before


def test_a_load_pauses_the_collector_while_it_unpickles(fast_on, monkeypatch, tmp_path):
    cloudckpt.save(_many(10), tmp_path / "a.pt")
    seen: list[bool] = []
    real = load_module.unpickle

    def spying(*args: Any, **kwargs: Any) -> Any:
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(load_module, "unpickle", spying)
    cloudckpt.load(tmp_path / "a.pt")
    assert seen == [False] and gc.isenabled()
    set_fast_paths(False)
    cloudckpt.load(tmp_path / "a.pt")
    assert seen == [False, True]  # the plain path leaves the collector alone


def test_a_host_that_disabled_its_collector_finds_it_disabled(fast_on, monkeypatch, tmp_path):
    monkeypatch.setattr(gc, "enable", _raiser("gc.enable"))
    gc.disable()
    try:
        cloudckpt.save(_many(100), tmp_path / "a.pt")
        cloudckpt.load(tmp_path / "a.pt")
        cloudckpt.async_save(_many(100), tmp_path / "b.pt").result()
        cloudckpt.save_safetensors(_many(100), tmp_path / "m.safetensors")
        assert not gc.isenabled()
    finally:
        _enable()


def test_objects_the_host_froze_stay_frozen(fast_on, monkeypatch, tmp_path):
    cloudckpt.save(_many(), tmp_path / "a.pt")
    kept = [object() for _ in range(100)]
    gc.collect()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        monkeypatch.setattr(gc, "unfreeze", _raiser("gc.unfreeze"))  # it would thaw them
        cloudckpt.load(tmp_path / "a.pt")
        cloudckpt.async_save(_many(), tmp_path / "b.pt").result()
        # Frozen objects freed meanwhile leave the count; an unfreeze would empty it.
        assert kept and frozen // 2 < gc.get_freeze_count() <= frozen
    finally:
        _unfreeze()


def test_asked_for_the_freeze_a_load_moves_what_it_built_to_the_oldest_generation(
    fast_on, freeze_opt_in, monkeypatch, tmp_path
):
    monkeypatch.setattr(gcpause, "_frozen_until", 0.0)
    cloudckpt.save(_many(), tmp_path / "g.pt")
    assert gc.get_freeze_count() == 0
    got = cloudckpt.load(tmp_path / "g.pt")
    young = _young()
    assert id(got) not in young and not any(id(t) in young for t in got.values())
    assert gc.get_freeze_count() == 0 and gc.isenabled()
