"""The ``cloudckpt`` subcommands: each takes parsed arguments and returns an exit code.

Commands are a thin layer over the manager (``manager/``) and the engine; what they
print for people goes through :class:`~cloudckpt.cli.output.Printer`, and with
``--json`` each prints exactly one JSON document on stdout.
"""

from __future__ import annotations

import argparse
import os
import posixpath
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engine.bench import run_bench
from ..engine.copy import PARTIAL_SUFFIX, copy_object
from ..errors import CloudCkptError, ConfigError, NotFoundError
from ..manager.gc import collect_garbage, delete_prefix, delete_tree
from ..manager.marker import (
    MARKER_NAME,
    CheckpointInfo,
    list_checkpoints,
    parse_step,
    read_marker,
    root_prefix,
)
from ..options import TransferOptions
from ..redact import display_url
from ..store import ObjectInfo, Store
from ..store import Target as Opened
from ..store.local import LocalStore
from ..store.paths import dir_prefix, exists
from .export import cmd_export
from .output import Printer, human_bytes, human_time, progress
from .settings import Settings

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
    checkpoints = list_checkpoints(store, key, options, listing=listing)
    if checkpoints:
        committed = {root_prefix(key) + posixpath.basename(c.url.rstrip("/")) for c in checkpoints}
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
        )
    if listing:
        return Target("prefix", store, key, options, objects=listing)
    return Target("missing", store, key, options)


def _not_found(p: Printer, what: str, url: str) -> int:
    url = display_url(url)
    if p.json_mode:
        p.json({"error": f"{what}: {url}", "exit_code": EXIT_NOT_FOUND})
    p.note(f"cloudckpt: {what}: {url}")
    return EXIT_NOT_FOUND


def _metrics_text(metrics: Any) -> str:
    return " ".join(f"{k}={v:.6g}" for k, v in sorted(metrics.items())) or "-"


# -- ls ------------------------------------------------------------------------------------


def cmd_ls(args: argparse.Namespace, opts: Settings, p: Printer) -> int:
    t = resolve(args.url, opts)
    if t.kind == "missing":
        return _not_found(p, "nothing at", t.url)
    if t.kind == "run":
        if p.json_mode:
            p.json(
                {
                    "kind": "run",
                    "url": t.dir_url,
                    "checkpoints": [c.as_dict() for c in t.checkpoints],
                    "uncommitted": t.uncommitted,
                }
            )
            return EXIT_OK
        total = sum(c.size for c in t.checkpoints)
        p.line(
            f"{t.dir_url}  {len(t.checkpoints)} checkpoint(s), {human_bytes(total)}, "
            f"latest step {t.checkpoints[-1].step}"
        )
        rows = [
            [
                str(c.step),
                human_time(c.time),
                human_bytes(c.size),
                c.kind,
                str(len(c.files)),
                _metrics_text(c.metrics),
            ]
            for c in t.checkpoints
        ]
        p.table(["step", "saved", "size", "kind", "files", "metrics"], rows)
        if t.uncommitted:
            p.line(
                f"{len(t.uncommitted)} uncommitted step prefix(es) (a save that failed or is "
                "still running; `cloudckpt gc` removes old ones):"
            )
            for u in t.uncommitted:
                p.line(f"  {u}")
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
    if p.json_mode:
        p.json(
            {
                "kind": t.kind,
                "url": t.url if t.kind == "object" else t.dir_url,
                "objects": [
                    {"url": t.store.url(o.key), "size": o.size, "mtime": o.mtime} for o in objects
                ],
            }
        )
        return EXIT_OK
    base = root_prefix(t.key) if t.kind == "prefix" else ""
    rows = [
        [
            human_bytes(o.size),
            human_time(o.mtime),
            o.key[len(base) :] if base else t.store.url(o.key),
        ]
        for o in objects
    ]
    p.table(["size", "modified", "name"], rows, title=t.dir_url if t.kind == "prefix" else None)
    return EXIT_OK


# -- latest --------------------------------------------------------------------------------


def cmd_latest(args: argparse.Namespace, opts: Settings, p: Printer) -> int:
    o = opts.open(args.root)
    store, key = o.store, o.key
    found = list_checkpoints(store, key.rstrip("/"), o.options)
    if not found:
        return _not_found(p, "no committed checkpoint under", store.url(root_prefix(key)))
    c = found[-1]
    if p.json_mode:
        p.json(c.as_dict())
    else:
        p.line(c.url)
        p.note(f"step {c.step}, {human_bytes(c.size)}, saved {human_time(c.time)}")
    return EXIT_OK


# -- info ----------------------------------------------------------------------------------


def _archive_keys(c: CheckpointInfo, prefix: str) -> list[str]:
    return [prefix + f.name for f in c.files if f.name.endswith((".pt", ".pth", ".ckpt", ".bin"))]


def cmd_info(args: argparse.Namespace, opts: Settings, p: Printer) -> int:
    from ..engine.verify import describe  # imports torch: only the commands that read

    t = resolve(args.url, opts)
    if t.kind == "missing":
        return _not_found(p, "nothing at", t.url)
    checkpoint: CheckpointInfo | None = None
    if t.kind == "run":
        checkpoint = t.checkpoints[-1]
        p.note(f"{t.dir_url} is a run; showing its latest checkpoint, step {checkpoint.step}")
    elif t.kind == "checkpoint":
        checkpoint = t.checkpoint
    elif t.kind == "prefix":
        raise ConfigError(f"{t.dir_url} is a prefix, not a checkpoint (try `cloudckpt ls`)")
    keys = [t.key]
    if checkpoint is not None:
        step_prefix = t.store.url("")  # root of the store
        prefix = checkpoint.url[len(step_prefix) :]
        keys = _archive_keys(checkpoint, prefix)
    archives = [describe(t.store, k, weights_only=not args.unsafe) for k in keys]
    if p.json_mode:
        body: dict[str, Any] = {
            "checkpoint": checkpoint.as_dict() if checkpoint is not None else None,
            "archives": [
                {
                    "url": a.url,
                    "size": a.size,
                    "format": a.format,
                    "records": a.records,
                    "top_level_type": a.top_level_type,
                    "top_level_keys": a.top_level_keys,
                    "tensor_bytes": a.tensor_bytes,
                    "tensors": [
                        {
                            "name": x.path,
                            "dtype": x.dtype,
                            "shape": list(x.shape),
                            "bytes": x.nbytes,
                        }
                        for x in a.tensors
                    ],
                    "note": a.note,
                }
                for a in archives
            ],
        }
        p.json(body)
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
    for a in archives:
        p.line(f"{a.url}: {human_bytes(a.size)}, {a.format}, {a.records} records")
        if a.top_level_keys is not None:
            p.line(f"top-level keys ({len(a.top_level_keys)}): {', '.join(a.top_level_keys)}")
        else:
            p.line(f"top level: {a.top_level_type}")
        if a.note:
            p.line(a.note)
        p.line(f"{len(a.tensors)} tensors, {human_bytes(a.tensor_bytes)}")
        rows = [
            [x.path, x.dtype, "x".join(map(str, x.shape)) or "scalar", human_bytes(x.nbytes)]
            for x in a.tensors
        ]
        p.table(["name", "dtype", "shape", "bytes"], rows)
    return EXIT_OK


# -- verify --------------------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace, opts: Settings, p: Printer) -> int:
    from ..engine.verify import dcp_tensor_slices, verify_archive, verify_archive_bytes

    t = resolve(args.url, opts)
    if t.kind == "missing":
        return _not_found(p, "nothing at", t.url)
    if t.kind == "prefix":
        raise ConfigError(f"{t.dir_url} holds no committed checkpoint and is not an object")
    store_root = t.store.url("")
    # (url of what is checked, key, expected size, expected etag, check CRCs?)
    jobs: list[tuple[str, int | None, str | None, bool]] = []
    # DCP data objects: key -> (offset, length) of each tensor archive inside them.
    dcp_slices: dict[str, list[tuple[int, int]]] = {}
    if t.kind == "object":
        jobs.append((t.key, None, None, True))
    else:
        checkpoints = t.checkpoints if t.kind == "run" else [t.checkpoint]
        for c in checkpoints:
            assert c is not None
            prefix = c.url[len(store_root) :]
            for f in c.files:
                archive = f.name.endswith((".pt", ".pth", ".ckpt", ".bin"))
                jobs.append((prefix + f.name, f.size, f.etag, archive))
            if any(f.name == ".metadata" for f in c.files):
                dcp_slices.update(dcp_tensor_slices(t.store, prefix))
    results: list[dict[str, Any]] = []
    enabled = args.progress if args.progress is not None else sys.stderr.isatty()
    with progress("verify", enabled and not p.json_mode) as (advance, _set_total):
        for key, size, etag, archive in jobs:
            url = t.store.url(key)
            entry: dict[str, Any] = {"url": url, "ok": True, "bytes": 0, "error": None}
            try:
                info = t.store.head(key)
                if size is not None and info.size != size:
                    raise _Mismatch(f"{url} holds {info.size} bytes; its marker says {size}")
                if etag and info.etag and etag.strip('"') != info.etag.strip('"'):
                    raise _Mismatch(f"{url} changed since it was committed (ETag differs)")
                entry["bytes"] = info.size
                if archive:
                    entry["bytes"] = verify_archive(t.store, key, t.options, advance=advance)
                for offset, length in dcp_slices.get(key, ()):
                    data = t.store.get_range(key, offset, offset + length)
                    verify_archive_bytes(data, f"{url} bytes {offset}+{length}")
                    advance(length)
            except (_Mismatch, NotFoundError, CloudCkptError) as exc:
                if not isinstance(exc, (_Mismatch, NotFoundError)) and not _is_corrupt(exc):
                    raise
                entry["ok"] = False
                entry["error"] = str(exc)
            results.append(entry)
    ok = all(r["ok"] for r in results)
    if p.json_mode:
        p.json({"ok": ok, "checked": results})
    else:
        for r in results:
            status = "ok" if r["ok"] else "FAILED"
            p.line(f"{status:6} {r['url']}" + (f"  {r['error']}" if r["error"] else ""))
        p.line(f"{'all' if ok else 'NOT all'} {len(results)} object(s) verified")
    return EXIT_OK if ok else EXIT_VERIFY_FAILED


class _Mismatch(CloudCkptError):
    pass


def _is_corrupt(exc: BaseException) -> bool:
    from ..errors import CorruptCheckpointError

    return isinstance(exc, CorruptCheckpointError)


# -- rm ------------------------------------------------------------------------------------


def cmd_rm(args: argparse.Namespace, opts: Settings, p: Printer) -> int:
    t = resolve(args.url, opts)
    removed: list[str] = []
    if t.kind == "missing":
        return _not_found(p, "nothing at", t.url)
    if t.kind == "object":
        t.store.delete(t.key)
        removed.append(t.url)
    elif t.kind == "checkpoint" or parse_step(posixpath.basename(t.key)) is not None:
        prefix = root_prefix(t.key)
        delete_prefix(t.store, prefix, t.options, t.objects)
        removed += [t.store.url(o.key) for o in t.objects]
    else:
        if not args.recursive:
            raise ConfigError(
                f"{t.dir_url} is a prefix with {len(t.objects)} object(s); "
                "pass --recursive (-r) to delete all of them"
            )
        # Markers first, so no checkpoint looks committed while its files go.
        base = t.store.url("")
        delete_tree(t.store, t.objects, t.options, [c.url[len(base) :] for c in t.checkpoints])
        removed += [t.store.url(o.key) for o in t.objects]
    if p.json_mode:
        p.json({"removed": removed})
    else:
        p.line(f"removed {len(removed)} object(s) under {t.url}")
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
                "prefixes": [{"url": u, "objects": n, "bytes": b} for u, n, b in report.prefixes],
                "uploads": [{"url": u, "upload_id": i, "age_s": a} for u, i, a in report.uploads],
                "skipped_young": report.skipped_young,
            }
        )
        return EXIT_OK
    verb = "would remove" if report.dry_run else "removed"
    for u, n, b in report.prefixes:
        p.line(f"{verb} {u} ({n} objects, {human_bytes(b)}, no commit marker)")
    for u, i, a in report.uploads:
        p.line(
            f"{'would abort' if report.dry_run else 'aborted'} upload {i[:16]}... to {u} "
            f"(opened {a / 3600:.1f} h ago)"
        )
    for u in report.skipped_young:
        p.line(f"kept {u}: uncommitted but younger than the grace period")
    p.line(
        f"{verb} {len(report.prefixes)} uncommitted prefix(es), {human_bytes(report.bytes)}; "
        f"{len(report.uploads)} stale upload(s)"
    )
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


def cmd_cp(args: argparse.Namespace, opts: Settings, p: Printer) -> int:
    src = opts.open(args.src)
    src_store, src_key = src.store, src.key
    if not src_key or args.src.endswith("/"):
        raise ConfigError(f"{args.src} names a prefix; cp copies one object")
    dst, dst_key = _destination(src_key, args.dst, opts)
    dst_store = dst.store
    enabled = args.progress if args.progress is not None else sys.stderr.isatty()
    state_dir = Path(args.state_dir) if args.state_dir else None
    name = posixpath.basename(src_key)
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
            )
    except (KeyboardInterrupt, CloudCkptError, OSError):
        if not isinstance(dst_store, LocalStore) or os.path.exists(
            str(dst_store.root / dst_key) + PARTIAL_SUFFIX
        ):
            p.note("cloudckpt: the copy stopped; run the same command again to resume it")
        raise
    if p.json_mode:
        p.json(
            {
                "src": result.src,
                "dst": result.dst,
                "size": result.size,
                "seconds": result.seconds,
                "resumed_bytes": result.resumed_bytes,
            }
        )
    else:
        rate = result.size / result.seconds / 1e6 if result.seconds > 0 else 0.0
        resumed = (
            f", resumed after {human_bytes(result.resumed_bytes)}" if result.resumed_bytes else ""
        )
        p.line(
            f"copied {result.src} -> {result.dst} ({human_bytes(result.size)}, "
            f"{rate:.1f} MB/s{resumed})"
        )
    return EXIT_OK


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
    "bench": cmd_bench,
    "export": cmd_export,
}
