"""Fuzzed manifests: DCP's ``.metadata``, cloudckpt's layout index, the manager's markers.

Whatever a manifest holds, loading returns exactly what was saved or raises a cloudckpt
error (a CloudCkptError subclass): never another exception from cloudckpt's code, never
a wrong tensor, never code run from a manifest, never a file written outside the
checkpoint. Errors torch's own planner raises for a well-formed ``.metadata`` that does
not match the state dict ("Missing key", "Size mismatch") are torch's and allowed; they
carry no cloudckpt frame.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import io
import json
import os
import pickle
import shutil
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

import cloudckpt
from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter
from cloudckpt.errors import CloudCkptError
from cloudckpt.format.dcp.metadata import decode_metadata
from cloudckpt.manager.marker import MARKER_NAME, decode_marker
from dcp_compat import SINGLE

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

FUZZ = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
SENTINEL = "pwned-by-a-manifest"


def _state() -> dict[str, Any]:
    """Tensors of distinct shapes and dtypes (a mix-up cannot pass as right), one byte item."""
    g = torch.Generator().manual_seed(5)
    return {
        "w": torch.randn(160, 512, generator=g),  # 320 KiB: read by slices, 5 blocks
        "emb": torch.randn(100, 400, generator=g).double(),  # 320 KB, another dtype
        "b": torch.arange(12, dtype=torch.int32),
        "h": torch.randn(3, 5, generator=g).double(),
        "step": 11,
    }


STATE = _state()


def _empty() -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in STATE.items()}


def _exact(out: dict[str, Any]) -> bool:
    return all(
        torch.equal(out[k], v) and out[k].dtype == v.dtype
        if isinstance(v, torch.Tensor)
        else out[k] == v and type(out[k]) is type(v)
        for k, v in STATE.items()
    )


PACKAGE = Path(cloudckpt.__file__).resolve().parent


def _check_failure(exc: BaseException, frames: traceback.StackSummary) -> None:
    """A failure is a cloudckpt error, or torch's own, raised with no cloudckpt code on
    the stack (its planner refusing a well-formed metadata that does not fit)."""
    if isinstance(exc, CloudCkptError):
        return
    # The package's own files, wherever the checkout is (a clone named "cloudckpt" holds
    # torch under cloudckpt/.venv/ too).
    ours = [f for f in frames if Path(f.filename).resolve().is_relative_to(PACKAGE)]
    assert not ours, f"cloudckpt code raised {type(exc).__name__}: {exc}\n{ours}"


def _load(url: str) -> dict[str, Any] | None:
    """dcp.load of the whole state: the result, or None after an allowed failure."""
    out = _empty()
    try:
        dcp.load(out, storage_reader=CloudStorageReader(url), **SINGLE)
    except CheckpointException as exc:
        for error, frames in exc.failures.values():
            _check_failure(error, frames)
            event(f"load: {type(error).__name__}")
        return None
    except Exception as exc:  # no_dist: torch lets a rank's error through unwrapped
        _check_failure(exc, traceback.extract_tb(exc.__traceback__))
        event(f"load: {type(exc).__name__}")
        return None
    event("load: exact" if _exact(out) else "load: WRONG")
    return out


class _Planner:
    def __init__(self, target: torch.Tensor) -> None:
        self.target = target

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        return self.target

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        pass

    def load_bytes(self, item: ReadItem, value: io.BytesIO) -> None:
        raise AssertionError("no byte items here")


def _slice_of_w(url: str) -> None:
    """Rows 37..97 of ``w`` (a partial read with its blocks); exact or a cloudckpt error."""
    try:
        reader = CloudStorageReader(url)
        reader.set_up_storage_reader(reader.read_metadata(), True)
        target = torch.zeros(60, 512)
        item = ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=MetadataIndex("w"),
            dest_offsets=torch.Size([0, 0]),
            storage_index=MetadataIndex("w", torch.Size([0, 0])),
            storage_offsets=torch.Size([37, 0]),
            lengths=torch.Size([60, 512]),
        )
        reader.read_data(LoadPlan([item]), _Planner(target)).wait()
    except CloudCkptError as exc:
        event(f"slice: {type(exc).__name__}")
        return
    event("slice: exact")
    assert torch.equal(target, STATE["w"][37:97]), "a wrong slice loaded silently"


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "ckpt"
    dcp.save(STATE, storage_writer=CloudStorageWriter(str(path)), **SINGLE)
    return path


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A working directory (the cwd) whose files outside ``ckpt/`` must not change."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outside.distcp").write_bytes(b"PK\x03\x04" + bytes(4096))
    before = _files(tmp_path)
    yield tmp_path
    assert _files(tmp_path) == before, "a file outside the checkpoint appeared or changed"
    assert not (tmp_path / SENTINEL).exists()


def _files(root: Path) -> dict[str, float]:
    return {
        str(p.relative_to(root)): p.stat().st_mtime
        for p in root.rglob("*")
        if p.is_file() and "ckpt" not in p.relative_to(root).parts
    }


def _fresh(template: Path, workdir: Path) -> Path:
    target = workdir / "ckpt"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(template, target)
    return target


# -- byte-level mutations ------------------------------------------------------------------


_position = st.integers(0, 1 << 16)
mutation = st.one_of(
    st.tuples(st.just("flip"), _position, st.integers(0, 7)),
    st.tuples(st.just("truncate"), _position, st.just(0)),
    st.tuples(st.just("insert"), _position, st.integers(1, 16)),
    st.tuples(st.just("zero"), _position, st.integers(1, 64)),
    st.tuples(st.just("byte"), _position, st.integers(0, 255)),
)


def _mutate(data: bytes, ops: list[tuple[str, int, int]]) -> bytes:
    """Apply ``ops``; a position is taken modulo the current length."""
    buf = bytearray(data)
    for op, position, arg in ops:
        pos = position % (len(buf) + (op == "insert")) if buf else 0
        if op == "flip" and buf:
            buf[pos] ^= 1 << arg
        elif op == "truncate":
            del buf[pos:]
        elif op == "insert":
            buf[pos:pos] = bytes((pos * 7 + i) % 256 for i in range(arg))
        elif op == "zero":
            buf[pos : pos + arg] = bytes(len(buf[pos : pos + arg]))
        elif op == "byte" and buf:
            buf[pos] = arg
    return bytes(buf)


def _check_metadata(path: Path, payload: bytes, what: str) -> None:
    """``payload`` (now ``path``'s .metadata) decodes, reads and loads exactly, or is
    refused with a cloudckpt error; never a silently wrong state."""
    with contextlib.suppress(CloudCkptError):
        decode_metadata(payload, "mem://.metadata")
    try:
        CloudStorageReader(str(path)).read_metadata()
    except CloudCkptError as exc:
        event(f"read_metadata: {type(exc).__name__}")
        return
    out = _load(str(path))
    assert out is None or _exact(out), f"silently wrong state {what}"
    _slice_of_w(str(path))


@FUZZ
@given(ops=st.lists(mutation, min_size=1, max_size=3), keep_layout=st.booleans())
def test_mutated_dcp_metadata_bytes(
    template: Path, workdir: Path, ops: list[tuple[str, int, int]], keep_layout: bool
) -> None:
    path = _fresh(template, workdir)
    payload = _mutate((path / ".metadata").read_bytes(), ops)
    (path / ".metadata").write_bytes(payload)
    if not keep_layout:  # no CRC-32 of .metadata: every check behind it is exercised
        (path / ".cloudckpt-layout.json").unlink()
    _check_metadata(path, payload, f"after {ops}")


# -- generated pickles of allow-listed-looking structures ------------------------------------


class _RunsCode:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {SENTINEL}",))


def _imports(module: str, name: str) -> bytes:
    """A pickle that calls ``module.name()``: GLOBAL, EMPTY_TUPLE, REDUCE."""
    return b"\x80\x02c" + module.encode() + b"\n" + name.encode() + b"\n)R."


_NASTY_PATHS = ["..", "../outside.distcp", "/etc/passwd", "a\x00b", "", "a//b", "d00/../x"]
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.integers(0, 700_000),
    st.floats(),
    st.text(max_size=12),
    st.sampled_from(["w", "emb", "b", "h", "step", "__0_0.distcp", *_NASTY_PATHS]),
    st.binary(max_size=8),
    st.sampled_from([torch.float32, torch.float64, torch.int32, torch.uint8, torch.bool]),
    st.lists(st.integers(-3, 600), max_size=3).map(torch.Size),
)
_values = st.recursive(
    _scalars,
    lambda kids: st.one_of(
        st.lists(kids, max_size=3),
        st.dictionaries(st.text(max_size=4), kids, max_size=3),
        st.tuples(kids, kids),
    ),
    max_leaves=8,
)


def _template_metadata(template: Path) -> Any:
    return pickle.loads((template / ".metadata").read_bytes())  # our own file: trusted


def _targets(meta: Any) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = [("save_id", None), ("storage_meta", None)]
    out += [("planner_data", None), ("version", None), ("state", None), ("storage", None)]
    for fqn in meta.state_dict_metadata:
        out += [(f"sdm.{part}", fqn) for part in ("entry", "size", "chunks", "dtype")]
        out += [(f"chunk.{part}", fqn) for part in ("offsets", "sizes", "object")]
    for index in meta.storage_data:
        out += [(f"info.{part}", index) for part in ("relative_path", "offset", "length")]
        out += [("info.entry", index), ("info.key", index)]
    return out


def _apply(meta: Any, target: tuple[str, Any], value: Any) -> Any:
    meta = copy.deepcopy(meta)
    kind, key = target
    if kind == "save_id" and meta.storage_meta is not None:
        meta.storage_meta.save_id = value
    elif kind in ("storage_meta", "planner_data", "version"):
        setattr(meta, kind, value)
    elif kind == "state":
        meta.state_dict_metadata = value
    elif kind == "storage":
        meta.storage_data = value
    elif kind == "sdm.entry":
        meta.state_dict_metadata[key] = value
    elif kind.startswith("sdm.") and hasattr(meta.state_dict_metadata[key], "chunks"):
        md = meta.state_dict_metadata[key]
        if kind == "sdm.dtype":
            md.properties.dtype = value
        else:
            setattr(md, kind.removeprefix("sdm."), value)
    elif kind.startswith("chunk.") and getattr(meta.state_dict_metadata[key], "chunks", None):
        chunks = meta.state_dict_metadata[key].chunks
        if kind == "chunk.object":
            chunks[0] = value
        else:
            setattr(chunks[0], kind.removeprefix("chunk."), value)
    elif kind == "info.entry":
        meta.storage_data[key] = value
    elif kind == "info.key":
        meta.storage_data[value if _hashable(value) else repr(value)] = meta.storage_data.pop(key)
    elif kind.startswith("info."):
        setattr(meta.storage_data[key], kind.removeprefix("info."), value)
    return meta


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


_dangerous = st.sampled_from(
    [
        ("os", "system"),
        ("builtins", "eval"),
        ("builtins", "exec"),
        ("subprocess", "Popen"),
        ("torch", "load"),
        ("torch.serialization", "load"),
        ("shutil", "rmtree"),
        ("pathlib", "Path"),
        ("torch.distributed.checkpoint.filesystem", "FileSystemReader"),
    ]
)


@FUZZ
@given(data=st.data())
def test_generated_dcp_metadata(template: Path, workdir: Path, data: st.DataObject) -> None:
    meta = _template_metadata(template)
    choice = data.draw(st.sampled_from(["field", "field", "field", "code", "import", "any"]))
    if choice == "field":  # the real metadata with one field replaced by anything
        target = data.draw(st.sampled_from(_targets(meta)))
        value = data.draw(st.one_of(_values, st.just(_RunsCode())))
        obj: Any = _apply(meta, target, value)
    elif choice == "code":
        obj = _apply(meta, ("info.entry", next(iter(meta.storage_data))), _RunsCode())
    else:
        obj = data.draw(_values)
    payload = pickle.dumps(obj, protocol=data.draw(st.sampled_from([2, 4, 5])))
    if choice == "import":
        payload = _imports(*data.draw(_dangerous))
    path = _fresh(template, workdir)
    (path / ".metadata").write_bytes(payload)
    (path / ".cloudckpt-layout.json").unlink()  # generated: no CRC-32 would match
    _check_metadata(path, payload, "from a generated .metadata")


# -- the layout index ----------------------------------------------------------------------


_json = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**66), 2**66),
        st.sampled_from([-1, 0, 1, 2**31, 2**63, 10**30, -(10**30)]),
        st.floats(allow_nan=False),
        st.text(max_size=16),
        st.sampled_from(["float32", "int32", "float64", "AAAA", "__0_0.distcp@0", "../x@0"]),
    ),
    lambda kids: st.one_of(
        st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=6), kids, max_size=3)
    ),
    max_leaves=10,
)


def _layout_paths(doc: dict[str, Any]) -> list[tuple[Any, ...]]:
    paths: list[tuple[Any, ...]] = [(k,) for k in doc]
    for where, entry in doc["archives"].items():
        paths += [("archives", where, i) for i in range(len(entry))]
        paths += [("archives", where), ("archive-key", where)]
    for where in doc["chunks"]:
        paths += [("chunks", where), ("chunk-key", where)]
    return paths


def _edit(doc: dict[str, Any], path: tuple[Any, ...], how: str, value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    if path[0] in ("archive-key", "chunk-key"):
        table = doc["archives" if path[0] == "archive-key" else "chunks"]
        table[value if isinstance(value, str) else json.dumps(value)] = table.pop(path[1])
        return doc
    parent: Any = doc
    for key in path[:-1]:
        parent = parent[key]
    last = path[-1]
    if how == "delete":
        del parent[last]
    elif how == "nudge" and isinstance(parent[last], int):
        parent[last] += value if isinstance(value, int) and abs(value) < 2**20 else 1
    else:
        parent[last] = value
    return doc


def _plausible(entry: list[Any], field: int) -> st.SearchStrategy[Any]:
    """Values of the right type for an archive entry's field (see format/dcp/index.py)."""
    if field == 0:
        return st.sampled_from(["float32", "float64", "int32", "int64", "bfloat16", "uint8"])
    if field in (1, 2):
        return st.one_of(
            st.permutations(entry[field]),
            st.lists(st.integers(0, 2000), min_size=1, max_size=3),
            st.just([entry[field][0] * 2, entry[field][1] // 2]),
        )
    if field == 6:
        return st.sampled_from([4096, 32768, 131072, 1 << 20, entry[6] // 2, entry[6] * 2])
    if field == 7:
        n = len(entry[7]) * 3 // 4
        return st.binary(min_size=n, max_size=n).map(lambda b: base64.b64encode(b).decode())
    return st.integers(max(0, entry[field] - 70_000), entry[field] + 70_000)


@FUZZ
@given(data=st.data())
def test_mutated_layout_index(template: Path, workdir: Path, data: st.DataObject) -> None:
    path = _fresh(template, workdir)
    layout = path / ".cloudckpt-layout.json"
    doc = json.loads(layout.read_text())
    how = data.draw(st.sampled_from(["edit", "edit", "plausible", "plausible", "bytes"]))
    if how == "edit":  # any JSON value anywhere, a key deleted, a number nudged
        edited = _edit(
            doc,
            data.draw(st.sampled_from(_layout_paths(doc))),
            data.draw(st.sampled_from(["set", "set", "nudge", "delete"])),
            data.draw(st.one_of(_json, st.integers(-70_000, 70_000))),
        )
        layout.write_text(json.dumps(edited))
    elif how == "plausible":  # a well-formed entry that says something else
        where = data.draw(st.sampled_from(sorted(doc["archives"])))
        field = data.draw(st.integers(0, 7))
        entry = doc["archives"][where]
        entry[field] = data.draw(_plausible(entry, field))
        layout.write_text(json.dumps(doc))
    else:
        ops = data.draw(st.lists(mutation, min_size=1, max_size=2))
        layout.write_bytes(_mutate(layout.read_bytes(), ops))
    out = _load(str(path))
    assert out is None or _exact(out), "silently wrong state from a damaged layout index"
    _slice_of_w(str(path))


# -- manager markers -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("runs") / "run"
    manager = cloudckpt.CheckpointManager(root)
    manager.save(1, {"w": torch.ones(3)})
    manager.save(2, {"w": torch.arange(4.0)})
    return root


_nasty_names = st.sampled_from(
    [
        "../step-000000001/state.pt",
        "../../outside.distcp",
        "/etc/passwd",
        "a\x00b",
        "",
        "a//b",
        "x/../../y",
        ".",
        "state.pt/..",
        "C:\\windows",
    ]
)
_marker_fields = st.sampled_from(
    [
        "format",
        "step",
        "time",
        "size",
        "kind",
        "files",
        "metrics",
        "metadata",
        "library_version",
        "ranks",
    ]
)
_marker_values = st.one_of(
    _json,
    st.sampled_from([10**400, -(10**400), 1e308, -1, 2**64, 2**1000]),
    st.lists(st.fixed_dictionaries({"name": _nasty_names, "size": _json}), max_size=2),
)


def _marker_edit(body: dict[str, Any], data: st.DataObject) -> bytes:
    how = data.draw(st.sampled_from(["field", "file", "delete", "bytes", "deep"]))
    if how == "field":
        body[data.draw(_marker_fields)] = data.draw(_marker_values)
    elif how == "file":
        entry = body["files"][0]
        entry[data.draw(st.sampled_from(["name", "size", "etag"]))] = data.draw(
            st.one_of(_nasty_names, _json, st.sampled_from([10**400, 2**70]))
        )
    elif how == "delete":
        body.pop(data.draw(_marker_fields), None)
    elif how == "deep":  # nesting deeper than the JSON parser recurses
        depth = data.draw(st.integers(1, 200_000))
        body[data.draw(_marker_fields)] = "@@"
        text = json.dumps(body)
        return text.replace('"@@"', "[" * depth + "]" * depth).encode()
    raw = json.dumps(body).encode()
    if how == "bytes":
        raw = _mutate(raw, data.draw(st.lists(mutation, min_size=1, max_size=2)))
    return raw


@FUZZ
@given(data=st.data())
def test_mutated_manager_markers(run_template: Path, workdir: Path, data: st.DataObject) -> None:
    root = workdir / "ckpt" / "run"
    shutil.rmtree(root.parent, ignore_errors=True)
    shutil.copytree(run_template, root)
    marker = root / "step-000000002" / MARKER_NAME
    raw = _marker_edit(json.loads(marker.read_text()), data)
    marker.write_bytes(raw)
    url = marker.as_uri()
    try:
        decoded = decode_marker(raw, url)
    except CloudCkptError:
        decoded = None
    event("marker: corrupt" if decoded is None else "marker: decoded")
    if decoded is not None:  # what a marker may hold once decoded
        assert all(isinstance(f.name, str) and ".." not in f.name.split("/") for f in decoded.files)
        assert all(f.etag is None or isinstance(f.etag, str) for f in decoded.files)
        assert all(isinstance(f.size, int) and f.size >= 0 for f in decoded.files)
        assert isinstance(decoded.step, int) and decoded.step >= 0
    manager = cloudckpt.CheckpointManager(root)
    steps = [c.step for c in _tolerant(manager.list)]
    assert steps in ([1], [1, 2]), steps  # the damaged marker is listed right or skipped
    event(f"listed steps {steps}")
    info = _tolerant(lambda: manager.info(2))
    assert info is None or info.step == 2
    restored = _tolerant(lambda: manager.restore(2))
    assert restored is None or torch.equal(restored["w"], torch.arange(4.0))
    assert torch.equal(manager.restore(1)["w"], torch.ones(3))
    from cloudckpt.cli.main import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = main(["verify", str(root), "--json"])
    assert code in (0, 1, 2, 3, 4), code


def _tolerant(fn: Callable[[], Any]) -> Any:
    """fn's result, or None after a cloudckpt error; any other exception fails the test."""
    try:
        return fn()
    except CloudCkptError:
        return None
