"""Run PyTorch's own DCP tests against cloudckpt's StorageWriter/StorageReader.

Not collected by pytest (no ``test_`` prefix) and not part of ``make test``: torch's test
files are PyTorch's code, read from the directory given, never copied here::

    .venv/bin/python tests/compat/torch_dcp_suite.py --torch-tests /tmp/torch-dcp-tests/test

Each selected module runs once per mode under pytest (``--modes``, default
``torch,cloudckpt``): ``torch`` is the baseline with torch's own ``FileSystemWriter`` and
``FileSystemReader``; ``cloudckpt`` replaces both with the adapters of
``torch_dcp_patch.py``; ``writer`` / ``reader`` replace one of them (a checkpoint written
by one and read by the other). The report compares every test with the baseline: passes
with both, fails only with cloudckpt's classes (the ones to explain), fails with both
(most often: the test needs an accelerator), skipped (and why).

By default tests gated only by ``skip_if_lt_x_gpu`` run on CPU with gloo, as torch's
``allow_cpu=True`` does (most of the DTensor, resharding and e2e tests are gated so, yet
need no GPU); ``--keep-gpu-skips`` keeps torch's skips.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
SITE_DIR = HERE / "torch_dcp_site"

#: Under torch's ``test/`` directory.
DEFAULT_MODULES = (
    "distributed/checkpoint/test_compatibility.py",
    "distributed/checkpoint/test_file_system_checkpoint.py",
    "distributed/checkpoint/test_file_system_checkpoint_cpu.py",
    "distributed/checkpoint/e2e/test_e2e_save_and_load.py",
    "distributed/checkpoint/test_dtensor_resharding.py",
    "distributed/checkpoint/test_format_utils.py",
    "distributed/checkpoint/test_save_load_api.py",
)
MODES = ("torch", "cloudckpt", "writer", "reader")
_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Failed|Timeout)\b.*")
_WRAPPER = re.compile(r"Process \d+ exited with error code")


@dataclass(frozen=True)
class Outcome:
    status: str  # passed, failed, skipped
    reason: str


def _test_dir(root: Path) -> Path:
    """torch's ``test/`` directory: ``root`` itself or ``root/test``."""
    for candidate in (root, root / "test"):
        if (candidate / "distributed" / "checkpoint").is_dir():
            return candidate
    sys.exit(f"{root}: no distributed/checkpoint/ in it or in {root / 'test'}")


def _reason(text: str) -> str:
    """The line of a failure or skip text that says why: the last exception line, a rank's
    own rather than MultiProcessTestCase's "Process N exited with error code" around it."""
    lines = [re.sub(r"^E\s+", "", line).strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    found = [line for line in lines if _EXC_LINE.match(line) and not _WRAPPER.search(line)]
    line = (found or lines or [""])[-1]
    return line if len(line) <= 200 else line[:197] + "..."


def _parse_junit(path: Path, modules: dict[str, str]) -> dict[str, dict[str, Outcome]]:
    """{module: {test id: outcome}} from pytest's junit XML."""
    results: dict[str, dict[str, Outcome]] = collections.defaultdict(dict)
    if not path.exists():
        return results
    for case in ET.parse(path).iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        dotted = classname or name  # a collection error has the module as its name
        module = next(
            (m for d, m in modules.items() if dotted == d or dotted.startswith(d + ".")),
            dotted,
        )
        test_id = f"{classname[len(_dotted(module)) + 1 :]}::{name}" if classname else name
        status, reason = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                status = "failed"
                reason = _reason(f"{child.get('message', '')}\n{child.text or ''}")
                break
            if child.tag == "skipped":
                status, reason = "skipped", _reason(child.get("message", "") or "")
        if module in modules.values():
            results[module][test_id] = Outcome(status, reason)
    return results


def _dotted(module: str) -> str:
    return module.removesuffix(".py").replace("/", ".")


def _run_mode(mode: str, test_dir: Path, files: list[str], args: argparse.Namespace) -> Path:
    out = Path(args.out)
    junit, log = out / f"{mode}.xml", out / f"{mode}.adapters.log"
    for stale in (junit, log):
        stale.unlink(missing_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(SITE_DIR), str(HERE), *filter(None, [env.get("PYTHONPATH")])]
    )
    env["CLOUDCKPT_TORCH_DCP_MODE"] = mode
    env["CLOUDCKPT_TORCH_DCP_UNGATE_GPU"] = "0" if args.keep_gpu_skips else "1"
    env["CLOUDCKPT_TORCH_DCP_WEIGHTS_ONLY"] = "1" if args.reader_weights_only else "0"
    env["CLOUDCKPT_TORCH_DCP_LOG"] = str(log)
    pytest_args = [
        *files,
        "-p",
        "torch_dcp_patch",
        "-p",
        "no:cacheprovider",
        "-c",
        os.devnull,  # none of cloudckpt's pytest settings, and none of torch's
        "--rootdir",
        str(test_dir),
        "--continue-on-collection-errors",
        f"--junitxml={junit}",
        f"--timeout={args.timeout}",
        "-q",
        "--disable-warnings",
        *args.pytest_args,
    ]
    print(f"== mode {mode}: pytest {' '.join(pytest_args)}", flush=True)
    start = time.monotonic()
    subprocess.run([sys.executable, __file__, "--run-pytest", *pytest_args], cwd=test_dir, env=env)
    print(f"== mode {mode}: {time.monotonic() - start:.0f} s", flush=True)
    return junit


def _adapter_counts(log: Path) -> str:
    if not log.exists():
        return "no adapter used"
    events = [line.split(" ", 1) for line in log.read_text().splitlines() if line]
    kinds = collections.Counter(e[1].split(" ", 1)[0] for e in events if len(e) == 2)
    pids = len({e[0] for e in events})
    return ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) + f" in {pids} processes"


def _names(tests: list[str]) -> str:
    return ", ".join(t.rsplit("/", 1)[-1] for t in tests)


def _report(results: dict[str, dict[str, dict[str, Outcome]]], modes: list[str], out: Path) -> int:
    """Markdown report; returns the number of tests failing only with cloudckpt's classes."""
    base = results.get("torch", {})
    lines = ["| module | " + " | ".join(f"{m} pass/fail/skip" for m in modes) + " |"]
    lines.append("|---" * (len(modes) + 1) + "|")
    modules = sorted({mod for r in results.values() for mod in r})
    for mod in modules:
        cells = []
        for m in modes:
            count = collections.Counter(o.status for o in results.get(m, {}).get(mod, {}).values())
            cells.append(f"{count['passed']}/{count['failed']}/{count['skipped']}")
        lines.append(f"| {mod} | " + " | ".join(cells) + " |")

    only: list[str] = []
    both: dict[str, list[str]] = collections.defaultdict(list)
    skipped: dict[str, list[str]] = collections.defaultdict(list)
    for mod in modules:
        for test, o in sorted(base.get(mod, {}).items()):
            if o.status == "failed":
                both[o.reason].append(f"{mod}::{test}")
            elif o.status == "skipped":
                skipped[o.reason].append(f"{mod}::{test}")
        for m in modes:
            if m == "torch":
                continue
            for test, o in sorted(results.get(m, {}).get(mod, {}).items()):
                b = base.get(mod, {}).get(test)
                if o.status == "failed" and (b is None or b.status != "failed"):
                    only.append(f"- [{m}] {mod}::{test}: {o.reason}")
                elif b is not None and b.status == "failed" and o.status == "passed":
                    only.append(f"- [{m}] {mod}::{test}: passes, but fails with torch's classes")
    lines += ["", f"## Fails only with cloudckpt's classes ({len(only)})", *only]
    lines += ["", "## Fails with torch's classes too (not cloudckpt's doing)"]
    for reason, tests in sorted(both.items()):
        lines.append(f"- {len(tests)} x `{reason}`: {_names(tests)}")
    lines += ["", "## Skipped with torch's classes"]
    for reason, tests in sorted(skipped.items()):
        lines.append(f"- {len(tests)} x {reason}: {_names(tests)}")
    lines += ["", "## Adapter use (checks the patch reached every process)"]
    lines += [f"- {m}: {_adapter_counts(out / f'{m}.adapters.log')}" for m in modes]
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    print(text)
    return len(only)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--run-pytest"]:  # the child: pytest in a process of its own per mode
        import pytest

        return int(pytest.main(argv[1:]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch-tests", required=True, type=Path, help="pytorch's test/ dir")
    parser.add_argument("--modules", nargs="+", default=list(DEFAULT_MODULES))
    parser.add_argument("--modes", default="torch,cloudckpt", help=f"comma list of {MODES}")
    parser.add_argument("--keep-gpu-skips", action="store_true")
    parser.add_argument(
        "--reader-weights-only",
        default="true",
        choices=("true", "false"),
        help="CloudStorageReader(weights_only=...) in the adapter (cloudckpt's default: true)",
    )
    parser.add_argument("--timeout", type=int, default=900, help="seconds per test")
    parser.add_argument("--out", default="/tmp/torch-dcp-suite", help="junit XML and report")
    parser.add_argument(
        "--reuse", action="store_true", help="report a mode's junit XML in --out, if any"
    )
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest (-k ...)")
    args = parser.parse_args(argv)
    args.reader_weights_only = args.reader_weights_only == "true"
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes: comma list of {MODES}")
    if "torch" not in modes:
        modes.insert(0, "torch")  # the baseline every other mode is compared with
    for dep in ("expecttest", "pytest_timeout"):  # torch.testing._internal's, and --timeout
        if importlib.util.find_spec(dep) is None:
            sys.exit(f"{dep} is not installed (pip install {dep.replace('_', '-')})")
    test_dir = _test_dir(args.torch_tests.resolve())
    files = [m for m in args.modules if (test_dir / m).is_file()]
    for missing in sorted(set(args.modules) - set(files)):
        print(f"not found, skipped: {test_dir / missing}")
    if not files:
        sys.exit("no test module found")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    modules = {_dotted(m): m for m in files}
    results = {}
    for mode in modes:
        junit = Path(args.out) / f"{mode}.xml"
        if not (args.reuse and junit.exists()):
            junit = _run_mode(mode, test_dir, files, args)
        results[mode] = _parse_junit(junit, modules)
    only = _report(results, modes, Path(args.out))
    broken = [m for m in modes if not results[m]]
    if broken:
        print(f"no results from mode(s) {broken}: see pytest's output above", file=sys.stderr)
        return 2
    return 1 if only else 0


if __name__ == "__main__":
    sys.exit(main())
