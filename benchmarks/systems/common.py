"""What every system module gets: where to write, and small shared helpers."""

from __future__ import annotations

import resource
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Ctx:
    """One repetition's target: ``s3://{bucket}/{prefix}`` on the benchmark server."""

    endpoint: str
    access_key: str
    secret_key: str
    region: str
    bucket: str
    prefix: str
    part_size: int = 64 * 1024 * 1024
    concurrency: int = 10

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def storage_options(self) -> dict[str, Any]:
        """cloudckpt's ``storage_options`` for the server."""
        return {
            "endpoint_url": self.endpoint,
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
            "region_name": self.region,
        }


def empty_like(state: Any) -> Any:
    """Destination tensors of the same shapes (what a model already holds before a load),
    through nested dicts, lists and tuples (an optimizer's state); other values as they are."""
    if isinstance(state, torch.Tensor):
        return torch.empty_like(state)
    if isinstance(state, dict):
        return {k: empty_like(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(empty_like(v) for v in state)
    return state


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` figure in KiB (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where it is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cpu_seconds() -> float:
    """User + system CPU of this process and of its children that have been waited for."""
    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime
