"""What a new user trips over on day one (issue 41), through the installed ``cloudckpt``
command in a subprocess (the tree under test first on ``PYTHONPATH``), and the README's
local-S3 block in a fresh bash.

* the README block works in a new shell after ``make demo`` when ``python`` is not the
  project's, and ends within seconds, saying so, when the server cannot start;
* a silent endpoint: metadata requests wait ``metadata_timeout``, every command takes
  ``--deadline`` (a default for ls, latest, info, rm, gc, mb), a WARNING per retry;
* an endpoint without a scheme is a one-line usage error with the URL meant;
* ``cp DIR`` without ``-r``, ``s3//bucket/x``: usage errors that say what to type;
* ``ls > file`` keeps whole names, listings name objects relative to their prefix, and
  ``--json`` gives one document on every command;
* any number of Ctrl-C: one line, exit code 130, what was stored kept;
* one error prefix (``cloudckpt COMMAND:``), short subcommand help, a plain
  ``python -m cloudckpt.testing --help``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cloudckpt.testing.fault_proxy import FaultProxy
from servers import S3Server, unique_bucket_name
from silent import SilentServer

ROOT = Path(__file__).resolve().parents[2]
SRC = str(ROOT / "src")
VENV_BIN = Path(sys.executable).parent
CLOUDCKPT = str(VENV_BIN / "cloudckpt")
MiB = 1 << 20


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
        AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
    )
    env.update(extra)
    return env


def _cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CLOUDCKPT, *args],
        env=env or _env(),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# -- 1. the README's local-S3 block ----------------------------------------------------------


def _readme_block(marker: str = "local-s3") -> str:
    text = (ROOT / "README.md").read_text()
    after = text[text.index(f"<!-- {marker}") :]
    return after.split("```bash\n", 1)[1].split("```", 1)[0]


def _foreign_python(tmp_path: Path) -> Path:
    """A directory holding a ``python`` that is not the project's: the interpreter the
    venv was made from (or the system's), which cannot import cloudckpt."""
    base = getattr(sys, "_base_executable", "") or "/usr/bin/python3"
    if os.path.realpath(base) == os.path.realpath(sys.executable) or not os.path.exists(base):
        base = "/usr/bin/python3"
    bin_dir = tmp_path / "other-bin"
    bin_dir.mkdir()
    shim = bin_dir / "python"
    shim.write_text(f'#!/bin/sh\nexec "{base}" -s "$@"\n')
    shim.chmod(0o755)
    clean = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    found = subprocess.run(
        ["python", "-c", "import cloudckpt"], env=clean, capture_output=True, check=False
    )
    if found.returncode == 0:
        pytest.skip(f"{base} imports cloudckpt: no python without it here")
    return bin_dir


def _fresh_shell_env(bin_dir: Path, tmp_path: Path) -> dict[str, str]:
    """A new login's environment: no venv active, ``python`` the foreign one."""
    keep = ("LANG", "LC_ALL", "TMPDIR", "NO_PROXY", "no_proxy")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(
        PATH=f"{bin_dir}:/usr/bin:/bin",
        HOME=str(tmp_path),
        AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
    )
    return env


def test_the_readme_block_runs_in_a_new_shell_after_make_demo(tmp_path: Path) -> None:
    """The repository after ``make demo``: ``.venv`` there, not active, and ``python``
    another interpreter. The block runs as printed (``bash -e``)."""
    bin_dir = _foreign_python(tmp_path)
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / ".venv").symlink_to(VENV_BIN.parent)  # what `make demo` made
    env = _fresh_shell_env(bin_dir, tmp_path)
    env["PYTHONPATH"] = SRC  # the tree under test, for the venv's python
    done = subprocess.run(
        ["bash", "-e", "-c", _readme_block()],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "w.pt" in done.stdout, done.stdout
    assert "all 1 object(s) verified" in done.stdout, done.stdout


def test_the_readme_block_stops_when_the_server_cannot_start(tmp_path: Path) -> None:
    """No ``.venv`` and a ``python`` without cloudckpt: the server cannot start. The
    block ends within seconds (it spun forever) with a line saying why."""
    bin_dir = _foreign_python(tmp_path)
    env = _fresh_shell_env(bin_dir, tmp_path)
    started = time.monotonic()
    done = subprocess.run(
        ["bash", "-c", _readme_block()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,  # TimeoutExpired: the loop still waits for a server that never came
        check=False,
    )
    assert time.monotonic() - started < 90
    assert "No module named" in done.stderr, done.stderr
    assert "the local S3 server did not start (its error is above)" in done.stderr


# -- 3. a silent endpoint --------------------------------------------------------------------


def _keys(endpoint: str) -> dict[str, str]:
    return _env(AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s", AWS_ENDPOINT_URL=endpoint)


def _profile(tmp_path: Path, **settings: Any) -> str:
    lines = ["[profiles.quick]", 'match = ["s3://silent/"]']
    lines += [f"{k} = {v!r}" for k, v in settings.items()]
    path = tmp_path / "config.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_ls_at_a_silent_endpoint_stops_at_its_deadline_warning_at_each_retry(
    silent: SilentServer, tmp_path: Path
) -> None:
    """Each HEAD waits ``metadata_timeout`` (1 s here, from a profile), is retried with a
    WARNING, and ``--deadline 6s`` ends the command: about 6 s, not 20 minutes."""
    env = {**_keys(silent.url), "CLOUDCKPT_CONFIG": _profile(tmp_path, metadata_timeout=1.0)}
    started = time.monotonic()
    done = _cli("ls", "s3://silent/run1", "--deadline", "6s", env=env, timeout=60)
    took = time.monotonic() - started
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    retries = [x for x in lines if x.startswith("cloudckpt ls: retrying head s3://silent/run1")]
    assert len(retries) >= 2, lines
    assert "deadline" in lines[-1] and lines[-1].startswith("cloudckpt ls: "), lines
    assert "--deadline" in lines[-1], lines
    assert "Traceback" not in done.stderr
    assert took < 30, took


def test_metadata_requests_give_up_after_metadata_timeout(
    silent: SilentServer, tmp_path: Path
) -> None:
    """Without a deadline: three attempts of 1 s each (a profile's ``metadata_timeout``
    and ``max_attempts``), then one error line; the stall timeout (120 s) plays no part."""
    config = _profile(tmp_path, metadata_timeout=1.0, max_attempts=3, backoff_max=0.5)
    env = {**_keys(silent.url), "CLOUDCKPT_CONFIG": config}
    started = time.monotonic()
    done = _cli("ls", "s3://silent/run1", "--deadline", "0", env=env, timeout=60)
    assert done.returncode == 1, done.stderr
    assert time.monotonic() - started < 30
    assert "failed after 3 attempts" in done.stderr, done.stderr
    assert done.stderr.count("retrying head") == 2, done.stderr


def test_every_command_takes_deadline() -> None:
    for command in ("ls", "latest", "info", "cp", "export", "verify", "rm", "gc", "mb", "bench"):
        done = _cli(command, "--help")
        assert done.returncode == 0
        assert "--deadline" in done.stdout, command


# -- 4. an endpoint without a scheme ---------------------------------------------------------


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_an_endpoint_without_a_scheme_is_a_usage_error_with_the_url_meant(how: str) -> None:
    if how == "flag":
        done = _cli("ls", "s3://b/x", "--endpoint-url", "127.0.0.1:9000", env=_keys(""))
    else:
        done = _cli("ls", "s3://b/x", env=_keys("127.0.0.1:9000"))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "without a scheme: did you mean 'http://127.0.0.1:9000'?" in lines[0]
    assert ("AWS_ENDPOINT_URL" if how == "environment" else "--endpoint-url") in lines[0]


def test_gcs_and_azure_endpoints_without_a_scheme_are_usage_errors() -> None:
    pytest.importorskip("google.auth")
    pytest.importorskip("azure.storage.blob")
    done = _cli("ls", "gs://b/x", "--endpoint-url", "localhost:9023", "--anonymous")
    assert done.returncode == 2, done.stderr
    assert "did you mean 'http://localhost:9023'?" in done.stderr
    done = _cli("ls", "az://c/x", "-o", "account_url=acct.blob.core.windows.net", "--anonymous")
    assert done.returncode == 2, done.stderr
    assert "did you mean 'https://acct.blob.core.windows.net'?" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


# -- 6, 7. what to type instead ------------------------------------------------------------


def test_cp_of_a_directory_without_r_says_use_cp_r(tmp_path: Path) -> None:
    (tmp_path / "somedir").mkdir()
    (tmp_path / "somedir" / "a.pt").write_bytes(b"x")
    done = _cli("cp", "./somedir", "s3://b/x/", cwd=tmp_path, env=_keys("http://127.0.0.1:9"))
    assert done.returncode == 2, done.stderr
    said = "cloudckpt cp: ./somedir is a directory: use cp -r to copy what it holds"
    assert done.stderr.strip() == said


def test_cp_of_a_prefix_without_r_says_use_cp_r(moto_server: S3Server, tmp_path: Path) -> None:
    bucket = moto_server.make_bucket(unique_bucket_name("cp-prefix"))
    moto_server.client().put_object(Bucket=bucket, Key="run/step/a.pt", Body=b"x")
    env = {**_env(), **moto_server.env()}
    done = _cli("cp", f"s3://{bucket}/run/step", str(tmp_path / "out"), env=env)
    assert done.returncode == 2, done.stderr
    assert f"s3://{bucket}/run/step is a prefix, not an object: use cp -r" in done.stderr
    assert "nothing kept" not in done.stderr


def test_a_scheme_without_its_colon_gets_the_url_meant(tmp_path: Path) -> None:
    done = _cli("ls", "s3//bucket/x", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "did you mean 's3://bucket/x'?" in done.stderr
    assert not (tmp_path / "s3").exists()


# -- 8. listings for scripts -----------------------------------------------------------------


def test_ls_into_a_file_keeps_whole_names(tmp_path: Path) -> None:
    folder = tmp_path / "ckpts"
    folder.mkdir()
    name = "model-" + "x" * 120 + ".pt"
    (folder / name).write_bytes(b"abc")
    out = tmp_path / "listing.txt"
    with out.open("w") as stdout:  # stdout a file, not a terminal
        code = subprocess.run(
            [CLOUDCKPT, "ls", str(folder)], env=_env(), stdout=stdout, timeout=120, check=False
        ).returncode
    assert code == 0
    text = out.read_text()
    assert name in text and "…" not in text and "..." not in text, text
    # A lone object is listed the same way: its folder heads the table, its name follows.
    one = _cli("ls", str(folder / name))
    lines = one.stdout.splitlines()
    assert lines[0] == f"file://{folder}/", lines
    assert lines[-1].split()[-1] == name, lines
    assert f"file://{folder}/{name}" not in one.stdout
    listed = json.loads(_cli("ls", "--json", str(folder)).stdout)
    assert listed["objects"][0]["name"] == name
    assert listed["objects"][0]["url"] == f"file://{folder}/{name}"


def test_every_command_prints_one_json_document(tmp_path: Path) -> None:
    import torch

    import cloudckpt

    run = tmp_path / "run"
    run.mkdir()
    cloudckpt.save({"w": torch.ones(2)}, str(run / "w.pt"))
    runs = {
        "ls": ["ls", str(run)],
        "info": ["info", str(run / "w.pt")],
        "verify": ["verify", str(run / "w.pt")],
        "cp": ["cp", str(run / "w.pt"), str(tmp_path / "copy.pt")],
        "rm": ["rm", "--dry-run", str(tmp_path / "copy.pt")],
        "latest": ["latest", str(run)],  # nothing committed: an error, still JSON
        "gc": ["gc", "--dry-run", str(run)],
        "mb": ["mb", str(tmp_path / "x")],  # a usage error, still JSON
    }
    for command, args in runs.items():
        done = _cli(*args, "--json")
        body = json.loads(done.stdout)  # one document, nothing else on stdout
        assert isinstance(body, dict), command
        if done.returncode:
            assert body["exit_code"] == done.returncode, (command, body)


# -- 9. Ctrl-C, however many times ------------------------------------------------------------


PART = 5 * MiB
PARTS = 6


class _PartsAfter:
    def __init__(self, n: int) -> None:
        self.n, self.seen = n, 0
        self._lock = threading.Lock()

    def __call__(self, method: str, target: str) -> bool:
        if method != "PUT" or "partNumber=" not in target:
            return False
        with self._lock:
            self.seen += 1
            return self.seen > self.n


def _journal(state: Path) -> dict[str, Any] | None:
    for path in state.glob("upload-*.json"):
        try:
            return dict(json.loads(path.read_text()))
        except (OSError, ValueError):
            return None
    return None


def test_any_number_of_ctrl_c_is_one_line_and_exit_130(
    moto_server: S3Server, tmp_path: Path
) -> None:
    """Five SIGINTs 50 ms apart (``timeout -s INT`` sends two), the later ones while the
    first is being handled: one line, exit 130, no traceback, the parts kept and the
    journal whole, so the same command resumes."""
    bucket = moto_server.make_bucket(unique_bucket_name("sigint-many"))
    data = os.urandom((PARTS - 1) * PART + MiB)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    state = tmp_path / "state"
    dst = f"s3://{bucket}/big.bin"
    command = [
        CLOUDCKPT, "cp", str(src), dst, "--part-size", "5MiB", "--concurrency", "2",
        "--state-dir", str(state),
    ]  # fmt: skip
    held = _PartsAfter(2)
    proxy = FaultProxy(
        moto_server.endpoint_url, rate=1.0, kinds=("slow",), slow_seconds=30.0, match=held
    )
    env = {**_env(), **moto_server.env(), "AWS_ENDPOINT_URL": ""}
    with proxy:
        env["AWS_ENDPOINT_URL"] = proxy.url
        proc = subprocess.Popen(
            command, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        try:
            deadline = time.monotonic() + 180
            while not (held.seen > 2 and len((_journal(state) or {}).get("parts", {})) >= 2):
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "no upload progress"
                time.sleep(0.05)  # polling for the progress above
            for _ in range(5):
                proc.send_signal(signal.SIGINT)
                time.sleep(0.05)
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 130, (proc.returncode, err)
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert lines == [
        f"cloudckpt cp: interrupted: 2 of {PARTS} parts kept; run the same command to resume"
    ], lines
    journal = _journal(state)
    assert journal is not None and len(journal["parts"]) == 2
    again = subprocess.run(
        [*command, "--json"], env={**_env(), **moto_server.env()}, text=True,
        capture_output=True, timeout=300, check=False,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["resumed_bytes"] == 2 * PART
    assert moto_server.client().get_object(Bucket=bucket, Key="big.bin")["Body"].read() == data


# -- 10. smaller things ----------------------------------------------------------------------


def test_mb_of_a_path_names_the_command_once(tmp_path: Path) -> None:
    done = _cli("mb", "./x", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith("cloudckpt mb: cannot create a bucket for ./x: ")
    assert done.stderr.count("cloudckpt mb") == 1, done.stderr


def test_every_error_and_warning_line_starts_with_the_command(tmp_path: Path) -> None:
    missing = _cli("ls", str(tmp_path / "nothing"))
    assert missing.returncode == 3
    assert missing.stderr.startswith("cloudckpt ls: nothing at: "), missing.stderr
    latest = _cli("latest", str(tmp_path))
    assert latest.returncode == 3
    assert latest.stderr.startswith("cloudckpt latest: "), latest.stderr
    with socket.socket() as s:  # a port nothing listens on: refused, retried, warned
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    refused = _cli("ls", "s3://b/run1", env=_keys(f"http://127.0.0.1:{port}"))
    lines = refused.stderr.strip().splitlines()
    assert lines and all(x.startswith("cloudckpt ls: ") for x in lines), lines


def test_subcommand_help_is_its_own() -> None:
    top = _cli("--help").stdout
    assert "exit codes:" in top and "cloudckpt mb s3://bucket" in top
    for command in ("ls", "cp", "rm", "mb"):
        sub = _cli(command, "--help").stdout
        assert "exit codes:\n" not in sub and "  130 " not in sub, command
        assert "cloudckpt --help" in sub, command
        others = [c for c in ("gc", "bench", "export") if c != command]
        assert not any(f"  cloudckpt {c} " in sub for c in others), (command, sub)
    assert "cloudckpt ls --json" in _cli("ls", "--help").stdout


def test_the_testing_command_help_is_plain_text() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "cloudckpt.testing", "--help"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0
    assert "``" not in done.stdout and ":class:" not in done.stdout, done.stdout
    assert "--bucket" in done.stdout


def test_a_local_dir_of_another_run_is_named_once(tmp_path: Path) -> None:
    """``ls --local`` / ``verify --local`` with another run's tier: one line saying so,
    not a WARNING and then the error repeating it."""
    import torch

    from cloudckpt.manager import CheckpointManager

    tier = tmp_path / "tier"
    CheckpointManager(tmp_path / "runA", local_dir=tier).save(1, {"w": torch.ones(2)})
    for command in ("ls", "verify"):
        done = _cli(command, "--local", str(tier), str(tmp_path / "runB"))
        assert done.returncode == 2, done.stderr
        lines = [x for x in done.stderr.splitlines() if "holds the local tier of" in x]
        assert len(lines) == 1, done.stderr
        assert lines[0].startswith(f"cloudckpt {command}: ") and "runA" in lines[0]
