"""cloudckpt.torchtitan imports without torchtitan (the check runs in any environment)."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
sys.modules["torchtitan"] = None  # as if torchtitan were not installed
import cloudckpt.torchtitan as tt
assert tt.__all__ == ["CloudCheckpointManager"]
try:
    tt.CloudCheckpointManager
except ImportError as exc:
    assert "torchtitan" in str(exc), exc
else:
    raise AssertionError("CloudCheckpointManager was built without torchtitan")
"""


def test_the_module_imports_without_torchtitan_and_names_it_when_used():
    subprocess.run([sys.executable, "-c", CODE], check=True, timeout=120)
