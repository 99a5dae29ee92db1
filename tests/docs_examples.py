"""Run the examples of docs/integrations.md as written, each section's in its own process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cloudckpt.testing import unique_bucket_name


def docs_examples(heading: str) -> list[str]:
    """The Python blocks of one section of docs/integrations.md, as written."""
    doc = (Path(__file__).parents[1] / "docs" / "integrations.md").read_text()
    section = doc.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return [block.split("```", 1)[0] for block in section.split("```python\n")[1:]]


def run_example(server, code: str, tmp_path: Path, name: str) -> str:
    """Run a docs example in its own process on ``server`` (its bucket ``ckpt`` renamed)."""
    bucket = server.make_bucket(unique_bucket_name(name))
    script = tmp_path / f"{name}.py"
    script.write_text(code.replace("s3://ckpt/", f"s3://{bucket}/"))
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
