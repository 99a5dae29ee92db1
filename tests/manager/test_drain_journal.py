"""The drain record every local tier keeps (engine/journal.py): ``_DRAINS/<name>.json``
per checkpoint name, for the manager's ``step-N``, NeMo's names and Lightning's file
names alike; a name that could leave ``_DRAINS/`` is refused before anything is written;
a manager's journal written by the previous release is read as it is.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from cloudckpt.engine.journal import (
    JOURNAL_DIR,
    DrainJournal,
    DrainRecord,
    check_name,
    matches,
)
from cloudckpt.errors import InvalidURLError
from cloudckpt.manager import CheckpointManager
from cloudckpt.manager.marker import step_dir
from cloudckpt.manager.tiers import LocalTier
from cloudckpt.options import TransferOptions
from cloudckpt.store.local import LocalStore

REMOTE = "s3://bucket/run"
#: A name of each tier: the manager's, NeMo's, Lightning's.
NAMES = [
    "step-5",
    "megatron_gpt--val_loss=1.25-step=40-consumed_samples=80.0-last",
    "epoch=3-step=40.ckpt",
]


def files(under: Path) -> list[str]:
    return sorted(p.relative_to(under).as_posix() for p in under.rglob("*") if p.is_file())


def test_each_tiers_names_are_kept_under_drains_and_read_back(tmp_path: Path) -> None:
    journal = DrainJournal(LocalStore(tmp_path), REMOTE)
    for i, name in enumerate(NAMES):
        objects = {name: f"{i}:etag{i}:1.5"}
        journal.write(name, DrainRecord(10.0 + i, REMOTE, objects, committed=True, due=i == 2))
    assert files(tmp_path) == sorted(f"{JOURNAL_DIR}/{n}.json" for n in NAMES)
    assert journal.names() == sorted(NAMES)
    lightning = journal.read(NAMES[2])
    assert lightning == DrainRecord(
        12.0, REMOTE, {NAMES[2]: "2:etag2:1.5"}, committed=True, due=True
    )
    assert journal.read(NAMES[0], 10.0) is not None
    assert journal.read(NAMES[0], 11.0) is None  # another local commit of the name
    assert DrainJournal(LocalStore(tmp_path), "s3://bucket/other").read(NAMES[0]) is None
    journal.forget(NAMES[1])
    assert journal.read(NAMES[1]) is None and journal.names() == sorted([NAMES[0], NAMES[2]])


@pytest.mark.parametrize(
    "name", ["", ".", "..", "a/b", "../escape", "/abs", "a\\b", "nul\x00", "x" * 201]
)
def test_a_name_that_could_leave_the_folder_is_refused_before_anything_is_written(
    tmp_path: Path, name: str
) -> None:
    journal = DrainJournal(LocalStore(tmp_path / "tier"), REMOTE)
    with pytest.raises(InvalidURLError, match="cannot name a drain record"):
        journal.write(name, DrainRecord(1.0, REMOTE))
    with pytest.raises(InvalidURLError):
        journal.read(name)
    with pytest.raises(InvalidURLError):
        journal.forget(name)
    with pytest.raises(InvalidURLError):
        check_name(name)
    assert files(tmp_path) == []


def test_an_unreadable_record_proves_nothing_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / JOURNAL_DIR).mkdir()
    (tmp_path / JOURNAL_DIR / "step-1.json").write_text('{"format": "cloudckpt.drain/2"}')
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        assert DrainJournal(LocalStore(tmp_path), REMOTE).read("step-1") is None
    assert any("ignoring the drain record" in r.getMessage() for r in caplog.records)


def test_an_object_matches_its_record_by_size_and_etag() -> None:
    assert matches("12:abc:1700000000.25", 12, '"abc"')  # a HEAD's time differs: not compared
    assert not matches("12:abc:1.0", 13, "abc")
    assert not matches("12:abc:1.0", 12, "abd")
    assert not matches(None, 12, "abc")
    assert matches(":abc:", 99, "abc")  # an earlier release recorded the ETag alone
    assert matches("12::", 12, None)  # ... or the size alone


def test_a_managers_journal_of_the_previous_release_is_read(tmp_path: Path) -> None:
    """A tier the previous release drained (format ``cloudckpt.drain/1``, keyed by step):
    the step counts as drained and its objects as this drain's, with no request."""
    root, tier = tmp_path / "bucket", tmp_path / "tier"
    m = CheckpointManager(str(root), local_dir=tier)
    m.save(4, {"w": torch.ones(4)})
    m.drain()
    remote = json.loads((tier / "_TIER.json").read_text())["root_url"]
    key = tier / JOURNAL_DIR / f"{step_dir(4)}.json"
    now = json.loads(key.read_text())
    old = {  # exactly what the previous release wrote
        "format": "cloudckpt.drain/1",
        "step": 4,
        "time": now["time"],
        "remote": remote,
        "objects": now["objects"],
        "committed": True,
    }
    key.write_text(json.dumps(old, sort_keys=True))
    local = LocalTier(tier, remote, TransferOptions(), None, 1)
    info = local.info(4)
    assert info is not None and local.drained(info)
    assert local.journal(4, info) == {"objects": now["objects"], "committed": True}
    assert local.waiting() == []
