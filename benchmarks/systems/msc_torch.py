"""multi-storage-client's ``msc.torch.save`` / ``msc.torch.load`` on an ``msc://`` URL.

The profile (an S3 provider on the server's endpoint with static credentials) is
written to a JSON file that ``MSC_CONFIG`` points at, set by :func:`configure` before
multistorageclient is imported.
"""

from __future__ import annotations

import atexit
import json
import os
import tempfile

import torch

from .common import Ctx

PROFILE = "bench"


def configure(ctx: Ctx) -> None:
    config = {
        "profiles": {
            PROFILE: {
                "storage_provider": {
                    "type": "s3",
                    "options": {
                        "base_path": ctx.bucket,
                        "endpoint_url": ctx.endpoint,
                        "region_name": ctx.region,
                    },
                },
                "credentials_provider": {
                    "type": "S3Credentials",
                    "options": {"access_key": ctx.access_key, "secret_key": ctx.secret_key},
                },
            }
        }
    }
    fd, path = tempfile.mkstemp(prefix="cloudckpt-bench-msc-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(config, f)
    atexit.register(os.unlink, path)
    os.environ["MSC_CONFIG"] = path


def warm(state: dict[str, torch.Tensor], ctx: Ctx) -> None:
    """Untimed: import multistorageclient and create the profile's client."""
    import multistorageclient as msc

    msc.resolve_storage_client(f"msc://{PROFILE}/{ctx.prefix}/ckpt.pt")


def save(state: dict[str, torch.Tensor], ctx: Ctx) -> None:
    import multistorageclient as msc

    msc.torch.save(state, f"msc://{PROFILE}/{ctx.prefix}/ckpt.pt")


def load(ctx: Ctx, template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    import multistorageclient as msc

    return msc.torch.load(f"msc://{PROFILE}/{ctx.prefix}/ckpt.pt", weights_only=True)
