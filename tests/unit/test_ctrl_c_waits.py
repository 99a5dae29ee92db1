"""Ctrl-C ends the main thread's waits even when a worker thread took the signal.

Linux may hand SIGINT to any thread; the test sends it to the stalled worker itself
(``pthread_kill``), once the main thread is blocked in the wait, which is the case a
user's Ctrl-C hit about one time in thirty in ``tests/cli/test_sigint.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")

PROGRAM = textwrap.dedent(
    """
    import signal, sys, threading, time
    from cloudckpt.engine.handle import SaveHandle
    from cloudckpt.io.scheduler import TransferGroup
    from cloudckpt.options import resolve_options

    main = threading.main_thread().ident
    stalled = {}

    def stall():  # a request the network never answers
        stalled["ident"] = threading.get_ident()
        threading.Event().wait()

    def blocked_in_wait():  # in a lock wait, under the wait of the main thread's call
        frame = sys._current_frames().get(main)
        if frame is None or not frame.f_code.co_filename.endswith("threading.py"):
            return False
        while frame is not None:
            if frame.f_code.co_name == "waiting":
                return True
            frame = frame.f_back
        return False

    def interrupt():  # once the main thread waits, the worker takes the signal
        while "ident" not in stalled or not blocked_in_wait():
            time.sleep(0.01)
        signal.pthread_kill(stalled["ident"], signal.SIGINT)

    group = TransferGroup(resolve_options(), 2)
    group.submit(stall, "stalled read")
    threading.Thread(target=interrupt, daemon=True).start()
    def waiting():
        if sys.argv[1] == "group":
            group.wait()
        else:
            SaveHandle("s3://bucket/never").wait()

    try:
        waiting()
    except KeyboardInterrupt:
        group.cancel()  # Ctrl-C: the stalled request is abandoned, not awaited
        print("interrupted", flush=True)
        sys.exit(3)
    """
)


@pytest.mark.parametrize("wait", ["group", "handle"])
def test_ctrl_c_taken_by_a_worker_thread_ends_the_main_threads_wait(wait: str) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    # Fails (TimeoutExpired) where the main thread waits on, deaf to the pending signal.
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, wait],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout.strip()) == (3, "interrupted"), done.stderr
