"""Damaged commit markers (docs/manager.md, "Damaged markers"): a ``_CHECKPOINT.json``
that exists but cannot be decoded, or names another step, is a damaged checkpoint,
never "nothing committed". ``list()``/``latest()`` skip it with a WARNING naming the
step and the marker; ``restore()`` falls back to the newest valid step with a WARNING,
and raises CorruptCheckpointError naming the damaged markers when no valid step is
left (never "starting fresh"); the CLI's ``ls``, ``latest`` and ``verify`` say so.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from cloudckpt.errors import CorruptCheckpointError
from cloudckpt.manager import MARKER_NAME, CheckpointManager
from cloudckpt.store import open_url
from servers import S3Server, unique_bucket_name

ROOT = Path(__file__).resolve().parents[2]
CLOUDCKPT = str(Path(sys.executable).parent / "cloudckpt")


def _junk(raw: bytes) -> bytes:
    return b"\x00\xff not json at all \xfe"


def _empty(raw: bytes) -> bytes:
    return b""


def _other_step(raw: bytes) -> bytes:
    body = json.loads(raw)
    body["step"] = body["step"] + 7  # a valid marker, in the directory of another step
    return json.dumps(body).encode()


DAMAGES: dict[str, Callable[[bytes], bytes]] = {
    "garbage": _junk,
    "empty": _empty,
    "other-step": _other_step,
}


def _run(m: CheckpointManager) -> None:
    m.save(1, {"w": torch.ones(3)})
    m.save(2, {"w": torch.arange(4.0)})


def _damage(m: CheckpointManager, step: int, how: Callable[[bytes], bytes]) -> str:
    """Overwrite ``step``'s marker in the manager's bucket; returns its URL."""
    url = m.step_url(step) + MARKER_NAME
    store, key = open_url(url, m.options)
    store.put(key, how(store.get(key)))
    return url


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("how", DAMAGES)
def test_every_marker_damaged_is_an_error_not_a_fresh_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    m = CheckpointManager(tmp_path / "run")
    _run(m)
    urls = [_damage(m, s, DAMAGES[how]) for s in (1, 2)]
    fresh = CheckpointManager(tmp_path / "run")
    caplog.set_level(logging.INFO, logger="cloudckpt")
    with pytest.raises(CorruptCheckpointError) as err:
        fresh.restore()
    assert all(u in str(err.value) for u in urls), err.value
    assert "[1, 2]" in str(err.value)
    assert not any("starting fresh" in r.getMessage() for r in caplog.records)
    assert fresh.restored_step is None
    caplog.clear()
    assert fresh.list() == []
    said = _warnings(caplog)
    for step, url in zip((1, 2), urls, strict=True):
        assert any(f"step {step} is damaged" in w and url in w for w in said), said
    assert fresh.latest() is None
    with pytest.raises(CorruptCheckpointError, match="step-000000002"):
        fresh.restore(step=2)


@pytest.mark.parametrize("how", DAMAGES)
def test_the_newest_marker_damaged_falls_back_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    m = CheckpointManager(tmp_path / "run")
    _run(m)
    url = _damage(m, 2, DAMAGES[how])
    fresh = CheckpointManager(tmp_path / "run")
    caplog.set_level(logging.WARNING, logger="cloudckpt")
    state = fresh.restore()
    assert torch.equal(state["w"], torch.ones(3))
    assert fresh.restored_step == 1
    said = _warnings(caplog)
    assert any("restoring step 1" in w and "[2]" in w and url in w for w in said), said
    assert any("step 2 is damaged" in w and url in w for w in said), said
    assert [c.step for c in fresh.list()] == [1]


def test_damaged_markers_in_s3_are_an_error(
    moto_server: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    bucket = moto_server.make_bucket(unique_bucket_name("damaged"))
    url = f"s3://{bucket}/run"
    m = CheckpointManager(url, storage_options=moto_server.storage_options())
    _run(m)
    markers = [_damage(m, s, _junk) for s in (1, 2)]
    fresh = CheckpointManager(url, storage_options=moto_server.storage_options())
    caplog.set_level(logging.INFO, logger="cloudckpt")
    with pytest.raises(CorruptCheckpointError) as err:
        fresh.restore()
    assert all(u in str(err.value) for u in markers)
    assert not any("starting fresh" in r.getMessage() for r in caplog.records)


def test_damaged_markers_in_both_tiers_are_an_error(
    moto_server: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bucket = moto_server.make_bucket(unique_bucket_name("damaged-tier"))
    url = f"s3://{bucket}/run"
    opts = moto_server.storage_options()
    m = CheckpointManager(url, local_dir=tmp_path / "tier", storage_options=opts)
    _run(m)
    m.drain()
    for s in (1, 2):
        _damage(m, s, _junk)
    fresh = CheckpointManager(url, local_dir=tmp_path / "tier", storage_options=opts)
    # Only the bucket's are damaged: the local copies are valid, and restored.
    assert fresh.restore()["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    for s in (1, 2):
        (tmp_path / "tier" / f"step-{s:09d}" / MARKER_NAME).write_bytes(b"{")
    fresh = CheckpointManager(url, local_dir=tmp_path / "tier", storage_options=opts)
    caplog.set_level(logging.INFO, logger="cloudckpt")
    with pytest.raises(CorruptCheckpointError, match=r"step\(s\) \[1, 2\]"):
        fresh.restore()
    assert not any("starting fresh" in r.getMessage() for r in caplog.records)


# -- the CLI (the installed command, in a subprocess) ----------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [CLOUDCKPT, *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_cli_reports_every_damaged_step(tmp_path: Path) -> None:
    root = tmp_path / "run"
    m = CheckpointManager(root)
    _run(m)
    for s in (1, 2):
        _damage(m, s, _junk)
    latest = _cli("latest", str(root))
    assert latest.returncode == 4, latest.stderr
    assert "damaged" in latest.stderr and "starting fresh" not in latest.stderr
    verify = _cli("verify", str(root))
    assert verify.returncode == 4, verify.stderr
    assert "holds no committed checkpoint" not in verify.stderr
    assert verify.stdout.count("FAILED") == 2, verify.stdout
    ls = _cli("ls", str(root))
    assert ls.returncode == 0, ls.stderr
    assert "2 damaged step(s)" in ls.stdout, ls.stdout
    assert "uncommitted" not in ls.stdout
    listed = json.loads(_cli("ls", str(root), "--json").stdout)
    assert [d["step"] for d in listed["damaged"]] == [1, 2]
    assert listed["uncommitted"] == []


def test_cli_with_the_newest_step_damaged(tmp_path: Path) -> None:
    root = tmp_path / "run"
    m = CheckpointManager(root)
    _run(m)
    _damage(m, 2, _other_step)
    latest = _cli("latest", str(root))
    assert latest.returncode == 0, latest.stderr
    assert latest.stdout.strip() == m.step_url(1)
    assert "step 2 is damaged" in latest.stderr
    verify = _cli("verify", str(root))
    assert verify.returncode == 4, verify.stdout + verify.stderr
    assert "names step 9" in verify.stdout
    ls = _cli("ls", str(root))
    assert "1 damaged step(s)" in ls.stdout and "uncommitted" not in ls.stdout, ls.stdout


# -- several ranks, each with its local tier ------------------------------------------------


def _ranks_damaged(rank: int, world: int, url: str, so: dict[str, str], base: str) -> None:
    import torch.distributed as dist

    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("cloudckpt").addHandler(handler)
    tier = Path(base) / f"node{rank}"
    m = CheckpointManager(url, local_dir=tier, kind="dcp", storage_options=so)
    for step in (1, 2):
        m.save(step, {f"own{rank}": torch.full((4,), float(step))})
    m.drain()

    def damage(step: int) -> None:
        (tier / f"step-{step:09d}" / MARKER_NAME).write_bytes(b"\x00junk")
        if rank == 0:
            _damage(m, step, _junk)
        dist.barrier()

    damage(2)  # the newest: every rank falls back to step 1, saying so
    state = {f"own{rank}": torch.zeros(4)}
    fresh = CheckpointManager(url, local_dir=tier, kind="dcp", storage_options=so)
    fresh.restore(state=state)
    assert fresh.restored_step == 1
    assert torch.equal(state[f"own{rank}"], torch.ones(4))
    assert any("restoring step 1" in s and "[2]" in s for s in seen), seen
    damage(1)  # none valid: every rank raises, none starts fresh
    fresh = CheckpointManager(url, local_dir=tier, kind="dcp", storage_options=so)
    with pytest.raises(CorruptCheckpointError, match=r"step\(s\) \[1, 2\]"):
        fresh.restore(state=state)
    assert fresh.restored_step is None
    dist.barrier()


def test_every_rank_agrees_on_damaged_markers(moto_server: S3Server, tmp_path: Path) -> None:
    pytest.importorskip("cloudckpt.dcp")
    from ranks import run_ranks

    bucket = moto_server.make_bucket(unique_bucket_name("damaged-ranks"))
    url = f"s3://{bucket}/run"
    run_ranks(_ranks_damaged, 2, url, moto_server.storage_options(), str(tmp_path), timeout=300)
