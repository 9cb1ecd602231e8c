"""PNG plots for benchmark reports (matplotlib, no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

COLORS = {"llm": "#3b6fe0", "queue": "#f0a020", "tool": "#20a88a"}
RELAYOUT_COLOR = "#d0453a"


def throughput_bars(out: Path, values: Mapping[str, float], title: str,
                    ylabel: str = "output tokens / s") -> Path:
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
    names = list(values)
    ax.bar(names, [values[n] for n in names], color="#3b6fe0")
    for i, n in enumerate(names):
        ax.text(i, values[n], f"{values[n]:,.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def completion_cdf(out: Path, durations: Mapping[str, Sequence[float]], title: str) -> Path:
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
    for name, ds in durations.items():
        xs = sorted(ds)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=name)
    ax.set_xlabel("trajectory finished at (s)")
    ax.set_ylabel("fraction of batch done")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def gantt(out: Path, rows: Sequence[Mapping[str, Any]], title: str, top: int = 12,
          relayouts: Sequence[Mapping[str, Any]] = ()) -> Path:
    """``rows``: {"id", "start", "end", "llm": [(s, e)], "queue": [(s, e)]} in seconds;
    tool time is what lies between LLM segments. ``relayouts``: {"start", "end"} of the
    pool's layout changes (drain + stop + start), drawn as bands across all rows."""
    slow = sorted(rows, key=lambda r: r["end"] - r["start"], reverse=True)[:top]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(slow) + 1.2), dpi=110)
    for y, r in enumerate(reversed(slow)):
        ax.barh(y, r["end"] - r["start"], left=r["start"], color=COLORS["tool"], height=0.6)
        for kind in ("queue", "llm"):
            for s, e in r.get(kind, ()):
                ax.barh(y, e - s, left=s, color=COLORS[kind], height=0.6)
    end = max((r["end"] for r in slow), default=0.0)
    for rl in relayouts:
        ax.axvspan(rl["start"], rl["end"] if rl["end"] is not None else end,
                   color=RELAYOUT_COLOR, alpha=0.25, zorder=0)
    ax.set_yticks(range(len(slow)), [r["id"] for r in reversed(slow)], fontsize=7)
    ax.set_xlabel("seconds")
    ax.set_title(title)
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    labels = ["LLM", "queued", "tool / other"]
    if relayouts:
        handles.append(Rectangle((0, 0), 1, 1, color=RELAYOUT_COLOR, alpha=0.25))
        labels.append(f"relayout ({len(relayouts)})")
    ax.legend(handles, labels, fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def grid_heatmap(out: Path, summary: Mapping[str, Any], subject: str, title: str) -> Path:
    """Cells of ``bench grid`` (rows: workload and load; columns: TP-efficiency point),
    coloured by ``subject``'s paired speed-up over the cell's best static layout and
    labelled with it and that layout's TP."""
    keys = list(summary)
    bands = list(dict.fromkeys(k.rsplit("/", 1)[1] for k in keys))
    rows = list(dict.fromkeys(k.rsplit("/", 1)[0] for k in keys))
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(bands), 0.8 + 0.42 * len(rows)), dpi=110)
    grid = [[float("nan")] * len(bands) for _ in rows]
    for key, row in summary.items():
        r, b = key.rsplit("/", 1)
        ratio = row.get(f"{subject}_vs_best_static")
        if ratio is None:
            continue
        i, j = rows.index(r), bands.index(b)
        grid[i][j] = ratio[0]
        best = row["best_static"].rsplit("-", 1)[-1].upper()
        ax.text(j, i, f"{ratio[0]:.2f}x\n{best}", ha="center", va="center", fontsize=7)
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0.85, vmax=1.15, aspect="auto")
    ax.set_xticks(range(len(bands)), bands)
    ax.set_yticks(range(len(rows)), rows, fontsize=7)
    ax.set_xlabel("TP efficiency (docs/tp-efficiency.md)")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label=f"best static / {subject}")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def learning_curve(out: Path, doc: Mapping[str, Any]) -> Path:
    """``bench learn``: success per GRPO step, each seed and their mean with its 95%
    interval."""
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
    for seed, run in doc["seeds"].items():
        ax.plot(range(len(run["success"])), run["success"], color="#9db4ea", lw=0.8,
                label="one seed" if seed == next(iter(doc["seeds"])) else None)
    curve = doc["summary"]["curve"]
    xs = range(len(curve))
    mean = [m for m, _ in curve]
    ax.fill_between(xs, [m - h for m, h in curve], [m + h for m, h in curve],
                    color="#3b6fe0", alpha=0.18, lw=0, label="95% interval")
    ax.plot(xs, mean, color="#3b6fe0", lw=2, label=f"mean of {len(doc['seeds'])} seeds")
    ax.set_ylim(0, 1)
    ax.set_xlabel("GRPO step (weights pushed to the engines after each)")
    ax.set_ylabel("success (right code)")
    opts = doc["options"]
    how = ("StepRunner async GRPO" if opts.get("trainer") == "async" else "TRL GRPO")
    ax.set_title(f"lookup task, tiny model, {how} through the gateway "
                 f"({opts['groups']}x{opts['group_size']} a step)", fontsize=10)
    ax.legend(loc="upper left", fontsize=8, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
