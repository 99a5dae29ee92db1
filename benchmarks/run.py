"""Benchmark cloudckpt against a raw-transfer ceiling and its peers, in one run.

    .venv/bin/python -m benchmarks.run            # full: 1 GiB in 100 tensors + 10k tensors
                                                  # + a Megatron GPTModel checkpoint + ...
    .venv/bin/python -m benchmarks.run --quick    # the same shape, smaller
    .venv/bin/python -m benchmarks.run --variants megatron   # the Megatron scenario alone
    .venv/bin/python -m benchmarks.run --variants safetensors   # the safetensors scenario
    .venv/bin/python -m benchmarks.run --variants gpt-adamw,scaling   # mixed state, sweep
    .venv/bin/python -m benchmarks.run --variants tiers,cli-startup   # the studies alone

Run from the repository root (``make bench`` does). Starts ``rclone serve s3`` with its
data on tmpfs (``server.py``), then for every repetition runs every system of the
variant once (in a rotated order, so the systems interleave; the Megatron scenario has
systems of its own, ``systems.SCENARIOS``), each in a fresh worker process
(``python -m benchmarks.worker``) that saves the state and loads it back. Writes
``benchmarks/results/latest.json`` (one record per variant, system and figure, with the
machine description), ``docs/benchmarks.md``, ``docs/benchmarks.png`` and
``docs/benchmarks-scaling.png``, and prints the tables.

After the variants, with the server stopped, it runs the studies the page renders
(``STUDIES``: the CLI start-up, the tiered checkpoints), each in a subprocess that starts
what it needs and writes its results file under ``benchmarks/studies/results/``; a study
that fails is recorded in ``latest.json`` and shown as failed on the page. With only
studies selected, the page is rendered again from the existing ``--out`` file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import report, server
from benchmarks.many_ranks import STUDY_RESULTS
from benchmarks.systems import SYSTEMS, family, systems_for
from benchmarks.systems.gpt_adamw import FULL as GA_FULL
from benchmarks.systems.gpt_adamw import QUICK as GA_QUICK
from benchmarks.systems.megatron_gpt import FULL as GPT_FULL
from benchmarks.systems.megatron_gpt import QUICK as GPT_QUICK
from benchmarks.systems.st_model import FULL as ST_FULL
from benchmarks.systems.st_model import QUICK as ST_QUICK

ROOT = Path(__file__).resolve().parents[1]

MiB = 1024 * 1024
BUCKET = "bench"

MEGATRON = "megatron"
SAFETENSORS = "safetensors"
GPT_ADAMW = "gpt-adamw"
SCALING = "scaling"
#: The scenarios' models (full, quick): their shapes set the variant's bytes and tensors.
#: gpt-adamw's is built by the worker (``worker.LAYOUTS``) for the usual systems.
MODELS: dict[str, tuple[Any, Any]] = {
    MEGATRON: (GPT_FULL, GPT_QUICK),
    SAFETENSORS: (ST_FULL, ST_QUICK),
    GPT_ADAMW: (GA_FULL, GA_QUICK),
}
#: The scaling sweep (issue 15), full and quick: tensor counts at fixed MiB, then MiB at
#: a fixed count, as (MiB, counts, count, MiBs); one point shared by both is run once.
SWEEPS = {
    False: (256, (100, 1_000, 10_000, 100_000), 100, (128, 512, 1024, 4096)),
    True: (64, (100, 1_000, 10_000), 100, (32, 128)),
}


def _scenario(name: str, quick: bool, reps: int) -> tuple[str, int, int, int]:
    """A scenario as a variant: its model's size in MiB (rounded) and tensors."""
    shape = MODELS[name][quick]
    return (name, round(shape.nbytes / MiB), shape.tensors, reps)


def _scaling(quick: bool, reps: int) -> list[tuple[str, int, int, int]]:
    """The scaling sweep's points as variants, ``scaling-n{tensors}-{MiB}mib``."""
    mib, counts, count, sizes = SWEEPS[quick]
    points = [(n, mib) for n in counts]
    points += [(count, m) for m in sizes if (count, m) not in points]
    return [(f"{SCALING}-n{n}-{m}mib", m, n, reps) for n, m in points]


#: (name, MiB, tensors, repetitions) for each state variant; "megatron" is the Megatron
#: scenario (a GPTModel checkpoint, its own systems: benchmarks/systems/megatron_gpt.py),
#: "safetensors" the safetensors one (a bf16 model: benchmarks/systems/st_model.py),
#: "gpt-adamw" a GPT-like model with its AdamW state (benchmarks/systems/gpt_adamw.py),
#: "scaling-..." the points of the scaling sweep (one repetition each).
FULL = [
    ("default", 1024, 100, 5),
    ("many-small", 160, 10_000, 3),
    _scenario(MEGATRON, False, 3),
    _scenario(SAFETENSORS, False, 3),
    _scenario(GPT_ADAMW, False, 3),
    *_scaling(False, 1),
]
QUICK = [
    ("default", 128, 100, 3),
    ("many-small", 20, 10_000, 1),
    _scenario(MEGATRON, True, 1),
    _scenario(SAFETENSORS, True, 1),
    _scenario(GPT_ADAMW, True, 1),
    *_scaling(True, 1),
]
#: The studies run after the variants, each as ``python -m MODULE --out RESULTS [ARGS]``:
#: name -> (module, results file under ``benchmarks/studies/results/``, full arguments,
#: quick arguments). ``report.write_page`` renders their sections from those files.
STUDIES: dict[str, tuple[str, str, tuple[str, ...], tuple[str, ...]]] = {
    "cli-startup": ("benchmarks.cli_startup", "cli_startup.json", (), ()),
    "tiers": ("benchmarks.studies.tiers", "tiers.json", (), ("--mib", "128", "--reps", "3")),
}
#: Seconds a study may run (the full tiers study takes 2-3 minutes on 2 cores).
STUDY_TIMEOUT = 1800.0
#: How the worker builds each family's state (``worker.LAYOUTS``); others: "matrices".
LAYOUT = {GPT_ADAMW: "gpt-adamw", SCALING: "even"}


def _clean_env() -> dict[str, str]:
    """This process's environment without user AWS/MSC/cloudckpt settings or proxies,
    keeping the benchmark's own ``CLOUDCKPT_BENCH_*`` switches (the profiling one)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if (k.startswith("CLOUDCKPT_BENCH_") or not k.startswith(("AWS_", "MSC_", "CLOUDCKPT_")))
        and k not in ("HTTP_PROXY", "HTTPS_PROXY")
    }
    env.update(
        AWS_EC2_METADATA_DISABLED="true", NO_PROXY="127.0.0.1,localhost", PYTHONWARNINGS="ignore"
    )
    return env


def _worker_env(srv: server.S3Server) -> dict[str, str]:
    """The worker's environment: the clean one (``_clean_env``) and the server's."""
    env = _clean_env()
    # AWS_ENDPOINT_URL_S3: for peers that read the service-specific one
    env.update(srv.env(), AWS_ENDPOINT_URL_S3=srv.endpoint_url)
    return env


def run_study(
    name: str, quick: bool, results: Path = STUDY_RESULTS, timeout: float = STUDY_TIMEOUT
) -> dict[str, Any]:
    """Run the study ``name`` of ``STUDIES`` in a subprocess, its results file under
    ``results``: its name, command line and seconds, and ``error`` (the last line it
    printed, or the timeout) when it failed, so the page can say so."""
    module, results_name, full, quick_args = STUDIES[name]
    argv = [sys.executable, "-m", module, "--out", str(results / results_name)]
    argv += quick_args if quick else full
    shown = " ".join(["python", *argv[1:]])
    outcome: dict[str, Any] = {"name": name, "command": shown}
    started = time.perf_counter()
    try:
        proc = subprocess.run(argv, env=_clean_env(), cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        outcome["error"] = f"timed out after {timeout:.0f} s"
    else:
        if proc.returncode != 0:
            said = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
            last = said[-1][:300] if said else "no output"
            outcome["error"] = f"exited with {proc.returncode}: {last}"
    outcome["seconds"] = round(time.perf_counter() - started, 1)
    return outcome


def run_studies(names: list[str], quick: bool) -> list[dict[str, Any]]:
    """Run each study of ``names`` in turn (``run_study``), printing how each went."""
    outcomes = []
    for name in names:
        print(f"# study {name}", flush=True)
        outcome = run_study(name, quick)
        state = f"FAILED ({outcome['error']})" if "error" in outcome else "done"
        print(f"  {name}: {state} in {outcome['seconds']:.0f}s", flush=True)
        outcomes.append(outcome)
    return outcomes


def run_worker(
    srv: server.S3Server,
    system: str,
    variant: tuple[str, int, int, int],
    rep: int,
    timeout: float,
    model: Any = None,
) -> dict[str, Any]:
    """One system, one repetition, in a fresh process; its objects are removed afterwards.
    ``model``: a scenario's model shape (its exact bytes replace the variant's MiB)."""
    name, mib, tensors, _reps = variant
    prefix = f"{name}-r{rep}-{system}"
    spec = {
        "system": system,
        "variant": name,
        "rep": rep,
        "bytes": mib * MiB if model is None else model.nbytes,
        "tensors": tensors,
        "seed": rep,
        "log": str(srv.log_path),
        "server": srv.name,
        "model": None if model is None else dataclasses.asdict(model),
        "layout": LAYOUT.get(family(name), "matrices"),
        "ctx": {
            "endpoint": srv.endpoint_url,
            "access_key": srv.access_key_id,
            "secret_key": srv.secret_access_key,
            "region": srv.region,
            "bucket": BUCKET,
            "prefix": prefix,
        },
    }
    with tempfile.TemporaryDirectory(prefix="cloudckpt-bench-w-") as tmp:
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "result.json")
        spec_path.write_text(json.dumps(spec))
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.worker", str(spec_path), str(out_path)],
                env=_worker_env(srv), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
            )  # fmt: skip
            if out_path.exists():
                result = json.loads(out_path.read_text())
            else:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
                err = f"worker exited with {proc.returncode}: {tail[0][:300]}"
                result = {"save": {"error": err}, "load": {"error": err}}
        except subprocess.TimeoutExpired:
            err = f"timed out after {timeout:.0f}s"
            result = {"save": {"error": err}, "load": {"error": err}}
    assert srv.data_dir is not None  # rclone: a bucket is a directory
    shutil.rmtree(srv.data_dir / BUCKET / prefix, ignore_errors=True)
    result.update(system=system, variant=name, rep=rep)
    return result


def _line(r: dict[str, Any]) -> str:
    parts = []
    for op in ("save", "load"):
        fig = r.get(op)
        if not fig:
            continue
        if "error" in fig:
            parts.append(f"{op} FAILED ({fig['error'][:80]})")
        else:
            gbps = r.get("bytes", 0) / fig["seconds"] / 1e9
            parts.append(f"{op} {fig['seconds']:6.2f}s {gbps:5.2f} GB/s cpu {fig['cpu_s']:5.2f}s")
    return f"  {r['variant']:10s} rep{r['rep']} {r['system']:18s} " + "  ".join(parts)


def _selected(name: str, wanted: list[str]) -> bool:
    """Whether ``--variants`` names the variant or its family (``scaling``)."""
    return name in wanted or family(name) in wanted


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller states, fewer reps (~9 min)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    p.add_argument("--variants",
                   default="default,many-small,megatron,safetensors,gpt-adamw,scaling,"
                           "cli-startup,tiers",
                   help="comma-separated subset (megatron, safetensors: scenarios; scaling: "
                        "every point of the sweep, or one by its name; cli-startup, tiers: "
                        "the studies, run after the rest)")  # fmt: skip
    p.add_argument("--reps", type=int, default=None, help="override repetitions")
    p.add_argument("--state-mib", type=int, default=None, help="override the default state size")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per worker")
    p.add_argument("--tmpfs", default="/dev/shm")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "latest.json"))
    p.add_argument("--docs", default=str(ROOT / "docs" / "benchmarks.md"),
                   help="Markdown page to write ('' to skip)")  # fmt: skip
    p.add_argument("--note", default="", help="a line for the page (e.g. 'machine shared')")
    p.add_argument("--render", metavar="JSON",
                   help="only rebuild the page (and its targets) from a results file")  # fmt: skip
    args = p.parse_args()
    if args.render:  # the targets are checked again: their definitions may have changed
        doc = report.retarget(json.loads(Path(args.render).read_text()))
        Path(args.render).write_text(json.dumps(doc, indent=1) + "\n")
        print(report.markdown_tables(doc))
        print("\n".join(report.scaling_section(doc)))
        if args.docs:
            report.write_page(doc, Path(args.docs))
        return 0

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        p.error(f"unknown systems {unknown}; known: {list(SYSTEMS)}")
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
    studies = [name for name in STUDIES if name in wanted]
    variants = []
    for name, mib, tensors, reps in QUICK if args.quick else FULL:
        if not _selected(name, wanted) or not systems_for(name, systems):
            continue
        if name == "default" and args.state_mib:
            mib = args.state_mib
        variants.append((name, mib, tensors, args.reps or reps))

    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the server is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not variants:  # the studies alone: their sections on the page of the last run
        outcomes = run_studies(studies, args.quick)
        if args.docs and Path(args.out).is_file():
            doc = json.loads(Path(args.out).read_text())
            report.write_page({**doc, "studies": outcomes}, Path(args.docs))
            print(f"# wrote {args.docs} (from {args.out})")
        return 1 if any("error" in o for o in outcomes) else 0
    models = {name: shapes[args.quick] for name, shapes in MODELS.items()}
    started = time.time()
    srv = server.start(args.tmpfs)
    results: list[dict[str, Any]] = []
    try:
        srv.make_bucket(BUCKET)
        print(f"# {srv.version}, data in {srv.workdir}, endpoint {srv.endpoint_url}", flush=True)
        for variant in variants:
            name, mib, tensors, reps = variant
            model = models.get(name)
            shown = f"{model.describe()}, " if model else ""
            kind = "" if model else " fp32"
            print(f"# {name}: {shown}{mib} MiB in {tensors}{kind} tensors, {reps} reps", flush=True)
            on = systems_for(name, systems)
            for rep in range(reps):
                order = on[rep % len(on) :] + on[: rep % len(on)]
                for system in order:
                    r = run_worker(srv, system, variant, rep, args.timeout, model)
                    results.append(r)
                    print(_line(r), flush=True)
    finally:
        server.stop(srv)
    outcomes = run_studies(studies, args.quick)
    doc = report.build(results, variants, systems, srv.version, args.quick, args.note,
                       time.time() - started,
                       {n: m.describe() for n, m in models.items()})  # fmt: skip
    doc["studies"] = outcomes
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print()
    print(report.markdown_tables(doc))
    print("\n".join(report.scaling_section(doc)))
    if args.docs:
        report.write_page(doc, Path(args.docs))
        print(f"# wrote {out} and {args.docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
