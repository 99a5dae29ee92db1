"""The gpt-adamw variant's state: a GPT-like model and its AdamW state, as a user saves it.

``{"model": model.state_dict(), "optimizer": optimizer.state_dict()}`` of a GPT-2-style
decoder (learned position embeddings, LayerNorm with bias, fused QKV, 4x MLP, head tied
to the token embedding, fp32) trained for some steps with ``torch.optim.AdamW``: per
parameter ``step`` (a 0-dim tensor, as torch keeps it), ``exp_avg`` and ``exp_avg_sq``,
keyed by the parameter's index, and two parameter groups as nanoGPT makes them (weight
decay on the matrices, none on biases and norms). Tensors from 4 bytes (``step``) and a
few KiB (biases, norms) to the token embedding (98 MiB at hidden 512). The same seed
gives the same values in every system's worker, so each load is checked against the
state its save wrote. Built in the worker (``benchmarks.worker``), before the clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

#: The AdamW step the state is at (each ``step`` tensor's value).
STEP = 1000.0


@dataclass(frozen=True)
class GptAdamwShape:
    """Sizes of the model; ``nbytes`` and ``tensors`` count model and optimizer state."""

    hidden: int
    layers: int
    vocab: int
    seq: int

    def params(self) -> dict[str, tuple[int, ...]]:
        """The model's parameters, in ``state_dict`` order (no ``lm_head``: it is tied)."""
        h = self.hidden
        out: dict[str, tuple[int, ...]] = {
            "transformer.wte.weight": (self.vocab, h),
            "transformer.wpe.weight": (self.seq, h),
        }
        for i in range(self.layers):
            p = f"transformer.h.{i}."
            out[p + "ln_1.weight"] = out[p + "ln_1.bias"] = (h,)
            out[p + "attn.c_attn.weight"], out[p + "attn.c_attn.bias"] = (3 * h, h), (3 * h,)
            out[p + "attn.c_proj.weight"], out[p + "attn.c_proj.bias"] = (h, h), (h,)
            out[p + "ln_2.weight"] = out[p + "ln_2.bias"] = (h,)
            out[p + "mlp.c_fc.weight"], out[p + "mlp.c_fc.bias"] = (4 * h, h), (4 * h,)
            out[p + "mlp.c_proj.weight"], out[p + "mlp.c_proj.bias"] = (h, 4 * h), (h,)
        out["transformer.ln_f.weight"] = out["transformer.ln_f.bias"] = (h,)
        return out

    @property
    def nbytes(self) -> int:
        """Tensor bytes: every parameter three times (weights, ``exp_avg``, ``exp_avg_sq``)
        and one fp32 ``step`` per parameter."""
        shapes = self.params().values()
        return 3 * 4 * sum(math.prod(s) for s in shapes) + 4 * len(shapes)

    @property
    def tensors(self) -> int:
        return 4 * len(self.params())

    def describe(self) -> str:
        return (
            f"GPT-like decoder hidden {self.hidden}, {self.layers} layers, vocab {self.vocab}, "
            f"context {self.seq}, fp32, tied head, with AdamW state"
        )


FULL = GptAdamwShape(hidden=512, layers=20, vocab=50257, seq=1024)  # 1022 MiB, 976 tensors
QUICK = GptAdamwShape(hidden=256, layers=8, vocab=16384, seq=512)  # 122 MiB, 400 tensors


def build(shape: GptAdamwShape, seed: int) -> dict[str, Any]:
    """The checkpoint a training loop saves: model and optimizer state dicts (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    params = shape.params()
    model = {name: torch.rand(dims, generator=gen) for name, dims in params.items()}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for i, dims in enumerate(params.values()):
        state[i] = {
            "step": torch.tensor(STEP),
            "exp_avg": torch.rand(dims, generator=gen),
            "exp_avg_sq": torch.rand(dims, generator=gen),
        }
    decay = [i for i, dims in enumerate(params.values()) if len(dims) >= 2]
    no_decay = [i for i, dims in enumerate(params.values()) if len(dims) < 2]
    group = {"lr": 6e-4, "betas": (0.9, 0.95), "eps": 1e-08, "amsgrad": False,
             "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
             "fused": None, "decoupled_weight_decay": True}  # fmt: skip
    groups = [{**group, "weight_decay": 0.1, "params": decay},
              {**group, "weight_decay": 0.0, "params": no_decay}]  # fmt: skip
    return {"model": model, "optimizer": {"state": state, "param_groups": groups}}
