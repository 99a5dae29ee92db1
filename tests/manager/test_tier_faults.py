"""The local tier's fault suite (issue 40, item 5): each case its own test, on moto behind
the fault proxy (``cloudckpt.testing.fault_proxy``), with real processes killed by
``kill -9`` at each stage of a save, drain and retention.

Every case checks what docs/tiers.md ("What a crash loses") promises: nothing committed
is lost, no commit mixes two saves (what a step restores, from either tier, is compared
byte for byte with what the save named by its marker wrote), the newest valid step
restores, and saves went on (during an outage at local speed; after a crash in the next
process). States are tens of MiB in 5 MiB parts, so every drain is a multipart upload.

The cases the other tier tests cover are not repeated here: the bucket refusing
connections or silent from the start (test_tier_outage.py), another node's leftovers of
the same step found by a later drain (test_tier_outage.py), a killed save's temp file
(test_tier_leftovers.py), a drain stalled at the bucket's marker with a small state
(test_tiers.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import resource
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
import torch
from test_tier_leftovers import SPAWN_TIMEOUT_S, kill, temps
from test_tier_outage import (
    FAST,
    LOCAL_SAVE_S,
    Usage,
    local_steps,
    other_warnings,
    outage_warnings,
)

from cloudckpt.errors import LocalTierFullError, StorageError
from cloudckpt.manager import MARKER_NAME, CheckpointManager
from cloudckpt.manager.marker import parse_step, step_dir
from cloudckpt.options import MiB
from cloudckpt.testing.fault_proxy import FaultProxy
from servers import S3Server, free_port, unique_bucket_name

#: Elements of a state's tensor: 20 MiB of float32, four 5 MiB parts.
N = 5 * MiB
PART = 5 * MiB
#: The bucket keeps 2 steps, the local tier 3: retention runs in both while a step drains.
KEEP = {"keep_last": 2, "keep_local": 3, "part_size": PART}
HERE = Path(__file__).resolve().parent


def big(step: int, node: str = "") -> dict[str, Any]:
    """The state a save of ``step`` (by ``node``) writes: random values of its own, so
    any two saves differ in every part."""
    seed = step * 1000 + sum(node.encode())
    return {"w": torch.randn(N, generator=torch.Generator().manual_seed(seed)), "step": step}


def same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    """Byte for byte: the tensor's bytes and the step."""
    return got["step"] == want["step"] and got["w"].numpy().tobytes() == want["w"].numpy().tobytes()


class Requests:
    """A proxy ``match``: picks the requests the proxy's fault meets (held, or a 500:
    :func:`proxy_for`), the first one ``trigger`` accepts, and every one ``failing``
    accepts (both are given the method and the path with its query); ``hit`` is set
    when the trigger's arrives. Notes the step of every marker PUT forwarded
    (``markers``)."""

    def __init__(self) -> None:
        self.markers: list[int] = []
        self.trigger: Callable[[str, str], bool] | None = None
        self.failing: Callable[[str, str], bool] | None = None
        self.hit = threading.Event()

    def __call__(self, method: str, target: str) -> bool:
        parts = urlsplit(target)
        path = unquote(parts.path) + ("?" + parts.query if parts.query else "")
        if self.trigger is not None and self.trigger(method, path):
            self.trigger = None
            self.hit.set()
            return True
        if self.failing is not None and self.failing(method, path):
            return True
        if method == "PUT" and path.endswith("/" + MARKER_NAME):
            step = parse_step(path.split("/")[-2])
            if step is not None:
                self.markers.append(step)
        return False


@pytest.fixture
def bucket(moto_server: S3Server) -> Iterator[str]:
    name = moto_server.make_bucket(unique_bucket_name("tier-faults"))
    yield name
    with contextlib.suppress(Exception):  # freeing moto's memory, never a test failure
        moto_server.remove_bucket(name)


def proxy_for(moto_server: S3Server, requests: Requests, kind: str) -> FaultProxy:
    """A proxy in front of moto that answers the requests ``requests`` picks with ``kind``
    (``slow``: held, never answered; ``internal``: a 500)."""
    return FaultProxy(
        moto_server.endpoint_url, rate=1.0, kinds=(kind,), slow_seconds=600, match=requests
    )


def manager(root: str, tier: Path, options: dict[str, Any], **kwargs: Any) -> CheckpointManager:
    return CheckpointManager(root, local_dir=tier, storage_options=options, **KEEP, **kwargs)


def bucket_steps(root: str, options: dict[str, Any]) -> list[int]:
    return [c.step for c in CheckpointManager(root, storage_options=options).list()]


def check_restores(
    root: str, tier: Path, options: dict[str, Any], want: Callable[[int], dict[str, Any]]
) -> None:
    """Every step committed in either tier restores ``want(step)`` byte for byte: from
    the bucket (a manager without a tier) and from the local tier (its file, loaded)."""
    plain = CheckpointManager(root, storage_options=options)
    for step in bucket_steps(root, options):
        assert same(plain.restore(step=step), want(step)), f"the bucket's step {step}"
    for step in local_steps(tier):
        got = torch.load(tier / step_dir(step) / "state.pt", weights_only=True)
        assert same(got, want(step)), f"the local step {step}"


def uncommitted(root: str, options: dict[str, Any], tier: Path) -> list[str]:
    """Objects in either tier under a step that is not committed there."""
    plain = CheckpointManager(root, storage_options=options)
    committed = {step_dir(s) for s in bucket_steps(root, options)}
    left = [
        o.key
        for o in plain.store.list(plain.root_key + "/")
        if o.key.split("/")[-2] not in committed
    ]
    local = {step_dir(s) for s in local_steps(tier)}
    left += [
        str(p)
        for p in tier.rglob("*")
        if p.is_file() and p.parent.name.startswith("step-") and p.parent.name not in local
    ]
    return left


# -- kill -9 at each stage ---------------------------------------------------------------

#: Stages of the save of step 4 (steps 1-3 committed in both tiers before it): the request
#: the proxy holds there (None: a stage of the local tier, where the child stops itself,
#: :func:`stop_at`), and the newest valid step once the process is killed there.
STAGES: dict[str, tuple[Callable[[str, str], bool] | None, int]] = {
    # the local payload half written (its second of four parts)
    "payload-half-written": (None, 3),
    # the payload whole, its local marker not written
    "before-local-marker": (None, 3),
    # local retention removing step 1: its marker gone, its payload not yet
    "local-retention": (None, 4),
    # the drain's multipart upload of step 4 at its second part
    "mid-drain": (
        lambda m, p: m == "PUT" and f"/{step_dir(4)}/state.pt?" in p and "partNumber=2" in p,
        4,
    ),
    # step 4's payload whole in the bucket, its marker held
    "before-bucket-marker": (
        lambda m, p: m == "PUT" and p.endswith(f"/{step_dir(4)}/{MARKER_NAME}"),
        4,
    ),
    # the bucket's retention removing step 2: its marker gone, its payload not yet
    "bucket-retention": (
        lambda m, p: m == "DELETE" and p.endswith(f"/{step_dir(2)}/state.pt"),
        4,
    ),
}


def stop_at(stage: str) -> None:
    """In the child: patch the local store to stop at ``stage`` (print "hit", then wait to
    be killed) when it is one of the local tier's."""
    from cloudckpt.store.local import LocalStore

    def hit() -> None:
        print("hit", flush=True)
        threading.Event().wait()

    payload = f"{step_dir(4)}/state.pt"
    if stage == "payload-half-written":
        write_part = LocalStore._write_part
        parts: list[int] = []

        def half(self: LocalStore, upload: Any, *args: Any) -> Any:
            done = write_part(self, upload, *args)
            if upload.key.endswith(payload):
                parts.append(1)
                if len(parts) == 2:
                    hit()
            return done

        LocalStore._write_part = half  # type: ignore[method-assign]
    elif stage == "before-local-marker":
        put = LocalStore._put

        def before_marker(self: LocalStore, key: str, *args: Any) -> None:
            if key.endswith(f"{step_dir(4)}/{MARKER_NAME}"):
                hit()
            put(self, key, *args)

        LocalStore._put = before_marker  # type: ignore[method-assign]
    elif stage == "local-retention":
        delete = LocalStore._delete

        def deleting(self: LocalStore, key: str) -> None:
            if key.endswith(f"{step_dir(1)}/state.pt"):
                hit()
            delete(self, key)

        LocalStore._delete = deleting  # type: ignore[method-assign]


def save_step_4(root: str, tier: str, options: str, stage: str) -> None:
    """The child: save step 4 and drain it, stopping at ``stage``."""
    torch.set_num_threads(1)
    stop_at(stage)
    m = manager(root, Path(tier), json.loads(options))
    m.save(4, big(4))
    m.drain()
    print("done", flush=True)


_CHILD = (
    "import sys; sys.path[:0] = sys.argv[1:3]; import test_tier_faults as t; "
    "t.save_step_4(*sys.argv[3:])"
)


def run_until(proc: subprocess.Popen[str], hit: threading.Event) -> None:
    """Wait until the child says "hit" (its stdout) or ``hit`` is set (the proxy held its
    request), then kill it with SIGKILL."""
    assert proc.stdout is not None
    stdout, ended = proc.stdout, threading.Event()

    def read() -> None:
        for line in stdout:
            if line.strip() == "hit":
                hit.set()
                return
        ended.set()  # its stdout closed: the child is ending without reaching the stage
        hit.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert hit.wait(SPAWN_TIMEOUT_S), "the child never reached the stage"
        if ended.is_set():
            proc.wait(timeout=SPAWN_TIMEOUT_S)
            assert proc.stderr is not None
            raise AssertionError(f"the child ended first: {proc.stderr.read()[-3000:]}")
    finally:
        if proc.poll() is None:
            kill(proc)


def killed_at(stage: str, tier: Path, plain: CheckpointManager) -> None:
    """What the killed process left shows it died at ``stage``."""

    def local(step: int) -> set[str]:
        return {p.name for p in (tier / step_dir(step)).iterdir()}

    def bucket(step: int) -> set[str]:
        return {o.key.rpartition("/")[2] for o in plain.store.list(f"run/{step_dir(step)}/")}

    if stage == "payload-half-written":
        assert temps(tier / step_dir(4)) and MARKER_NAME not in local(4)
    elif stage == "before-local-marker":  # and the dead save's lock (a temp file)
        assert {n for n in local(4) if not n.startswith(".")} == {"state.pt"}
    elif stage == "local-retention":
        assert local(1) == {"state.pt"} and MARKER_NAME in local(4)
    elif stage == "mid-drain":
        assert MARKER_NAME in local(4) and bucket(4) == set()  # parts are not objects
        assert [u.key for u in plain.store.list_multipart("run/")] == [
            f"run/{step_dir(4)}/state.pt"
        ]
    elif stage == "before-bucket-marker":
        assert bucket(4) == {"state.pt"}
    elif stage == "bucket-retention":
        assert bucket(2) == {"state.pt"} and MARKER_NAME in bucket(4)


@pytest.mark.parametrize("stage", list(STAGES))
def test_kill_9_at_each_stage_loses_nothing_committed(
    moto_server: S3Server, bucket: str, tmp_path: Path, stage: str
) -> None:
    trigger, newest = STAGES[stage]
    root, tier = f"s3://{bucket}/run", tmp_path / "tier"
    requests = Requests()
    with proxy_for(moto_server, requests, "slow") as proxy:
        options = {**moto_server.storage_options(), "endpoint_url": proxy.url}
        first = manager(root, tier, options)
        for step in (1, 2, 3):
            first.save(step, big(step))
            first.drain()
        assert bucket_steps(root, options) == [2, 3] and local_steps(tier) == [1, 2, 3]
        requests.markers.clear()

        requests.trigger = trigger
        argv = [str(HERE), str(HERE.parent), root, str(tier), json.dumps(options), stage]
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, *argv],
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        run_until(proc, requests.hit)
        requests.trigger = None
        killed_at(stage, tier, CheckpointManager(root, storage_options=options))

        # The next process on the node: the newest valid step restores, saves go on.
        after = manager(root, tier, options)
        assert same(after.restore(), big(newest))
        after.drain()  # finishes what the killed process left
        assert bucket_steps(root, options) == [newest - 1, newest]
        # A step the bucket's retention removed is never committed there again.
        assert set(requests.markers) <= {4}, requests.markers
        after.save(5, big(5))
        assert temps(tier) == []  # the killed writer's temp file is swept
        after.drain()
        # Nothing committed is lost: every step the two retentions keep is there, whole.
        assert bucket_steps(root, options) == [newest, 5]
        check_restores(root, tier, options, big)
        assert local_steps(tier)[-2:] == [newest, 5]
        after.gc(grace_seconds=0)
        assert uncommitted(root, options, tier) == []


# -- the bucket failing or silent, from the middle of a drain -----------------------------


def second_part_of_step_2(method: str, path: str) -> bool:
    return method == "PUT" and f"/{step_dir(2)}/state.pt?" in path and "partNumber=2" in path


def timed_saves(m: CheckpointManager, steps: range) -> list[float]:
    took = []
    for step in steps:
        started = time.monotonic()
        assert m.save(step, big(step)).tiers == ("local",)
        took.append(time.monotonic() - started)
    return took


def outage_from_step_2(
    moto_server: S3Server,
    bucket: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    kind: str,
    fails: Callable[[str, str], bool],
) -> None:
    """Step 1 drains; from the second part of step 2's upload on, the requests ``fails``
    picks are answered with ``kind``; saves 3 and 4 go on meanwhile; then the bucket
    recovers and the drains land in order, each step the bytes its save wrote."""
    root, tier = f"s3://{bucket}/run", tmp_path / "tier"
    caplog.set_level(logging.INFO, logger="cloudckpt")
    requests = Requests()
    begun = threading.Event()

    def failing(method: str, path: str) -> bool:
        if second_part_of_step_2(method, path):
            begun.set()
        return begun.is_set() and fails(method, path)

    with proxy_for(moto_server, requests, kind) as proxy:
        options = {**moto_server.storage_options(), "endpoint_url": proxy.url}
        m = CheckpointManager(
            root, local_dir=tier, keep_local=1, part_size=PART, storage_options=options, **FAST
        )
        m.save(1, big(1))
        m.drain()
        requests.failing = failing
        took = timed_saves(m, range(2, 3))
        with pytest.raises(StorageError):
            m.drain()  # step 2's upload met the outage midway
        assert begun.is_set()
        took += timed_saves(m, range(3, 5))  # saves go on, at local speed
        assert max(took) < LOCAL_SAVE_S, took
        with pytest.raises(StorageError, match=r"step 2\b"):
            m.drain()  # the oldest waiting step names the outage
        assert local_steps(tier) == [2, 3, 4]  # keep_local=1 keeps what waits
        said = outage_warnings(caplog)
        assert len(said) == 1 and "wait to be drained" in said[0], said
        assert other_warnings(caplog) == []
        assert requests.markers == [1]

        requests.failing = None  # the bucket recovers
        m.drain()
        assert requests.markers == [1, 2, 3, 4]  # the bucket's commits, oldest first
        assert bucket_steps(root, options) == [1, 2, 3, 4]
        check_restores(root, tier, options, big)
        assert local_steps(tier) == [4]
    assert len(outage_warnings(caplog)) == 1


def test_saves_go_on_while_the_bucket_answers_500_to_every_write_and_drain_after(
    moto_server: S3Server, bucket: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """PUTs and POSTs (parts, completes, markers) get 500 InternalError; reads answer."""
    outage_from_step_2(
        moto_server, bucket, tmp_path, caplog, "internal", lambda m, p: m in ("PUT", "POST")
    )


def test_saves_go_on_while_the_bucket_stops_answering_mid_drain(
    moto_server: S3Server, bucket: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every request is accepted and held without an answer, from the middle of step 2's
    multipart upload (test_tier_outage.py has a bucket silent from the start)."""
    outage_from_step_2(moto_server, bucket, tmp_path, caplog, "slow", lambda m, p: True)


# -- two nodes saving the same step ------------------------------------------------------


def saved(kind: str, step: int, node: str = "") -> dict[str, Any]:
    """What a save of ``kind`` writes: ``big``, the tensor alone for DCP."""
    state = big(step, node)
    return state if kind == "object" else {"w": state["w"]}


def restored(m: CheckpointManager, kind: str, step: int | None = None) -> dict[str, Any]:
    """``m.restore(step)`` of ``kind``, as :func:`big` has it."""
    if kind == "object":
        return m.restore(step=step)  # type: ignore[no-any-return]
    target = {"w": torch.zeros(N)}
    info = m.info(step) if step is not None else m.latest()
    assert info is not None
    m.restore(step=info.step, state=target)
    return {**target, "step": info.step}


def dcp_files(step_dir_path: Path) -> dict[str, Any]:
    """A DCP step of a local tier, read by torch's own ``FileSystemReader``."""
    import torch.distributed.checkpoint as dcp

    target = {"w": torch.zeros(N)}
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(step_dir_path)))
    return target


def node_saves_step_5(root: str, tier: str, options: str, kind: str, node: str) -> None:
    """A node (a child process): restore step 4 from the bucket, save step 5 with values
    of its own, drain it (once more if that fails). Its first bucket commit of step 5
    waits for a line on stdin: the parent orders the two nodes' commits."""
    torch.set_num_threads(1)
    from cloudckpt.manager import manager as module

    commit_step = module.commit_step
    held: list[int] = []

    def hold(store: Any, prefix: str, step: int, *args: Any, **kwargs: Any) -> Any:
        if step == 5 and not held:
            held.append(step)
            print("commit", flush=True)
            sys.stdin.readline()
        return commit_step(store, prefix, step, *args, **kwargs)

    module.commit_step = hold  # type: ignore[attr-defined]
    m = manager(root, Path(tier), json.loads(options), kind=kind)
    assert same(restored(m, kind), big(4))
    m.save(5, saved(kind, 5, node), metadata={"node": node})
    try:
        m.drain()
    except StorageError as exc:
        print(f"drain failed: {exc}", file=sys.stderr, flush=True)
        m.drain()  # the bucket keeps one save's commit; this node's copy stays local
    print("done", flush=True)


_NODE = (
    "import sys; sys.path[:0] = sys.argv[1:3]; import test_tier_faults as t; "
    "t.node_saves_step_5(*sys.argv[3:])"
)


def say(proc: subprocess.Popen[str], line: str) -> None:
    """Tell the child ``line`` on its stdin."""
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def next_line(proc: subprocess.Popen[str]) -> str:
    """The child's next line on stdout (its stderr when it ended without one)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], SPAWN_TIMEOUT_S)
    assert ready, "the child said nothing"
    line = proc.stdout.readline().strip()
    if not line:
        proc.wait(timeout=SPAWN_TIMEOUT_S)
        assert proc.stderr is not None
        raise AssertionError(f"the child ended: {proc.stderr.read()[-3000:]}")
    return line


@pytest.mark.parametrize("kind", ["object", "dcp"])
def test_two_nodes_saving_the_same_step_commit_one_saves_bytes(
    moto_server: S3Server, bucket: str, tmp_path: Path, kind: str
) -> None:
    """Two processes, each its own local_dir, save step 5 (other values) to one bucket and
    drain it at once: node A uploads, node B uploads over it, A commits, B commits. The
    bucket's step 5 is then one save's bytes under that save's own marker, file for file,
    never A's marker over B's bytes; each node's local copy is its own."""
    if kind == "dcp":
        pytest.importorskip("cloudckpt.dcp")
    root = f"s3://{bucket}/run"
    options = moto_server.storage_options()
    first = manager(root, tmp_path / "first", options, kind=kind)
    first.save(4, saved(kind, 4))
    first.drain()

    nodes: dict[str, subprocess.Popen[str]] = {}
    try:
        for node in ("a", "b"):  # A's payload is up before B starts: B uploads over it
            argv = [str(HERE), str(HERE.parent), root, str(tmp_path / node), json.dumps(options)]
            nodes[node] = subprocess.Popen(
                [sys.executable, "-c", _NODE, *argv, kind, node],
                text=True,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            assert next_line(nodes[node]) == "commit"  # its payload is in the bucket
        for node in ("a", "b"):  # A commits first, then B
            say(nodes[node], "go")
            assert next_line(nodes[node]) == "done"
            assert nodes[node].wait(timeout=SPAWN_TIMEOUT_S) == 0
    finally:
        for proc in nodes.values():
            if proc.poll() is None:
                kill(proc)

    plain = CheckpointManager(root, kind=kind, storage_options=options)
    assert bucket_steps(root, options) == [4, 5]
    winner = plain.info(5).metadata["node"]
    assert same(restored(plain, kind, 5), big(5, winner))  # the marker's save, its bytes
    for f in plain.info(5).files:  # file for file: the winner's local copy
        local = tmp_path / winner / step_dir(5) / f.name
        assert plain.store.get(f"run/{step_dir(5)}/{f.name}") == local.read_bytes(), f.name
    for node in ("a", "b"):  # nothing committed is lost: each node's copy is its own
        where = tmp_path / node / step_dir(5)
        if kind == "object":
            assert same(torch.load(where / "state.pt", weights_only=True), big(5, node))
        else:
            assert torch.equal(dcp_files(where)["w"], big(5, node)["w"]), node
    assert same(restored(plain, kind, 4), big(4))


# -- a disk that fills -------------------------------------------------------------------


class Quota:
    """``shutil.disk_usage`` of a filesystem of ``limit`` bytes that holds the tier alone:
    what the tier's files leave is free (the tier's own check reads it there)."""

    def __init__(self, tier: Path, limit: int) -> None:
        self.tier, self.limit = tier, limit

    def __call__(self, path: Any) -> Usage:
        used = sum(p.stat().st_size for p in self.tier.rglob("*") if p.is_file())
        return Usage(self.limit, used, max(self.limit - used, 0))


def tier_files(tier: Path) -> dict[str, int]:
    return {str(p.relative_to(tier)): p.stat().st_size for p in tier.rglob("*") if p.is_file()}


def test_a_tier_that_fills_while_the_bucket_is_away_refuses_before_writing_then_drains(
    moto_server: S3Server, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 70 MiB filesystem: three 20 MiB saves fit while the bucket refuses connections;
    the fourth is refused before a byte is written, naming the steps that wait. When the
    bucket is back they land, local retention frees the room, and saves go on."""
    root, tier = f"s3://{bucket}/run", tmp_path / "tier"
    port = free_port()  # nothing listens there yet: every connection is refused
    options = {**moto_server.storage_options(), "endpoint_url": f"http://127.0.0.1:{port}"}
    m = CheckpointManager(
        root, local_dir=tier, keep_local=1, part_size=PART, storage_options=options, **FAST
    )
    monkeypatch.setattr(shutil, "disk_usage", Quota(tier, 70 * MiB))
    took = timed_saves(m, range(1, 4))
    assert max(took) < LOCAL_SAVE_S, took
    before = tier_files(tier)
    with pytest.raises(LocalTierFullError, match=re.escape("wait for the bucket")) as full:
        m.save(4, big(4))
    assert re.escape("[1, 2, 3]") in re.escape(str(full.value)), full.value
    assert tier_files(tier) == before  # nothing written, nothing removed
    assert local_steps(tier) == [1, 2, 3]

    requests = Requests()
    with FaultProxy(moto_server.endpoint_url, port=port, match=requests):
        m.drain()
        assert requests.markers == [1, 2, 3]
        assert local_steps(tier) == [3]  # drained: the room comes back
        m.save(4, big(4))
        m.drain()
        assert bucket_steps(root, options) == [1, 2, 3, 4]
        assert same(m.restore(), big(4))
        check_restores(root, tier, options, big)


def save_past_a_file_size_limit(root: str, tier: str, options: str) -> None:
    """A child: step 2's payload write fails midway (the kernel refuses to write past
    12 MiB: EFBIG, as a full disk refuses with ENOSPC); then a smaller save goes on."""
    torch.set_num_threads(1)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
    m = manager(root, Path(tier), json.loads(options))
    resource.setrlimit(resource.RLIMIT_FSIZE, (12 * MiB, resource.RLIM_INFINITY))
    try:
        m.save(2, big(2))
    except StorageError as exc:
        print(f"refused {type(exc).__name__}: {exc}", flush=True)
    small = {"w": big(3)["w"][:MiB].clone(), "step": 3}  # 4 MiB, its own storage
    m.save(3, small)
    torch.save(small, Path(tier) / "expected-3.pt")
    m.drain()
    print("done", flush=True)


def test_a_payload_write_failing_midway_commits_nothing_and_leaves_no_temp_file(
    moto_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    root, tier = f"s3://{bucket}/run", tmp_path / "tier"
    options = moto_server.storage_options()
    first = manager(root, tier, options)
    first.save(1, big(1))
    first.drain()
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.path[:0] = sys.argv[1:3]; import test_tier_faults as t; "
            "t.save_past_a_file_size_limit(*sys.argv[3:])",
            *(str(HERE), str(HERE.parent), root, str(tier), json.dumps(options)),
        ],
        capture_output=True,
        text=True,
        timeout=SPAWN_TIMEOUT_S,
    )
    assert done.returncode == 0 and done.stdout.endswith("done\n"), done.stderr[-3000:]
    assert done.stdout.startswith("refused StorageError") and "step-000000002" in done.stdout
    assert local_steps(tier) == [1, 3] and temps(tier) == []
    assert not list((tier / step_dir(2)).glob("*"))  # nothing of step 2 (its folder at most)
    expected = torch.load(tier / "expected-3.pt", weights_only=True)
    after = manager(root, tier, options)
    assert same(after.restore(), expected)  # the newest valid step
    after.save(4, big(4))  # and saves go on, at full size
    after.drain()
    assert bucket_steps(root, options) == [3, 4]
    check_restores(root, tier, options, lambda s: expected if s == 3 else big(s))
