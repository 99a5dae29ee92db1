"""Turn the workers' raw results into figures (medians), a JSON document, a Markdown page
and a PNG chart, and check cloudckpt's targets."""

from __future__ import annotations

import datetime
import os
import platform
import re
import statistics
from collections import Counter
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks.cli_startup import cli_startup_section
from benchmarks.many_ranks import many_ranks_section
from benchmarks.studies.tiers import tiers_section
from benchmarks.systems import family, systems_for
from cloudckpt.format import checksum

GiB = 1024**3
MiB = 1024**2
PEERS = ("boto3-nemo", "lightning-s3fs", "s3torchconnector", "msc", "dcp-fsspec")
PACKAGES = ("torch", "botocore", "boto3", "s3fs", "aiobotocore", "lightning",
            "s3torchconnector", "multi-storage-client", "megatron-core", "safetensors",
            "runai-model-streamer", "runai-model-streamer-s3", "isal")  # fmt: skip
#: Targets on the default state (issue 8).
SAVE_RATIO, LOAD_RATIO, STALL_RATIO = 0.85, 0.85, 2.0
#: Issue 4: DCP saves and (resharded) loads at this share of the ceiling.
DCP_RATIO = 0.8
RSS_ALLOWANCE = 10 * 64 * MiB + 64 * MiB  # write_concurrency x part_size + 64 MiB
#: The Megatron scenario: cloudckpt.megatron against megatron-core's own writer and
#: reader with multi-storage-client, and against the raw transfer of the same 2 ranks.
MEGATRON_PEER_RATIO, MEGATRON_CEILING_RATIO = 1.5, 0.8
#: The ceiling each scenario's ``x ceiling`` is taken against.
CEILINGS = {"megatron": "ceiling-2to2", "safetensors": "ceiling-st"}
#: The raw-transfer ceilings of the other variants (default, many-small): their
#: ``x ceiling`` is against the best of these, save and load apart (issue 15). A results
#: file without ``ceiling-curl`` (older runs, or curl missing) falls back to ``ceiling``.
BYTE_CEILINGS = ("ceiling", "ceiling-curl")
#: The safetensors scenario (issue 17): load at this share of the ceiling GET and ahead of
#: every peer; an export (DCP -> safetensors) within this many times the ceiling's GET +
#: PUT of the same bytes, its peak extra RSS under this many output shards.
ST_LOAD_RATIO, EXPORT_TIME_RATIO, EXPORT_RSS_SHARDS = 0.85, 1.3, 2.0
ST_PEERS = ("st-runai", "st-boto3")
#: Issue 15: on the gpt-adamw state (model + AdamW state, ~1,000 tensors), cloudckpt's
#: save and load, single object and DCP, at this share of the best ceiling.
MIXED_RATIO = 0.85
#: Issue 15's scaling sweep: the per-tensor cost at the largest tensor count within this
#: many times the one at the next count down (100,000 vs 10,000 in a full run).
PER_TENSOR_GROWTH = 1.5
SCALING_SYSTEMS = ("ceiling", "cloudckpt", "cloudckpt-dcp")
#: Issue 15's targets on the 10,000-tensor state (many-small): (what, system, figure,
#: goal, higher is better).
MANY_SMALL_TARGETS = (
    ("single-object load vs best ceiling GET", "cloudckpt", "load_vs_ceiling", 0.5, True),
    ("single-object load vs torch.load(weights_only=True) from memory (x faster)",
     "cloudckpt", "load_vs_torch_load_memory", 3.0, True),
    ("single-object save vs best ceiling PUT", "cloudckpt", "save_vs_ceiling", 0.85, True),
    ("async stall vs warm memcpy", "cloudckpt-async", "async_stall_vs_memcpy", 2.0, False),
    ("DCP save vs best ceiling PUT", "cloudckpt-dcp", "save_vs_ceiling", 0.4, True),
    ("DCP load vs best ceiling GET", "cloudckpt-dcp", "load_vs_ceiling", 0.25, True),
)  # fmt: skip
FINDINGS = Path(__file__).with_name("findings")  # dated studies, newest first by name
#: The studies ``run.py`` runs after the variants (its ``STUDIES``), in the page's order,
#: each with the renderer of its section (from its results file).
STUDY_SECTIONS = (("cli-startup", cli_startup_section), ("tiers", tiers_section))


def studies_sections(doc: dict[str, Any], results: Path | None = None) -> list[str]:
    """The studies' sections (``STUDY_SECTIONS``), each from its results file under
    ``results`` (default ``benchmarks/studies/results/``); a study that failed in this
    run (``doc["studies"]``) says so under its heading, with its error line, above the
    figures of its last good run if there are any."""
    failed = {o.get("name"): o for o in doc.get("studies", []) if isinstance(o, dict)
              and o.get("error")}  # fmt: skip
    lines: list[str] = []
    for name, render in STUDY_SECTIONS:
        heading, *body = render() if results is None else render(results)
        if name in failed:
            o = failed[name]
            note = (f"**Failed in this run** (`{o.get('command', name)}`): `{o['error']}`. "
                    "Any figures below are from an earlier run.")  # fmt: skip
            body = ["", note, *body]
        lines += [heading, *body]
    return lines


def demote_headings(text: str, levels: int = 2) -> list[str]:
    """``text``'s lines with every Markdown heading outside fenced code ``levels`` deeper,
    so a study's title and sections nest under the page's "Findings"."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            line = "#" * levels + line
        out.append(line)
    return out


def findings_section() -> list[str]:
    """The newest dated study in full, the older ones as links."""
    studies = sorted(FINDINGS.glob("20*.md"), reverse=True)
    if not studies:
        return []
    newest, *older = studies
    lines = ["", "## Findings", "", *demote_headings(newest.read_text().rstrip()), ""]
    if older:
        lines += ["Earlier studies (benchmarks/findings/):", ""]
        for path in older:
            title = path.read_text().partition("\n")[0].lstrip("# ")
            lines.append(f"- [{title}](../benchmarks/findings/{path.name})")
        lines.append("")
    return lines


def machine() -> dict[str, Any]:
    """What ran the benchmark."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            names = (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
            cpu = next(names, cpu)
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            mem_gib = int(f.readline().split()[1]) / 1024**2
    except OSError:
        mem_gib = 0.0
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "memory_GiB": round(mem_gib, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "packages": versions,
        "crc32": checksum.IMPLEMENTATION,  # what cloudckpt checksums with (isal or zlib)
    }


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def best_ceiling(variant: str, by_system: dict[str, dict[str, Any]], op: str) -> str:
    """The system ``variant``'s ``x ceiling`` of ``op`` is against: the scenario's own
    ceiling, else the fastest of ``BYTE_CEILINGS`` measured (``ceiling`` if none was)."""
    if variant in CEILINGS:
        return CEILINGS[variant]
    rates = {s: by_system.get(s, {}).get(f"{op}_GBps") for s in BYTE_CEILINGS}
    measured = {s: r for s, r in rates.items() if r}
    return max(measured, key=lambda s: measured[s]) if measured else BYTE_CEILINGS[0]


def _figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median figures of one system on one variant over its repetitions."""
    out: dict[str, Any] = {"reps": len(runs)}
    for op in ("save", "load"):
        ok = [r for r in runs if r.get(op) and "error" not in r[op] and r.get("bytes")]
        errors = [r[op]["error"] for r in runs if r.get(op) and "error" in r[op]]
        if errors and not ok:
            out[f"{op}_error"] = errors[0]
        if not ok:
            continue
        gib = ok[0]["bytes"] / GiB
        out["bytes"] = ok[0]["bytes"]
        out[f"{op}_GBps"] = _median([r["bytes"] / r[op]["seconds"] / 1e9 for r in ok])
        out[f"{op}_seconds"] = _median([r[op]["seconds"] for r in ok])
        out[f"{op}_cpu_s_per_GiB"] = _median([r[op]["cpu_s"] / gib for r in ok])
        out[f"{op}_peak_extra_rss_MiB"] = _median([r[op]["peak_extra_rss"] / MiB for r in ok])
        out[f"{op}_requests"] = _median([r[op]["requests"] for r in ok])
        for name in ok[0][op].get("variants", {}):  # ceiling-curl's ways, each timed apart
            out[f"{op}_{name}_GBps"] = _median(
                [r["bytes"] / r[op]["variants"][name]["seconds"] / 1e9 for r in ok]
            )
        if op == "save" and "stall_s" in ok[0]["save"]:
            out["async_stall_s"] = _median([r["save"]["stall_s"] for r in ok])
            out["async_total_s"] = out["save_seconds"]
            memcpy = _median([r["warm"]["memcpy_s"] for r in ok if "warm" in r])
            if memcpy:
                out["warm_memcpy_s"] = memcpy
                out["async_stall_vs_memcpy"] = out["async_stall_s"] / memcpy
        reference = [r["warm"]["torch_load_memory_s"] for r in ok if _torch_load_ran(r)]
        if op == "load" and reference:
            out["torch_load_memory_s"] = _median(reference)
            out["load_vs_torch_load_memory"] = out["torch_load_memory_s"] / out["load_seconds"]
    return out


def _torch_load_ran(run: dict[str, Any]) -> bool:
    return isinstance(run.get("warm"), dict) and "torch_load_memory_s" in run["warm"]


UNITS = {
    "GBps": "GB/s (1e9 B/s)", "seconds": "s", "cpu_s_per_GiB": "CPU s/GiB",
    "peak_extra_rss_MiB": "MiB", "requests": "requests", "vs_ceiling": "x ceiling",
    "vs_ceiling_2to3": "x ceiling-2to3", "vs_megatron_msc": "x megatron-msc",
    "vs_get_put": "x ceiling GET + PUT time", "bytes": "B",
    "stall_s": "s", "total_s": "s", "memcpy_s": "s", "vs_memcpy": "x warm memcpy",
    "torch_load_memory_s": "s", "vs_torch_load_memory": "x torch.load from memory",
    "error": "error", "reps": "count",
}  # fmt: skip


def _unit(figure: str) -> str:
    return next((u for k, u in UNITS.items() if figure.endswith(k)), "")


def build(
    results: list[dict[str, Any]],
    variants: list[tuple[str, int, int, int]],
    systems: list[str],
    server_version: str,
    quick: bool,
    note: str,
    elapsed: float,
    models: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The JSON document: machine, configuration, one record per figure, raw runs.
    ``models`` describes the model behind a variant (the Megatron scenario's)."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    ceilings: dict[str, dict[str, str]] = {}
    for name, *_ in variants:
        table[name] = {}
        for system in systems_for(name, systems):
            runs = [r for r in results if r["variant"] == name and r["system"] == system]
            table[name][system] = _figures(runs)
        ceilings[name] = {op: best_ceiling(name, table[name], op) for op in ("save", "load")}
        ceiling = {op: table[name].get(c, {}) for op, c in ceilings[name].items()}
        layout = table[name].get("ceiling-2to3", {})
        peer = table[name].get("megatron-msc", {})
        for system, figs in table[name].items():
            against = {"vs_ceiling": ceiling}
            if system.endswith("-2to3"):  # also against the ceiling of the same process layout
                against["vs_ceiling_2to3"] = {"save": layout, "load": layout}
            if system == "megatron-cloudckpt":
                against["vs_megatron_msc"] = {"save": peer, "load": peer}
            if system == "st-export" and figs.get("load_seconds") and figs.get("bytes"):
                c_save = ceiling["save"].get("save_GBps")
                c_load = ceiling["load"].get("load_GBps")
                if c_save and c_load:  # the export's time over the ceiling's GET + PUT
                    get_put = figs["bytes"] / 1e9 * (1 / c_save + 1 / c_load)
                    figs["export_vs_get_put"] = figs["load_seconds"] / get_put
            for op in ("save", "load"):
                for label, others in against.items():
                    other = others[op]
                    if figs.get(f"{op}_GBps") and other.get(f"{op}_GBps"):
                        figs[f"{op}_{label}"] = figs[f"{op}_GBps"] / other[f"{op}_GBps"]
    records = [
        {"variant": v, "system": s, "figure": f, "value": val, "unit": _unit(f)}
        for v, by_system in table.items()
        for s, figs in by_system.items()
        for f, val in figs.items()
    ]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": "quick" if quick else "full",
        "note": note,
        "elapsed_s": round(elapsed, 1),
        "machine": machine(),
        "server": f"{server_version} serve s3, data on tmpfs, 127.0.0.1",
        "variants": [
            {"name": n, "MiB": m, "tensors": t, "reps": r, **_model(models, n)}
            for n, m, t, r in variants
        ],
        "targets": targets(table),
        "ceilings": ceilings,
        "records": records,
        "runs": results,
    }


def retarget(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with its targets checked again from its records (after the checks changed)."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for r in doc["records"]:
        table.setdefault(r["variant"], {}).setdefault(r["system"], {})[r["figure"]] = r["value"]
    return {**doc, "targets": targets(table)}


def _model(models: dict[str, str] | None, variant: str) -> dict[str, str]:
    return {"model": models[variant]} if models and variant in models else {}


def targets(table: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Issue 8's targets for cloudckpt on the default state, and the Megatron scenario's:
    met, missed, or not measured. "best ceiling": the faster of ``BYTE_CEILINGS``."""
    figs = table.get("default", {})
    cc, aa = figs.get("cloudckpt", {}), figs.get("cloudckpt-async", {})
    out: list[dict[str, Any]] = []

    def check(name: str, value: float | None, goal: float, higher: bool, unit: str) -> None:
        met = None if value is None else (value >= goal if higher else value <= goal)
        out.append({"target": name, "value": value, "goal": goal,
                    "direction": ">=" if higher else "<=", "unit": unit, "met": met})  # fmt: skip

    check("save vs best ceiling PUT", cc.get("save_vs_ceiling"), SAVE_RATIO, True, "x")
    check("load vs best ceiling GET", cc.get("load_vs_ceiling"), LOAD_RATIO, True, "x")
    check("async stall vs warm memcpy", aa.get("async_stall_vs_memcpy"), STALL_RATIO, False, "x")
    check("sync save peak extra RSS", cc.get("save_peak_extra_rss_MiB"), RSS_ALLOWANCE / MiB,
          False, "MiB")  # fmt: skip
    # Issue 4: DCP save and resharded load at 0.8 of the ceiling of the same job.
    dd, rr = figs.get("cloudckpt-dcp", {}), figs.get("cloudckpt-dcp-2to3", {})
    check("DCP save vs best ceiling PUT", dd.get("save_vs_ceiling"), DCP_RATIO, True, "x")
    check("DCP load vs best ceiling GET", dd.get("load_vs_ceiling"), DCP_RATIO, True, "x")
    # Against the store's one-process ceiling (the target), then against the raw
    # transfer run by the same process layout (2 uploading, 3 downloading processes
    # sharing the cores with the server): above the one-process ceiling for the save,
    # below it for the load on a machine with fewer cores than processes.
    check("DCP 2-rank save vs best ceiling PUT", rr.get("save_vs_ceiling"), DCP_RATIO, True, "x")
    check("DCP 2->3 resharded load vs best ceiling GET", rr.get("load_vs_ceiling"), DCP_RATIO,
          True, "x")  # fmt: skip
    check("DCP 2-rank save vs ceiling-2to3 PUT (same layout)", rr.get("save_vs_ceiling_2to3"),
          DCP_RATIO, True, "x")  # fmt: skip
    check("DCP 2->3 resharded load vs ceiling-2to3 GET (same layout)",
          rr.get("load_vs_ceiling_2to3"), DCP_RATIO, True, "x")  # fmt: skip
    for fig, higher, label in (
        ("save_GBps", True, "save throughput"),
        ("load_GBps", True, "load throughput"),
        ("save_cpu_s_per_GiB", False, "save CPU s/GiB"),
        ("load_cpu_s_per_GiB", False, "load CPU s/GiB"),
    ):
        measured = {p: figs[p][fig] for p in PEERS if figs.get(p, {}).get(fig) is not None}
        if not measured:
            continue
        best = max(measured.values()) if higher else min(measured.values())
        best_peer = next(p for p, v in measured.items() if v == best)
        check(f"{label} ahead of every peer (best: {best_peer})", cc.get(fig), best, higher,
              _unit(fig))  # fmt: skip
    mm = table.get("megatron", {}).get("megatron-cloudckpt", {})
    for op in ("save", "load"):
        check(f"Megatron {op}: cloudckpt vs megatron-core + MSC", mm.get(f"{op}_vs_megatron_msc"),
              MEGATRON_PEER_RATIO, True, "x")  # fmt: skip
    for op, verb in (("save", "PUT"), ("load", "GET")):
        check(f"Megatron {op} vs ceiling-2to2 {verb} (same 2 ranks)", mm.get(f"{op}_vs_ceiling"),
              MEGATRON_CEILING_RATIO, True, "x")  # fmt: skip
    st = table.get("safetensors", {})
    sc, sx = st.get("st-cloudckpt", {}), st.get("st-export", {})
    check("safetensors load vs ceiling-st GET", sc.get("load_vs_ceiling"), ST_LOAD_RATIO, True,
          "x")  # fmt: skip
    peers = {p: st[p]["load_GBps"] for p in ST_PEERS if st.get(p, {}).get("load_GBps")}
    if peers:
        best = max(peers, key=lambda p: peers[p])
        check(f"safetensors load ahead of every peer (best: {best})", sc.get("load_GBps"),
              peers[best], True, _unit("load_GBps"))  # fmt: skip
    check("export time vs ceiling GET + PUT of the same bytes", sx.get("export_vs_get_put"),
          EXPORT_TIME_RATIO, False, "x")  # fmt: skip
    if sx.get("bytes"):  # one output file under the default 5GB shards: the whole model
        check("export peak extra RSS (MiB) vs 2x the largest output shard",
              sx.get("load_peak_extra_rss_MiB"), EXPORT_RSS_SHARDS * sx["bytes"] / MiB, False,
              "MiB")  # fmt: skip
    ms = table.get("many-small", {})
    for name, system, figure, goal, higher in MANY_SMALL_TARGETS:
        check(f"many-small {name}", ms.get(system, {}).get(figure), goal, higher, "x")
    ga = table.get("gpt-adamw", {})
    for system, label in (("cloudckpt", "single object"), ("cloudckpt-dcp", "DCP")):
        for op, verb in (("save", "PUT"), ("load", "GET")):
            check(f"gpt-adamw {label} {op} vs best ceiling {verb}",
                  ga.get(system, {}).get(f"{op}_vs_ceiling"), MIXED_RATIO, True, "x")  # fmt: skip
    fits = scaling_fits(table)
    for system in ("cloudckpt", "cloudckpt-dcp"):
        for op in ("save", "load"):
            fit = fits.get((system, op), {})
            last, prev = fit.get("growth_counts", (100_000, 10_000))
            check(f"scaling: {system} {op} per-tensor cost at {last:,} vs {prev:,} tensors",
                  fit.get("growth"), PER_TENSOR_GROWTH, False, "x")  # fmt: skip
    return out


_POINT = re.compile(r"scaling-n(\d+)-(\d+)mib$")


def scaling_points(table: dict[str, dict[str, dict[str, Any]]]) -> list[tuple[int, int, str]]:
    """The scaling sweep's points in ``table``: ``(tensors, MiB, variant)``, sorted."""
    found = ((_POINT.match(name), name) for name in table if family(name) == "scaling")
    return sorted((int(m[1]), int(m[2]), name) for m, name in found if m)


def _sweeps(
    points: list[tuple[int, int, str]],
) -> tuple[list[tuple[int, str]], list[tuple[int, str]], int, int]:
    """The count sweep (at its fixed MiB) and the bytes sweep (at its fixed count) of the
    points: ``(tensors, variant)`` and ``(MiB, variant)``, and the fixed MiB and count."""
    mib = Counter(m for _, m, _ in points).most_common(1)[0][0] if points else 0
    count = Counter(n for n, _, _ in points).most_common(1)[0][0] if points else 0
    by_count = [(n, name) for n, m, name in points if m == mib]
    by_bytes = [(m, name) for n, m, name in points if n == count]
    return by_count, by_bytes, mib, count


def _slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ``ys`` over ``xs``; None under two distinct ``xs``."""
    if len(set(xs)) < 2:
        return None
    return statistics.linear_regression(xs, ys).slope


def scaling_fits(
    table: dict[str, dict[str, dict[str, Any]]],
) -> dict[tuple[str, str], dict[str, Any]]:
    """Per system and operation of the scaling sweep: the per-tensor cost (us/tensor, the
    least-squares slope of seconds over tensor count at fixed bytes, wall and CPU), the
    per-GiB cost (s/GiB, the slope over GiB at the fixed count), each larger count's
    marginal cost per tensor over the smallest count's point, and ``growth``: the largest
    count's marginal cost over the next count's (issue 15: within 1.5x)."""
    by_count, by_bytes, _mib, _count = _sweeps(scaling_points(table))
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for system in SCALING_SYSTEMS:
        for op in ("save", "load"):
            fit: dict[str, Any] = {}

            def series(sweep: list[tuple[int, str]], op: str = op, system: str = system) -> (
                    list[tuple[int, float, float, float]]):  # fmt: skip
                rows = []
                for x, name in sweep:
                    figs = table[name].get(system, {})
                    if figs.get(f"{op}_seconds") and figs.get("bytes"):
                        gib = figs["bytes"] / GiB
                        rows.append((x, gib, figs[f"{op}_seconds"],
                                     figs[f"{op}_cpu_s_per_GiB"] * gib))  # fmt: skip
                return rows

            counts, sizes = series(by_count), series(by_bytes)
            wall = _slope([g for _, g, _, _ in sizes], [t for _, _, t, _ in sizes])
            cpu = _slope([g for _, g, _, _ in sizes], [c for _, _, _, c in sizes])
            if wall is not None and cpu is not None:
                fit.update(s_per_GiB=wall, cpu_s_per_GiB=cpu)
            wall = _slope([n for n, _, _, _ in counts], [t for _, _, t, _ in counts])
            cpu = _slope([n for n, _, _, _ in counts], [c for _, _, _, c in counts])
            if wall is not None and cpu is not None:
                fit.update(us_per_tensor=wall * 1e6, cpu_us_per_tensor=cpu * 1e6)
            if len(counts) >= 2:
                n0, _, t0, _ = counts[0]
                marginal = {n: (t - t0) / (n - n0) * 1e6 for n, _, t, _ in counts[1:]}
                fit["marginal_us"] = marginal
                if len(marginal) >= 2:
                    last, prev = sorted(marginal)[-1], sorted(marginal)[-2]
                    fit["growth_counts"] = (last, prev)
                    if marginal[prev] > 0:
                        fit["growth"] = marginal[last] / marginal[prev]
            if fit:
                out[(system, op)] = fit
    return out


def _ratio(target: dict[str, Any]) -> str:
    if target["value"] is None or not target["goal"]:
        return "-"
    return f"{target['value'] / target['goal']:.2f}"


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _cell_rate(figs: dict[str, Any], op: str, mibps: bool = False) -> str:
    """GB/s (or MiB/s) of one operation, with its ratio to the variant's ceiling."""
    if f"{op}_error" in figs:
        return "**fails**"
    if f"{op}_GBps" not in figs:
        return "-"
    ratio = figs.get(f"{op}_vs_ceiling")
    rate = figs[f"{op}_GBps"]
    text = f"{rate * 1e9 / MiB:.0f}" if mibps else f"{rate:.3f}"
    return text + (f" ({ratio:.2f}x)" if ratio is not None else "")


def _state_table(v: dict[str, Any], by_system: dict[str, dict[str, Any]]) -> list[str]:
    what = f"{v['model']}; {v['MiB']} MiB in {v['tensors']:,} tensors" if v.get("model") else (
        f"{v['MiB']} MiB in {v['tensors']:,} fp32 tensors")  # fmt: skip
    lines = [
        f"### {v['name']}: {what}, median of {v['reps']} rep(s)",
        "",
        "| system | save GB/s (x ceiling) | load GB/s (x ceiling) | save CPU s/GiB "
        "| load CPU s/GiB | save peak extra RSS MiB | load peak extra RSS MiB "
        "| requests save / load | async stall s (x memcpy) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for system, figs in by_system.items():
        stall = "-"
        if "async_stall_s" in figs:
            ratio = figs.get("async_stall_vs_memcpy")
            stall = f"{figs['async_stall_s']:.3f}" + (f" ({ratio:.1f}x)" if ratio else "")
        lines.append(
            f"| {system} | {_cell_rate(figs, 'save')} | {_cell_rate(figs, 'load')} "
            f"| {_fmt(figs.get('save_cpu_s_per_GiB'))} "
            f"| {_fmt(figs.get('load_cpu_s_per_GiB'))} "
            f"| {_fmt(figs.get('save_peak_extra_rss_MiB'), 0)} "
            f"| {_fmt(figs.get('load_peak_extra_rss_MiB'), 0)} | {_requests(figs)} | {stall} |"
        )
    return lines + _ceiling_notes(v["name"], by_system)


#: ceiling-curl's ways of each operation (its module's ``variants``), as the page names them.
CURL_WAYS = {"save": {"put": "1 PUT", "multipart": "multipart"},
             "load": {"get": "1 GET", "ranged": "ranged GETs"}}  # fmt: skip


def _ceiling_notes(variant: str, by_system: dict[str, dict[str, Any]]) -> list[str]:
    """Which ceiling ``x ceiling`` is against, save and load apart, and ceiling-curl's ways."""
    best = {op: best_ceiling(variant, by_system, op) for op in ("save", "load")}
    rates = [f"{op} {best[op]} ({_fmt(by_system.get(best[op], {}).get(f'{op}_GBps'), 3)} GB/s)"
             for op in ("save", "load")]  # fmt: skip
    lines = ["", f"x ceiling: against the run's best raw-transfer ceiling: {', '.join(rates)}."]
    curl = by_system.get("ceiling-curl", {})
    ways = [f"{label} {_fmt(curl[f'{op}_{name}_GBps'], 3)}"
            for op, names in CURL_WAYS.items() for name, label in names.items()
            if f"{op}_{name}_GBps" in curl]  # fmt: skip
    if ways:
        lines.append(f"ceiling-curl's ways, each timed apart (GB/s; its row: the faster of "
                     f"each operation): {', '.join(ways)}.")  # fmt: skip
    return lines


def _requests(figs: dict[str, Any]) -> str:
    return f"{_fmt(figs.get('save_requests'), 0)} / {_fmt(figs.get('load_requests'), 0)}"


def _megatron_table(v: dict[str, Any], by_system: dict[str, dict[str, Any]]) -> list[str]:
    ceiling = CEILINGS[v["name"]]
    lines = [
        f"### {v['name']}: {v.get('model', 'a Megatron model')}; {v['MiB']} MiB in "
        f"{v['tensors']:,} tensors, median of {v['reps']} rep(s)",
        "",
        f"| system | save s | save MiB/s (x {ceiling}) | load s | load MiB/s (x {ceiling}) "
        "| save / load CPU s/GiB | save / load peak extra RSS MiB | requests save / load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for system, figs in by_system.items():
        cpu = f"{_fmt(figs.get('save_cpu_s_per_GiB'))} / {_fmt(figs.get('load_cpu_s_per_GiB'))}"
        rss = (f"{_fmt(figs.get('save_peak_extra_rss_MiB'), 0)} / "
               f"{_fmt(figs.get('load_peak_extra_rss_MiB'), 0)}")  # fmt: skip
        ops = " | ".join(f"{_fmt(figs.get(f'{op}_seconds'))} | {_cell_rate(figs, op, mibps=True)}"
                         for op in ("save", "load"))  # fmt: skip
        lines.append(f"| {system} | {ops} | {cpu} | {rss} | {_requests(figs)} |")
    ours = by_system.get("megatron-cloudckpt", {})
    ratios = [f"{op} {ours[f'{op}_vs_megatron_msc']:.2f}x" for op in ("save", "load")
              if f"{op}_vs_megatron_msc" in ours]  # fmt: skip
    if ratios:
        lines += ["", f"megatron-cloudckpt / megatron-msc (throughput): {', '.join(ratios)}."]
    return lines


def _safetensors_table(v: dict[str, Any], by_system: dict[str, dict[str, Any]]) -> list[str]:
    lines = _megatron_table(v, by_system)
    lines[0] = (f"### {v['name']}: {v.get('model', 'a model')}; {v['MiB']} MiB in "
                f"{v['tensors']:,} tensors, median of {v['reps']} rep(s)")  # fmt: skip
    ex = by_system.get("st-export", {})
    if "export_vs_get_put" in ex:
        lines += ["", f"st-export: the export (its load column) took "
                  f"{ex['export_vs_get_put']:.2f}x the ceiling's GET + PUT time of the same "
                  "bytes; its save column is the DCP save it exports from. st-runai reads "
                  "only (its file is written untimed)."]  # fmt: skip
    return lines


def markdown_tables(doc: dict[str, Any]) -> str:
    """One table per state variant, plus the failures and the targets."""
    lines: list[str] = []
    by = _by_variant(doc)
    for v in doc["variants"]:
        if family(v["name"]) == "scaling":  # the Scaling section's (scaling_section)
            continue
        by_system = by.get(v["name"], {})
        table = _megatron_table if v["name"] in CEILINGS else _state_table
        if v["name"] == "safetensors":
            table = _safetensors_table
        lines += table(v, by_system)
        failures = [
            f"- {system} {op}: `{figs[f'{op}_error']}`"
            for system, figs in by_system.items()
            for op in ("save", "load")
            if f"{op}_error" in figs
        ]
        lines.append("")
        if failures:
            lines += ["Failures:", "", *failures, ""]
    lines += ["### Targets (cloudckpt: default state, scenarios, gpt-adamw, scaling)", "",
              "| target | measured | goal | measured / goal | met |",
              "|---|---:|---:|---:|---|"]  # fmt: skip
    for t in doc["targets"]:
        met = {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
        lines.append(
            f"| {t['target']} | {_fmt(t['value'], 3)} {t['unit']} "
            f"| {t['direction']} {_fmt(t['goal'], 3)} | {_ratio(t)} | {met} |"
        )
    return "\n".join(lines) + "\n"


def chart(doc: dict[str, Any], path: Path) -> bool:
    """Save and load throughput per system on the default state; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figs: dict[str, dict[str, Any]] = {}
    for rec in doc["records"]:
        if rec["variant"] == "default":
            figs.setdefault(rec["system"], {})[rec["figure"]] = rec["value"]
    if not figs:
        return False
    names = list(figs)
    save = [figs[n].get("save_GBps") or 0.0 for n in names]
    load = [figs[n].get("load_GBps") or 0.0 for n in names]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], save, 0.4, label="save")
    ax.bar([x + 0.2 for x in xs], load, 0.4, label="load")
    for x, n in zip(xs, names, strict=True):
        for dx, op in ((-0.2, "save"), (0.2, "load")):
            if f"{op}_error" in figs[n]:
                ax.text(x + dx, 0.005, "fails", rotation=90, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), names, rotation=25, ha="right")
    ax.set_ylabel("GB/s (median)")
    v = next(v for v in doc["variants"] if v["name"] == "default")
    ax.set_title(f"{v['MiB']} MiB in {v['tensors']} tensors, rclone serve s3 on tmpfs "
                 f"({doc['date'][:10]}, {doc['mode']} run)")  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _by_variant(doc: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """``doc``'s records as variant -> system -> figure -> value."""
    by: dict[str, dict[str, dict[str, Any]]] = {}
    for rec in doc["records"]:
        figs = by.setdefault(rec["variant"], {}).setdefault(rec["system"], {})
        figs[rec["figure"]] = rec["value"]
    return by


def _point_cell(figs: dict[str, Any], op: str) -> str:
    if f"{op}_error" in figs:
        return "**fails**"
    if f"{op}_seconds" not in figs:
        return "-"
    return f"{figs[f'{op}_seconds']:.2f} ({figs[f'{op}_cpu_s_per_GiB']:.2f})"


def scaling_section(doc: dict[str, Any], chart_name: str | None = None) -> list[str]:
    """The page's "Scaling" section: how it is measured, the chart, the fitted per-tensor
    and per-GiB costs with the super-linear check, and the points' figures."""
    table = _by_variant(doc)
    points = scaling_points(table)
    lines = ["## Scaling", ""]
    if not points:
        return [*lines, "This run has no scaling points (`make bench` runs them; alone: "
                "`python -m benchmarks.run --variants scaling`).", ""]  # fmt: skip
    by_count, by_bytes, mib, count = _sweeps(points)
    reps = {v["name"]: v["reps"] for v in doc["variants"]}
    shown = sorted({reps.get(name, 1) for *_, name in points})
    per_point = ("one repetition per point" if shown == [1] else
                 f"{' or '.join(map(str, shown))} repetitions per point (median)")  # fmt: skip
    lines += [
        f"The same states at growing size: equal fp32 matrices (`worker.build_even_state`), "
        f"{mib} MiB in {by_count[0][0]:,} to {by_count[-1][0]:,} tensors, then {count:,} "
        f"tensors of {by_bytes[0][0]:,} to {by_bytes[-1][0]:,} MiB, saved and loaded by "
        "the ceiling, cloudckpt (`cloudckpt.save` / `load`) and cloudckpt-dcp (`dcp.save` / "
        "`load` through cloudckpt's writer and reader), each point and system in a fresh "
        f"worker as above, {per_point}. The ceiling moves pre-built bytes, so its time "
        "does not depend on the tensor count: its per-tensor figures below are the noise "
        "of this shared machine.",
        "",
    ]
    if chart_name:
        lines += [f"![seconds and CPU s/GiB against tensor count and bytes]({chart_name})", ""]
    fits = scaling_fits(table)
    marg = sorted({n for f in fits.values() for n in f.get("marginal_us", {})})
    lines += [
        "### Per-tensor and per-GiB cost",
        "",
        f"**us/tensor**: least-squares slope of seconds (wall or CPU) over tensor count at "
        f"{mib} MiB; **s/GiB**: slope over GiB at {count:,} tensors. **marginal**: a "
        f"count's extra seconds over the {by_count[0][0]:,}-tensor point, per extra "
        f"tensor (us); **growth**: the largest count's marginal cost over the next one's "
        f"(target: within {PER_TENSOR_GROWTH}x, no super-linear step).",
        "",
        "| system | op | us/tensor | CPU us/tensor | s/GiB | CPU s/GiB | marginal us/tensor at "
        + " / ".join(f"{n:,}" for n in marg)
        + " | growth |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    flags = []
    for (system, op), fit in fits.items():
        m = fit.get("marginal_us", {})
        growth = fit.get("growth")
        cell = "-" if growth is None else f"{growth:.2f}x"
        if growth is not None and growth > PER_TENSOR_GROWTH and system != "ceiling":
            cell = f"**{cell}**"
            last, prev = fit["growth_counts"]
            flags.append(f"- **super-linear**: {system} {op} costs {m[last]:.0f} us per tensor "
                         f"at {last:,} tensors, {growth:.2f}x its {m[prev]:.0f} us at "
                         f"{prev:,}.")  # fmt: skip
        lines.append(
            f"| {system} | {op} | {_fmt(fit.get('us_per_tensor'), 1)} "
            f"| {_fmt(fit.get('cpu_us_per_tensor'), 1)} | {_fmt(fit.get('s_per_GiB'))} "
            f"| {_fmt(fit.get('cpu_s_per_GiB'))} | "
            + " / ".join(_fmt(m.get(n), 1) for n in marg)
            + f" | {cell} |"
        )
    lines += ["", *(flags or ["No super-linear step: every cloudckpt and cloudckpt-dcp "
                              "growth is within the target."]), ""]  # fmt: skip
    header = " | ".join(f"{s} {op}" for s in SCALING_SYSTEMS for op in ("save", "load"))
    rule = "|---:" + "|---:" * 2 * len(SCALING_SYSTEMS) + "|"
    failures = []
    for title, first, sweep in ((f"Count sweep: {mib} MiB", "tensors", by_count),
                                (f"Bytes sweep: {count:,} tensors", "MiB", by_bytes)):  # fmt: skip
        lines += [f"### {title}", "", "seconds (CPU s/GiB)", "", f"| {first} | {header} |", rule]
        for x, name in sweep:
            cells = " | ".join(_point_cell(table[name].get(s, {}), op)
                               for s in SCALING_SYSTEMS for op in ("save", "load"))  # fmt: skip
            lines.append(f"| {x:,} | {cells} |")
            failures += [f"- {name} {s} {op}: `{table[name][s][f'{op}_error']}`"
                         for s in SCALING_SYSTEMS for op in ("save", "load")
                         if f"{op}_error" in table[name].get(s, {})]  # fmt: skip
        lines.append("")
    if failures:
        lines += ["Failures:", "", *dict.fromkeys(failures), ""]
    return lines


def scaling_chart(doc: dict[str, Any], path: Path) -> bool:
    """Seconds and CPU s/GiB against tensor count and against MiB, log-log, per system
    and operation; False without matplotlib or scaling points."""
    table = _by_variant(doc)
    points = scaling_points(table)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import NullLocator
    except ImportError:
        return False
    if not points:
        return False
    by_count, by_bytes, mib, count = _sweeps(points)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    colors = dict(zip(SCALING_SYSTEMS, ("tab:gray", "tab:blue", "tab:orange"), strict=True))
    for col, (sweep, xlabel) in enumerate(((by_count, f"tensors (at {mib} MiB)"),
                                           (by_bytes, f"MiB (at {count:,} tensors)"))):  # fmt: skip
        for row, (figure, ylabel) in enumerate((("seconds", "seconds"),
                                                ("cpu_s_per_GiB", "CPU s/GiB"))):  # fmt: skip
            ax = axes[row][col]
            for system in SCALING_SYSTEMS:
                for op, style in (("save", "-"), ("load", "--")):
                    xy = [(x, table[name].get(system, {}).get(f"{op}_{figure}"))
                          for x, name in sweep]  # fmt: skip
                    xy = [(x, y) for x, y in xy if y]
                    if xy:
                        ax.plot(*zip(*xy, strict=True), style, marker="o",
                                color=colors[system], label=f"{system} {op}")  # fmt: skip
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xticks([x for x, _ in sweep], [f"{x:,}" for x, _ in sweep])
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Scaling, rclone serve s3 on tmpfs ({doc['date'][:10]}, {doc['mode']} run)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_page(doc: dict[str, Any], path: Path) -> None:
    """docs/benchmarks.md: how it was measured, the tables, the chart, targets, findings."""
    png = path.with_suffix(".png")
    has_chart = chart(doc, png)
    scaling_png = path.with_name(f"{path.stem}-scaling.png")
    has_scaling_chart = scaling_chart(doc, scaling_png)
    m = doc["machine"]
    pkgs = ", ".join(f"{k} {v}" for k, v in m["packages"].items() if v)
    crc = f"; cloudckpt's CRC-32: {m['crc32']}" if m.get("crc32") else ""  # not in older runs
    lines = [
        "# Benchmarks: cloudckpt against the ceiling and its peers",
        "",
        "Generated by `make bench` / `make bench-quick` (`python -m benchmarks.run`); raw data in "
        "`benchmarks/results/latest.json`. Do not edit the generated sections by hand: "
        "rerun, and put commentary into a dated study in `benchmarks/findings/`.",
        "",
        f"- **Run**: {doc['date']}, {doc['mode']} mode, {doc['elapsed_s']:.0f} s.",
        f"- **Machine**: {m['cpus']} CPUs ({m['cpu']}), {m['memory_GiB']} GiB, {m['platform']}, "
        f"Python {m['python']}.",
        f"- **Packages**: {pkgs}{crc}.",
        f"- **Server**: {doc['server']}.",
    ]
    if doc.get("note"):
        lines.append(f"- **Note**: {doc['note']}")
    lines += [
        "",
        "## How it is measured",
        "",
        "Every system saves the same state (a dict of random fp32 matrices of 1024 columns, "
        "like a model's weights) to the same "
        "server and loads it back, each repetition in a fresh worker process, systems "
        "interleaved (rotated order per repetition). Figures are medians over repetitions. "
        "Each system creates its client before the clock starts (botocore, s3fs, the CRT "
        "and msc clients each take 0.1-0.5 s to build once per process), as a training "
        "process that checkpoints repeatedly already has it.",
        "",
        "- **GB/s**: state bytes (tensor bytes) / wall time of the call, 1 GB = 1e9 B.",
        "- **ceiling**: botocore alone moving pre-built bytes: multipart PUT in parts of at "
        "most 64 MiB, 10 at a time, zero-copy; ranged GETs of at most 32 MiB, 15 at a time, "
        "each object's GET signed once and every range sent straight to the client's "
        "connection pool (as cloudckpt's reads are), `readinto` a preallocated buffer "
        "(cloudckpt's default part "
        "size, chunk size and concurrencies), with sizes evened out so every wave of "
        "requests is full.",
        "- **ceiling-curl**: a C client, curl (`--aws-sigv4`, in subprocesses), moving the "
        "same pre-built bytes from and into memfds (tmpfs pages mapped by the worker; no "
        "Python in the byte path), each operation two ways, each timed apart, the faster "
        "one its figures: save as one PUT of the whole object, or as a multipart upload "
        "(create and complete by curl, the ceiling's balanced parts by 10 curl processes at "
        "once); load as one GET, or as the ceiling's balanced ranged GETs by 15 curl "
        "processes at once, each writing its ranges in place. Every transfer's status and "
        "bytes are checked, each object's size after the save, and every byte it loads "
        "against the pre-built ones.",
        "- **x ceiling**: a system's GB/s over the best ceiling's GB/s in the same run, "
        "save and load apart: on the default and many-small states the faster of `ceiling` "
        "and `ceiling-curl` (the line under each table names it; runs without "
        "`ceiling-curl`: `ceiling`); on the Megatron and safetensors scenarios their own "
        "ceiling (`ceiling-2to2`, `ceiling-st`). A ceiling's own row is then at or below "
        "1.00x.",
        "- **CPU s/GiB**: user + system CPU of the worker process and its children during "
        "the call, per GiB of state.",
        "- **peak extra RSS**: VmHWM after resetting it (`/proc/self/clear_refs`) minus VmRSS "
        "before the call. A load necessarily includes the loaded state itself.",
        "- **requests**: S3 requests the server logged during the call (rclone's debug "
        "log; ListBuckets is not logged).",
        "- **async stall**: time `cloudckpt.async_save` blocks the caller, on the second save "
        "of the process (the first warms the staging buffers), against the median of three "
        "warm `copy_` passes of the state into touched buffers. The async row's save "
        "figures are the time to commit.",
        "- **cloudckpt-dcp-2to3**: `dcp.save` on 2 ranks, `dcp.load` on 3 (forked gloo "
        "processes; every tensor a `Shard(0)` DTensor), so each loading rank reads byte "
        "spans of the saved shards: an FSDP job resumed on another world size. Time from "
        "a barrier before the call to one after it; CPU is the ranks' own in between.",
        "- **ceiling-2to3**: the ceiling's transport and method run by the same ranks (2 "
        "PUT half the pre-built bytes each; 3 GET a third each, across both objects): the "
        "raw-transfer bound for that job here, where three clients and the server share "
        "the cores. `x ceiling-2to3` in the targets compares the DCP ranks with it.",
        "- **megatron** (its own systems): a megatron-core `GPTModel` (local layer spec, "
        "gated linear unit, tied embeddings, fp32; the heading gives its sizes), tensor-"
        "parallel on 2 forked gloo ranks, its `sharded_state_dict()` saved and loaded back "
        "into a zeroed model by `cloudckpt.megatron.save/load` to `s3://` "
        "(**megatron-cloudckpt**) and by megatron-core's own `dist_checkpointing.save/load` "
        "(`torch_dist`) with multi-storage-client on `msc://` (**megatron-msc**). Each rank "
        "builds its part of the model and its client before the clock; the time is the "
        "slowest rank's, from a barrier before the call to one after it; CPU is the ranks' "
        "own (with megatron's writer processes); every loaded tensor is compared with the "
        "saved one afterwards. **ceiling-2to2**: the ceiling's transfer on the same 2 ranks "
        "(2 PUT, then 2 GET half each) for exactly the checkpoint's tensor bytes; `x "
        "ceiling` in that table is against it. Targets: cloudckpt at 1.5x megatron-core + "
        "MSC and at 0.8x of ceiling-2to2, save and load.",
        '- **gpt-adamw**: what a training loop saves, `{"model": model.state_dict(), '
        '"optimizer": optimizer.state_dict()}` of a GPT-2-style decoder (the heading '
        "gives its sizes) with its AdamW state: per parameter a 0-dim `step`, `exp_avg` and "
        "`exp_avg_sq`, two parameter groups; tensors from 4 bytes and a few KiB (steps, "
        "biases, norms) to the token embedding (`benchmarks/systems/gpt_adamw.py`). The "
        "single-object systems save the nested dict as it is, cloudckpt-dcp hands it to "
        "`dcp.save` and loads into a copy of its tensors' shapes; the ceilings move its "
        "tensors' bytes. Targets: cloudckpt and cloudckpt-dcp save and load at 0.85x the "
        "best ceiling.",
        "- **scaling**: the ceiling, cloudckpt and cloudckpt-dcp on equal fp32 matrices, "
        "the same bytes in 100 to 100,000 tensors, then 100 tensors of growing size; see "
        "[Scaling](#scaling).",
        "- **peers**: NeMo-style `torch.save` to memory + boto3 `upload_fileobj` "
        "(TransferConfig 64 MiB, 10 threads) / `download_fileobj`; Lightning "
        "`TorchCheckpointIO` over s3fs; s3torchconnector `S3Checkpoint`; "
        "multi-storage-client `msc.torch.save/load`; DCP with `FsspecWriter/Reader` over "
        "s3fs. A peer that fails is shown as failing with its error.",
        "- **server**: `rclone serve s3` with MD5 ETags off (`--etag-hash ''`) and no "
        "read-ahead (`--buffer-size 0`): it shares the two cores with the clients being "
        "measured, and both would otherwise burn CPU per request that a real object store "
        "spends on its own machines (see `benchmarks/server.py`).",
        "",
        "## Results",
        "",
    ]
    if has_chart:
        lines += [f"![save and load throughput]({png.name})", ""]
    elif not _have_matplotlib():
        lines += ["(No chart: matplotlib is not installed.)", ""]
    lines.append(markdown_tables(doc))
    lines += scaling_section(doc, scaling_png.name if has_scaling_chart else None)
    lines += many_ranks_section()
    lines += studies_sections(doc)
    lines += findings_section()
    lines += [
        "",
        "## Reproduce",
        "",
        "```",
        "make bench-quick    # every variant smaller, 1-3 reps",
        "make bench          # 1 GiB / 100 tensors x5, 160 MiB / 10k x3, scenarios x3, sweep",
        ".venv/bin/python -m benchmarks.run --systems ceiling,cloudckpt --reps 3",
        ".venv/bin/python -m benchmarks.run --variants megatron --docs ''   # Megatron alone",
        ".venv/bin/python -m benchmarks.run --variants gpt-adamw --docs '' --out /tmp/ga.json",
        ".venv/bin/python -m benchmarks.run --variants scaling --docs '' --out /tmp/sc.json",
        ".venv/bin/python -m benchmarks.run --variants tiers,cli-startup   # the studies alone",
        "```",
        "",
    ]
    path.write_text("\n".join(lines))
