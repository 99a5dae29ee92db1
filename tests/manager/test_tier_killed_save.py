"""A save killed after its payload and before its local marker leaves its files in the
tier's ``step-N/``; the next save of that step must commit its own files only, never
the killed one's (docs/tiers.md, "Leftovers of a crash").

The killed save is reproduced as what it leaves: a whole save of two ranks sharing one
``local_dir`` whose local marker is then deleted (the payload there, no marker).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from test_tier_leftovers import dead_temp, holder, kill, temps

from cloudckpt.errors import StorageError
from cloudckpt.manager import MARKER_NAME, CheckpointManager
from cloudckpt.manager.marker import step_dir

#: The files a DCP save of one process commits.
ONE_RANK = {".cloudckpt-layout.json", ".metadata", "__0_0.distcp"}
TWO_RANKS = ONE_RANK | {"__1_0.distcp"}


def _state(rank: int, value: float) -> dict[str, Any]:
    """Rank ``rank``'s tensor (its own key, so each rank writes a file of its own)."""
    return {f"w{rank}": torch.full((256,), value)}


def _manager(base: str, **kwargs: Any) -> CheckpointManager:
    return CheckpointManager(
        str(Path(base) / "bucket"), local_dir=Path(base) / "node", kind="dcp", **kwargs
    )


def _killed_save(rank: int, world: int, base: str) -> None:
    """Two ranks sharing one directory: step 1 saved and drained, step 2 saved (its
    local marker is deleted afterwards: a kill before it)."""
    m = _manager(base)
    m.save(1, _state(rank, 1.0))
    m.drain()
    m.save(2, _state(rank, 20.0 + rank))


def _kill_before_marker(base: Path) -> Path:
    """Run the two ranks, then delete step 2's local marker; returns its folder."""
    from ranks import run_ranks

    run_ranks(_killed_save, 2, str(base), timeout=300)
    folder = base / "node" / step_dir(2)
    (folder / MARKER_NAME).unlink()
    assert {p.name for p in folder.iterdir()} == TWO_RANKS
    return folder


def _marker_files(marker: Path) -> set[str]:
    return {f["name"] for f in json.loads(marker.read_text())["files"]}


def test_a_resave_on_one_rank_commits_none_of_a_killed_two_rank_saves_files(
    tmp_path: Path,
) -> None:
    pytest.importorskip("cloudckpt.dcp")
    folder = _kill_before_marker(tmp_path)

    m = _manager(str(tmp_path))  # the job restarts on one rank
    assert m.restore(state=_state(0, 0.0)) is not None and m.restored_step == 1
    m.save(2, _state(0, 7.0))
    m.drain()

    assert _marker_files(folder / MARKER_NAME) == ONE_RANK
    assert not (folder / "__1_0.distcp").exists()
    bucket = tmp_path / "bucket" / step_dir(2)
    assert _marker_files(bucket / MARKER_NAME) == ONE_RANK
    assert not (bucket / "__1_0.distcp").exists()
    got = CheckpointManager(str(tmp_path / "bucket"), kind="dcp").restore(state=_state(0, 0.0))
    assert torch.equal(got["w0"], torch.full((256,), 7.0))


def _resave(rank: int, world: int, base: str) -> None:
    """Two ranks again: step 2 saved with new values and drained; the bucket's step 2
    read back (a manager without local tier) holds them."""
    m = _manager(base)
    assert m.restore(state=_state(rank, 0.0)) is not None and m.restored_step == 1
    m.save(2, _state(rank, 70.0 + rank))
    m.drain()
    got = CheckpointManager(str(Path(base) / "bucket"), kind="dcp").restore(state=_state(rank, 0.0))
    assert torch.equal(got[f"w{rank}"], torch.full((256,), 70.0 + rank))


def test_a_resave_on_two_ranks_clears_a_killed_saves_leftovers_first(tmp_path: Path) -> None:
    pytest.importorskip("cloudckpt.dcp")
    from ranks import run_ranks

    folder = _kill_before_marker(tmp_path)
    # What else a killed save (of three ranks, say) leaves: a file no rank writes
    # again, a subfolder, and the temp file of a writer killed mid-file.
    shutil.copy(folder / "__1_0.distcp", folder / "__2_0.distcp")
    (folder / "extra").mkdir()
    (folder / "extra" / "x.bin").write_bytes(b"x")
    left = dead_temp(tmp_path / "node", f"{step_dir(2)}/__0_0.distcp")

    run_ranks(_resave, 2, str(tmp_path), timeout=300)

    assert _marker_files(folder / MARKER_NAME) == TWO_RANKS
    assert not left.exists() and not (folder / "extra").exists()
    assert {p.name for p in folder.iterdir()} == TWO_RANKS | {MARKER_NAME}
    bucket = tmp_path / "bucket" / step_dir(2)
    assert _marker_files(bucket / MARKER_NAME) == TWO_RANKS
    assert not (bucket / "__2_0.distcp").exists()


def test_an_object_save_clears_a_killed_saves_files_and_keeps_a_live_writers(
    tmp_path: Path,
) -> None:
    tier = tmp_path / "node"
    m = CheckpointManager(str(tmp_path / "bucket"), local_dir=tier)
    folder = tier / step_dir(2)
    folder.mkdir(parents=True)
    (folder / "state.pt").write_bytes(b"a killed save's")
    (folder / "other.bin").write_bytes(b"not this save's")

    live = holder(tier, f"{step_dir(2)}/state.pt")  # another process writing there
    try:
        (alive,) = temps(folder)
        with pytest.raises(StorageError, match="being written by another process"):
            m.save(2, {"w": torch.ones(4)})
        assert alive.exists() and (folder / "other.bin").exists()  # nothing removed
    finally:
        kill(live)

    info = m.save(2, {"w": torch.ones(4)})
    assert [f.name for f in info.files] == ["state.pt"]
    assert sorted(p.name for p in folder.iterdir()) == [MARKER_NAME, "state.pt"]
    assert torch.equal(m.restore()["w"], torch.ones(4))
