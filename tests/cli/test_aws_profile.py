"""An AWS profile that no AWS config file holds is a configuration error naming it:
one line and exit code 2 from the ``cloudckpt`` command (``--profile`` or
``AWS_PROFILE``), a ConfigError from the library, never botocore's ProfileNotFound."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import cloudckpt
from cloudckpt.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CLOUDCKPT = str(Path(sys.executable).parent / "cloudckpt")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
        AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
    )
    env.update(extra)
    return env


@pytest.mark.parametrize("region", [None, "us-east-1"])  # the region found elsewhere or not
@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_missing_profile_is_one_line_and_exit_2(how: str, region: str | None) -> None:
    extra = {"AWS_REGION": region} if region else {}
    if how == "env":
        extra["AWS_PROFILE"] = "nosuch"
    args = ["ls", "s3://bkt/x"] + (["--profile", "nosuch"] if how == "flag" else [])
    done = subprocess.run(
        [CLOUDCKPT, *args],
        env=_env(**extra),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("cloudckpt ls: AWS profile 'nosuch'")
    assert ("--profile" if how == "flag" else "AWS_PROFILE") in lines[0]


@pytest.mark.parametrize("region", [None, "us-east-1"])
def test_a_missing_profile_in_storage_options_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, region: str | None
) -> None:
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    if region:
        monkeypatch.setenv("AWS_REGION", region)
    with pytest.raises(ConfigError, match=r"AWS profile 'nosuch' .*profile_name"):
        cloudckpt.load("s3://bkt/x.pt", storage_options={"profile_name": "nosuch"})
