"""A ``local_dir`` that holds another run's tier is named once (issue 41, item 10): one
WARNING when the manager meets it, however many calls use the manager after."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from cloudckpt.errors import ConfigError
from cloudckpt.manager import CheckpointManager


def test_another_runs_local_dir_is_warned_about_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = tmp_path / "tier"
    first = CheckpointManager(tmp_path / "runA", local_dir=tier)
    first.save(1, {"w": torch.ones(2)})
    first.drain()
    caplog.set_level(logging.INFO, logger="cloudckpt")
    other = CheckpointManager(tmp_path / "runB", local_dir=tier)
    assert other.restore() is None  # runA's step is not runB's
    assert other.list() == [] and other.latest() is None
    other.gc(dry_run=True)
    with pytest.raises(ConfigError, match="a directory of its own"):
        other.save(1, {"w": torch.zeros(2)})
    said = [r for r in caplog.records if "holds the local tier of" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING], [r.getMessage() for r in said]
