"""cloudckpt.nemo imports NeMo only when used, and names the package when it is missing."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
sys.modules["nemo"] = None  # as if nemo_toolkit were not installed
import cloudckpt.nemo as cn
assert "nemo" not in [m.split(".")[0] for m in sys.modules if sys.modules[m] is not None]
try:
    cn.CloudMegatronCheckpointIO
except ImportError as exc:
    assert "nemo_toolkit" in str(exc) and "NeMo 2" in str(exc), exc
else:
    raise AssertionError("no ImportError without NeMo")
try:
    cn.no_such_name
except AttributeError:
    pass
"""


def test_missing_nemo_is_an_import_error_naming_the_package() -> None:
    subprocess.run([sys.executable, "-c", CODE], check=True, timeout=120)
