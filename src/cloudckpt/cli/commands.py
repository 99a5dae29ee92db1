"""The ``cloudckpt`` subcommands: each takes parsed arguments and returns an exit code.

Commands are a thin layer over the manager (``manager/``) and the engine; what they
print for people goes through :class:`~cloudckpt.cli.output.Printer`, and with
``--json`` each prints exactly one JSON document on stdout.
"""

from __future__ import annotations

import argparse
import posixpath
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..engine.bench import run_bench
from ..engine.copy import CopyState, TreeCopyResult, copy_object, copy_tree
from ..engine.drain import read_owner
from ..engine.remove import removal_rounds, remove_checkpoint
from ..errors import (
    BucketNotFoundError,
    CloudCkptError,
    ConfigError,
    CorruptCheckpointError,
    DeadlineExceededError,
    NotFoundError,
)
from ..manager.gc import Leftover, collect_garbage, find_leftovers
from ..manager.marker import (
    MARKER_NAME,
    CheckpointInfo,
    DamagedMarker,
    list_checkpoints,
    parse_step,
    read_marker,
    root_prefix,
    step_dir,
)
from ..manager.tiers import LOCAL, REMOTE, RUN_FILE, LocalTier, merge_tiers
from ..options import TransferOptions
from ..redact import display_url
from ..store import ObjectInfo, Store
from ..store import Target as Opened
from ..store.local import LocalStore
from ..store.paths import dir_prefix, exists
from .export import cmd_export
from .output import Printer, human_age, human_bytes, human_time, progress
from .settings import Settings

if TYPE_CHECKING:  # the engine's readers import torch: only the commands that read do
    from ..engine.inspect import Inspection
    from ..engine.verify import ArchiveInfo, TensorInfo

__all__ = ["COMMANDS", "EXIT_NOT_FOUND", "EXIT_OK", "EXIT_VERIFY_FAILED", "Settings"]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_VERIFY_FAILED = 4


@dataclass
class Target:
    """What a URL names: a run root, one checkpoint, one object, or a plain prefix."""

    kind: str  # "run" | "checkpoint" | "object" | "prefix" | "missing"
    store: Store
    key: str  # without trailing "/"
    options: TransferOptions
    checkpoints: list[CheckpointInfo] = field(default_factory=list)
    checkpoint: CheckpointInfo | None = None
    objects: list[ObjectInfo] = field(default_factory=list)
    uncommitted: list[str] = field(default_factory=list)
    #: The steps of a run whose commit marker is there but damaged (neither committed
    #: nor uncommitted leftovers).
    damaged: list[DamagedMarker] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.store.url(self.key)

    @property
    def dir_url(self) -> str:
        return self.store.url(root_prefix(self.key))


def resolve(url: str, settings: Settings) -> Target:
    """Classify ``url`` with at most one HEAD and one listing (plus marker reads)."""
    opened = settings.open(url)
    store, options = opened.store, opened.options
    key = opened.key.rstrip("/")
    if not url.endswith("/") and exists(store, key):
        return Target("object", store, key, options)
    prefix = dir_prefix(key)
    listing = list(store.list(prefix))
    base = posixpath.basename(key)
    if parse_step(base) is not None:
        marker = read_marker(store, prefix + MARKER_NAME)
        if marker is not None:
            return Target("checkpoint", store, key, options, checkpoint=marker, objects=listing)
    damaged: list[DamagedMarker] = []
    checkpoints = list_checkpoints(store, key, options, listing=listing, damaged=damaged)
    if checkpoints or damaged:
        committed = {root_prefix(key) + posixpath.basename(c.url.rstrip("/")) for c in checkpoints}
        committed |= {root_prefix(key) + step_dir(d.step) for d in damaged}
        steps: set[str] = set()
        for o in listing:
            head, sep, _ = o.key[len(prefix) :].partition("/")
            if sep and parse_step(head) is not None and prefix + head not in committed:
                steps.add(store.url(prefix + head + "/"))
        return Target(
            "run",
            store,
            key,
            options,
            checkpoints=checkpoints,
            objects=listing,
            uncommitted=sorted(steps),
            damaged=damaged,
        )
    if listing:
        return Target("prefix", store, key, options, objects=listing)
    return Target("missing", store, key, options)


def _not_found(p: Printer, what: str, url: str) -> int:
    url = display_url(url)
    if p.json_mode:
        p.json({"error": f"{what}: {url}", "exit_code": EXIT_NOT_FOUND})
    p.error(f"{what}: {url}")
    return EXIT_NOT_FOUND


def _metrics_text(metrics: Any) -> str:
    return " ".join(f"{k}={v:.6g}" for k, v in sorted(metrics.items())) or "-"


# -- ls ------------------------------------------------------------------------------------


def cmd_ls(args: argparse.Namespace, opts: Settings, p: Printer) -> int:
    if args.drain_every_n_steps is not None and args.local is None:
        raise ConfigError(
            "--drain-every-n-steps says which steps of a local tier are due: add --local DIR"
        )
    t = resolve(args.url, opts)
    if args.local is not None:
        return _ls_tiers(args, opts, t, p)
    # --all: a run root or prefix also shows open uploads and uncommitted step prefixes
    # (what a killed save leaves), with their ages, even when nothing else is there yet.
    leftovers = None
    if args.all and t.kind in ("run", "prefix", "missing"):
        leftovers = find_leftovers(t.store, t.key, grace_seconds=args.grace, listing=t.objects)
    if t.kind == "missing" and not leftovers:
        return _not_found(p, "nothing at", t.url)
    if t.kind == "missing":
        if p.json_mode:
            p.json({"kind": "leftovers", "url": t.dir_url, "leftovers": _json(leftovers)})
        else:
            _print_leftovers(p, t.dir_url, leftovers or [])
        return EXIT_OK
    if t.kind == "run":
        if p.json_mode:
            body: dict[str, Any] = {
                "kind": "run",
                "url": t.dir_url,
                "checkpoints": [c.as_dict() for c in t.checkpoints],
                "uncommitted": t.uncommitted,
                "damaged": [d.as_dict() for d in t.damaged],
            }
            if leftovers is not None:
                body["leftovers"] = _json(leftovers)
            p.json(body)
            return EXIT_OK
        total = sum(c.size for c in t.checkpoints)
        latest = f"latest step {t.checkpoints[-1].step}" if t.checkpoints else "none valid"
        p.line(f"{t.dir_url}  {len(t.checkpoints)} checkpoint(s), {human_bytes(total)}, {latest}")
        if t.checkpoints:
            p.table(
                ["step", "saved", "size", "kind", "files", "metrics"],
                [_checkpoint_row(c) for c in t.checkpoints],
            )
        _print_damaged(p, t.damaged)
        _print_run_leftovers(p, t, leftovers)
        return EXIT_OK
    if t.kind == "checkpoint":
        c = t.checkpoint
        assert c is not None
        if p.json_mode:
            p.json({"kind": "checkpoint", **c.as_dict()})
            return EXIT_OK
        p.line(
            f"{c.url}  step {c.step}, {human_bytes(c.size)}, {c.kind}, saved {human_time(c.time)}"
        )
        p.line(f"metrics: {_metrics_text(c.metrics)}")
        p.table(["size", "name"], [[human_bytes(f.size), f.name] for f in c.files])
        return EXIT_OK
    objects = t.objects
    if t.kind == "object":
        objects = [t.store.head(t.key)]
    # Every listing names its objects relative to the prefix it lists, which heads it
    # (a lone object: its folder); JSON gives each whole URL too.
    base = root_prefix(t.key) if t.kind == "prefix" else t.key.rpartition("/")[0] + "/"
    base = base.lstrip("/")
    if p.json_mode:
        listed: dict[str, Any] = {
            "kind": t.kind,
            "url": t.url if t.kind == "object" else t.dir_url,
            "objects": [
                {
                    "url": t.store.url(o.key),
                    "name": o.key[len(base) :],
                    "size": o.size,
                    "mtime": o.mtime,
                }
                for o in objects
            ],
        }
        if leftovers is not None:
            listed["leftovers"] = _json(leftovers)
        p.json(listed)
        return EXIT_OK
    rows = [[human_bytes(o.size), human_time(o.mtime), o.key[len(base) :]] for o in objects]
    p.table(["size", "modified", "name"], rows, title=t.store.url(base))
    if leftovers is not None:
        _print_leftovers(p, t.dir_url, leftovers)
    return EXIT_OK


def _checkpoint_row(c: CheckpointInfo, tiers: str | None = None) -> list[str]:
    """One row of a run's table: step, time, size, kind, files, [tiers,] metrics."""
    row = [str(c.step), human_time(c.time), human_bytes(c.size), c.kind, str(len(c.files))]
    return row + ([] if tiers is None else [tiers]) + [_metrics_text(c.metrics)]


def _print_damaged(p: Printer, damaged: list[DamagedMarker]) -> None:
    """Below a run's table: the steps whose commit marker is damaged."""
    if damaged:
        p.line(
            f"{len(damaged)} damaged step(s) (a commit marker that cannot be used: not "
            "restored, `cloudckpt verify` fails them):"
        )
        for d in damaged:
            p.line(f"  step {d.step}  {d.reason}")


def _damaged_error(where: str, damaged: list[DamagedMarker]) -> CorruptCheckpointError:
    steps = sorted({d.step for d in damaged})
    return CorruptCheckpointError(
        f"no valid committed checkpoint under {where}: the commit marker of step(s) "
        f"{steps} is damaged: " + "; ".join(d.reason for d in damaged)
    )


def _print_run_leftovers(p: Printer, t: Target, leftovers: list[Leftover] | None) -> None:
    """Below a run's table: its leftovers (``--all``), else its uncommitted step prefixes."""
    if leftovers is not None:
        _print_leftovers(p, t.dir_url, leftovers)
    elif t.uncommitted:
        p.line(
            f"{len(t.uncommitted)} uncommitted step prefix(es) (a save that failed or is "
            "still running; `cloudckpt gc` removes old ones; `ls --all` shows their "
            "ages and open uploads):"
        )
        for u in t.uncommitted:
            p.line(f"  {u}")


def _open_tier(local: str, root_url: str, settings: Settings, every: int = 1) -> LocalTier:
    """The local tier in the directory ``local`` (a manager's ``local_dir``) of the run
    ``root_url``: NotFoundError when the directory has no run file, ConfigError when its
    run file names another run (a tier is only ever read for its own run)."""
    opened = settings.open(local)
    if not isinstance(opened.store, LocalStore):
        raise ConfigError(f"--local takes a local directory, not {display_url(local)}")
    key = opened.key.rstrip("/")
    if not exists(opened.store, root_prefix(key) + RUN_FILE):
        raise NotFoundError(
            f"{opened.store.url(root_prefix(key))} is not a local tier: it has no {RUN_FILE} "
            "(a CheckpointManager with local_dir= writes one)"
        )
    path = opened.store.root / key
    # Checked before the tier is opened: opening another run's tier logs a WARNING that
    # would say the same as this error, a second time.
    owner = read_owner(LocalStore(path))
    if owner != root_url:
        raise ConfigError(
            f"{opened.store.url(root_prefix(key))} holds the local tier of {owner}, not of "
            f"{root_url}; name the run root it belongs to"
        )
    # The run file exists and names this run: opening the tier reads it, writes nothing.
    return LocalTier(path, root_url, opened.options, None, every)


def _tier_text(tiers: tuple[str, ...]) -> str:
    """Which tiers hold a step, in one word: local, remote or both."""
    return "both" if LOCAL in tiers and REMOTE in tiers else ", ".join(tiers)


def _ls_tiers(args: argparse.Namespace, opts: Settings, t: Target, p: Printer) -> int:
    """``ls --local DIR ROOT``: the run's steps committed in either tier (the tier's own
    listing, merged as the manager merges it), which tiers hold each, and the steps due
    for the bucket that are not committed there yet."""
    if t.kind in ("object", "checkpoint"):
        raise ConfigError(f"--local lists a run: {t.url} is a {t.kind}, not a run root")
    every = args.drain_every_n_steps if args.drain_every_n_steps is not None else 1
    tier = _open_tier(args.local, t.dir_url, opts, every)
    in_tier = tier.list()
    merged = merge_tiers(t.checkpoints, in_tier)
    undrained = tier.undrained((c.step for c in t.checkpoints), in_tier)
    leftovers = None
    if args.all:
        leftovers = find_leftovers(t.store, t.key, grace_seconds=args.grace, listing=t.objects)
    if not merged and not leftovers:
        return _not_found(p, f"no committed checkpoint in {tier.url} or", t.dir_url)
    if p.json_mode:
        body: dict[str, Any] = {
            "kind": "run",
            "url": t.dir_url,
            "local_url": tier.url,
            "drain_every_n_steps": every,
            "checkpoints": [c.as_dict() for c in merged],
            "undrained": undrained,
            "uncommitted": t.uncommitted,
            "damaged": [d.as_dict() for d in t.damaged],
        }
        if leftovers is not None:
            body["leftovers"] = _json(leftovers)
        p.json(body)
        return EXIT_OK
    if merged:
        local = sum(LOCAL in c.tiers for c in merged)
        remote = sum(REMOTE in c.tiers for c in merged)
        p.line(
            f"{t.dir_url}  {len(merged)} checkpoint(s), latest step {merged[-1].step}: "
            f"{local} in the local tier {tier.url}, {remote} in the bucket"
        )
        p.table(
            ["step", "saved", "size", "kind", "files", "tiers", "metrics"],
            [_checkpoint_row(c, _tier_text(c.tiers)) for c in merged],
        )
    if undrained:
        p.line(
            f"{len(undrained)} step(s) due for the bucket and not drained yet: "
            f"{', '.join(map(str, undrained))} (the manager drains them in the background; "
            "the next CheckpointManager with this local_dir finishes a drain left unfinished)"
        )
    elif merged:
        p.line("nothing left to drain: every step due for the bucket is committed there")
    _print_damaged(p, t.damaged)
    _print_run_leftovers(p, t, leftovers)
    return EXIT_OK


def _json(leftovers: list[Leftover] | None) -> list[dict[str, object]]:
    return [x.as_dict() for x in leftovers or []]


def _leftover_text(x: Leftover) -> str:
    """One leftover for people: what it is, its size or upload id, its age, its fate."""
    if x.kind == "upload":
        what = f"open multipart upload to {x.url} (upload {(x.upload_id or '?')[:16]}...)"
        age = f"opened {human_age(x.age_s)} ago"
    else:
        what = f"uncommitted {x.url} ({x.objects} objects, {human_bytes(x.bytes)})"
        age = f"newest object {human_age(x.age_s)} old"
    fate = "within grace period (kept)" if x.kept else "older than the grace period"
    return f"{what}, {age}: {fate}"


def _print_leftovers(p: Printer, root_url: str, leftovers: list[Leftover]) -> None:
    """The ``ls --all`` section: every leftover under a root, or that there is none."""
    if not leftovers:
        p.line(f"no leftovers under {root_url} (no open uploads, no uncommitted steps)")
        return
    p.line(
        f"{len(leftovers)} leftover(s) under {root_url} (a save that failed or is still "
        "running; `cloudckpt gc` removes those older than its grace period, 1h by default):"
    )
    for x in leftovers:
        p.line(f"  {_leftover_text(x)}")


# -- latest --------------------------------------------------------------------------------


def cmd_latest(args: argparse.Namespace, opts: Settings, p: Printer) -> int:
    o = opts.open(args.root)
    store, key = o.store, o.key
    damaged: list[DamagedMarker] = []
    found = list_checkpoints(store, key.rstrip("/"), o.options, damaged=damaged)
    if not found and damaged:  # a run with checkpoints, none usable: exit code 4
        raise _damaged_error(store.url(root_prefix(key)), damaged)
    if not found:
        return _not_found(p, "no committed checkpoint under", store.url(root_prefix(key)))
    c = found[-1]
    newer = sorted({d.step for d in damaged if d.step > c.step})
    if newer:
        p.note(
            f"{p.prefix}: step {c.step} is the newest step with a valid commit marker; "
            f"the marker of newer step(s) {newer} is damaged"
        )
    if p.json_mode:
        p.json(c.as_dict())
    else:
        p.line(c.url)
        p.note(f"step {c.step}, {human_bytes(c.size)}, saved {human_time(c.time)}")
    return EXIT_OK


# -- info ----------------------------------------------------------------------------------


def _archive_keys(c: CheckpointInfo, prefix: str) -> list[str]:
    return [prefix + f.name for f in c.files if f.name.endswith((".pt", ".pth", ".ckpt", ".bin"))]


def _tensor_json(x: TensorInfo) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": x.path,
        "dtype": x.dtype,
        "shape": list(x.shape),
        "bytes": x.nbytes,
    }
    if x.file:
        body["file"] = x.file
    return body


def _archive_json(a: ArchiveInfo) -> dict[str, Any]:
    return {
        "url": a.url,
        "size": a.size,
        "format": a.format,
        "records": a.records,
        "top_level_type": a.top_level_type,
        "top_level_keys": a.top_level_keys,
        "tensor_bytes": a.tensor_bytes,
        "tensors": [_tensor_json(x) for x in a.tensors],
        "scalars": a.scalars,
        "note": a.note,
    }


def _inspect_target(
    t: Target, args: argparse.Namespace, p: Printer
) -> tuple[CheckpointInfo | None, Inspection]:
    """The checkpoint marker (for a run or a step) and the engine's description."""
    from ..engine.inspect import Inspection, detect, inspect
    from ..engine.verify import describe

    weights_only = not args.unsafe
    if t.kind in ("object", "prefix"):
        found = detect(t.store, t.key + ("/" if t.kind == "prefix" else ""))
        if found.kind == "prefix":
            raise ConfigError(f"{t.dir_url} is a prefix, not a checkpoint (try `cloudckpt ls`)")
        return None, inspect(found, t.options, weights_only=weights_only)
    if t.kind == "run" and not t.checkpoints:
        raise _damaged_error(t.dir_url, t.damaged)
    c = t.checkpoints[-1] if t.kind == "run" else t.checkpoint
    assert c is not None
    if t.kind == "run":
        p.note(f"{t.dir_url} is a run; showing its latest checkpoint, step {c.step}")
    prefix = c.url[len(t.store.url("")) :]
    if c.kind == "dcp":
        return c, inspect(detect(t.store, prefix), t.options, weights_only=weights_only)
    archives = [describe(t.store, k, weights_only=weights_only) for k in _archive_keys(c, prefix)]
    out = Inspection("checkpoint", c.url, c.size, len(c.files), c.kind, archives=archives)
    for a in archives:
        out.tensors += a.tensors
        name = a.url.rpartition("/")[2]
        out.scalars.update(
            {(k if len(archives) == 1 else f"{name}:{k}"): v for k, v in a.scalars.items()}
        )
    return c, out


def cmd_info(args: argparse.Namespace, opts: Settings, p: Printer) -> int:
    t = resolve(args.url, opts)
    if t.kind == "missing":
        return _not_found(p, "nothing at", t.url)
    checkpoint, info = _inspect_target(t, args, p)  # imports torch: only commands that read
    if p.json_mode:
        p.json(
            {
                "kind": info.kind,
                "url": info.url,
                "format": info.format,
                "size": info.size,
                "files": info.files,
                "checkpoint": checkpoint.as_dict() if checkpoint is not None else None,
                "tensor_bytes": info.tensor_bytes,
                "tensors": [_tensor_json(x) for x in info.tensors],
                "items": [{"name": i.name, "bytes": i.nbytes} for i in info.items],
                "scalars": info.scalars,
                "metadata": info.metadata,
                "archives": [_archive_json(a) for a in info.archives],
                "note": info.note,
            }
        )
        return EXIT_OK
    if checkpoint is not None:
        c = checkpoint
        p.line(
            f"checkpoint {c.url}: step {c.step}, {c.kind}, {human_bytes(c.size)}, "
            f"saved {human_time(c.time)} by cloudckpt {c.library_version}"
        )
        p.line(f"metrics: {_metrics_text(c.metrics)}")
        if c.metadata:
            p.line(f"metadata: {c.metadata}")
    if info.kind not in ("torch", "checkpoint"):
        p.line(f"{info.url}: {info.format}, {info.files} file(s), {human_bytes(info.size)}")
        for k, v in info.metadata.items():
            p.line(f"{k}: {v}")
    for a in info.archives:
        p.line(f"{a.url}: {human_bytes(a.size)}, {a.format}, {a.records} records")
        if a.top_level_keys is not None:
            p.line(f"top-level keys ({len(a.top_level_keys)}): {', '.join(a.top_level_keys)}")
        else:
            p.line(f"top level: {a.top_level_type}")
        if a.note:
            p.line(a.note)
    if info.note:
        p.line(info.note)
    if info.scalars:
        p.line("values: " + ", ".join(f"{k}={v!r}" for k, v in info.scalars.items()))
    if info.kind == "dcp-data":
        return EXIT_OK
    p.line(f"{len(info.tensors)} tensors, {human_bytes(info.tensor_bytes)}")
    sharded = any(x.file for x in info.tensors)
    rows = [
        [x.path, x.dtype, "x".join(map(str, x.shape)) or "scalar", human_bytes(x.nbytes)]
        + ([x.file] if sharded else [])
        for x in info.tensors
    ]
    p.table(["name", "dtype", "shape", "bytes"] + (["file"] if sharded else []), rows)
    if info.items:
        p.line(f"{len(info.items)} non-tensor items")
        p.table(["name", "bytes"], [[i.name, human_bytes(i.nbytes)] for i in info.items])
    return EXIT_OK


# -- verify --------------------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace, opts: Settings, p: Printer) -> int:
    from ..engine.inspect import Checked, detect, verify

    if args.local is not None:
        t = _tier_run(args.local, args.url, opts)
        if not t.checkpoints and not t.damaged:
            return _not_found(p, "no committed checkpoint in the local tier", t.dir_url)
    else:
        t = resolve(args.url, opts)
    if t.kind == "missing":
        return _not_found(p, "nothing at", t.url)
    enabled = args.progress if args.progress is not None else sys.stderr.isatty()
    note = ""
    results: list[Checked] = []
    with progress("verify", enabled and not p.json_mode) as (advance, _set_total):
        if t.kind in ("object", "prefix"):
            found = detect(t.store, t.key + ("/" if t.kind == "prefix" else ""))
            if found.kind == "prefix":
                raise ConfigError(
                    f"{t.dir_url} holds no committed checkpoint of a kind cloudckpt knows "
                    "(a manager run, DCP, Megatron, safetensors) and is not an object"
                )
            report = verify(found, t.options, advance=advance)
            results, note = report.checked, report.note
        else:
            checkpoints = t.checkpoints if t.kind == "run" else [t.checkpoint]
            for c in checkpoints:
                assert c is not None
                results += _verify_managed(t, c, advance)
            for d in t.damaged:  # a damaged marker fails its step
                results.append(Checked(d.url, ok=False, error=d.reason))
    ok = all(r.ok for r in results)
    if p.json_mode:
        p.json(
            {
                "ok": ok,
                "url": t.url if t.kind == "object" else t.dir_url,
                "note": note,
                "checked": [
                    {"url": r.url, "ok": r.ok, "bytes": r.bytes, "error": r.error} for r in results
                ],
            }
        )
    else:
        for r in results:
            status = "ok" if r.ok else "FAILED"
            p.line(f"{status:6} {r.url}" + (f"  {r.error}" if r.error else ""))
        if note:
            p.line(note)
        p.line(f"{'all' if ok else 'NOT all'} {len(results)} object(s) verified")
    return EXIT_OK if ok else EXIT_VERIFY_FAILED


def _tier_run(local: str, root: str, settings: Settings) -> Target:
    """``verify --local DIR ROOT``: the local tier of the run ``ROOT`` as a run of its
    own, holding the steps committed there (the bucket is not read)."""
    opened = settings.open(root)
    tier = _open_tier(local, opened.store.url(root_prefix(opened.key)), settings)
    damaged: list[DamagedMarker] = []
    found = tier.list(damaged)
    return Target("run", tier.store, "", tier.options, checkpoints=found, damaged=damaged)


def _verify_managed(t: Target, c: CheckpointInfo, advance: Callable[[int], None]) -> list[Any]:
    """One manager checkpoint: each file's size and ETag against its marker, every
    archive's records, and a DCP payload's own checks (engine/inspect.py)."""
    from ..engine.inspect import Checked, detect, verify_dcp
    from ..engine.verify import verify_archive

    prefix = c.url[len(t.store.url("")) :]
    dcp: dict[str, Checked] = {}
    if c.kind == "dcp":
        dcp = {r.url: r for r in verify_dcp(detect(t.store, prefix), t.options, advance=advance)}
    results = []
    for f in c.files:
        key = prefix + f.name
        entry = Checked(t.store.url(key))
        try:
            info = t.store.head(key)
            if info.size != f.size:
                raise _Mismatch(f"{entry.url} holds {info.size} bytes; its marker says {f.size}")
            if f.etag and info.etag and f.etag.strip('"') != info.etag.strip('"'):
                raise _Mismatch(f"{entry.url} changed since it was committed (ETag differs)")
            entry.bytes = info.size
            if f.name.endswith((".pt", ".pth", ".ckpt", ".bin")):
                entry.bytes = verify_archive(t.store, key, t.options, advance=advance)
        except (_Mismatch, NotFoundError, CloudCkptError) as exc:
            if not isinstance(exc, (_Mismatch, NotFoundError)) and not _is_corrupt(exc):
                raise
            entry.fail(exc)
        checked = dcp.get(entry.url)
        if checked is not None and not checked.ok:
            entry.fail(checked.error or "failed")
        results.append(entry)
    return results


class _Mismatch(CloudCkptError):
    pass


def _is_corrupt(exc: BaseException) -> bool:
    from ..errors import CorruptCheckpointError

    return isinstance(exc, CorruptCheckpointError)


# -- rm ------------------------------------------------------------------------------------


def _rm_plan(t: Target) -> list[ObjectInfo]:
    """What ``rm`` deletes, in its order: the commit markers before the files (so no
    checkpoint looks committed while they go), then everything else (engine/remove.py)."""
    if t.kind == "object":
        return [t.store.head(t.key)]
    return [o for round_ in removal_rounds(t.objects) for o in round_]


def cmd_rm(args: argparse.Namespace, opts: Settings, p: Printer) -> int:
    t = resolve(args.url, opts)
    removed: list[str] = []
    if t.kind == "missing":
        return _not_found(p, "nothing at", t.url)
    if args.dry_run:
        return _rm_dry_run(args, t, p)
    if t.kind == "object":
        t.store.delete(t.key)
        removed.append(t.url)
    elif t.kind == "checkpoint" or parse_step(posixpath.basename(t.key)) is not None:
        remove_checkpoint(t.store, root_prefix(t.key), t.options, t.objects)
        removed += [t.store.url(o.key) for o in t.objects]
    else:
        if not args.recursive:
            raise ConfigError(
                f"{t.dir_url} is a prefix with {len(t.objects)} object(s); "
                "pass --recursive (-r) to delete all of them"
            )
        # Markers first, so no checkpoint looks committed while its files go.
        remove_checkpoint(t.store, dir_prefix(t.key), t.options, t.objects)
        removed += [t.store.url(o.key) for o in t.objects]
    if p.json_mode:
        p.json({"removed": removed})
    else:
        p.line(f"removed {len(removed)} object(s) under {t.url}")
    return EXIT_OK


def _rm_dry_run(args: argparse.Namespace, t: Target, p: Printer) -> int:
    """List what ``rm`` would delete, in its order, and delete nothing."""
    is_step = parse_step(posixpath.basename(t.key)) is not None
    if t.kind not in ("object", "checkpoint") and not is_step and not args.recursive:
        raise ConfigError(
            f"{t.dir_url} is a prefix with {len(t.objects)} object(s); "
            "pass --recursive (-r) to delete all of them"
        )
    plan = _rm_plan(t)
    if p.json_mode:
        p.json(
            {
                "dry_run": True,
                "would_remove": [{"url": t.store.url(o.key), "size": o.size} for o in plan],
            }
        )
        return EXIT_OK
    for o in plan:
        p.line(f"would remove {t.store.url(o.key)} ({human_bytes(o.size)})")
    total = human_bytes(sum(o.size for o in plan))
    p.line(f"would remove {len(plan)} object(s), {total}, under {t.url} (dry run: nothing removed)")
    return EXIT_OK


# -- gc ------------------------------------------------------------------------------------


def cmd_gc(args: argparse.Namespace, opts: Settings, p: Printer) -> int:
    o = opts.open(args.root)
    report = collect_garbage(
        o.store, o.key.rstrip("/"), o.options, grace_seconds=args.grace, dry_run=args.dry_run
    )
    if p.json_mode:
        p.json(
            {
                "dry_run": report.dry_run,
                "grace_s": args.grace,
                "prefixes": [{"url": u, "objects": n, "bytes": b} for u, n, b in report.prefixes],
                "uploads": [{"url": u, "upload_id": i, "age_s": a} for u, i, a in report.uploads],
                "skipped_young": report.skipped_young,
                "kept": _json(report.kept),
                "leftovers": _json(report.leftovers),
            }
        )
        return EXIT_OK
    verb = "would remove" if report.dry_run else "removed"
    ages = {x.url: x.age_s for x in report.leftovers if x.kind == "prefix"}
    for u, n, b in report.prefixes:
        p.line(
            f"{verb} {u} ({n} objects, {human_bytes(b)}, no commit marker, newest object "
            f"{human_age(ages.get(u, float('inf')))} old)"
        )
    for u, i, a in report.uploads:
        p.line(
            f"{'would abort' if report.dry_run else 'aborted'} upload {i[:16]}... to {u} "
            f"(opened {human_age(a)} ago)"
        )
    for x in report.kept:
        p.line(f"kept {_leftover_text(x)}")
    p.line(
        f"{verb} {len(report.prefixes)} uncommitted prefix(es), {human_bytes(report.bytes)}; "
        f"{'would abort' if report.dry_run else 'aborted'} {len(report.uploads)} stale "
        f"upload(s); kept {len(report.kept)} within the grace period ({human_age(args.grace)})"
    )
    return EXIT_OK


# -- mb ------------------------------------------------------------------------------------


def cmd_mb(args: argparse.Namespace, opts: Settings, p: Printer) -> int:
    o = opts.open(args.url)
    create = getattr(o.store, "create_bucket", None)
    if create is None:
        raise ConfigError(
            f"cannot create a bucket for {display_url(args.url)}: its store "
            f"({type(o.store).__name__}) has no buckets to create (S3 and S3-compatible "
            "stores do)"
        )
    if o.key.strip("/"):
        raise ConfigError(
            f"{display_url(args.url)} names a path inside a bucket; mb takes a bucket URL "
            "such as s3://NAME"
        )
    create()
    url = o.store.root_url
    if p.json_mode:
        p.json({"created": url})
    else:
        p.line(f"created bucket {url}")
    return EXIT_OK


# -- cp ------------------------------------------------------------------------------------


def _destination(src_key: str, dst_url: str, settings: Settings) -> tuple[Opened, str]:
    """The destination opened, and the key the copy lands at."""
    opened = settings.open(dst_url)
    store, key = opened.store, opened.key
    name = posixpath.basename(src_key)
    if dst_url.endswith("/") or not key:
        return opened, root_prefix(key) + name
    if isinstance(store, LocalStore) and (store.root / key).is_dir():
        return opened, f"{key}/{name}"
    return opened, key


def _rate(moved: int, seconds: float) -> str:
    """The transfer rate over the bytes this run moved; '' when it moved none."""
    return f"{moved / seconds / 1e6:.1f} MB/s" if moved > 0 and seconds > 0 else ""


def _copy_stopped(p: Printer, exc: BaseException, state: CopyState) -> None:
    """Say what an interrupted or failed copy kept, and that rerunning resumes it."""
    if isinstance(exc, (ConfigError, NotFoundError)):
        return  # nothing was started, or the source is gone: nothing to resume
    if isinstance(exc, KeyboardInterrupt):
        cause = "interrupted"
    elif isinstance(exc, DeadlineExceededError):
        cause = "deadline passed"
    else:
        cause = "stopped"
    if not (state.copied or state.pieces_kept or state.upload_open):
        # A rerun starts over: no resume to offer.
        said = f"{cause}: nothing kept"
    else:
        said = f"{cause}: {state.kept()}; run the same command to resume"
    if isinstance(exc, KeyboardInterrupt):
        p.stopped = said  # the one line an interrupted command ends with (cli/main.py)
    else:
        p.error(said)


def cmd_cp(args: argparse.Namespace, opts: Settings, p: Printer) -> int:
    if args.recursive:
        return _cp_tree(args, opts, p)
    if args.dry_run:
        raise ConfigError("--dry-run lists the objects of a recursive copy: add -r")
    src = opts.open(args.src)
    src_store, src_key = src.store, src.key
    if not src_key or args.src.endswith("/"):
        raise ConfigError(f"{args.src} names a prefix; copy a prefix with cp -r")
    if isinstance(src_store, LocalStore) and (src_store.root / src_key).is_dir():
        raise ConfigError(f"{args.src} is a directory: use cp -r to copy what it holds")
    dst, dst_key = _destination(src_key, args.dst, opts)
    dst_store = dst.store
    enabled = args.progress if args.progress is not None else sys.stderr.isatty()
    state_dir = Path(args.state_dir) if args.state_dir else None
    name = posixpath.basename(src_key)
    state = CopyState()
    try:
        with progress(f"cp {name}", enabled and not p.json_mode) as (advance, set_total):
            result = copy_object(
                src_store,
                src_key,
                dst_store,
                dst_key,
                dst.options,
                state_dir=state_dir,
                advance=advance,
                on_size=set_total,
                state=state,
            )
    except NotFoundError as exc:
        if not isinstance(exc, BucketNotFoundError):
            first = next(iter(src_store.list(dir_prefix(src_key))), None)
            if first is not None:  # no object there, but objects under it
                raise ConfigError(
                    f"{display_url(src_store.url(src_key))} is a prefix, not an object: use "
                    "cp -r to copy what it holds"
                ) from None
        raise
    except (KeyboardInterrupt, CloudCkptError, OSError) as exc:
        _copy_stopped(p, exc, state)
        raise
    if p.json_mode:
        p.json(
            {
                "src": result.src,
                "dst": result.dst,
                "size": result.size,
                "seconds": result.seconds,
                "resumed_bytes": result.resumed_bytes,
                "moved_bytes": result.moved_bytes,
            }
        )
    else:
        rate = _rate(result.moved_bytes, result.seconds)
        resumed = (
            f", resumed after {human_bytes(result.resumed_bytes)}" if result.resumed_bytes else ""
        )
        p.line(
            f"copied {result.src} -> {result.dst} ({human_bytes(result.size)}"
            f"{', ' + rate if rate else ''}{resumed})"
        )
    return EXIT_OK


def _cp_tree(args: argparse.Namespace, opts: Settings, p: Printer) -> int:
    """``cp -r``: every object under the source prefix, keys relative to it."""
    src = opts.open(args.src)
    dst = opts.open(args.dst)
    enabled = args.progress if args.progress is not None else sys.stderr.isatty()
    state_dir = Path(args.state_dir) if args.state_dir else None
    name = posixpath.basename(src.key.rstrip("/")) or src.store.url("")
    state = CopyState()
    try:
        show = enabled and not p.json_mode and not args.dry_run
        with progress(f"cp -r {name}", show) as (advance, set_total):
            result = copy_tree(
                src.store,
                src.key,
                dst.store,
                dst.key,
                dst.options,
                state_dir=state_dir,
                dry_run=args.dry_run,
                advance=advance,
                on_size=set_total,
                state=state,
            )
    except (KeyboardInterrupt, CloudCkptError, OSError) as exc:
        _copy_stopped(p, exc, state)
        raise
    _print_tree(result, p)
    return EXIT_OK


def _print_tree(result: TreeCopyResult, p: Printer) -> None:
    """The summary of a recursive copy (with ``--dry-run``: its plan, object by object)."""
    if p.json_mode:
        p.json(
            {
                "src": result.src,
                "dst": result.dst,
                "dry_run": result.dry_run,
                "copied": len(result.copied),
                "skipped": len(result.skipped),
                "bytes": result.size,
                "moved_bytes": result.moved_bytes,
                "resumed_bytes": result.resumed_bytes,
                "seconds": result.seconds,
                "objects": [
                    {"name": e.name, "size": e.size, "action": "skip" if e.skip else "copy"}
                    for e in result.entries
                ],
            }
        )
        return
    verb = "would copy" if result.dry_run else "copied"
    if result.dry_run:
        rows = [["skip" if e.skip else "copy", human_bytes(e.size), e.name] for e in result.entries]
        p.table(["action", "size", "name"], rows, title=f"{result.src} -> {result.dst}")
    rate = "" if result.dry_run else _rate(result.moved_bytes, result.seconds)
    resumed = f", resumed after {human_bytes(result.resumed_bytes)}" if result.resumed_bytes else ""
    p.line(
        f"{verb} {len(result.copied)} object(s) ({human_bytes(result.size)}"
        f"{', ' + rate if rate else ''}{resumed}), skipped {len(result.skipped)} already at "
        f"the destination: {result.src} -> {result.dst}"
        + (" (dry run: nothing written)" if result.dry_run else "")
    )


# -- bench ---------------------------------------------------------------------------------


def cmd_bench(args: argparse.Namespace, opts: Settings, p: Printer) -> int:
    o = opts.open(args.url)
    result = run_bench(
        o.store,
        o.key,
        o.options,
        size=args.size,
        part_size=args.bench_part_size,
        concurrencies=args.concurrency,
        requests=args.requests,
        report=(lambda s: None) if p.json_mode else p.note,
    )
    if p.json_mode:
        p.json(result.as_dict())
        return EXIT_OK
    p.line(
        f"bench {result.url} ({human_bytes(result.size)} object, "
        f"{human_bytes(result.part_size)} parts)"
    )
    p.table(
        ["op", "p50 ms", "p95 ms", "max ms"],
        [[op, str(v["p50"]), str(v["p95"]), str(v["max"])] for op, v in result.latency_ms.items()],
        title="request latency",
    )
    p.table(
        ["in flight", "write GB/s", "read GB/s"],
        [
            [str(c), f"{result.write_gbps.get(c, 0):.3f}", f"{result.read_gbps.get(c, 0):.3f}"]
            for c in sorted(set(result.write_gbps) | set(result.read_gbps))
        ],
        title="throughput",
    )
    s = result.suggestion
    p.line(
        f"suggested: part_size={human_bytes(s['part_size'])} "
        f"write_concurrency={s['write_concurrency']} read_concurrency={s['read_concurrency']}"
    )
    return EXIT_OK


COMMANDS = {
    "ls": cmd_ls,
    "info": cmd_info,
    "cp": cmd_cp,
    "verify": cmd_verify,
    "rm": cmd_rm,
    "latest": cmd_latest,
    "gc": cmd_gc,
    "mb": cmd_mb,
    "bench": cmd_bench,
    "export": cmd_export,
}
