"""``cloudckpt export``: a DCP checkpoint as consolidated safetensors (dcp/export.py)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import TYPE_CHECKING

from ..errors import ConfigError
from .output import Printer, human_bytes

if TYPE_CHECKING:
    from .settings import Settings

__all__ = ["cmd_export", "parse_rename"]


def parse_rename(items: list[str] | None) -> dict[str, str] | None:
    """``OLD=NEW`` prefix replacements (``model.=`` strips ``model.``)."""
    if not items:
        return None
    found: dict[str, str] = {}
    for item in items:
        old, sep, new = item.partition("=")
        if not sep or not old:
            raise ConfigError(f"--rename {item!r} is not OLD=NEW (e.g. model.=)")
        found[old] = new
    return found


def cmd_export(args: argparse.Namespace, opts: Settings, p: Printer) -> int:
    from ..dcp.export import export_safetensors

    enabled = args.progress if args.progress is not None else sys.stderr.isatty()
    src, dst = opts.open(args.src), opts.open(args.dst)
    result = export_safetensors(
        args.src,
        args.dst,
        dtype=args.dtype,
        include=args.include,
        exclude=args.exclude,
        rename=parse_rename(args.rename),
        max_shard_size=None if args.max_shard_size in ("0", "none") else args.max_shard_size,
        resume=args.resume,
        options=dataclasses.replace(dst.options, progress=enabled and not p.json_mode),
        source_options=src.options,
    )
    if p.json_mode:
        p.json(
            {
                "url": result.url,
                "files": list(result.files),
                "tensors": result.tensors,
                "size": result.size,
                "reused": list(result.reused),
                "skipped": list(result.skipped),
                "seconds": result.seconds,
            }
        )
        return 0
    rate = result.size / result.seconds / 1e6 if result.seconds > 0 else 0.0
    reused = f", {len(result.reused)} kept from an earlier run" if result.reused else ""
    p.line(
        f"exported {result.tensors} tensors to {result.url} ({len(result.files)} files, "
        f"{human_bytes(result.size)}, {rate:.1f} MB/s{reused})"
    )
    if result.skipped:
        p.note(
            f"not tensors, left out: {', '.join(result.skipped[:8])}"
            + (f" and {len(result.skipped) - 8} more" if len(result.skipped) > 8 else "")
        )
    return 0
