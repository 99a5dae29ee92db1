"""``cloudckpt`` argument parsing, options and exit codes; the commands live in commands.py."""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from ..errors import (
    AccessDeniedError,
    CloudCkptError,
    ConfigError,
    CorruptCheckpointError,
    CredentialsError,
    DeadlineExceededError,
    NotFoundError,
)
from ..options import MiB
from ..redact import RedactingFilter, redact_text
from ..store.deadline import deadline_scope
from .commands import COMMANDS, Settings
from .output import Printer, StderrHandler

__all__ = ["EXIT_CODES", "build_parser", "main"]

EXIT_CODES = {
    0: "success",
    1: "error (storage failure, conflict, anything else)",
    2: "usage error (bad arguments, bad URL or option)",
    3: "not found (object, prefix, bucket or committed checkpoint)",
    4: "verification failed (checksum mismatch, corrupted or truncated data)",
    5: "credentials missing or rejected, or access denied",
    130: "interrupted",
}

#: ``(command line, what it does)``: the top-level help shows them all, each command's
#: help its own.
_EXAMPLES = (
    ("cloudckpt ls s3://bucket/run1", "the run's checkpoints: step, time, size, metrics"),
    ("cloudckpt ls --json s3://bucket/run1", "the same as one JSON document, for scripts"),
    ("cloudckpt latest s3://bucket/run1", "URL of the newest committed checkpoint"),
    ("cloudckpt info s3://bucket/run1/step-000000300", ""),
    ("cloudckpt cp s3://bucket/run1/step-000000300/state.pt ./state.pt", ""),
    ("cloudckpt cp -r s3://bucket/run1/step-000000300 ./step-300 --dry-run", ""),
    ("cloudckpt verify s3://bucket/run1", "every checksum of every committed checkpoint"),
    ("cloudckpt export s3://bucket/run1/step-000000300 s3://bucket/hf/ --dtype bf16", ""),
    ("cloudckpt ls --all s3://bucket/run1", "also open uploads, uncommitted steps, ages"),
    (
        "cloudckpt ls --local /nvme/run1 s3://bucket/run1",
        "steps in the local tier and the bucket, undrained",
    ),
    (
        "cloudckpt verify --local /nvme/run1 s3://bucket/run1",
        "every checksum of the local tier's copies",
    ),
    ("cloudckpt rm -r s3://bucket/scratch --dry-run", "what it would delete, markers first"),
    ("cloudckpt gc s3://bucket/run1 --dry-run", "what a failed save left behind"),
    ("cloudckpt mb s3://bucket", "create a bucket (S3-compatible stores)"),
    ("cloudckpt bench s3://bucket/scratch", "throughput, latency, suggested settings"),
)


def _examples(command: str | None = None) -> str:
    lines = []
    for line, what in _EXAMPLES:
        if command is not None and line.split()[1] != command:
            continue
        if not what:
            lines.append(f"  {line}")
        elif len(line) <= 42:
            lines.append(f"  {line:<43}{what}")
        else:
            lines.append(f"  {line}\n{'':45}{what}")
    return "examples:\n" + "\n".join(lines) if lines else ""


#: Seconds each command may take by default (``--deadline`` changes it; ``0``: none).
#: The commands that move data (cp, export, verify, bench) have none: no default fits
#: every size; their requests stay bounded by the request timeouts and attempts.
DEFAULT_DEADLINES: dict[str, float | None] = {
    "ls": 120.0,
    "latest": 120.0,
    "info": 120.0,
    "rm": 120.0,
    "gc": 120.0,
    "mb": 120.0,
    "cp": None,
    "export": None,
    "verify": None,
    "bench": None,
}

_EPILOG = (
    """\
URLs: s3://bucket/prefix, gs://, az://, file:///abs/path or a plain path. S3 credentials
and endpoint come from the usual AWS variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_PROFILE, AWS_REGION, AWS_ENDPOINT_URL) or the flags of each command. Every command
takes --json (one JSON document on stdout) and --deadline (ls, latest, info, rm, gc and
mb stop after 2m by default).

"""
    + _examples()
    + """

exit codes:
"""
    + "\n".join(f"  {code:<4} {text}" for code, text in EXIT_CODES.items())
)
#: Below each command's own help: its examples, and where the rest is.
_COMMAND_EPILOG = "URLs, credentials and exit codes: cloudckpt --help (and docs/cli.md)."

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"64MiB"``, ``"8M"``, ``"1048576"`` -> bytes (K/M/G/T are powers of 1024)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 8MiB, 512KiB, 1048576)")
    scale = 1024 ** "_kmgt".index(m.group(2).lower() or "_")
    return int(float(m.group(1)) * scale)


def parse_duration(text: str) -> float:
    """``"1h"``, ``"30m"``, ``"45s"``, ``"2d"``, ``"0"`` -> seconds."""
    m = _DURATION.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 1h, 30m, 90s, 0)")
    unit = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2).lower()]
    return float(m.group(1)) * unit


def _deadline(text: str) -> float:
    """``--deadline``: a duration; ``0`` or ``none`` for no deadline (0.0)."""
    return 0.0 if text.strip().lower() == "none" else parse_duration(text)


def parse_storage_option(text: str) -> tuple[str, Any]:
    """``"KEY=VALUE"`` -> ``(KEY, VALUE)``: ``true``/``false`` become booleans, anything
    else stays text (the store checks it; ``tags=a=1&b=2`` splits at the first ``=``)."""
    key, sep, value = text.partition("=")
    key = key.strip()
    # The argument may hold a secret: only a name before an '=' is ever shown.
    if not sep:
        raise argparse.ArgumentTypeError("expected KEY=VALUE (the argument has no '=')")
    if not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got the name {key!r}")
    flags = {"true": True, "false": False}
    return key, flags.get(value.lower(), value)


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,4,8, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers like 1,4,8, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("output and connection")
    g.add_argument("--json", action="store_true", help="print one JSON document for scripts")
    g.add_argument("--endpoint-url", help="S3-compatible endpoint (else AWS_ENDPOINT_URL)")
    g.add_argument("--region", help="S3 region (else AWS_REGION, default us-east-1)")
    g.add_argument("--profile", help="AWS profile name (else AWS_PROFILE)")
    g.add_argument("--anonymous", action="store_true", help="unsigned requests (public buckets)")
    g.add_argument(
        "-o",
        "--storage-option",
        metavar="KEY=VALUE",
        type=parse_storage_option,
        action="append",
        default=[],
        help="any storage option of the URL's store, repeatable (sse=aws:kms, "
        "storage_class=STANDARD_IA, tags=team=ml&env=prod, requester_pays=true: "
        "docs/stores.md); true/false are booleans; the flags above win",
    )
    g.add_argument(
        "--deadline",
        type=_deadline,
        metavar="DURATION",
        help="stop after this long, every request and retry included (e.g. 30s, 10m; "
        "0: none; exit 1); default 2m for ls, latest, info, rm, gc and mb, none for cp, "
        "export, verify and bench (cp keeps what is stored for a rerun)",
    )
    g.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="log requests and retries (secrets are masked: docs/configuration.md)",
    )

    parser = argparse.ArgumentParser(
        prog="cloudckpt",
        description="Inspect, copy, verify and clean up PyTorch checkpoints on object "
        "storage and filesystems.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from .._version import __version__

    parser.add_argument("--version", action="version", version=f"cloudckpt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, help: str, description: str) -> argparse.ArgumentParser:
        examples = _examples(name)
        return sub.add_parser(
            name,
            parents=[common],
            help=help,
            description=description,
            epilog=(examples + "\n\n" if examples else "") + _COMMAND_EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    p = add(
        "ls",
        "list a run's checkpoints, or the objects under a prefix",
        "A run root (a prefix holding step-N/ checkpoints) lists its committed "
        "checkpoints with step, time, size and metrics, and any uncommitted leftovers. "
        "A checkpoint prefix lists its files; anything else lists objects.",
    )
    p.add_argument("url", help="run root, checkpoint prefix, prefix or object")
    p.add_argument(
        "-a",
        "--all",
        action="store_true",
        help="also list leftovers: open multipart uploads and uncommitted step prefixes, "
        "with their ages, young ones marked as kept by gc's grace period",
    )
    p.add_argument(
        "--grace",
        type=parse_duration,
        default=3600.0,
        help="with --all: the grace period young leftovers are marked against (default 1h, "
        "as gc's)",
    )
    p.add_argument(
        "--local",
        metavar="DIR",
        help="also the run's local tier DIR (a CheckpointManager's local_dir; URL is the run "
        "root it drains to): which tiers hold each step (local, remote, both) and the steps "
        "due for the bucket that are not drained yet",
    )
    p.add_argument(
        "--drain-every-n-steps",
        type=int,
        metavar="K",
        help="with --local: the run's drain_every_n_steps (default 1): steps divisible by K "
        "are due for the bucket",
    )

    p = add(
        "info",
        "tensors, dtypes, shapes, bytes, scalars and top-level keys of a checkpoint",
        "Any kind: a torch archive, a manager run or step, a DCP checkpoint (cloudckpt's "
        "or torch's), a Megatron checkpoint, a safetensors file, folder or index, a lone "
        "DCP data file. Reads directories, headers and small items only, never the "
        "tensors. A run root shows its latest checkpoint.",
    )
    p.add_argument("url", help="checkpoint object, prefix, folder or run root")
    p.add_argument(
        "--unsafe",
        action="store_true",
        help="unpickle with full pickle (only for checkpoints you trust)",
    )

    p = add(
        "cp",
        "copy an object, or a prefix with -r: upload, download or bucket to bucket (resumable)",
        "Copies SRC to DST with parallel ranged reads and multipart uploads; with -r, every "
        "object under the prefix SRC to the prefix DST (keys relative to SRC), commit "
        "markers last, skipping objects already whole at DST. If the copy fails or is "
        "interrupted (Ctrl-C stops it at once), run the same command again: finished "
        "chunks and parts are kept (a .cloudckpt-partial file for downloads, an open "
        "multipart upload for uploads) and only the rest is transferred.",
    )
    p.add_argument("src", help="source object URL or path (with -r: a prefix)")
    p.add_argument(
        "dst",
        help="destination URL or path (ending in / or a directory: keep the name; "
        "with -r: the prefix the objects land under)",
    )
    p.add_argument(
        "-r", "--recursive", action="store_true", help="copy every object under the prefix SRC"
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="with -r: list what would be copied and skipped, with sizes; write nothing",
    )
    p.add_argument("--part-size", type=parse_size, help="multipart part size (default 64MiB)")
    p.add_argument("--concurrency", type=int, help="parts/ranges in flight (default 10/15)")
    p.add_argument("--state-dir", help="where upload journals live (default ~/.cache/cloudckpt/cp)")
    _progress_flags(p)

    p = add(
        "export",
        "a DCP checkpoint as consolidated safetensors shards, store to store",
        "Reads the tensors of the DCP checkpoint at SRC (written on any number of ranks) "
        "with ranged reads and writes them whole, in shards of at most --max-shard-size, "
        "with model.safetensors.index.json last (the Hugging Face layout), at DST. "
        "Memory stays bounded by one read batch and the parts in flight. Run the same "
        "command again after a failure: finished files are kept.",
    )
    p.add_argument("src", help="DCP checkpoint prefix (holding .metadata)")
    p.add_argument("dst", help="folder, .safetensors file or .safetensors.index.json")
    p.add_argument("--dtype", help="cast floating-point tensors (bf16, fp16, fp32)")
    p.add_argument(
        "--include", action="append", metavar="GLOB", help="only names matching (repeatable)"
    )
    p.add_argument(
        "--exclude", action="append", metavar="GLOB", help="drop names matching (repeatable)"
    )
    p.add_argument(
        "--rename",
        action="append",
        metavar="OLD=NEW",
        help="replace a name prefix (repeatable; model.= strips model.)",
    )
    p.add_argument(
        "--max-shard-size", default="5GB", help="bytes per shard (5GB, 500MiB; none: one file)"
    )
    p.add_argument(
        "--no-resume",
        dest="resume",
        action="store_false",
        help="rewrite every file, even one an earlier run finished",
    )
    _progress_flags(p)

    p = add(
        "verify",
        "check every checksum of a checkpoint of any kind, a run, or an object",
        "Torch archives, manager runs and steps, DCP checkpoints (cloudckpt's or torch's), "
        "Megatron checkpoints, safetensors files and folders: each file's size (and "
        "ETag) against the commit marker, every CRC-32 and checksum recorded, every "
        "tensor's bytes inside its file. Exit code 4 if anything fails.",
    )
    p.add_argument("url", help="object, checkpoint prefix, folder or run root")
    p.add_argument(
        "--local",
        metavar="DIR",
        help="check the copies in the run's local tier DIR (a CheckpointManager's local_dir) "
        "instead; URL is the run root it drains to (the bucket is not read)",
    )
    _progress_flags(p)

    p = add(
        "rm",
        "delete an object, a checkpoint (marker first), or a prefix with -r",
        "Deleting a checkpoint removes its commit marker first, so it never looks "
        "committed while its files go.",
    )
    p.add_argument("url")
    p.add_argument("-r", "--recursive", action="store_true", help="delete a whole prefix")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="list what would be deleted, in order (markers first); delete nothing",
    )

    p = add(
        "latest",
        "print the URL of the newest committed checkpoint of a run",
        "Prints the step prefix of the highest committed step; exit code 3 if none.",
    )
    p.add_argument("root", help="run root (the prefix holding step-N/ checkpoints)")

    p = add(
        "gc",
        "remove uncommitted leftovers and stale multipart uploads of a run",
        "Removes step-N/ prefixes without a commit marker whose newest object is older "
        "than the grace period, and aborts multipart uploads opened before it. Younger "
        "ones (a save may still be running) are listed with their age as kept.",
    )
    p.add_argument("root", help="run root")
    p.add_argument(
        "--grace",
        type=parse_duration,
        default=3600.0,
        help="leave anything younger than this alone (default 1h; e.g. 30m, 0)",
    )
    p.add_argument("--dry-run", action="store_true", help="only show what would be removed")

    p = add(
        "mb",
        "make a bucket (S3 and S3-compatible stores)",
        "Creates the bucket of URL (s3://NAME) in the configured region; exit code 1 if it "
        "exists already, 2 for a name S3 does not allow.",
    )
    p.add_argument("url", help="the bucket to create, e.g. s3://my-bucket")

    p = add(
        "bench",
        "measure throughput and latency against a store; suggest settings",
        "Writes and reads a test object under URL/.cloudckpt-bench-<id>/ (deleted "
        "afterwards) at several concurrencies, times small requests, and suggests "
        "part_size, write_concurrency and read_concurrency.",
    )
    p.add_argument("url", help="a prefix you may write to")
    p.add_argument("--size", type=parse_size, default=32 * MiB, help="test object size (32MiB)")
    p.add_argument(
        "--part-size",
        dest="bench_part_size",
        type=parse_size,
        default=8 * MiB,
        help="part and range size (default 8MiB)",
    )
    p.add_argument(
        "--concurrency", type=_ints, default=[1, 4, 8], help="concurrencies to try, e.g. 1,4,8"
    )
    p.add_argument("--requests", type=int, default=20, help="small round trips for latency")
    return parser


def _progress_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--progress",
        dest="progress",
        action="store_true",
        default=None,
        help="show a progress bar on stderr (default: when stderr is a terminal)",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false")


def _options(args: argparse.Namespace) -> Any:
    storage: dict[str, Any] = dict(args.storage_option)
    if args.endpoint_url:
        storage["endpoint_url"] = args.endpoint_url
    if args.region:
        storage["region_name"] = args.region
    if args.profile:
        storage["profile_name"] = args.profile
    if args.anonymous:
        storage["anonymous"] = True
    overrides: dict[str, Any] = {}
    if storage:
        overrides["storage_options"] = storage
    if getattr(args, "part_size", None):
        overrides["part_size"] = args.part_size
    if args.deadline is not None:  # given: a call argument, over a profile's (0: none)
        overrides["deadline"] = args.deadline or None
    if getattr(args, "concurrency", None) and args.command == "cp":
        overrides["write_concurrency"] = overrides["read_concurrency"] = args.concurrency
    return Settings(overrides)


def _exit_code(exc: BaseException) -> int:
    if isinstance(exc, KeyboardInterrupt):
        return 130
    if isinstance(exc, ConfigError):
        return 2
    if isinstance(exc, NotFoundError):
        return 3
    if isinstance(exc, CorruptCheckpointError):
        return 4
    if isinstance(exc, (CredentialsError, AccessDeniedError)):
        return 5
    return 1


def _verbose_logging() -> None:
    """Debug logging on stderr, every SDK's included, through a filter that masks secrets
    (botocore logs signed headers and canonical requests, Azure SAS query strings)."""
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    root = logging.getLogger()
    root.setLevel(logging.DEBUG)
    for handler in root.handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())


def _warnings_to_stderr(prefix: str) -> None:
    """cloudckpt's warnings (each retry with its cause) as lines on stderr, above the
    progress bar while one runs, each starting with ``prefix:`` as the command's errors
    do; installed once per process."""
    log = logging.getLogger("cloudckpt")
    handler = next((h for h in log.handlers if isinstance(h, StderrHandler)), None)
    if handler is None:
        handler = StderrHandler(logging.WARNING)
        handler.addFilter(RedactingFilter())
        log.addHandler(handler)
    handler.setFormatter(logging.Formatter(f"{prefix}: %(message)s"))


class _Interrupts:
    """The SIGINT handler while a command runs: the first Ctrl-C raises
    KeyboardInterrupt, which the command handles (keeps what is stored, says so in one
    line, exit code 130); every later one is counted and ignored, so a second Ctrl-C
    (``timeout -s INT`` delivers two) cannot interrupt that handling half-way."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.count == 1:
            raise KeyboardInterrupt


@contextlib.contextmanager
def _one_interrupt(leave_ignored: bool) -> Iterator[_Interrupts]:
    """Run with :class:`_Interrupts` as the SIGINT handler (in the main thread only);
    afterwards the previous one again, except that with ``leave_ignored`` (the process
    ends next: the ``cloudckpt`` command) a process that was interrupted ignores further
    Ctrl-C while it exits."""
    handler = _Interrupts()
    if threading.current_thread() is not threading.main_thread():
        yield handler
        return
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield handler
    finally:
        if handler.count and leave_ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        else:
            signal.signal(signal.SIGINT, previous)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``cloudckpt`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    with _one_interrupt(leave_ignored=argv is None):
        try:
            return _main(argv)
        except KeyboardInterrupt:  # before a command ran (parsing the arguments)
            print("cloudckpt: interrupted", file=sys.stderr)
            return 130


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version (0) and usage errors (2)
        return int(exc.code or 0)
    if args.command is None:
        parser.print_help()
        return 2
    prefix = f"cloudckpt {args.command}"
    if args.verbose:
        _verbose_logging()
    else:
        _warnings_to_stderr(prefix)
    printer = Printer(args.json, prefix)
    given = args.deadline is not None
    deadline = args.deadline if given else DEFAULT_DEADLINES.get(args.command)
    try:
        with deadline_scope(deadline or None):
            return COMMANDS[args.command](args, _options(args), printer)
    except (CloudCkptError, OSError, KeyboardInterrupt) as exc:
        code = _exit_code(exc)
        if isinstance(exc, KeyboardInterrupt):
            message = printer.stopped or "interrupted"
        else:
            message = redact_text(str(exc))
        if isinstance(exc, DeadlineExceededError) and deadline:
            hint = "--deadline DURATION sets another, 0 none"
            message += f" ({hint})" if given else f" ({args.command}'s default; {hint})"
        if args.json:
            printer.json({"error": message, "type": type(exc).__name__, "exit_code": code})
        printer.error(message)
        return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
