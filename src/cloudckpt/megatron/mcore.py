"""The megatron-core names cloudckpt.megatron builds on, imported once, version-checked.

Every import of megatron-core lives here, so a release that moves a helper breaks in
one place with one clear message. Tested with megatron-core 0.15 and 0.16
(docs/megatron.md). The load path reuses megatron's own ``TorchDistLoadShardedStrategy``
(its key mapping, shape checks and, on 0.15, the N-D flattened tensor reformulation);
it reads through cloudckpt because :func:`install_reader_hook` teaches megatron's one
reader factory to answer a :class:`RemoteDir` with a ``CloudStorageReader``.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

__all__ = ["MIN_VERSION", "RemoteDir", "install_reader_hook", "require"]

MIN_VERSION = (0, 15)

_lock = threading.Lock()
_names: SimpleNamespace | None = None


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def require() -> SimpleNamespace:
    """The megatron-core helpers, or ImportError naming the package and version needed."""
    global _names
    if _names is not None:
        return _names
    with _lock:
        if _names is None:
            _names = _import()
    return _names


def _import() -> SimpleNamespace:
    wanted = ".".join(map(str, MIN_VERSION))
    try:
        from megatron.core import package_info
        from megatron.core.dist_checkpointing import dict_utils, mapping, validation
        from megatron.core.dist_checkpointing import state_dict_utils as sdu
        from megatron.core.dist_checkpointing import utils as mutils
        from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
    except ImportError as exc:
        raise ImportError(
            f"cloudckpt.megatron needs megatron-core >= {wanted} "
            f"(pip install 'megatron-core>={wanted}'): {exc}"
        ) from exc
    version = str(package_info.__version__)
    if _version_tuple(version) < MIN_VERSION:
        raise ImportError(
            f"cloudckpt.megatron needs megatron-core >= {wanted}; megatron-core {version} "
            "is installed"
        )
    return SimpleNamespace(
        version=version,
        ShardedTensor=mapping.ShardedTensor,
        ShardedObject=mapping.ShardedObject,
        apply_factory_merges=mapping.apply_factory_merges,
        nested_values=dict_utils.nested_values,
        merge=dict_utils.merge,
        save_preprocess=sdu.save_preprocess,
        load_preprocess=sdu.load_preprocess,
        extract_sharded_base=mutils.extract_sharded_base,
        force_all_tensors_to_non_fp8=getattr(mutils, "force_all_tensors_to_non_fp8", None),
        StrictHandling=validation.StrictHandling,
        parse_strict_flag=validation.parse_strict_flag,
        determine_global_metadata=validation.determine_global_metadata,
        validate_integrity_and_strict_load=validation.validate_integrity_and_strict_load,
        torch_strategy=torch_strategy,
        MCoreSavePlanner=torch_strategy.MCoreSavePlanner,
        TorchDistLoadShardedStrategy=torch_strategy.TorchDistLoadShardedStrategy,
        replace_keys_with_sharded_keys=torch_strategy._replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict=torch_strategy.mcore_to_pyt_state_dict,
    )


class RemoteDir(str):
    """A checkpoint URL handed to megatron's load strategy, carrying the reader to use.

    A ``str`` so megatron's messages print the URL; megatron's reader factory, hooked
    by :func:`install_reader_hook`, returns :attr:`reader` for it.
    """

    reader: Any

    def __new__(cls, url: str, reader: Any) -> RemoteDir:
        self = super().__new__(cls, url)
        self.reader = reader
        return self


def install_reader_hook() -> None:
    """Make megatron's ``_get_filesystem_reader`` answer a :class:`RemoteDir` (idempotent).

    Any other argument goes to megatron's own factory unchanged, so megatron's own
    loads of local or ``msc://`` checkpoints in the same process are not affected.
    """
    strategy = require().torch_strategy
    with _lock:
        original = getattr(strategy, "_get_filesystem_reader", None)
        if original is None:
            raise ImportError(
                "this megatron-core release has no strategies.torch._get_filesystem_reader; "
                f"cloudckpt.megatron is tested with megatron-core {'.'.join(map(str, MIN_VERSION))}"
                " to 0.16"
            )
        if getattr(original, "_cloudckpt_hook", False):
            return

        def _get_filesystem_reader(checkpoint_dir: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(checkpoint_dir, RemoteDir):
                return checkpoint_dir.reader
            return original(checkpoint_dir, *args, **kwargs)

        _get_filesystem_reader._cloudckpt_hook = True  # type: ignore[attr-defined]
        strategy._get_filesystem_reader = _get_filesystem_reader
