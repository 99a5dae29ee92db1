"""CloudCheckpointIO's local tier keeps the drain record every tier keeps (one file per
checkpoint, ``_DRAINS/<file>.json``, engine/journal.py), reads the journal of the
previous release (``_DRAIN.json``) once, and sweeps the temp files of dead writers at
each save and removal, never a live writer's (docs/tiers.md, "Lightning").
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import cloudckpt
from cloudckpt.lightning import CloudCheckpointIO
from cloudckpt.store.local import LocalStore
from servers import S3Server, recorded_bucket


@pytest.fixture
def bucket(moto_server: S3Server) -> Iterator[tuple[str, dict[str, str], list[tuple[str, str]]]]:
    """(the run's URL, storage options, the (method, path) of every request so far)."""
    with recorded_bucket(moto_server) as (name, options, seen):
        yield f"s3://{name}/run", options, seen


def records(tier: Path) -> dict[str, dict[str, Any]]:
    """The tier's drain records by file name."""
    return {p.stem: json.loads(p.read_bytes()) for p in (tier / "_DRAINS").glob("*.json")}


def payload_gets(seen: list[tuple[str, str]]) -> int:
    return sum(1 for method, path in seen if method == "GET" and path.endswith(".ckpt"))


def test_each_file_has_its_drain_record_and_the_previous_releases_journal_is_read_once(
    bucket: Any, tmp_path: Path
) -> None:
    url, options, seen = bucket
    tier = tmp_path / "tier"
    name = "epoch=3-step=40.ckpt"
    io = CloudCheckpointIO(local_dir=tier, storage_options=options)
    io.save_checkpoint({"w": torch.zeros(4)}, f"{url}/{name}")
    io.wait()
    (drained,) = records(tier).values()
    assert drained["committed"] and not drained["due"] and drained["remote"] == url
    size, etag, _ = drained["objects"][name].split(":", 2)
    assert int(size) == (tier / name).stat().st_size and etag

    # What the previous release left: name drained (its ETag in _DRAIN.json), a.ckpt
    # saved locally and due, no drain records.
    cloudckpt.save({"w": torch.ones(4)}, str(tier / "a.ckpt"))
    for p in (tier / "_DRAINS").glob("*.json"):
        p.unlink()
    legacy = {"format": "cloudckpt.io-drain/1", "root_url": url}
    legacy |= {"due": ["a.ckpt"], "drained": {name: etag}}
    (tier / "_DRAIN.json").write_text(json.dumps(legacy))

    again = CloudCheckpointIO(local_dir=tier, storage_options=options)
    again.wait()  # a.ckpt, due in the old journal, is drained
    assert not (tier / "_DRAIN.json").exists()  # read once, into the records
    found = records(tier)
    assert sorted(found) == ["a.ckpt", name]
    assert found["a.ckpt"]["committed"] and not found["a.ckpt"]["due"]
    assert found[name]["committed"] and found[name]["objects"] == {name: f":{etag}:"}
    gets = payload_gets(seen)
    assert torch.equal(again.load_checkpoint(f"{url}/{name}")["w"], torch.zeros(4))
    assert torch.equal(again.load_checkpoint(f"{url}/a.ckpt")["w"], torch.ones(4))
    assert payload_gets(seen) == gets  # both read from the local tier
    again.teardown()


def dead_temp(tier: Path, name: str) -> Path:
    """What a local save killed mid-file leaves: its hidden temp file, whose writer's
    lock (``flock``) went with the process."""
    path = tier / f".{name}.cloudckpt-{uuid.uuid4().hex}.part"
    path.write_bytes(b"\0" * 4096)
    return path


def test_a_dead_writers_temp_file_is_swept_by_the_next_save_and_removal_a_live_ones_kept(
    bucket: Any, tmp_path: Path
) -> None:
    url, options, _ = bucket
    tier = tmp_path / "tier"
    io = CloudCheckpointIO(local_dir=tier, storage_options=options)
    io.save_checkpoint({"w": torch.zeros(4)}, f"{url}/a.ckpt")
    io.wait()
    store = LocalStore(tier)
    live = store.create_multipart("c.ckpt")  # a writer of this tier, alive
    alive = tier / live.upload_id
    try:
        dead = dead_temp(tier, "b.ckpt")
        io.save_checkpoint({"w": torch.ones(4)}, f"{url}/b.ckpt")
        assert not dead.exists() and alive.exists()
        dead = dead_temp(tier, "a.ckpt")
        io.remove_checkpoint(f"{url}/a.ckpt")  # Lightning's rotation: the mirror's retention
        io.wait()
        assert not dead.exists() and alive.exists()
    finally:
        store.abort_multipart(live)
    io.teardown()
    assert sorted(p.name for p in tier.iterdir() if p.is_file()) == ["_TIER.json", "b.ckpt"]
