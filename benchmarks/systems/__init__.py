"""One module per benchmarked system; each exposes ``save(state, ctx)`` and ``load(ctx, template)``.

``ctx`` is a :class:`benchmarks.systems.common.Ctx`: the server's endpoint and credentials,
the bucket, and a key prefix unique to this repetition. ``save`` writes ``state`` (a dict of
CPU tensors) under that prefix; ``load`` reads it back and returns a dict of tensors.
A module may set ``LOAD = False`` (it has no load of its own) and may return a dict of extra
figures from ``save`` (async stall, ...). A module with ``own_state(spec)`` builds what its
``save`` and ``load`` take itself and says how many bytes that is (the Megatron systems:
the model's shape, built in each rank). A module with ``setup(state, ctx)`` only reads:
``setup`` writes what it reads, untimed, instead of a save; one with ``verify(ctx, state)``
is checked by it after the load's clock.
"""

from __future__ import annotations

#: Benchmark name -> module under ``benchmarks.systems``; the order is the table's order.
SYSTEMS: dict[str, str] = {
    "ceiling": "ceiling",
    "ceiling-curl": "ceiling_curl",
    "ceiling-2to3": "ceiling_ranks",
    "cloudckpt": "cloudckpt_sync",
    "cloudckpt-async": "cloudckpt_async",
    "cloudckpt-torch-unpickler": "cloudckpt_torch_unpickler",
    "cloudckpt-dcp": "cloudckpt_dcp",
    "cloudckpt-dcp-2to3": "cloudckpt_dcp_reshard",
    "boto3-nemo": "boto3_nemo",
    "lightning-s3fs": "lightning_s3fs",
    "s3torchconnector": "s3torchconnector_ckpt",
    "msc": "msc_torch",
    "dcp-fsspec": "dcp_fsspec",
    "ceiling-2to2": "ceiling_megatron",
    "megatron-cloudckpt": "megatron_cloudckpt",
    "megatron-msc": "megatron_msc",
    "ceiling-st": "ceiling",
    "st-cloudckpt": "st_cloudckpt",
    "st-runai": "st_runai",
    "st-boto3": "st_boto3",
    "st-export": "st_export",
}

#: Variants that run systems of their own; every other variant runs the systems not listed.
SCENARIOS: dict[str, tuple[str, ...]] = {
    "megatron": ("ceiling-2to2", "megatron-cloudckpt", "megatron-msc"),
    "safetensors": ("ceiling-st", "st-cloudckpt", "st-runai", "st-boto3", "st-export"),
}


#: Variants (or families of them: ``scaling`` for every ``scaling-...`` point) that run
#: only these of the other variants' systems.
SUBSETS: dict[str, tuple[str, ...]] = {
    "gpt-adamw": ("ceiling", "ceiling-curl", "cloudckpt", "cloudckpt-dcp", "boto3-nemo"),
    "scaling": ("ceiling", "cloudckpt", "cloudckpt-dcp"),
}


def family(variant: str) -> str:
    """The family a variant belongs to: ``scaling`` for the scaling sweep's points."""
    return "scaling" if variant.startswith("scaling-") else variant


def systems_for(variant: str, selected: list[str]) -> list[str]:
    """The ``selected`` systems that run on ``variant``, in ``selected``'s order."""
    own = SCENARIOS.get(variant)
    if own is not None:
        return [s for s in selected if s in own]
    taken = {s for names in SCENARIOS.values() for s in names}
    subset = SUBSETS.get(family(variant))
    return [s for s in selected if s not in taken and (subset is None or s in subset)]
