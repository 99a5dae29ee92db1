"""The Megatron scenario's checkpoint: a real megatron-core GPTModel, TP=2 on 2 ranks.

Each rank (forked gloo processes, through :mod:`.ranks`) builds its tensor-parallel half
of the model before the clock starts, with the local (no Transformer Engine) layer spec,
a gated linear unit (so the sharded state dict holds ``ShardedTensorFactory`` objects,
as Llama-style models' do) and tied embeddings. Weights are initialized on the CPU from
the full master weight with the repetition's seed, so a loading rank that builds the
same model knows every value the checkpoint must give back: it keeps a copy, zeroes
its parameters, loads (timed), then compares every tensor of the model (untimed).

A system supplies three callables: ``prepare()`` (per rank, untimed: its client),
``save(sharded_state_dict, url)`` and ``load(sharded_state_dict, url)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .ranks import Step, run_ranks


@dataclass(frozen=True)
class GptShape:
    """The model: megatron-core ``TransformerConfig`` sizes, fp32, ``tp`` ranks."""

    hidden: int
    layers: int
    heads: int
    ffn: int
    vocab: int
    seq: int
    tp: int = 2

    def per_layer(self) -> int:
        h, f = self.hidden, self.ffn
        norms = 2 * 2 * h  # input and pre-MLP LayerNorm, weight and bias
        attention = (3 * h * h + 3 * h) + (h * h + h)  # QKV and output projection
        mlp = (2 * f * h + 2 * f) + (f * h + h)  # gated fc1 (two halves), fc2
        return norms + attention + mlp

    @property
    def nbytes(self) -> int:
        """The checkpoint's tensor bytes: every parameter once (checked against the model)."""
        h = self.hidden
        return 4 * (self.vocab * h + self.seq * h + self.layers * self.per_layer() + 2 * h)

    @property
    def tensors(self) -> int:
        """Global tensors: word and position embeddings, 12 per layer, the final LayerNorm."""
        return 2 + 12 * self.layers + 2

    def describe(self) -> str:
        return (
            f"GPTModel hidden {self.hidden}, {self.layers} layers, {self.heads} heads, "
            f"GLU FFN {self.ffn}, vocab {self.vocab}, fp32, TP={self.tp} on {self.tp} ranks"
        )


#: 328 MiB: a vocabulary of 32k at hidden 1024 is 128 MiB of it.
FULL = GptShape(hidden=1024, layers=4, heads=16, ffn=2816, vocab=32768, seq=1024)
QUICK = GptShape(hidden=512, layers=2, heads=8, ffn=1408, vocab=16384, seq=512)


def own_state(spec: dict[str, Any]) -> tuple[tuple[GptShape, int], int]:
    """The worker's hook: (the model's shape and seed), the checkpoint's bytes.

    Imports megatron-core here, in the worker, so the forked ranks inherit it.
    """
    from megatron.core.models.gpt import GPTModel  # noqa: F401

    shape = GptShape(**spec["model"])
    return (shape, spec["seed"]), shape.nbytes


def build(shape: GptShape, seed: int) -> Any:
    """This rank's part of the model (``torch.distributed`` initialized, ``shape.tp`` ranks)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=shape.tp)
    config = TransformerConfig(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        ffn_hidden_size=shape.ffn,
        use_cpu_initialization=True,
        gated_linear_unit=True,
        params_dtype=torch.float32,
        bias_activation_fusion=False,
    )
    torch.manual_seed(seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=shape.vocab,
        max_sequence_length=shape.seq,
        share_embeddings_and_output_weights=True,
    )
    tp_split = sum(p.numel() for p in model.parameters() if getattr(p, "tensor_model_parallel", 0))
    whole = sum(p.numel() for p in model.parameters()) - tp_split
    if 4 * (tp_split * shape.tp + whole) != shape.nbytes:  # the ceiling moves shape.nbytes
        raise AssertionError(f"the model has {4 * (tp_split * shape.tp + whole)} bytes, "
                             f"GptShape.nbytes says {shape.nbytes}")  # fmt: skip
    return model


Prepare = Callable[[], None]
Save = Callable[[dict[str, Any], str], None]
Load = Callable[[dict[str, Any], str], dict[str, Any]]


def run_save(model: tuple[GptShape, int], url: str, prepare: Prepare, save: Save) -> dict[str, Any]:
    """``save(model.sharded_state_dict(), url)`` on every rank; the ranks' figures."""
    shape, seed = model

    def setup(rank: int, world: int) -> tuple[Step, Step]:
        prepare()
        sharded = build(shape, seed).sharded_state_dict()
        return lambda: save(sharded, url), lambda: None

    return run_ranks(shape.tp, setup)


def run_load(model: tuple[GptShape, int], url: str, prepare: Prepare, load: Load) -> dict[str, Any]:
    """``load`` into a zeroed model on every rank, then every tensor checked (untimed)."""
    shape, seed = model

    def setup(rank: int, world: int) -> tuple[Step, Step]:
        prepare()
        gpt = build(shape, seed)
        want = {k: v.clone() for k, v in gpt.state_dict().items() if torch.is_tensor(v)}
        with torch.no_grad():
            for p in gpt.parameters():
                p.zero_()
        sharded = gpt.sharded_state_dict()
        loaded: dict[str, Any] = {}

        def check() -> None:
            gpt.load_state_dict(loaded)
            got = gpt.state_dict()
            for name, value in want.items():
                if not torch.equal(got[name], value):
                    raise AssertionError(f"rank {rank}: loaded {name} differs from the saved one")

        return lambda: loaded.update(load(sharded, url)), check

    return run_ranks(shape.tp, setup)


def cpu_friendly_megatron() -> None:
    """megatron-core's own writer synchronizes CUDA; on CPU those calls become no-ops."""
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
