"""Run the Python examples of the docs as written, each in its own process.

:func:`docs_examples` gives one section's blocks of docs/integrations.md,
:func:`page_examples` every block of a page (docs/manager.md, docs/tiers.md, the
README); :func:`run_example` runs one against a test server, its bucket renamed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from cloudckpt.testing import unique_bucket_name

ROOT = Path(__file__).parents[1]


def _blocks(text: str) -> list[str]:
    return [block.split("```", 1)[0] for block in text.split("```python\n")[1:]]


def docs_examples(heading: str) -> list[str]:
    """The Python blocks of one section of docs/integrations.md, as written."""
    doc = (ROOT / "docs" / "integrations.md").read_text()
    section = doc.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return _blocks(section)


def page_examples(page: str) -> list[str]:
    """Every Python block of ``page`` (a path from the repository root), in order."""
    return _blocks((ROOT / page).read_text())


def run_example(
    server,
    code: str,
    tmp_path: Path,
    name: str,
    *,
    bucket: str | None = None,
    placeholder: str = "ckpt",
    paths: Mapping[str, str] | None = None,
) -> str:
    """Run a docs example in its own process on ``server`` and return its bucket.

    The example's bucket ``placeholder`` becomes ``bucket`` (a new one unless given, so
    a second run can resume the first's), and each prefix in ``paths`` (a local
    directory the page names, ``/local_nvme/``) becomes its value.
    """
    if bucket is None:
        bucket = server.make_bucket(unique_bucket_name(name))
    script = tmp_path / f"{name}.py"
    code = code.replace(f"s3://{placeholder}/", f"s3://{bucket}/")
    for old, new in (paths or {}).items():
        code = code.replace(old, new)
    script.write_text(code)
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **server.env()},
        cwd=tmp_path,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-6000:]
    return bucket
