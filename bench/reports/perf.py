"""Reports of ``bench overhead`` and ``bench store``: markdown and PNG plots, both made
from the run's JSON (never typed in), and their sections of ``BENCHMARKS.md``."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any


def _f(v: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def _met(t: dict[str, Any]) -> str:
    return "**met**" if t["met"] else "**missed**"


# ---------------------------------------------------------------- overhead
def overhead_markdown(doc: dict[str, Any], plots: dict[str, str]) -> str:
    s, m = doc["summary"], doc["machine"]
    lines = [
        "Command (one run, all targets side by side):", "", "```", doc["command"], "```", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, Python {m['python']}; load average at "
        f"start {', '.join(f'{x:.1f}' for x in m['load_avg_at_start'])}. Placement: server "
        f"under test on CPU {doc['placement']['server_cpus']}, upstream + load generator on "
        f"CPU {doc['placement']['side_cpus']}, Postgres unpinned. Wall time "
        f"{doc['wall_s']:.0f} s.", "",
        "| target | max sustained rate (req/s) | closed-loop saturation (req/s) | "
        "server CPU per call at 250 req/s (ms) |", "|---|---|---|---|"]
    for name, res in doc["results"].items():
        step = res["fixed"].get("250", {})
        lines.append(f"| {name} | {s['max_rate_rps'][name]:.0f} | "
                     f"{s['saturation_rps'][name]:.0f} | "
                     f"{_f(step.get('server_cpu_ms_per_call'), '{:.3f}')} |")
    lines += ["", "Latency by offered rate (ms; streamed and non-streamed calls alternate; "
              "added = target - direct):", "",
              "| target | rate | p50 | p99 | added p50 | added p99 | added p50 stream | "
              "added p99 stream | errors |", "|---|---|---|---|---|---|---|---|---|"]
    lines += _latency_rows(doc)
    lines += _references(doc)
    lines += ["", "Targets:", "", "| target | value | status |", "|---|---|---|"]
    t = s["targets"]
    lines += [
        f"| p50 added latency at 500 req/s <= 1 ms | "
        f"{_f(t['p50_added_at_500_le_1ms']['value'], '{:.3f} ms')} | "
        f"{_met(t['p50_added_at_500_le_1ms'])} |",
        f"| p99 added latency at 500 req/s <= 5 ms | "
        f"{_f(t['p99_added_at_500_le_5ms']['value'], '{:.3f} ms')} | "
        f"{_met(t['p99_added_at_500_le_5ms'])} |",
        f"| max rate >= 3x LiteLLM's, same core | "
        f"{_f(t['max_rate_ge_3x_litellm']['value'], '{:.1f}x')} | "
        f"{_met(t['max_rate_ge_3x_litellm'])} |", ""]
    lines += [f"![{k}]({v})" for k, v in plots.items()]
    return "\n".join(lines) + "\n"


def _references(doc: dict[str, Any]) -> list[str]:
    """The two references: what a bare Python hop costs, and LiteLLM as its users run it."""
    s, lines = doc["summary"], []
    own = s.get("gateway_over_plain_ms")
    if own:
        lines += ["", "The gateway's own cost (gateway - plain reverse proxy, same rate; "
                  "the plain proxy forwards bytes and records nothing):", "",
                  "| rate | added p50 (ms) | added p99 (ms) |", "|---|---|---|"]
        lines += [f"| {rate} | {_f(_dig(v, 'p50_ms'))} | {_f(_dig(v, 'p99_ms'))} |"
                  for rate, v in own.items()]
    lite, info = s.get("litellm_per_core"), doc.get("info", {}).get("litellm", {})
    if lite:
        errors = info.get("server_log_errors", {})
        lines += ["", f"LiteLLM {info.get('version', '?')} as its production guide sets it up "
                  f"({info.get('workers')} worker(s), one per core it gets; log level ERROR; "
                  f"master key; custom-callback logging). Its own readiness check before and "
                  f"after the run: {_dig(info, 'health_before', 'status')} / "
                  f"{_dig(info, 'health_after', 'status')}; error lines in its output: "
                  f"{errors.get('count', '?')}. Closed-loop saturation per worker core: "
                  f"{lite['saturation_rps_per_core']:.0f} req/s (p50 "
                  f"{_f(lite['saturation_p50_ms'], '{:.0f}')} ms, p99 "
                  f"{_f(lite['saturation_p99_ms'], '{:.0f}')} ms); its published benchmark "
                  f"implies {lite['published_rps_per_vcpu']:.0f} req/s per vCPU at p50 "
                  f"{lite['published_p50_ms']:.0f} ms / p99 {lite['published_p99_ms']:.0f} ms "
                  f"({lite['source']}): {lite['ratio_to_published']:.2f}x of it per core."]
    return lines


def _latency_rows(doc: dict[str, Any]) -> list[str]:
    rows = []
    added = doc["summary"].get("added_latency_ms", {})
    for name, res in doc["results"].items():
        for rate, step in res["fixed"].items():
            if "skipped" in step:
                rows.append(f"| {name} | {rate} | - | - | - | - | - | - | {step['skipped']} |")
                continue
            a = (added.get(name) or {}).get(rate) or {}
            rows.append(
                f"| {name} | {rate} | {_f(step['all']['p50_ms'])} | {_f(step['all']['p99_ms'])}"
                f" | {_f(_dig(a, 'all', 'p50_ms'))} | {_f(_dig(a, 'all', 'p99_ms'))} | "
                f"{_f(_dig(a, 'stream', 'p50_ms'))} | {_f(_dig(a, 'stream', 'p99_ms'))} | "
                f"{step['errors']} |")
    return rows


def _dig(d: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)  # type: ignore[assignment]
    return d


def overhead_plots(doc: dict[str, Any], out: Path) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, res in doc["results"].items():
        pts = [(float(r), s) for r, s in res["fixed"].items() if "skipped" not in s]
        if not pts:
            continue
        xs = [p[0] for p in pts]
        axes[0].plot(xs, [p[1]["all"]["p50_ms"] for p in pts], "o-", label=name)
        axes[1].plot(xs, [p[1]["all"]["p99_ms"] for p in pts], "o-", label=name)
    for ax, title in zip(axes, ("p50 latency", "p99 latency"), strict=True):
        ax.set(title=title, xlabel="offered rate (req/s)", ylabel="ms", yscale="log")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    paths = {"latency by rate": "overhead-latency.png"}
    fig.savefig(out / paths["latency by rate"], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(doc["summary"]["max_rate_rps"])
    ax.bar(names, [doc["summary"]["max_rate_rps"][n] for n in names])
    ax.set(title="max sustained request rate (one core)", ylabel="req/s")
    fig.tight_layout()
    paths["max rate"] = "overhead-max-rate.png"
    fig.savefig(out / paths["max rate"], dpi=110)
    plt.close(fig)
    return paths


# ---------------------------------------------------------------- BENCHMARKS.md
def write_section(benchmarks: Path, heading: str, body: str) -> None:
    """Replace (or append) the ``## heading`` section of ``benchmarks``; other sections
    are left exactly as they are."""
    text = benchmarks.read_text() if benchmarks.exists() else "# Benchmarks\n"
    section = f"## {heading}\n\n{body.rstrip()}\n"
    pattern = re.compile(rf"^## {re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _m: section + "\n", text, count=1).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + section
    benchmarks.write_text(text)


def record(benchmarks: Path, heading: str, intro: str, markdown: str, out: Path,
           plots: dict[str, str], assets: Path) -> None:
    """Copy the run's plots next to ``BENCHMARKS.md`` and write its section."""
    assets.mkdir(parents=True, exist_ok=True)
    rel = assets.relative_to(benchmarks.parent)
    for name in plots.values():
        shutil.copy(out / name, assets / name)
        markdown = markdown.replace(f"]({name})", f"]({rel}/{name})")
    write_section(benchmarks, heading, intro.rstrip() + "\n\n" + markdown)


# ---------------------------------------------------------------- store
def store_markdown(doc: dict[str, Any], plots: dict[str, str]) -> str:
    m, w, e, lin = doc["machine"], doc["writer"], doc["end_to_end"], doc["linearity"]
    lines = [
        "Command:", "", "```", doc["command"], "```", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, Python {m['python']}; load average at "
        f"start {', '.join(f'{x:.1f}' for x in m['load_avg_at_start'])}. Gateway on CPU "
        f"{doc['placement']['server_cpus']}, upstream + harness on CPU "
        f"{doc['placement']['side_cpus']}, Postgres unpinned. Wall time {doc['wall_s']:.0f} s."
        f" Shape: system {doc['shape']['system_tokens']} + task {doc['shape']['task_tokens']}"
        f" tokens, {doc['shape']['turns']} turns of {doc['shape']['completion_tokens']} "
        f"completion tokens and {doc['shape']['observation_tokens']} observation tokens.", "",
        "| measurement | calls | tokens | seconds | calls/s | tokens/s | bytes | bytes/token |",
        "|---|---|---|---|---|---|---|---|"]
    for name, r in (("writer (TraceWriter direct)", w), ("end-to-end (through the gateway)", e)):
        lines.append(f"| {name} | {r['calls']} | {r['tokens']} | {r['elapsed_s']:.2f} | "
                     f"{r['calls_per_s']:.0f} | {r['tokens_per_s']:.0f} | "
                     f"{r['calls_bytes'] + r['trajectories_bytes']} | "
                     f"{_f(r['bytes_per_token'])} |")
    lines += ["", "Per-trajectory storage (through the gateway, one trajectory each):", "",
              "| turns | calls | tokens stored | bytes (rows, TOAST incl.) | bytes/token | "
              "tokens if full prompts were stored |", "|---|---|---|---|---|---|"]
    for r in lin["trajectories"]:
        lines.append(f"| {r['turns']} | {r['calls']} | {r['tokens']} | {r['bytes']} | "
                     f"{r['bytes'] / r['tokens']:.2f} | {r['full_prompt_tokens']} |")
    lines += ["", f"Fitted exponent, bytes vs tokens: **{lin['exponent_bytes_vs_tokens']:.3f}**"
              f" (bytes vs turns: {lin['exponent_bytes_vs_turns']:.3f}; storing full prompts "
              f"would give {lin['exponent_full_prompts_vs_tokens']:.3f} vs tokens).", "",
              "Targets:", "", "| target | value | status |", "|---|---|---|"]
    names = {"writer_tokens_per_s_ge_200k": "writer >= 200k tokens/s",
             "end_to_end_tokens_per_s_ge_200k": "end-to-end >= 200k tokens/s",
             "bytes_per_token_le_8": "<= 8 bytes/token (end-to-end tables)",
             "linear_growth": "linear growth (exponent <= 1.1)"}
    for key, label in names.items():
        t = doc["targets"][key]
        lines.append(f"| {label} | {_f(t['value'])} | {_met(t)} |")
    lines.append("")
    if "routes" in doc:
        lines += _routes_lines(doc["routes"])
    lines += [f"![{k}]({v})" for k, v in plots.items()]
    return "\n".join(lines) + "\n"


def _routes_lines(r: dict[str, Any]) -> list[str]:
    """The writer without routed experts and with them in each store (``bench store
    --routes``)."""
    modes = list(r["runs"])
    out = [f"Routed experts ({r['router']}: {r['layers']} layers x top {r['top_k']} of "
           f"{r['experts']}, {r['raw_bytes_per_token']} B per token raw), the writer on "
           f"{r['trajectories']} trajectories, runs alternated on fresh databases: without "
           "routes, with them in segment files beside the database (`files`, the default), "
           "and in the calls' rows (`database`):", "",
           "| run | routes | calls/s | tokens/s | routes' bytes |", "|---|---|---|---|---|"]
    for i in range(len(r["runs"][modes[0]])):
        for mode in modes:
            run = r["runs"][mode][i]
            if mode == "disk":
                out.append(f"| {i + 1} | the disk alone ({run['mb_per_s']:.0f} MB/s) | "
                           f"{run['calls_per_s']:.0f} | | |")
                continue
            out.append(f"| {i + 1} | {mode} | {run['calls_per_s']:.0f} | "
                       f"{run['tokens_per_s']:.0f} | {run.get('routes_bytes', 0)} |")
    out.append("")
    for mode in modes[1:]:
        m = r[mode]
        size = f"; {_f(m['routes_bytes_per_token'])} B per token" \
            if "routes_bytes_per_token" in m else ""
        out.append(f"- `{mode}`: rate with routes / without "
                   f"{', '.join(f'{x:.3f}' for x in m['rate_ratio'])} (mean "
                   f"{m['rate_ratio_mean']:.3f}){size}")
    if "bound" in r:
        b = r["bound"]
        out += ["", f"0.9 of the writer's rate without routes, at {b['bytes_per_call'] / 1e3:.0f}"
                f" kB of routes a call, is {b['needed_mb_per_s']:.0f} MB/s of routes to disk; "
                f"the disk alone took {b['disk_mb_per_s']:.0f} MB/s in the same run."]
    return [*out, ""]


def store_plots(doc: dict[str, Any], out: Path) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["linearity"]["trajectories"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    toks = [r["tokens"] for r in rows]
    axes[0].loglog(toks, [r["bytes"] for r in rows], "o-", label="stored (prefix delta)")
    axes[0].loglog(toks, [r["full_prompt_tokens"] * 4 for r in rows], "s--",
                   label="full prompts, 4 B/id (for contrast)")
    axes[0].set(title=f"bytes per trajectory (exponent "
                      f"{doc['linearity']['exponent_bytes_vs_tokens']:.2f})",
                xlabel="tokens in the trajectory", ylabel="bytes")
    axes[0].legend()
    axes[0].grid(alpha=0.3, which="both")
    names = ["writer", "end_to_end"]
    axes[1].bar(names, [doc[n]["tokens_per_s"] / 1000 for n in names])
    axes[1].axhline(200, color="red", ls="--", label="target 200k")
    axes[1].set(title="tokens recorded per second", ylabel="k tokens/s")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(out / "store.png", dpi=110)
    plt.close(fig)
    return {"store: growth and rate": "store.png"}
