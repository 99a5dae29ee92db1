"""The public surface is deliberate: pin it, and keep the layers importing downward."""

from __future__ import annotations

import ast
import pathlib

import cloudckpt

SRC = pathlib.Path(cloudckpt.__file__).parent


def test_all_is_sorted_and_pinned():
    assert list(cloudckpt.__all__) == sorted(cloudckpt.__all__)
    assert set(cloudckpt.__all__) == {
        "CheckpointInfo",
        "CheckpointManager",
        "ExportResult",
        "SaveHandle",
        "SaveResult",
        "TransferOptions",
        "__version__",
        "async_save",
        "configure",
        "errors",
        "export_safetensors",
        "get_defaults",
        "load",
        "load_safetensors",
        "release_buffers",
        "save",
        "save_safetensors",
        "set_fast_paths",
        "set_unpickler",
        "wait_all",
    }
    for name in cloudckpt.__all__:
        assert hasattr(cloudckpt, name)


# Each layer may import only itself and the layers listed (plus the shared leaf modules),
# bottom to top as docs/architecture.md draws them. An entry with a dot allows one module.
LEAVES = {"errors", "options", "profiles", "redact", "_version", "_lazy"}
_BASE = {"_runtime", "store", "ranks", "io", "format"}
ALLOWED = {
    "_runtime": {"_runtime"},
    "store": {"store"},
    "ranks": {"ranks"},
    "io": {"io", "store", "_runtime"},
    "format": {"format", "store", "_runtime", "io.buffers"},
    "engine": {"engine"} | _BASE,
    "dcp": {"dcp", "engine"} | _BASE,
    # Lightning's sharded strategies save through the DCP writer and reader.
    "lightning": {"lightning", "dcp", "engine"} | _BASE,
    # The manager saves and loads Megatron-core checkpoints (kind="megatron").
    "manager": {"manager", "dcp", "megatron", "engine"} | _BASE,
    "megatron": {"megatron", "dcp", "engine"} | _BASE,
    "nemo": {"nemo", "megatron", "lightning", "manager", "dcp", "engine"} | _BASE,
    # The command line parses, calls the engine and the manager, and prints.
    "cli": {"cli", "manager", "dcp", "engine", "store", "io.progress"},
    # torchtitan's CheckpointManager over the manager (one module, torchtitan.py).
    "torchtitan": {"torchtitan", "manager", "dcp", "engine"} | _BASE,
    # The Hugging Face Trainer's callback over the manager (one module, hf.py).
    "hf": {"hf", "manager", "dcp", "engine"} | _BASE,
    # Accelerate's save_state/load_state over the manager (one module, accelerate.py).
    "accelerate": {"accelerate", "manager", "dcp", "engine"} | _BASE,
    # DeepSpeed's save_checkpoint/load_checkpoint over the manager (one module, deepspeed.py).
    "deepspeed": {"deepspeed", "manager", "engine"} | _BASE,
    # Ray Train's report/restore over the manager (one module, ray.py).
    "ray": {"ray", "manager"} | _BASE,
    # The local servers make buckets through cloudckpt's own S3 store.
    "testing": {"testing", "store"},
}


def _module_of(path: pathlib.Path) -> tuple[str, ...]:
    parts = path.relative_to(SRC).with_suffix("").parts
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imports(path: pathlib.Path) -> set[str]:
    """Every cloudckpt module ``path`` imports (at any depth, typing-only ones too)."""
    package = _module_of(path) if path.name == "__init__.py" else _module_of(path)[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level == 0:
            if (node.module or "").startswith("cloudckpt."):
                found.add(node.module.removeprefix("cloudckpt."))
            continue
        base = package[: len(package) - node.level + 1]
        if node.module:
            found.add(".".join((*base, node.module)))
        else:
            found.update(".".join((*base, alias.name)) for alias in node.names)
    return found


def _allowed(target: str, allowed: set[str]) -> bool:
    return any(target == a or target.startswith(a + ".") for a in allowed | LEAVES)


def test_subpackage_surfaces_are_pinned():
    from cloudckpt import store, testing

    assert list(testing.__all__) == sorted(testing.__all__)
    assert set(testing.__all__) == {
        "AzureServer",
        "GCSServer",
        "LocalServer",
        "S3Server",
        "ServerStartError",
        "count_requests",
        "free_port",
        "launch",
        "launch_emulator",
        "start_server",
        "stop",
        "unique_bucket_name",
    }
    assert set(store.__all__) >= {"Store", "Target", "open_target", "register_store"}
    for module in (store, testing):
        assert all(hasattr(module, name) for name in module.__all__)


#: Each public sub-package's surface, pinned as the root's is (nemo is checked without
#: importing NeMo: its names resolve lazily).
SUBPACKAGES = {
    "cli": {"EXIT_CODES", "main"},
    "dcp": {"CloudStorageReader", "CloudStorageWriter"},
    "lightning": {
        "CloudCheckpointIO",
        "CloudFSDPStrategy",
        "CloudFabricFSDPStrategy",
        "CloudFabricModelParallelStrategy",
        "CloudFileSystem",
        "CloudModelCheckpoint",
        "CloudModelParallelStrategy",
    },
    "manager": {
        "CheckpointInfo",
        "CheckpointManager",
        "DcpPayload",
        "FileEntry",
        "GcReport",
        "KeepEveryNSteps",
        "KeepLast",
        "KeepTopK",
        "MARKER_NAME",
        "ManagedSaveHandle",
        "ObjectPayload",
        "PayloadKind",
        "RetentionPolicy",
        "collect_garbage",
        "list_checkpoints",
        "read_marker",
    },
    "megatron": {
        "DistributedSaveError",
        "MegatronSaveHandle",
        "is_checkpoint",
        "load",
        "load_common_state_dict",
        "load_content_metadata",
        "load_sharded_metadata",
        "load_tensors_metadata",
        "save",
    },
    "nemo": {
        "CheckpointEntry",
        "CloudAsyncFinalizableCheckpointIO",
        "CloudAutoResume",
        "CloudMegatronCheckpointIO",
        "CloudModelCheckpoint",
        "cloud_checkpoint_io",
        "latest_checkpoint",
        "list_checkpoints",
    },
    "torchtitan": {"CloudCheckpointManager"},
    "hf": {"CloudCheckpointCallback", "fetch_latest"},
    "accelerate": {"AccelerateSaveHandle", "drain", "load_state", "save_state"},
    "deepspeed": {"DeepSpeedSaveHandle", "drain", "load_checkpoint", "save_checkpoint"},
    "ray": {"report", "restore", "run_url", "storage"},
    "store": {
        "MultipartUpload",
        "ObjectInfo",
        "Resolved",
        "RetryPolicy",
        "SUPPORTED_SCHEMES",
        "Settings",
        "Store",
        "Target",
        "UploadedPart",
        "byte_view",
        "check_key",
        "join_key",
        "locate",
        "object_url",
        "open_target",
        "open_url",
        "register_store",
        "resolve",
        "split_url",
    },
}


def test_every_public_subpackage_surface_is_pinned():
    import importlib

    for name, expected in SUBPACKAGES.items():
        module = importlib.import_module(f"cloudckpt.{name}")
        assert set(module.__all__) == expected, name
        if name not in ("nemo", "torchtitan", "hf"):  # NeMo, torchtitan, transformers
            assert all(hasattr(module, n) for n in module.__all__), name


def test_layers_only_import_downward():
    for layer, allowed in ALLOWED.items():
        module = SRC / f"{layer}.py"  # a layer of one module
        for path in [module] if module.is_file() else (SRC / layer).rglob("*.py"):
            bad = {t for t in _imports(path) if t and not _allowed(t, allowed)}
            assert not bad, f"{path.relative_to(SRC)} imports {bad}"


def test_every_package_is_a_layer():
    packages = {p.parent.relative_to(SRC).parts[0] for p in SRC.glob("*/__init__.py")}
    one_module = {layer for layer in ALLOWED if (SRC / f"{layer}.py").is_file()}
    assert packages | one_module == set(ALLOWED)


def test_no_module_imports_in_a_circle():
    """Within a layer too: no module reaches itself again through what it imports."""
    modules = {".".join(_module_of(p)): p for p in SRC.rglob("*.py")}

    def resolve(target: str) -> str:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target

    graph = {
        name: {resolve(t) for t in _imports(path)} - {"", name} for name, path in modules.items()
    }
    state: dict[str, int] = {}
    cycles = []

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for nxt in sorted(graph[name]):
            if state.get(nxt) == 1:
                cycles.append([*trail[trail.index(nxt) :], name, nxt])
            elif nxt not in state:
                visit(nxt, [*trail, name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert not cycles, cycles


def test_errors_subclass_builtins():
    from cloudckpt import errors

    assert issubclass(errors.NotFoundError, FileNotFoundError)
    assert issubclass(errors.CredentialsError, PermissionError)
    assert issubclass(errors.ConfigError, ValueError)
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.CloudCkptError)


def test_the_error_tree_in_the_docstring_is_the_class_tree():
    """errors.py draws its tree; every exported error is drawn under its real parent."""
    import re

    from cloudckpt import errors

    drawn: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for line in (errors.__doc__ or "").splitlines():
        m = re.match(r"^(\s*)(?:[│ ]*[├└]── )?(\w+Error)\b", line)
        if not m or m.group(2) not in errors.__all__:
            continue
        depth = line.find(m.group(2))
        while stack and stack[-1][0] >= depth:
            stack.pop()
        if stack:
            drawn[m.group(2)] = stack[-1][1]
        stack.append((depth, m.group(2)))
    assert set(drawn) == set(errors.__all__) - {"CloudCkptError"}
    for name, parent in drawn.items():
        assert getattr(errors, parent) in getattr(errors, name).__mro__[1:], (name, parent)


def test_import_is_light():
    """`import cloudckpt` (and so the command line) must not pull in torch."""
    import subprocess
    import sys

    code = "import sys, cloudckpt; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_no_private_name_is_imported_across_modules():
    """A name with a leading underscore is its module's own business (torch's private
    names that cloudckpt relies on are imported where they are used, and noted there)."""
    crossing = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            ours = isinstance(node, ast.ImportFrom) and (
                node.level > 0 or (node.module or "").startswith("cloudckpt")
            )
            if ours:
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        crossing.append(f"{path.relative_to(SRC)}: {node.module}.{alias.name}")
    assert not crossing, crossing
