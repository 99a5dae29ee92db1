"""tests/nemo imports tests/megatron's GPT builder (``mcore_workers``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "megatron"))
