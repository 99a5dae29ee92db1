"""Lightning tests need the ``lightning`` package."""

import pytest

pytest.importorskip("lightning")
