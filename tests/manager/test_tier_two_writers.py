"""Two live processes saving the same step into one ``local_dir`` (an old job still
running beside its restart): one save fails, neither removes the other's files, and
the step committed holds one save's bytes under that save's marker (docs/tiers.md,
"Leftovers of a crash").

The first writer is a real process stopped between its payload and its local marker
(its commit waits for a line on stdin); the second saves meanwhile.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from test_tier_leftovers import SPAWN_TIMEOUT_S, temps

from cloudckpt.errors import AlreadyExistsError, StorageError
from cloudckpt.manager import CheckpointManager, tiers
from cloudckpt.manager.marker import step_dir
from cloudckpt.manager.tiers import LocalTier
from cloudckpt.options import TransferOptions

_SLOW_COMMIT = textwrap.dedent(
    """
    import sys, torch
    from cloudckpt.manager import CheckpointManager, tiers
    commit = tiers.LocalTier.commit
    def held(self, *args, **kwargs):  # the payload is whole; the marker waits for a line
        print("payload written", flush=True)
        sys.stdin.readline()
        return commit(self, *args, **kwargs)
    tiers.LocalTier.commit = held
    m = CheckpointManager(sys.argv[1], local_dir=sys.argv[2])
    m.save(7, {"w": torch.full((1 << 20,), 1.0)}, metrics={"who": 1.0})
    print("committed", flush=True)
    """
)


def _managers(base: Path) -> tuple[str, Path]:
    return str(base / "bucket"), base / "node"


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((1 << 20,), value)}


def test_a_second_writer_of_a_step_fails_while_the_first_is_saving_it(tmp_path: Path) -> None:
    bucket, node = _managers(tmp_path)
    first = subprocess.Popen(
        [sys.executable, "-c", _SLOW_COMMIT, bucket, str(node)],
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert first.stdin is not None and first.stdout is not None
    try:
        assert first.stdout.readline() == "payload written\n"
        written = sorted(p.name for p in (node / step_dir(7)).iterdir())
        assert "state.pt" in written

        second = CheckpointManager(bucket, local_dir=node)
        with pytest.raises(StorageError, match="being written by another process") as err:
            second.save(7, _state(2.0), metrics={"who": 2.0})
        assert step_dir(7) in str(err.value)
        # The second save's clearing removed nothing of the first's.
        assert sorted(p.name for p in (node / step_dir(7)).iterdir()) == written

        first.stdin.write("go\n")
        first.stdin.flush()
        out, errors = first.communicate(timeout=SPAWN_TIMEOUT_S)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, errors
    assert out == "committed\n"

    info = next(c for c in second.list() if c.step == 7)
    assert info.metrics == {"who": 1.0}
    assert torch.equal(second.restore(step=7)["w"], _state(1.0)["w"])
    with pytest.raises(AlreadyExistsError):
        second.save(7, _state(2.0))
    second.save(8, _state(3.0))  # the other steps were never held
    assert temps(node) == []


def test_a_save_that_fails_gives_up_its_steps_folder(tmp_path: Path) -> None:
    """A save that failed after the clearing (its state cannot be pickled) releases the
    folder's lock: another process's manager, and this one again, save the step."""
    bucket, node = _managers(tmp_path)
    first = CheckpointManager(bucket, local_dir=node)
    with pytest.raises(Exception, match=r"lambda|pickle"):
        first.save(3, {"w": torch.ones(4), "f": lambda: None})
    assert temps(node) == []

    other = CheckpointManager(bucket, local_dir=node)  # a tier of its own: its own locks
    other.save(3, _state(5.0))
    other.drain()
    assert torch.equal(first.restore(step=3)["w"], _state(5.0)["w"])
    first.save(4, _state(6.0))
    assert temps(node) == []


def test_the_lock_is_the_tiers_not_the_processes(tmp_path: Path) -> None:
    """A second tier object of the same directory in the same process (a second
    manager) is refused while the first holds the step's folder, then saves it."""
    bucket, node = _managers(tmp_path)
    manager = CheckpointManager(bucket, local_dir=node)
    holder = LocalTier(node, manager.root_url, TransferOptions(), None, 1)
    holder.clear(5)  # a save of step 5 under way: its folder cleared and held
    with pytest.raises(StorageError, match="being written by another process"):
        manager.save(5, _state(1.0))
    holder.release(5)
    manager.save(5, _state(2.0))
    assert torch.equal(manager.restore(step=5)["w"], _state(2.0)["w"])
    manager.drain()  # the drainer's own record write (a temp file while it runs) is done
    assert temps(node) == []


def test_an_interrupted_clearing_gives_up_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while a save removes a killed save's leftovers (after it took the step's
    lock) gives the lock up: the process lives on (a notebook) and another saves."""
    bucket, node = _managers(tmp_path)
    manager = CheckpointManager(bucket, local_dir=node)
    folder = node / step_dir(7)
    folder.mkdir(parents=True)
    (folder / "state.pt").write_bytes(b"what a killed save left")

    def interrupted(*args: Any, **kwargs: Any) -> int:
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(tiers, "remove_checkpoint", interrupted)
        with pytest.raises(KeyboardInterrupt):
            manager.save(7, _state(1.0))
    assert temps(node) == []  # before: its lock, held until the process exits
    other = CheckpointManager(bucket, local_dir=node)
    other.save(7, _state(2.0))
    assert torch.equal(manager.restore(step=7)["w"], _state(2.0)["w"])


def test_gc_keeps_a_step_a_live_save_holds(tmp_path: Path) -> None:
    """gc with no grace period leaves an uncommitted step alone while a save holds its
    lock (between its payload and its marker); once given up, the step is garbage."""
    bucket, node = _managers(tmp_path)
    manager = CheckpointManager(bucket, local_dir=node)
    holder = LocalTier(node, manager.root_url, TransferOptions(), None, 1)
    holder.clear(5)  # another save of step 5: its payload written, its marker to come
    (node / step_dir(5) / "state.pt").write_bytes(b"a payload whose marker is coming")
    report = manager.gc(grace_seconds=0)
    assert (node / step_dir(5) / "state.pt").exists()  # before: removed under the save
    assert any(step_dir(5) in url for url in report.skipped_young), report
    holder.release(5)
    manager.gc(grace_seconds=0)
    assert not (node / step_dir(5)).exists()


def _one_rank_full(rank: int, world: int, base: str) -> None:
    """Two ranks, a directory each: rank 1's tier has no room. The save fails on both
    before either writes (rank 1 LocalTierFullError, rank 0 naming rank 1), and the
    step is saved once there is room."""
    import shutil

    from cloudckpt.errors import CollectiveError, LocalTierFullError

    m = CheckpointManager(
        str(Path(base) / "bucket"), local_dir=Path(base) / f"node{rank}", kind="dcp"
    )
    state = {f"w{rank}": torch.full((1024,), 1.0)}
    usage = shutil.disk_usage
    if rank == 1:
        shutil.disk_usage = lambda path: usage(path)._replace(free=1024)  # type: ignore[assignment]
    try:
        with pytest.raises((LocalTierFullError, CollectiveError)) as err:
            m.save(5, state)
        if rank == 0:
            assert isinstance(err.value, CollectiveError) and "rank 1" in str(err.value)
        else:
            assert isinstance(err.value, LocalTierFullError)
    finally:
        shutil.disk_usage = usage  # type: ignore[assignment]
    assert not list((Path(base) / f"node{rank}").glob("step-*/*"))  # nothing written
    m.save(5, state)  # both locks were given up
    assert [c.step for c in m.list()] == [5]


def test_a_full_tier_on_one_rank_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    pytest.importorskip("cloudckpt.dcp")
    from ranks import run_ranks

    run_ranks(_one_rank_full, 2, str(tmp_path), timeout=300)  # before: rank 0 hung in DCP
