"""``python -m cloudckpt.testing NAME``: run one local server by hand until killed.

Creates the buckets given with ``--bucket``, then prints ``export K=V`` lines for a
shell (``eval``-able; once they appear the buckets exist), then waits for Ctrl-C,
SIGTERM or SIGHUP and stops the server cleanly. ``install-azurite`` only installs
Azurite (for CI set-up) and prints the launcher's path.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading
from collections.abc import Sequence

from ..errors import ConfigError
from ._process import stop
from .emulators import EMULATOR_NAMES, Emulator, azurite_binary, launch_emulator
from .s3 import SERVER_NAMES, S3Server, launch

#: The help's text, plain (the module's docstring is reST, for the API docs).
_DESCRIPTION = """\
Run one local server on 127.0.0.1 until killed: create the buckets given with
--bucket, print `export NAME=VALUE` lines for a shell (once they appear the buckets
exist), then wait for Ctrl-C, SIGTERM or SIGHUP and stop the server cleanly."""
_EPILOG = """\
example (README.md's local-S3 block waits for the exports, and stops if the server
cannot start):
  python -m cloudckpt.testing rclone --bucket my-bucket > local-s3.env &
  # once local-s3.env holds the export lines:
  . ./local-s3.env    # AWS_ENDPOINT_URL, test credentials, region"""


def main(
    argv: Sequence[str] | None = None,
    *,
    prog: str = "python -m cloudckpt.testing",
    node_prefix: str | os.PathLike[str] | None = None,
) -> int:
    """Run the command line; ``node_prefix`` is the default for ``--node-prefix``."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "name",
        choices=[*SERVER_NAMES, *EMULATOR_NAMES, "install-azurite"],
        help="the server: moto or rclone (S3), gcs, azure (Azurite); install-azurite only "
        "installs Azurite and prints its path",
    )
    parser.add_argument("--node-prefix", default=node_prefix, help="where npm installs Azurite")
    parser.add_argument("--log-level", help="rclone's --log-level (DEBUG logs every request)")
    parser.add_argument(
        "--bucket",
        action="append",
        default=[],
        metavar="NAME",
        help="create this bucket (container) before printing the exports; repeatable",
    )
    args = parser.parse_args(argv)
    try:
        if args.name == "install-azurite":
            if args.bucket:
                raise ConfigError("--bucket needs a server, not install-azurite")
            print(azurite_binary(args.node_prefix))
            return 0
        return _serve(args.name, args.node_prefix, args.log_level, args.bucket)
    except ConfigError as exc:  # a server that is not installed, a wrong option, a bad name
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2


def _serve(
    name: str,
    node_prefix: str | os.PathLike[str] | None,
    log_level: str | None,
    buckets: Sequence[str] = (),
) -> int:
    """Start ``name``, make ``buckets``, print how to reach it, and stop it when a signal
    arrives."""
    done = threading.Event()
    # SIGTERM/SIGINT/SIGHUP wake the wait below so the server is stopped cleanly.
    for sig in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            signal.signal(sig, lambda *_: done.set())

    server: S3Server | Emulator
    if name in EMULATOR_NAMES:
        server = launch_emulator(name, node_prefix=node_prefix)  # type: ignore[arg-type]
    else:
        server = launch(name, log_level=log_level)  # type: ignore[arg-type]
    try:
        for bucket in buckets:
            server.make_bucket(bucket)
        for key, value in server.env().items():
            print(f"export {key}={shlex.quote(value)}")
        print(f"# {server.version} ready in {server.startup_s:.2f}s, log: {server.log_path}",
              file=sys.stderr)  # fmt: skip
        if isinstance(server, S3Server) and server.data_dir is not None:
            print(f"# buckets are directories under {server.data_dir}", file=sys.stderr)
        scheme = {"gcs": "gs", "azure": "az"}.get(name, "s3")
        for bucket in buckets:
            print(f"# bucket {scheme}://{bucket} created", file=sys.stderr)
        print("# Ctrl-C to stop", file=sys.stderr)
        sys.stdout.flush()
        while not done.wait(0.5):
            if not server.running:
                print(f"# {name} exited unexpectedly:\n{server.log_tail()}", file=sys.stderr)
                return 1
    finally:
        stop(server)
    return 0
