"""Which CRC-32 a plain install gets: ISA-L's where pyproject.toml's markers bring isal,
zlib's where isal is missing."""

from __future__ import annotations

import importlib.util
import sys
import zlib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import cloudckpt.format.checksum as checksum

try:
    import tomllib
except ImportError:  # Python 3.10: cloudckpt depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def _base_isal_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    return [r for r in reqs if r.name == "isal"]


def test_isal_is_a_base_dependency_on_the_platforms_with_wheels():
    reqs = _base_isal_requirements()
    assert reqs, "isal is no longer in pyproject.toml's base dependencies"
    assert all(r.marker is not None for r in reqs)  # never asked for where no wheel exists

    def wanted(**env: str) -> bool:
        full = {"platform_python_implementation": "CPython", "python_version": "3.12", **env}
        return any(r.marker is not None and r.marker.evaluate(full) for r in reqs)

    assert wanted(sys_platform="linux", platform_machine="x86_64")
    assert wanted(sys_platform="linux", platform_machine="aarch64")
    assert wanted(sys_platform="win32", platform_machine="AMD64")
    assert wanted(sys_platform="darwin", platform_machine="arm64", python_version="3.14")
    assert wanted(sys_platform="darwin", platform_machine="x86_64", python_version="3.13")
    assert not wanted(sys_platform="darwin", platform_machine="x86_64", python_version="3.14")
    assert not wanted(sys_platform="linux", platform_machine="ppc64le")
    assert not wanted(sys_platform="linux", platform_machine="x86_64",
                      platform_python_implementation="PyPy")  # fmt: skip


def test_the_default_install_uses_isal_where_the_markers_bring_it():
    if not any(r.marker is not None and r.marker.evaluate() for r in _base_isal_requirements()):
        pytest.skip("no isal wheel for this platform: zlib's CRC-32 is the default here")
    assert checksum.IMPLEMENTATION == "isal"


def test_without_isal_the_checksum_falls_back_to_zlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "isal", None)  # import isal raises ImportError
    monkeypatch.setitem(sys.modules, "isal.isal_zlib", None)
    spec = importlib.util.spec_from_file_location("checksum_without_isal", checksum.__file__)
    assert spec is not None and spec.loader is not None
    fallback = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fallback)
    assert fallback.IMPLEMENTATION == "zlib"
    assert fallback.crc32 is zlib.crc32
    assert fallback.crc32(b"cloudckpt") == checksum.crc32(b"cloudckpt")
