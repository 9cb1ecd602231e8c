"""``BENCHMARKS.md``'s tables and commands, generated from the JSON under ``docs/benchmarks/``.

Every number on the page comes from a JSON file a table's function loads; the page holds
blocks between ``<!-- generated: NAME -->`` and ``<!-- end: NAME -->`` that
``rollout-gateway bench page`` rewrites (``--check`` only compares, for CI and the tests).
Prose outside the blocks is the page's own. Files recorded before issue 29 name policies
the old way (``ours-lane``); they are shown, and their commands given, under the current
names (``gateway.policies.registry.DEPRECATED_NAMES``), with the JSON's current paths.
"""

from __future__ import annotations

import json
import re
import shlex
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any

import typer

from bench.reports.grid_summary import RIVALS, SUBJECT, fmt_ratio, verdicts
from bench.reports.learn_table import learning_table
from bench.reports.loop_table import loop_table, option, split_table
from bench.reports.relay_table import relay_markdown
from bench.simulator.steps import StepScenario, paired_ratio
from gateway.policies.registry import DEPRECATED_NAMES

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "BENCHMARKS.md"
BENCH = "docs/benchmarks"
Doc = dict[str, Any]

#: the runs each table is made of, by workload (several files of one workload pair seed
#: by seed: the simulator is deterministic per seed)
STEPS = {"search": ["search-64gpu-5steps.json", "search-64gpu-5steps-rivals.json"],
         "math-code": ["math-code-64gpu-5steps.json"],
         "swe": ["swe-64gpu-5steps.json", "swe-64gpu-5steps-heddle.json"]}
TAIL = {"search": ["search-64gpu.json", "search-64gpu-perfect.json"],
        "math-code": ["math-code-64gpu.json", "math-code-64gpu-perfect.json"],
        "swe": ["swe-64gpu.json"]}
WEIGHTS = "weights/math-code-8gpu.json"
GRID = ["grid/headline-math-code-5seeds.json", "grid/qwen3-14b-h100-16gpu-4pg-live.json",
        "grid/qwen3-14b-h100-16gpu-16pg-tau-live.json",
        "grid/qwen3-14b-h100-16gpu-16pg-swe-live.json",
        "grid/qwen3-14b-h100-16gpu-16pg-search-live.json", "grid/qwen3-14b-h100-16gpu.json",
        "grid/qwen3-14b-h100-16gpu-64pg.json", "grid/qwen3-14b-a100-16gpu.json",
        "grid/qwen3-8b-32b-h100.json"]
LIVE = ["live-16gpu/3x/static-and-lane.json", "live-16gpu/3x/heddle-libra.json"]
#: ``bench tail`` runs of the grid cells whose critical path leaves room for 1.15x, each
#: against the ``bench steps`` runs of the same seeds (``reach/<cell>-steps.json``)
REACH = [f"reach/{w}-16gpu-{per}pg-{band}-tail.json" for per, w, bands in (
    (16, "tau", ("low", "mid", "high")), (16, "swe", ("low", "mid")),
    (16, "search", ("low", "mid")), (16, "math-code", ("mid", "high")),
    (64, "tau", ("low", "mid", "high")), (64, "math-code", ("low", "mid", "high")))
    for band in bands] + ["reach/tau-16gpu-4pg-mid-a100-tail.json"]
LANE, BEST = "straggler-lane", "verl-tp8"
_LIST_OPTS = ("--policy", "--layout", "--against")


def _name(name: str) -> str:
    return DEPRECATED_NAMES.get(name, name)


def _path(p: str) -> str:
    """Where a JSON path of a recorded command lives now."""
    return re.sub(r"^docs/(steps|tail|weights)-", rf"{BENCH}/\1/", p)


def load(rel: str, root: Path = ROOT) -> Doc:
    doc: Doc = json.loads((root / BENCH / rel).read_text())
    return doc


def command(docs: Iterable[Doc], *outputs: str) -> str:
    """One command that reproduces what several recorded runs of one benchmark did: their
    common options, every run's policies/layouts/inputs (current names and paths), then
    ``outputs`` (``--json PATH``, ``--out DIR``) in place of where each run wrote."""
    lists: dict[str, list[str]] = {o: [] for o in _LIST_OPTS}
    heads: list[list[str]] = []
    for doc in docs:
        toks, head = shlex.split(doc["command"]), list[str]()
        k = 0
        while k < len(toks):
            if toks[k] in lists and _name(_path(toks[k + 1])) not in lists[toks[k]]:
                lists[toks[k]].append(_name(_path(toks[k + 1])))
            if toks[k] in lists or toks[k] in ("--json", "--out"):
                k += 2
                continue
            head.append(toks[k])
            k += 1
        heads.append(head)
    head = heads[0]
    if any(h != head for h in heads):  # one command would not reproduce them all
        raise ValueError(f"runs differ in more than their policies: {heads}")
    out = head + [x for o in _LIST_OPTS for v in lists[o] for x in (o, v)]
    return shlex.join([*out, *outputs])


def _steps_runs(workload: str, root: Path) -> tuple[list[Doc], dict[str, Doc]]:
    docs = [load(f"steps/{f}", root) for f in STEPS[workload]]
    rows: dict[str, Doc] = {}
    for doc in docs:
        for name, row in doc["results"].items():
            rows.setdefault(_name(name), row)
    return docs, rows


def _reported(doc: Doc) -> str:
    return f"2-{option(doc['command'], '--steps', str(StepScenario('', '').steps))}"


def _ratio(base: Doc, other: Doc) -> str:
    g, lo, hi = paired_ratio(base["per_seed_s"], other["per_seed_s"])
    return f"{g:.2f}x ({lo:.2f}-{hi:.2f})"


def _scale() -> str:
    sc = StepScenario("", "")
    return f"{sc.model} on simulated {sc.gpu}s"


#: the grids the headline summarizes: 16 per GPU, every workload, live beliefs
HEADLINE = ["grid/qwen3-14b-h100-16gpu-16pg-swe-live.json",
            "grid/qwen3-14b-h100-16gpu-16pg-search-live.json",
            "grid/headline-math-code-5seeds.json",
            "grid/qwen3-14b-h100-16gpu-16pg-tau-live.json"]


def headline(root: Path = ROOT) -> str:
    """The default policy against the best uniform static layout and each rival, per
    workload and point of the TP-efficiency band (from the grid's 16-per-GPU runs)."""
    lines = [f"{_scale()}, 16 GPUs, 16 trajectories per GPU, 5 seeds, every policy planning "
             "with what a live gateway measures (the calibrated profile, corrected per TP by "
             f"the engines' calls). `{SUBJECT}` (the default) against the best uniform static "
             "layout of each cell (every TP swept) and each rival: the geometric mean of the "
             f"per-seed makespan ratios (other / `{SUBJECT}`), paired 95% interval; above 1 "
             f"means `{SUBJECT}` is faster. Steps 2-3 reported; `{SUBJECT}`'s first step, which "
             "probes every degree, is in the grid below.", "",
             "| workload | TP efficiency | best static (s) | vs best static | "
             + " | ".join(f"vs `{p}`" for p in RIVALS) + " | best static / critical path |",
             "|---|---|---|---|" + "---|" * len(RIVALS) + "---|"]
    for rel in HEADLINE:
        for key, row in load(rel, root)["summary"].items():
            workload, band = key.split("/")[-2:]
            best = row["best_static"]
            cells = [fmt_ratio(row.get(f"{SUBJECT}_vs_best_static")),
                     *(fmt_ratio(row.get(f"{SUBJECT}_vs_{p}")) for p in RIVALS)]
            lines.append(f"| {workload} | {band} | `{best}` ({row['mean_s'][best]:.1f}) | "
                         + " | ".join(cells) + f" | {row['headroom']:.2f}x |")
    return "\n".join(lines)


def steps_table(root: Path = ROOT) -> str:
    lines = ["| workload | policy | makespan s (mean of the steps reported) | 95% CI ± | "
             f"`{BEST}` / this (paired 95% CI) | migrations per run |", "|---|---|---|---|---|---|"]
    cmds = []
    for w in STEPS:
        docs, rows = _steps_runs(w, root)
        for name, r in sorted(rows.items(), key=lambda kv: kv[1]["mean_s"]):
            lines.append(f"| {w} | `{name}` | {r['mean_s']:.1f} | {r['ci95_s']:.1f} | "
                         f"{_ratio(rows[BEST], r)} | {r['migrations']:.0f} |")
        cmds.append(command(docs, "--json", f"{BENCH}/steps/{STEPS[w][0]}"))
    crit = "; ".join(f"{w} {_steps_runs(w, root)[1][BEST]['lb_critical_s']:.1f} s"
                     for w in STEPS)
    return "\n".join([*lines, "", f"Critical path (lower bound; it binds on all three): "
                      f"{crit}.", "", "```sh", *cmds, "```"])


def _times(a: Doc) -> str:
    """A paired ratio of ``bench tail --against``: geometric mean and 95% interval."""
    return f"{a['geomean']:.2f}x ({a['ci95_low']:.2f}-{a['ci95_high']:.2f})"


def tail_table(root: Path = ROOT) -> str:
    lines = ["| workload | k longest alone | `verl-tp8` s | `straggler-lane` s | "
             "`straggler-lane-oracle` s |", "|---|---|---|---|---|"]
    notes, cmds = [], []
    for w, files in TAIL.items():
        docs = [load(f"tail/{f}", root) for f in files]
        per: dict[tuple[int, str], float] = {}
        for doc in docs:
            for key, seeds in doc["per_k"].items():
                k, layout = key.split(":")
                per.setdefault((int(k), _name(layout)), statistics.fmean(seeds.values()))
        for k in docs[0]["ks"]:
            cells = [per.get((k, p)) for p in (BEST, LANE, f"{LANE}-oracle")]
            lines.append(f"| {w} | {k} | " + " | ".join(
                "not run" if c is None else f"{c:.1f}" for c in cells) + " |")
        est, against = docs[0]["estimate_s"], docs[0]["against"]
        vs = ", ".join(f"`{_name(n)}` {_times(a)}" for n, a in against.items())
        notes.append(f"- {w}: estimate {est['mean']:.1f} ± {est['ci95']:.1f} s; whole-batch "
                     f"`bench steps` makespan / estimate: {vs}.")
        cmds.append(command(docs, "--json", f"{BENCH}/tail/{files[0]}"))
    return "\n".join([*lines, "", *notes, "", "```sh", *cmds, "```"])


def weights_table(root: Path = ROOT) -> str:
    runs = load(WEIGHTS, root)["runs"]
    first = next(iter(runs.values()))
    sc = first["scenario"]
    by: dict[tuple[str, str], list[Doc]] = {}
    seeds: list[str] = []
    for key, doc in runs.items():
        mode, seed = key.rsplit("-seed", 1)
        seeds += [seed] if seed not in seeds else []
        for name, r in doc["results"].items():
            by.setdefault((_name(name), mode), []).append(r)
    lines = [f"math-code, {sc['gpus']} x {sc['model']} on simulated {sc['gpu']}s, "
             f"{first['trajectories']} trajectories, an update every 60 s taking "
             f"{sc['weight_update_s']:g} s, seeds {', '.join(seeds)}.", "",
             "| policy | mode | makespan s (per seed) | mean | updates | paused s | "
             "staleness mean / max | stale tokens |", "|---|---|---|---|---|---|---|---|"]
    for (name, mode), rs in sorted(by.items(), key=lambda kv: kv[0][0]):  # modes as run
        ms = [r["makespan_s"] for r in rs]
        ws = [r["weights"] for r in rs if r["weights"]]
        extra = _weights_cells(ws) if ws else "- | - | - | -"
        lines.append(f"| `{name}` | {mode} | {' / '.join(f'{m:.0f}' for m in ms)} | "
                     f"{statistics.fmean(ms):.0f} | {extra} |")
    cmd = command([runs["wait-seed1"]], "--json", "out.json")
    return "\n".join([*lines, "", "```sh", cmd, "```"])


def _weights_cells(ws: list[Doc]) -> str:
    def mean(key: str) -> float:
        return statistics.fmean(w[key] for w in ws)

    return (f"{mean('updates'):.1f} | {mean('paused_s'):.0f} | "
            f"{mean('mean_staleness'):.2f} / {max(w['max_staleness'] for w in ws)} | "
            f"{mean('stale_token_frac'):.0%}")


def live_table(root: Path = ROOT) -> str:
    docs = [load(f, root) for f in LIVE]
    sc = docs[0]["scenario"]
    lines = [f"{sc['workload']}, {docs[0]['trajectories']} trajectories on {sc['gpus']} x "
             f"{sc['model']} ({sc['gpu']}, simulated engines, {sc['speed']:g}x time "
             f"compression), cap {sc['cap_per_gpu']} per GPU.", "",
             "| policy | layout (start) | live makespan s | simulator s | live vs sim | "
             "relayouts applied | migrations |", "|---|---|---|---|---|---|---|"]
    for doc in docs:
        for name, r in doc["results"].items():
            lines.append(f"| `{_name(name)}` | {'+'.join(map(str, r['layout']))} | "
                         f"{r['makespan_s']:.0f} | {r['sim_makespan_s']:.0f} | "
                         f"{r['live_vs_sim_diff']:+.1%} | {r['reconfigurations']} | "
                         f"{r['migrations']} |")
    return "\n".join([*lines, "", "```sh", command(docs, "--out", "/tmp/live",
                                                   "--json", "/tmp/live.json"), "```"])


def grid_table(root: Path = ROOT) -> str:
    """Issue 30's grid: per cell, each policy against the best uniform static layout."""

    out: list[str] = []
    for rel in GRID:
        doc = load(rel, root)
        summary = doc["summary"]
        live = doc.get("beliefs", "true") == "live"
        out += [f"{len(doc['seeds'])} seeds, {doc['steps']} steps per run (steps "
                f"2-{doc['steps']} reported). "
                + ("Policies plan with **live beliefs**: the calibrated profile's speeds, "
                   "corrected per TP by what the engines measured (a degree not yet run "
                   "borrows the nearest measured one's correction), as a live gateway does; "
                   f"`{SUBJECT}` probes every degree in step 1, whose cost is its own column."
                   if live else "Policies are **told the band's true speeds** (an older "
                   "run: a live gateway does not know them; see the live-belief grid above).")
                + " Ratios are best static / policy (paired 95% "
                "interval): above 1 the policy is faster. `-`: the policy cannot run the "
                "cell (a call needs more KV cache than its TP1 instances have).", "",
                "| model, GPU, GPUs | workload | per GPU | TP efficiency | best static (s) | "
                f"`{SUBJECT}` | " + (f"`{SUBJECT}` step 1 | " if live else "")
                + " | ".join(f"`{p}`" for p in RIVALS) + " | best static / critical path |",
                "|---|---|---|---|---|---|" + ("---|" if live else "") + "---|" * len(RIVALS)
                + "---|"]
        for key, row in summary.items():
            model, gpu, gpus, per_gpu, workload, band = key.split("/")
            best = row["best_static"]
            cells = [fmt_ratio(row.get(f"{p}_vs_best_static")) for p in (SUBJECT, *RIVALS)]
            if live:
                cells.insert(1, fmt_ratio(row.get(f"{SUBJECT}_step1_vs_best_static")))
            out.append(f"| {model}, {gpu}, {gpus.removesuffix('gpu')} | {workload} | "
                       f"{per_gpu.removesuffix('pg')} | {band} | `{best}` "
                       f"({row['mean_s'][best]:.1f}) | " + " | ".join(cells)
                       + f" | {row['headroom']:.2f}x |")
        v = verdicts(summary)
        out += ["", f"Cells: {v['cells']}. `{SUBJECT}` at least 0.98x the best static "
                f"(the paired interval's centre): {v['at_least_0.98x_best_static']}, its "
                f"interval not below 0.95: {v['interval_not_below_0.95']}; at least level "
                "with both `heddle` and "
                f"`libra`: {v['at_least_heddle_and_libra']} (not significantly behind either: "
                f"{v['not_significantly_behind_heddle_or_libra']}; a rival that cannot run "
                "the cell counts as beaten); cells whose best static is not "
                f"TP8: {v['best_static_not_tp8']}, of those at least 1.15x: "
                f"{v['of_those_at_least_1.15x']}, and where the critical path leaves room "
                f"for 1.15x at all: {v['of_those_where_1.15x_is_possible']} (point "
                "estimates; the critical path is the longest trajectory alone at its best "
                "TP, a bound no schedule beats).", "",
                f"![{SUBJECT} vs the best static layout]({BENCH}/{rel.removesuffix('.json')}.png)",
                "", "```sh", command([doc], "--json", f"{BENCH}/{rel}"), "```", ""]
    return "\n".join(out).rstrip()


#: the speed-up over the best static layout the reach table tests (issue 30's target)
TARGET = 1.15


def reach_table(root: Path = ROOT) -> str:
    """Per grid cell with room under the critical path: whether 1.15x over the best static
    layout is within ``bench tail``'s estimate (the step's longest trajectories alone)."""
    lines = ["| workload | GPU | per GPU | TP efficiency | estimate s | best static: makespan "
             f"/ estimate | `{SUBJECT}` / estimate | {TARGET:.2f}x over the best static "
             "needs | |",
             "|---|---|---|---|---|---|---|---|---|"]
    cmds: list[str] = []
    for rel in REACH:
        doc = load(rel, root)
        opts = dict(zip(toks := shlex.split(doc["command"]), toks[1:], strict=False))
        steps = opts["--against"]  # the steps runs `need` was computed against
        steps_doc = load(steps.removeprefix(f"{BENCH}/"), root)
        best = _name(steps_doc["best_static"])
        if doc["target"]["speedup"] != TARGET:
            raise ValueError(f"{rel} tests {doc['target']['speedup']}x, the table {TARGET}x")
        need = doc["target"]["needs_x_estimate"]
        est = doc["estimate_s"]
        against = {_name(n): a for n, a in doc["against"].items()}
        lines.append(f"| {opts['--workload']} | {opts.get('--gpu', 'H100')} | "
                     f"{opts['--per-gpu']} | {opts['--tp-efficiency']} | "
                     f"{est['mean']:.1f} ± {est['ci95']:.1f} | `{best}` {_times(against[best])} | "
                     f"{_times(against[SUBJECT])} | {need:.2f}x the estimate | "
                     f"{'out of reach' if need < 1 else 'not ruled out'} |")
        cmds += [command([steps_doc], "--json", steps),
                 command([doc], "--json", f"{BENCH}/{rel}")]
        if len(cmds) == 2:  # the caption, from the first file (all share these options)
            lines.insert(0, f"{opts.get('--model', 'qwen3-14b')}, {opts['--gpus']} GPUs, "
                            f"{opts['--seeds']} seeds, {opts['--steps']} steps (steps "
                            f"2-{opts['--steps']} reported); makespan / estimate is the "
                            "geometric mean of the per-seed ratios (paired 95% interval).\n")
    return "\n".join([*lines, "", "```sh", *cmds, "```"])


def relay_table(root: Path = ROOT) -> str:
    return "\n\n".join(relay_markdown(load(f"relay/{name}.json", root))
                       for name in ("relay", "relay-paced", "relay-grouped"))


BLOCKS: dict[str, Callable[[Path], str]] = {
    "headline": headline, "steps": steps_table, "tail": tail_table,
    "weights": weights_table, "live": live_table, "grid": grid_table, "loop": loop_table,
    "split": split_table, "relay": relay_table, "reach": reach_table,
    "learning": learning_table}


def render(text: str, root: Path = ROOT) -> str:
    """``text`` with every generated block rewritten from the JSON under ``root``."""
    for name, make in BLOCKS.items():
        pattern = re.compile(rf"<!-- generated: {name} -->\n.*?(?=<!-- end: {name} -->)", re.S)
        found = pattern.search(text)
        if found is None:
            raise ValueError(f"BENCHMARKS.md has no block {name!r}")
        block = f"<!-- generated: {name} -->\n{make(root)}\n"
        text = text[:found.start()] + block + text[found.end():]
    return text


def page(
    check: Annotated[bool, typer.Option(
        "--check", help="only compare: exit 1 if the page differs from its JSON")] = False,
    path: Annotated[Path, typer.Option(help="the page")] = PAGE,
) -> None:
    """Regenerate BENCHMARKS.md's tables and commands from docs/benchmarks/*/*.json."""
    text = path.read_text()
    new = render(text)
    if check:
        if new != text:
            typer.echo(f"{path} is out of date: run rollout-gateway bench page", err=True)
            raise typer.Exit(1)
        typer.echo(f"{path} matches its JSON")
        return
    path.write_text(new)
    typer.echo(f"updated {path}")
