"""Shared by the safetensors tests: states of every dtype, bitwise comparison, and
moving bytes to and from a test target without cloudckpt (the server's own client)."""

from __future__ import annotations

import torch

from cloudckpt.format.safetensors import DTYPES
from cloudckpt.store import open_target
from safetensors import torch as st_torch
from servers import StoreTarget

#: Every torch dtype cloudckpt maps to a safetensors dtype (in this torch).
OURS = [d.torch for d in DTYPES if d.torch is not None]
#: The dtypes ``safetensors.torch`` reads back (its table is private; F8_E8M0 and F4
#: it writes but cannot read in 0.8).
LIBRARY_READS = {t for t in st_torch._TYPES.values() if t is not None}


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random bits of ``dtype`` (NaNs and all: comparisons are bitwise)."""
    n = 1
    for d in shape:
        n *= d
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def every_dtype_state(dtypes=OURS, seed: int = 0) -> dict[str, torch.Tensor]:
    """For each dtype: a scalar, an empty tensor, a small matrix, a 70 KiB vector."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        packed = dtype == getattr(torch, "float4_e2m1fn_x2", None)
        shapes = {"empty": (0,), "matrix": (3, 5), "vector": (70_001,)}
        if not packed:  # float4 x2 holds two values per element: no scalar
            shapes["scalar"] = ()
        for label, shape in shapes.items():
            state[f"{name}.{label}"] = random_tensor(dtype, shape, g)
    return state


def library_reads(data: bytes, path) -> dict[str, torch.Tensor]:
    """What ``safetensors.safe_open`` (the library's reader) gives for ``data``: every
    tensor of a dtype it reads back, the rest checked for being listed."""
    from safetensors import safe_open

    path.write_bytes(data)
    out = {}
    with safe_open(path, framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - not a dict
            if f.get_slice(name).get_dtype() in _LIBRARY_READS_NAMES:
                out[name] = f.get_tensor(name)
    return out


_LIBRARY_READS_NAMES = {k for k, t in st_torch._TYPES.items() if t is not None}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_same(got: dict, want: dict) -> None:
    assert list(got) == sorted(want), "names differ (or are not sorted)"
    for name, t in want.items():
        g = got[name]
        assert g.dtype == t.dtype and g.shape == t.shape, name
        assert torch.equal(bits(g), bits(t)), f"{name}: different bytes"


def upload(target: StoreTarget, rel: str, data: bytes) -> None:
    """Put ``data`` at ``rel`` under the target with the server's own client."""
    if target.name == "memory":  # no other client: the store itself
        where = open_target(f"{target.base_url}/{rel}")
        where.store.put(where.key, data)
        return
    assert target.server is not None and target.bucket is not None
    target.server.client().put_object(Bucket=target.bucket, Key=rel, Body=data)


def download(target: StoreTarget, rel: str) -> bytes:
    if target.name == "memory":
        where = open_target(f"{target.base_url}/{rel}")
        return where.store.get(where.key)
    return target.read_object(f"{target.base_url}/{rel}")


def listing(target: StoreTarget, prefix: str = "") -> list[str]:
    where = open_target(f"{target.base_url}/x", storage_options=target.storage_options)
    return [o.key for o in where.store.list(prefix)]
