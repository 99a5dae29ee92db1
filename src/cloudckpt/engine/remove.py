"""Removing a checkpoint: its commit markers first, then its data, then its folders.

One rule for every checkpoint cloudckpt writes or reads (the manager's ``step-N/``, a
DCP directory, a Megatron or NeMo checkpoint, a Lightning sharded one, a tree of
them): the markers (format/commit.py, ``COMMIT_MARKERS``) are deleted before anything
else, the manager's first since it commits all the others, so an interrupted removal
leaves garbage for ``gc``, never a checkpoint that looks committed with files missing.
Then the data objects, many at once on the process's I/O threads (``io/bulk``); then
what is left of the folders on a filesystem (a bucket has none).

Everyone removes a checkpoint through :func:`remove_checkpoint`: the manager's
retention, ``delete`` and ``gc``, the local tier, the NeMo and Lightning removals, the
Hugging Face and Accelerate integrations, ``cloudckpt rm``. ``cloudckpt rm --dry-run``
lists its plan in the same order (:func:`removal_rounds`). A caller that must not wait
for the data (the local tier's retention after a synchronous save: freeing the pages of
a large file on tmpfs takes a third of writing them) runs the same removal in two
parts: :func:`remove_markers` now (the checkpoint is no longer committed), then
:func:`remove_checkpoint` with the listing it returned, later, on a thread of its own.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable

from ..format.commit import (
    DCP_MARKER,
    MANAGER_MARKER,
    MEGATRON_MARKER,
    SAFETENSORS_INDEX_SUFFIX,
)
from ..io.bulk import delete_keys
from ..options import TransferOptions
from ..store import ObjectInfo, Store

__all__ = ["removal_rounds", "remove_checkpoint", "remove_markers"]


def _marker_round(key: str) -> int | None:
    """Which round deletes ``key`` when it is a commit marker (the manager's first,
    then the markers it commits, in the reverse of their writing order); None for data."""
    name = posixpath.basename(key)
    if name == MANAGER_MARKER:
        return 0
    if name == MEGATRON_MARKER:
        return 1
    if name.endswith(SAFETENSORS_INDEX_SUFFIX):
        return 2
    if name == DCP_MARKER:
        return 3
    return None


def removal_rounds(objects: Iterable[ObjectInfo]) -> list[list[ObjectInfo]]:
    """``objects`` in the rounds a removal deletes them: one round per kind of commit
    marker present (the manager's, Megatron's, a safetensors index, DCP's), then
    everything else. A round starts once the one before it has ended."""
    markers: list[list[ObjectInfo]] = [[], [], [], []]
    rest: list[ObjectInfo] = []
    for obj in objects:
        found = _marker_round(obj.key)
        (rest if found is None else markers[found]).append(obj)
    return [r for r in markers if r] + ([rest] if rest else [])


def remove_markers(
    store: Store,
    prefix: str,
    options: TransferOptions,
    objects: Iterable[ObjectInfo] | None = None,
) -> list[ObjectInfo]:
    """The first part of :func:`remove_checkpoint`: delete the commit markers under
    ``prefix`` (ending in ``/``), in :func:`removal_rounds`' order, and nothing else.
    Returns the prefix's listing (``objects``, when the caller has it), for
    ``remove_checkpoint(store, prefix, options, listing)`` to remove the rest (the
    markers there again: an absent one is success)."""
    listed = list(store.list(prefix)) if objects is None else list(objects)
    for round_ in removal_rounds(listed):
        if _marker_round(round_[0].key) is None:
            break  # the data: the last round
        delete_keys(store, [o.key for o in round_], options)
    return listed


def remove_checkpoint(
    store: Store,
    prefix: str,
    options: TransferOptions,
    objects: Iterable[ObjectInfo] | None = None,
) -> int:
    """Delete every object under ``prefix`` (ending in ``/``), in
    :func:`removal_rounds`' order: the commit markers, wherever they lie below it,
    before the data. Then the empty folders a filesystem keeps, deepest first, and
    ``prefix``'s own; nothing above it. ``objects``: the prefix's listing, when the
    caller has it. Returns the number of objects deleted; an absent one is success."""
    listed = list(store.list(prefix)) if objects is None else list(objects)
    for round_ in removal_rounds(listed):
        delete_keys(store, [o.key for o in round_], options)
    for folder in _folders_below(prefix, listed):
        store.remove_prefix_dir(folder)
    store.remove_prefix_dir(prefix)
    return len(listed)


def _folders_below(prefix: str, objects: list[ObjectInfo]) -> list[str]:
    """The folders between ``prefix`` and each of ``objects``, deepest first."""
    found: set[str] = set()
    for obj in objects:
        folder = posixpath.dirname(obj.key)
        while obj.key.startswith(prefix) and len(folder) + 1 > len(prefix) and folder:
            if folder + "/" == prefix or folder + "/" in found:
                break
            found.add(folder + "/")
            folder = posixpath.dirname(folder)
    return sorted(found, key=lambda f: (-f.count("/"), f))
