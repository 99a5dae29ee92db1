"""Applies tests/compat/torch_dcp_patch.py at interpreter start (torch_dcp_suite.py puts
this folder on PYTHONPATH), so that ranks spawned by torch's MultiProcessTestCase, which
re-import the test module, see cloudckpt's classes too. A failure stops the process
instead of letting the tests run unpatched."""

import os

if os.environ.get("CLOUDCKPT_TORCH_DCP_MODE"):
    try:
        import torch_dcp_patch

        torch_dcp_patch.install_from_env()
    except BaseException:
        import sys
        import traceback

        traceback.print_exc()
        print("torch_dcp_site: could not apply the cloudckpt patch", file=sys.stderr)
        os._exit(70)
