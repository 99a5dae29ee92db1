"""The safetensors scenario's model: a Llama-like decoder's weights in bf16, as released.

Embedding and LM head (untied), per layer a fused QKV, the attention output, gate, up
and down projections and two RMSNorm weights: tensors from 4 KiB (norms) to a few
hundred MiB (the embedding), in the order a model's ``state_dict`` lists them. The same
seed gives the same values in every system's worker, so each load is checked against
the state its save wrote.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class LlamaShape:
    """Sizes of the model; ``nbytes`` is its checkpoint's tensor bytes (bf16)."""

    hidden: int
    layers: int
    ffn: int
    vocab: int

    def shapes(self) -> dict[str, tuple[int, ...]]:
        h, f = self.hidden, self.ffn
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h)}
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = (h,)
            out[p + "self_attn.qkv_proj.weight"] = (3 * h, h)
            out[p + "self_attn.o_proj.weight"] = (h, h)
            out[p + "post_attention_layernorm.weight"] = (h,)
            out[p + "mlp.gate_proj.weight"] = (f, h)
            out[p + "mlp.up_proj.weight"] = (f, h)
            out[p + "mlp.down_proj.weight"] = (h, f)
        out["model.norm.weight"] = (h,)
        out["lm_head.weight"] = (self.vocab, h)
        return out

    @property
    def nbytes(self) -> int:
        return sum(2 * math.prod(s) for s in self.shapes().values())

    @property
    def tensors(self) -> int:
        return len(self.shapes())

    def describe(self) -> str:
        return (
            f"Llama-like decoder hidden {self.hidden}, {self.layers} layers, FFN {self.ffn}, "
            f"vocab {self.vocab}, bf16, untied head"
        )


FULL = LlamaShape(hidden=2048, layers=8, ffn=5632, vocab=32000)  # 1.0 GiB in 60 tensors
QUICK = LlamaShape(hidden=1024, layers=4, ffn=2816, vocab=16000)  # 0.13 GiB


def own_state(spec: dict[str, Any]) -> tuple[dict[str, torch.Tensor], int]:
    """The worker's hook: the model's tensors (seeded), and their bytes."""
    shape = LlamaShape(**spec["model"])
    gen = torch.Generator().manual_seed(spec["seed"])
    state = {
        name: torch.randn(dims, generator=gen).to(torch.bfloat16)
        for name, dims in shape.shapes().items()
    }
    return state, shape.nbytes
