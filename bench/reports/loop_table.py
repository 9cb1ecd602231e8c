"""BENCHMARKS.md's ``bench loop`` block: step modes in samples per hour against the best
static synchronous layout, with the staleness and the cost of every speed-up beside it."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

from bench.simulator.steps import paired_ratio

LOOP = ["loop/qwen3-14b-h100-64gpu-math-code.json", "loop/qwen3-14b-h100-64gpu-search.json",
        "loop/qwen3-14b-h100-64gpu-swe.json",
        # the trainer's time swept, and the modes under the replay policy
        "loop/qwen3-14b-h100-64gpu-math-code-trainer-sweep.json",
        "loop/qwen3-14b-h100-64gpu-math-code-replay.json",
        "loop/qwen3-14b-h100-64gpu-math-code-replay-mid-high.json",
        # sync with 2x and 4x the batch beside async, tool sandboxes counted (16 GPUs)
        "loop/qwen3-14b-h100-16gpu-math-code-sync-batches.json",
        # async against sync both at 32 per GPU, where the rollout is busier (16 GPUs)
        "loop/qwen3-14b-h100-16gpu-math-code-32pg-async.json",
        # colocated sync (the pool's and the trainer's GPUs taking turns) beside async
        "loop/qwen3-14b-h100-16gpu-math-code-colocated.json"]
BENCH = "docs/benchmarks"


def option(command: str, name: str, default: str) -> str:
    """The value a recorded ``command`` gave option ``name``, else ``default``."""
    toks = shlex.split(command)
    return toks[toks.index(name) + 1] if name in toks else default


def _x(v: dict[str, float]) -> str:
    return f"{v['geomean']:.2f}x ({v['ci95_low']:.2f}-{v['ci95_high']:.2f})"


def _row(workload: str, band: str, name: str, row: dict[str, Any]) -> str:
    lag = (f"{row['lag0_share']:.0%} / {row['lag1_share']:.0%} / "
           f"{row['lag2_share'] + row['lag3plus_share']:.0%}")
    tokens = (f"{row['tokens_per_hour'] / 1e6:.2f} | {_x(row['tokens_vs_best_sync'])}"
              if "tokens_per_hour" in row else "not recorded | not recorded")
    sandboxes = (f"{row['sandboxes_mean']:.0f} / {row['sandboxes_peak']:.0f}"
                 if "sandboxes_mean" in row else "not recorded")
    return (f"| {workload} | {band} | `{name}` | {tokens} | {row['samples_per_hour']:.0f} | "
            f"{_x(row['vs_best_sync'])} | {lag} | {row['wasted_share']:.0%} | "
            f"{row['idle_share']:.0%} | {row['length_bias']:.2f} | {sandboxes} |")


_MEMORY = re.compile(r"memory ([0-9.]+)")
_FIGURES = ("tokens_per_hour", "samples_per_hour", "idle_share")


def _collapse_memory(rows: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Colocated rows that differ only in the engines' memory share, merged into one
    (named ``memory 0.5-0.8``, where the first of them stood) where every figure agrees
    within 0.5%: the KV cache did not bind there. The memory shares merged (none: rows
    as given)."""
    groups: dict[str, list[tuple[str, str]]] = {}
    for name in rows:
        if m := _MEMORY.search(name):
            groups.setdefault(_MEMORY.sub("memory {}", name), []).append((m[1], name))
    into: dict[str, str | None] = {}  # a merged row's members -> its name (first) or None
    merged = set[str]()
    for pattern, members in groups.items():
        first = rows[members[0][1]]
        if len(members) < 2 or not all(
                abs(rows[n][k] - first[k]) <= 0.005 * max(abs(first[k]), 1e-9)
                for _, n in members for k in _FIGURES):
            continue
        mems = sorted(m for m, _ in members)
        into |= {n: None for _, n in members}
        into[members[0][1]] = pattern.format(f"{mems[0]}-{mems[-1]}")
        merged.update(mems)
    out = {}
    for name, row in rows.items():
        if name not in into:
            out[name] = row
        elif (as_name := into[name]) is not None:
            out[as_name] = row
    return out, sorted(merged)


def _colocated_notes(workload: str, band: str,
                     sweeps: dict[str, dict[str, float]]) -> list[str]:
    """One line per colocated job: its layouts' rollout per step, at each memory share."""
    jobs: dict[str, list[tuple[str, dict[str, float]]]] = {}
    for job, rollouts in sweeps.items():
        m = _MEMORY.search(job)
        key = _MEMORY.sub("", job).rstrip(", ") if m else job
        jobs.setdefault(key, []).append((m[1] if m else "", rollouts))
    out = []
    for job, runs in jobs.items():
        layouts = list(dict.fromkeys(k for _, r in runs for k in r))
        each = ", ".join(f"`{lay}` " + " / ".join(
            f"{r[lay]:.0f}" if lay in r else "-" for _, r in runs) + " s" for lay in layouts)
        mems = " / ".join(m for m, _ in runs)
        out.append(f"- {workload}, {band}: colocated {job}, sync rollout per step at memory "
                   f"{mems}: {each}")
    return out


def _policy_vs_pinned(rows: dict[str, Any], pinned: str) -> list[str]:
    """Each ``mode@replay`` row against the same mode pinned to ``pinned``: trained tokens
    per hour, paired seed by seed (above 1: the policy trains more)."""
    out = []
    for name, row in rows.items():
        mode, _, at = name.rpartition("@")
        other = rows.get(f"{mode}@{pinned}")
        if at != "replay" or other is None or "tokens_per_seed" not in row:
            continue
        g, lo, hi = paired_ratio(row["tokens_per_seed"], other["tokens_per_seed"])
        out.append(f"`{mode}` {g:.3f}x ({lo:.3f}-{hi:.3f})")
    return out


def loop_table(root: Path) -> str:
    out = ["| workload | TP efficiency | mode @ layout | trained tokens/h (M) | x best static "
           "sync, tokens (paired 95% CI) | samples/h | x best static sync, samples | trained "
           "tokens 0 / 1 / 2+ versions stale | wasted tokens | pool idle | length bias | "
           "tool sandboxes mean / peak |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    commands, notes, seen = [], [], set[str]()
    for rel in LOOP:
        path = root / BENCH / rel
        if not path.exists():
            continue
        doc = json.loads(path.read_text())
        commands.append(doc["command"])
        per_gpu = option(doc["command"], "--per-gpu", "8")
        gpus = option(doc["command"], "--gpus", "64")
        if not any("tokens_per_hour" in row for cell in doc["cells"].values()
                   for part in cell["ratios"].values() for row in part["rows"].values()):
            notes.append(f"- `{rel}` is from the simulator before trained tokens per hour "
                         "were recorded and before staleness counted from a trajectory's "
                         "start: its `async` and `overprovisioned` rows are to be rerun")
        if "beliefs" not in doc and any("@replay" in name for cell in doc["cells"].values()
                                        for part in cell["ratios"].values()
                                        for name in part["rows"]):
            notes.append(f"- `{rel}` predates `replay`'s probe step, the live speed beliefs "
                         "and its relayout at weight pushes (issue 44): its `@replay` rows "
                         "are to be rerun (`docs/step-modes.md` has the 16-GPU measurement)")
        for key, cell in doc["cells"].items():
            workload, band = key.split("/")
            if per_gpu != "8":  # the page's prose says 8 per GPU: say where it is not
                band = f"{band}, {per_gpu}/GPU"
            if gpus != "64":  # ... and 64 GPUs
                band = f"{band}, {gpus} GPUs"
            sync = ", ".join(f"`{k}` {s:.0f} s" for k, s in cell["sync_rollout_s"].items())
            note = (f"- {workload}, {band}: sync rollout per step {sync}; best static "
                    f"`{cell['best_static']}`")
            if note not in notes:
                notes.append(note)
            notes += _colocated_notes(workload, band, cell.get("colocated_rollout_s", {}))
            for ratio, part in cell["ratios"].items():
                rows, same = _collapse_memory(part["rows"])
                if same:
                    notes.append(f"- {workload}, {band}: colocated rows at memory "
                                 f"{' and '.join(same)} measured the same (within 0.5% in "
                                 "every figure): one row each, memory named as the range")
                if against := _policy_vs_pinned(rows, cell["best_static"]):
                    trainer = (f", trainer {float(ratio):g}x" if len(cell["ratios"]) > 1
                               else "")
                    notes.append(f"- {workload}, {band}{trainer}: `replay` / the same mode "
                                 f"pinned to `{cell['best_static']}`, trained tokens per "
                                 f"hour (paired 95% CI): {', '.join(against)}")
                for name, row in rows.items():
                    line = _row(workload, f"{band}, trainer {float(ratio):g}x "
                                f"({part['train_s']:.0f} s)", name, row)
                    if line not in seen:  # a later file that reruns a row gives the same one
                        seen.add(line)
                        out.append(line)
    return "\n".join([*out, "", *notes, "", "```sh", *commands, "```"])


SPLIT = "shards/split.json"


def _ratio(r: dict[str, Any]) -> str:
    lo, hi = r["ci95"]
    return f"{r['ratio_geomean']:.3f}x ({lo:.3f}-{hi:.3f})"


def split_table(root: Path) -> str:
    """What scheduling in shards costs in makespan (``bench split``), per workload."""
    path = root / BENCH / SPLIT
    if not path.exists():
        return "(not run)"
    doc = json.loads(path.read_text())
    shards, gpus = option(doc["command"], "--shards", "2"), option(doc["command"], "--gpus", "32")
    total = int(shards) * int(gpus)
    rebalanced = all("rebalanced" in r for r in doc["results"].values())
    out = [f"| workload | one scheduler over {total} GPUs, s | {shards} shards of {gpus} GPUs, s "
           "| sharded / one (paired 95% CI) |"
           + (" with the rebalancer, s | rebalanced / one | rebalanced / sharded | moves per "
              "batch |" if rebalanced else "") + " seeds |",
           "|---|---|---|---|" + ("---|---|---|---|" if rebalanced else "") + "---|"]
    for workload, r in doc["results"].items():
        one, split = r["one_scheduler_s"], r["sharded_s"]
        row = (f"| {workload} | {sum(one) / len(one):.0f} | {sum(split) / len(split):.0f} | "
               f"{_ratio(r)} |")
        if rebalanced:
            rb = r["rebalanced"]
            moves = [len(m) for m in rb["moves"]]
            row += (f" {sum(rb['rebalanced_s']) / len(rb['rebalanced_s']):.0f} | {_ratio(rb)} | "
                    f"{_ratio(rb['over_sharded'])} | {min(moves)}-{max(moves)} |")
        out.append(row + f" {r['seeds']} |")
    return "\n".join([*out, "", "```sh", doc["command"], "```"])
