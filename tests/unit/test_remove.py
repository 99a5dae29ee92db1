"""engine/remove.py: one way to remove a checkpoint, its commit markers first."""

from __future__ import annotations

import uuid
from pathlib import Path

from cloudckpt.engine.remove import removal_rounds, remove_checkpoint, remove_markers
from cloudckpt.options import TransferOptions
from cloudckpt.store import ObjectInfo
from cloudckpt.store.local import LocalStore
from cloudckpt.store.memory import MemoryStore

OPTIONS = TransferOptions()


class _Recording(MemoryStore):
    """A memory store that records the order of its deletes."""

    def __init__(self, bucket: str) -> None:
        super().__init__(bucket)
        self.deleted: list[str] = []

    def _delete(self, key: str) -> None:
        self.deleted.append(key)
        super()._delete(key)


def _store(keys: list[str]) -> _Recording:
    store = _Recording(f"remove-{uuid.uuid4().hex}")
    for key in keys:
        store.put(key, b"x")
    return store


def test_every_marker_goes_before_any_data_the_managers_first() -> None:
    keys = [
        "run/step-1/model/__0_0.distcp",
        "run/step-1/model/.metadata",
        "run/step-1/weights/metadata.json",
        "run/step-1/model.safetensors.index.json",
        "run/step-1/_CHECKPOINT.json",
        "run/step-1/common.pt",
    ]
    store = _store(keys)
    assert remove_checkpoint(store, "run/step-1/", OPTIONS) == len(keys)
    assert store.deleted[:4] == [
        "run/step-1/_CHECKPOINT.json",
        "run/step-1/weights/metadata.json",
        "run/step-1/model.safetensors.index.json",
        "run/step-1/model/.metadata",
    ]
    assert sorted(store.deleted[4:]) == ["run/step-1/common.pt", "run/step-1/model/__0_0.distcp"]
    assert list(store.list("run/")) == []


def test_only_the_prefix_is_removed_and_a_given_listing_is_used() -> None:
    store = _store(["a/step-1/x", "a/step-10/x", "a/step-1/.metadata"])
    listing = list(store.list("a/step-1/"))
    assert remove_checkpoint(store, "a/step-1/", OPTIONS, listing) == 2
    assert [o.key for o in store.list("a/")] == ["a/step-10/x"]
    assert remove_checkpoint(store, "a/missing/", OPTIONS) == 0


def test_removal_in_two_parts_markers_now_the_rest_later(tmp_path: Path) -> None:
    # The local tier's retention after a synchronous save: uncommitted at once, the data
    # (and the folders) removed later with the listing the first part returned.
    store = LocalStore(tmp_path)
    keys = ["ck/_CHECKPOINT.json", "ck/model/.metadata", "ck/model/__0_0.distcp", "ck/x.pt"]
    for key in keys:
        store.put(key, b"x")
    listing = remove_markers(store, "ck/", OPTIONS)
    assert sorted(o.key for o in listing) == sorted(keys)
    assert sorted(o.key for o in store.list("ck/")) == ["ck/model/__0_0.distcp", "ck/x.pt"]
    assert remove_checkpoint(store, "ck/", OPTIONS, listing) == len(keys)  # markers: absent
    assert not (tmp_path / "ck").exists()


def test_a_per_rank_metadata_file_is_data() -> None:
    rounds = removal_rounds(
        [ObjectInfo(k, 1) for k in ("c/__0.metadata", "c/.metadata", "c/meta.json")]
    )
    assert [[o.key for o in r] for r in rounds] == [
        ["c/.metadata"],
        ["c/__0.metadata", "c/meta.json"],
    ]


def test_empty_folders_below_the_prefix_go_with_it(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    for key in ("ck/weights/deep/a.bin", "ck/weights/metadata.json", "ck/context/io.json"):
        store.put(key, b"x")
    store.put("other/keep.bin", b"x")
    assert remove_checkpoint(store, "ck/", OPTIONS) == 3
    assert not (tmp_path / "ck").exists()
    assert (tmp_path / "other" / "keep.bin").exists()
