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
        "set_unpickler",
        "wait_all",
    }
    for name in cloudckpt.__all__:
        assert hasattr(cloudckpt, name)


# Each layer may import only itself and the layers listed (plus the shared leaf modules).
LEAVES = {"errors", "options", "profiles", "redact", "_version"}
ALLOWED = {
    "store": {"store"},
    "format": {"format", "store"},
    "engine": {"engine", "store", "format"},
    "lightning": {"lightning", "engine", "store", "format"},
    "dcp": {"dcp", "engine", "store", "format"},
    "manager": {"manager", "dcp", "engine", "store", "format"},
    "megatron": {"megatron", "dcp", "engine", "store", "format"},
    "nemo": {"nemo", "megatron", "lightning", "manager", "dcp", "engine", "store", "format"},
    "cli": {"cli", "manager", "dcp", "engine", "store", "format"},
    "testing": {"testing"},
}


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level >= 1 and node.module:
            parts = path.relative_to(SRC).parts
            base = parts[: len(parts) - node.level]
            target = (*base, *node.module.split("."))
            found.add(target[0])
        elif isinstance(node, ast.ImportFrom) and node.level >= 2 and not node.module:
            found.add("")
    return found


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


def test_layers_only_import_downward():
    for layer, allowed in ALLOWED.items():
        for path in (SRC / layer).rglob("*.py"):
            bad = _imports(path) - allowed - LEAVES - {""}
            assert not bad, f"{path.relative_to(SRC)} imports {bad}"


def test_errors_subclass_builtins():
    from cloudckpt import errors

    assert issubclass(errors.NotFoundError, FileNotFoundError)
    assert issubclass(errors.CredentialsError, PermissionError)
    assert issubclass(errors.ConfigError, ValueError)
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.CloudCkptError)


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
