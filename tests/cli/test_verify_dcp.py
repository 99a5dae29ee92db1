"""`cloudckpt verify` checks every tensor record inside DCP data objects too."""

from __future__ import annotations

import json

import pytest
import torch

from cloudckpt.cli import main
from cloudckpt.manager import CheckpointManager


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_verify_finds_a_flipped_bit_in_a_dcp_data_object(tmp_path, capsys):
    manager = CheckpointManager(tmp_path / "run", kind="dcp")
    manager.save(1, {"w": torch.randn(2000), "b": torch.ones(10), "step": 1})
    assert main(["verify", str(tmp_path / "run")]) == 0
    data = next((tmp_path / "run").rglob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x04  # inside the 8 KB tensor record
    data.write_bytes(bytes(raw))
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "run")]) == 4
    out = capsys.readouterr().out
    assert f"FAILED {data.as_uri()}" in out and "CRC-32 check" in out


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_info_of_a_dcp_step_lists_its_tensors_and_scalars(tmp_path, capsys):
    manager = CheckpointManager(tmp_path / "run", kind="dcp")
    manager.save(3, {"w": torch.randn(20, 5), "step": 3, "opt": {"lr": 0.5}})
    capsys.readouterr()
    assert main(["info", str(tmp_path / "run"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["checkpoint"]["step"] == 3 and info["kind"] == "dcp"
    assert info["tensors"] == [{"name": "w", "dtype": "float32", "shape": [20, 5], "bytes": 400}]
    assert info["scalars"] == {"step": 3, "opt.lr": 0.5}
