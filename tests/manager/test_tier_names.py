"""The manager's local tier keyed by a checkpoint's name, as NeMo's tier uses it
(nemo/tier.py): ``<name>/`` holds the marker, ``weights/`` the files the bucket gets.

One process, a memory bucket (its ETags are CRC-32s: they prove nothing of the local
bytes, so only the drain's own record keeps an object there).
"""

from __future__ import annotations

import uuid
from pathlib import Path

from cloudckpt.manager.marker import MARKER_NAME
from cloudckpt.manager.tiers import LocalTier
from cloudckpt.options import TransferOptions
from cloudckpt.store.memory import MemoryStore

NAME = "step=3-last"
COMMIT = "metadata.json"  # megatron's, the bucket's commit for NeMo
PREFIX = f"run/{NAME}/weights/"


def _tier(tmp_path: Path, bucket: MemoryStore) -> LocalTier:
    tier = LocalTier(
        tmp_path / "local", f"{bucket.root_url}/run", TransferOptions(), None, 1, payload="weights/"
    )
    weights = tmp_path / "local" / NAME / "weights"
    weights.mkdir(parents=True)
    (weights / "__0_0.distcp").write_bytes(b"mine" * 256)
    (weights / COMMIT).write_bytes(b'{"sharded_backend": "torch_dist"}')
    tier.commit(3, "megatron", {}, {"nemo_name": NAME}, key=NAME)
    return tier


def _drain(tier: LocalTier, bucket: MemoryStore, sends: list[tuple[str, ...]]) -> None:
    options = TransferOptions()

    def send(exclude: tuple[str, ...]) -> None:
        sends.append(exclude)
        info = tier.info(NAME)
        assert info is not None
        tier.send_payload(NAME, info, bucket, PREFIX, options, exclude)

    tier.drain_ranks(
        NAME,
        bucket,
        PREFIX,
        group=None,
        owner=True,
        send=lambda local: send((COMMIT,)),
        commit=lambda local, files: send(()),
        uncommit=(COMMIT,),
    )


def test_a_named_checkpoint_drains_only_its_own_bytes(tmp_path: Path) -> None:
    """An earlier save of the name left its commit, a file of the same name and size
    with other bytes, and an object that is none of this copy's files: the drain
    deletes the commit and the stray, sends its own file over the other, commits last,
    and its record (``_DRAINS/<name>.json``) says drained; ``context/`` is not its."""
    bucket = MemoryStore(f"names-{uuid.uuid4().hex}")
    tier = _tier(tmp_path, bucket)
    bucket.put(PREFIX + "__0_0.distcp", b"them" * 256)  # same size, younger, other bytes
    bucket.put(PREFIX + "__1_0.distcp", b"another save's shard")
    bucket.put(PREFIX + COMMIT, b"{}")
    bucket.put(f"run/{NAME}/context/io.json", b"{}")
    sends: list[tuple[str, ...]] = []
    _drain(tier, bucket, sends)
    assert sends == [(COMMIT,), ()]
    assert sorted(o.key[len(PREFIX) :] for o in bucket.list(PREFIX)) == ["__0_0.distcp", COMMIT]
    assert bucket.get(PREFIX + "__0_0.distcp") == b"mine" * 256
    assert bucket.get(PREFIX + COMMIT) == b'{"sharded_backend": "torch_dist"}'
    assert bucket.get(f"run/{NAME}/context/io.json") == b"{}"
    info = tier.info(NAME)
    assert info is not None and info.step == 3 and tier.drained(info, NAME)
    assert not (tmp_path / "local" / NAME / "weights" / MARKER_NAME).exists()
    record = tier.journal(NAME, info)
    assert record is not None and sorted(record["objects"]) == ["__0_0.distcp", COMMIT]


def test_a_drain_resumed_keeps_what_its_record_proves_and_drop_removes_the_copy(
    tmp_path: Path,
) -> None:
    """A drain cut short after its data: the next one keeps the object its record names
    (unchanged in the bucket) and sends the rest; dropping the copy removes its folder
    and record."""
    bucket = MemoryStore(f"names-{uuid.uuid4().hex}")
    tier = _tier(tmp_path, bucket)
    info = tier.info(NAME)
    assert info is not None
    tier.send_payload(NAME, info, bucket, PREFIX, TransferOptions(), (COMMIT,))
    before = bucket.head(PREFIX + "__0_0.distcp")
    _drain(tier, bucket, [])
    assert bucket.head(PREFIX + "__0_0.distcp") == before  # kept: not sent again
    assert bucket.get(PREFIX + COMMIT) == b'{"sharded_backend": "torch_dist"}'
    tier.drop([NAME])
    assert not (tmp_path / "local" / NAME).exists()
    assert tier.journal(NAME, info) is None
