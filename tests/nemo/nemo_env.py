"""Import NeMo 2 for the tests in tests/nemo, with the shims newer Lightning needs.

NeMo 2.7.3 pins ``lightning<=2.4``. With Lightning 2.5+ two imports fail, and the
shims below (the ones docs/megatron.md lists for users) fix them in this process only,
before NeMo is imported; with Lightning 2.4 neither applies:

1. ``nv_one_logger``'s ``OneLoggerPTLTrainer.save_checkpoint`` declares
   ``weights_only: bool``; ``@override`` refuses it against Lightning's
   ``Optional[bool]``. The module is imported with that signature check off.
2. ``nemo.utils.exp_manager`` imports ``NeptuneLogger`` from ``lightning.pytorch.loggers``,
   which no longer re-exports it; it is re-exported from its own module.

``require()`` skips the calling test module when NeMo 2 can't be imported
(``make test-nemo`` builds an environment with it; ``make test`` has none).

Importing this module also puts tests/megatron on ``sys.path``, for its GPT builder
(``mcore_workers``); a conftest.py here would shadow the suite's root conftest, which
other test modules import by name.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "megatron"))

ONE_LOGGER_PL = "nv_one_logger.training_telemetry.integration.pytorch_lightning"


@contextlib.contextmanager
def _override_without_signature_check() -> Iterator[None]:
    import overrides  # noqa: F401  (the package's `overrides` name hides its module)

    checks = sys.modules["overrides.overrides"]
    original = checks.ensure_signature_is_compatible
    checks.ensure_signature_is_compatible = lambda *args, **kwargs: None
    try:
        yield
    finally:
        checks.ensure_signature_is_compatible = original


def apply_shims() -> list[str]:
    """Apply the shims this Lightning needs; returns the ones applied."""
    applied = []
    try:
        __import__(ONE_LOGGER_PL)
    except TypeError:
        sys.modules.pop(ONE_LOGGER_PL, None)
        with _override_without_signature_check():
            __import__(ONE_LOGGER_PL)
        applied.append("nv_one_logger save_checkpoint signature")
    import lightning.pytorch.loggers as loggers

    if not hasattr(loggers, "NeptuneLogger"):
        from lightning.pytorch.loggers.neptune import NeptuneLogger

        loggers.NeptuneLogger = NeptuneLogger  # type: ignore[attr-defined]
        applied.append("lightning.pytorch.loggers.NeptuneLogger")
    return applied


ERROR: str | None = None
SHIMS: list[str] = []
try:
    SHIMS = apply_shims()
    import nemo.lightning  # noqa: F401
except ImportError as exc:
    ERROR = f"NeMo 2 is not importable here ({exc}); run `make test-nemo`"


def require() -> None:
    """Skip the calling module unless NeMo 2 imports."""
    if ERROR is not None:
        pytest.skip(ERROR, allow_module_level=True)
