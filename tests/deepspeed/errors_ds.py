"""The load errors of ``cloudckpt.deepspeed`` in one process (one rank): what each call
raised, as JSON on stdout.

    python errors_ds.py STORAGE_OPTIONS_JSON EMPTY_URL GONE_URL ZERO2_URL ZERO3_URL

EMPTY_URL has nothing committed; GONE_URL's bucket does not exist; ZERO2_URL and
ZERO3_URL hold checkpoints saved by 2 ranks (ZeRO-2 and ZeRO-3).
"""

from __future__ import annotations

import json
import sys
import tempfile
from typing import Any

import torch
from run_ds import config, start_deepspeed


def outcome(fn: Any) -> list[str]:
    try:
        result = fn()
    except Exception as exc:
        return [type(exc).__name__, str(exc)]
    return ["ok", repr(result)]


def main() -> None:
    storage_options = json.loads(sys.argv[1])
    empty, gone, zero2, zero3 = sys.argv[2:6]
    torch.set_num_threads(1)
    deepspeed = start_deepspeed()
    from cloudckpt.deepspeed import load_checkpoint, save_checkpoint

    engines = {}
    for stage in (2, 3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
        )
        engines[stage], *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config(stage)
        )
    so = {"storage_options": storage_options}
    scratch = tempfile.mkdtemp(prefix="errors-ds-tier-")  # a local tier never written
    found = {
        "empty": outcome(lambda: load_checkpoint(engines[2], empty, **so)),
        "empty_ok": outcome(lambda: load_checkpoint(engines[2], empty, missing_ok=True, **so)),
        "no_step": outcome(lambda: load_checkpoint(engines[2], zero2, step=5, **so)),
        "no_tag": outcome(lambda: load_checkpoint(engines[2], zero2, tag="nope", **so)),
        "gone_load": outcome(lambda: load_checkpoint(engines[2], gone, **so)),
        "gone_save": outcome(lambda: save_checkpoint(engines[2], gone, **so)),
        "world2": outcome(lambda: load_checkpoint(engines[2], zero2, **so)),
        "world3": outcome(lambda: load_checkpoint(engines[3], zero3, **so)),
        "stage": outcome(lambda: load_checkpoint(engines[3], zero2, **so)),
        "module_only": outcome(
            lambda: load_checkpoint(engines[2], zero2, load_optimizer_states=False, **so)[0].step
        ),
        # The local tier's arguments, refused before anything is written.
        "tier_async": outcome(
            lambda: save_checkpoint(engines[2], empty, local_dir=scratch, async_save=True, **so)
        ),
        "tier_keep": outcome(lambda: save_checkpoint(engines[2], empty, keep_local=2, **so)),
        "tier_keep_0": outcome(
            lambda: save_checkpoint(engines[2], empty, local_dir=scratch, keep_local=0, **so)
        ),
        "tier_dir": outcome(lambda: load_checkpoint(engines[2], empty, local_dir=3, **so)),
    }
    for stage in (0, 1):  # a save and a load on one rank, for the stages not run on two
        found[f"roundtrip{stage}"] = outcome(
            lambda stage=stage: roundtrip(deepspeed, stage, f"{empty}-z{stage}", so)
        )
    print(json.dumps(found))


def roundtrip(deepspeed: Any, stage: int, url: str, so: dict) -> bool:
    """Two steps, a save, a fresh engine restored from it: the same parameters and step."""
    from cloudckpt.deepspeed import load_checkpoint, save_checkpoint

    engines = []
    for _ in range(2):
        torch.manual_seed(1)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
        )
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config(stage)
        )
        engines.append(engine)
    first, second = engines
    for _ in range(2):
        x = torch.randn(4, 16)
        first.backward(torch.nn.functional.mse_loss(first(x), x.sum(dim=1, keepdim=True)))
        first.step()
    info = save_checkpoint(first, url, **so)
    loaded, _ = load_checkpoint(second, url, **so)
    assert loaded.step == info.step == second.global_steps == 2, (loaded, second.global_steps)
    for a, b in zip(first.module.parameters(), second.module.parameters(), strict=True):
        assert torch.equal(a, b)
    return True


if __name__ == "__main__":
    main()
