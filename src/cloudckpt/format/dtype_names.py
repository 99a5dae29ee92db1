"""torch's dtypes by name, from a table made once at import.

A dtype name read from a file (a layout index, a description, a header) is looked up
here, never passed to ``getattr(torch, name)``: torch's module ``__getattr__`` imports
submodules (``_dynamo``, ``_inductor``, ``onnx``) for names it does not hold, which
runs their import-time code and changes globals (``torch.manual_seed`` among them).
"""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "dtype_named"]

#: Every dtype torch defines, by its attribute name (``float32``, ``bfloat16``...).
DTYPES: dict[str, torch.dtype] = {
    name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)
}


def dtype_named(name: object) -> torch.dtype | None:
    """The dtype ``name`` (``"float32"`` or ``"torch.float32"``) names; None for
    anything else, a non-string included."""
    if type(name) is not str:
        return None
    return DTYPES.get(name.removeprefix("torch."))
