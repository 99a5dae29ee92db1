"""CloudMegatronCheckpointIO and the async wrapper with NeMo 2's real classes, on S3.

Two forked gloo ranks save a real GPTModel (TP=2) as NeMo's MegatronStrategy hands it
over; the async saves are finalized by megatron-core's AsyncCallsQueue through NeMo's
AsyncFinalizerCallback. Skipped unless NeMo 2 imports (``make test-nemo``).
"""

from __future__ import annotations

from typing import Any

import nemo_env
import pytest

nemo_env.require()

import nemo_workers as nw  # noqa: E402

from ranks import run_ranks  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")

TIMEOUT = 300


def test_save_metadata_strict_load_and_remove(moto_server: Any) -> None:
    so = moto_server.storage_options()
    url = f"s3://{moto_server.make_bucket('nemo-io')}/run/checkpoints"
    run_ranks(nw.checkpoint_io_round_trip, 2, url, so, timeout=TIMEOUT)


def test_async_saves_finalize_through_nemos_callback(moto_server: Any) -> None:
    so = moto_server.storage_options()
    url = f"s3://{moto_server.make_bucket('nemo-async')}/run/checkpoints"
    run_ranks(nw.async_wrapper_and_finalizer, 2, url, so, timeout=TIMEOUT)
    assert nw.names_dirs(url, so) == ["step=1", "step=2"]
