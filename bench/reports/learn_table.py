"""BENCHMARKS.md's ``bench learn`` block: success per GRPO step through the gateway, per
seed and over seeds, for each trainer recorded under ``docs/benchmarks/learning/``."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

BENCH = "docs/benchmarks"
LEARN = {"lookup-3seeds": "TRL's `GRPOTrainer` (the adapter), synchronous",
         "lookup-async-3seeds": "the client's `StepRunner`, async mode, staleness bound 1",
         "lookup-trl-async-3seeds": "TRL's `AsyncGRPOTrainer` (`gateway.client.trl_async`), "
                                    "staleness bound 1",
         "lookup-trl-lora-3seeds": "TRL's `GRPOTrainer` training a LoRA adapter (peft), each "
                                   "step's adapter loaded beside the engines' weights, no pause"}
#: ``bench learn-two``: two policies in every trajectory
LEARN_TWO = {"two-policies-3seeds": "Two LoRA policies in every trajectory "
                                    "(`examples/two_policies.py`), both trained"}


def learning_table(root: Path) -> str:
    blocks = [_learning(name, title, root) for name, title in LEARN.items()
              if (root / BENCH / "learning" / f"{name}.json").exists()]
    blocks += [_two(name, title, root) for name, title in LEARN_TWO.items()
               if (root / BENCH / "learning" / f"{name}.json").exists()]
    return "\n\n".join(blocks)


def _two(name: str, title: str, root: Path) -> str:
    """``bench learn-two``: each policy's success at the start and end, per seed and over
    seeds, and the command."""
    doc = json.loads((root / BENCH / "learning" / f"{name}.json").read_text())
    o, policies = doc["options"], list(doc["summary"])
    lines = [f"**{title}.** {o['seeds']} seeds, {o['steps']} steps of {o['groups']} groups x "
             f"{o['group_size']} trajectories, rank-{o['rank']} adapters, lr {o['lr']:g}, one "
             "vLLM CPU engine; each policy's start and end = its mean success over the first "
             "and last 3 steps (95% t-interval over seeds).\n",
             "| seed | " + " | ".join(f"{p} start | {p} end" for p in policies) + " |",
             "|---|" + "---|---|" * len(policies)]
    for seed, run in doc["seeds"].items():
        cells = [f"{statistics.fmean(run[p]['success'][:3]):.2f} | "
                 f"{statistics.fmean(run[p]['success'][-3:]):.2f}" for p in policies]
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    lines.append("| **mean** | " + " | ".join(
        f"**{doc['summary'][p]['start'][0]:.2f} ± {doc['summary'][p]['start'][1]:.2f}** | "
        f"**{doc['summary'][p]['end'][0]:.2f} ± {doc['summary'][p]['end'][1]:.2f}**"
        for p in policies) + " |")
    lines += ["", "```sh", doc["command"], "```"]
    return "\n".join(lines)


def _learning(name: str, title: str, root: Path) -> str:
    """``bench learn``: success per seed at the start and end of GRPO, the mean curve every
    few steps, where a step's time goes, and the command."""
    doc = json.loads((root / BENCH / "learning" / f"{name}.json").read_text())
    s, o = doc["summary"], doc["options"]

    def pm(v: list[float], fmt: str = ".2f") -> str:
        return f"{v[0]:{fmt}} ± {v[1]:{fmt}}"
    lines = [f"**{title}.** {o['seeds']} seeds, {o['steps']} GRPO steps of {o['groups']} groups x "
             f"{o['group_size']} trajectories, lr {o['lr']:g}"
             + (f", a rank-{o['lora']} adapter on {o['lora_targets']}" if o.get("lora") else "")
             + f", {o['engines']} vLLM CPU engine(s); start and end = mean success of the "
             "first and last 3 steps (95% t-interval over seeds).\n",
             "| seed | warm start (s) | start | end | end / start | max staleness |",
             "|---|---|---|---|---|---|"]
    for seed, run in doc["seeds"].items():
        a, b = (statistics.fmean(run["success"][:3]), statistics.fmean(run["success"][-3:]))
        lines.append(f"| {seed} | {run['warm_start']['seconds']:.0f} | {a:.2f} | {b:.2f} | "
                     f"{b / a if a else float('inf'):.1f}x | {run['max_staleness']} |")
    lines.append(f"| **mean** | | **{pm(s['start'])}** | **{pm(s['end'])}** | "
                 f"**{pm(s['ratio'], '.1f')}x** | |")
    met = sum(statistics.fmean(r["success"][-3:]) >= max(0.6, 2 * statistics.fmean(
        r["success"][:3])) for r in doc["seeds"].values())
    lines += ["", f"End at least twice the start and at least 0.60 (issue 43's target): "
              f"{met} of {len(doc['seeds'])} seeds."]
    every = max(1, len(s["curve"]) // 8)
    lines += ["", "| step | " + " | ".join(str(k) for k in range(0, len(s["curve"]), every))
              + " |", "|---|" + "---|" * len(range(0, len(s["curve"]), every)),
              "| success | " + " | ".join(f"{m:.2f}" for m, _ in s["curve"][::every]) + " |",
              "", f"A step takes {s['step_s']:.1f} s: " + (
                  f"waiting for the batch {s['seconds']['rollout_s']:.1f} s (rollouts run "
                  "all along, sharing the CPUs with the trainer)"
                  if o.get("trainer") in ("async", "trl-async") else
                  f"rollout {s['seconds']['rollout_s']:.1f} s, fetch "
                  f"{s['seconds']['fetch_s']:.2f} s") + f", train "
              f"{s['seconds']['train_s']:.1f} s, save and push {s['seconds']['push_s']:.2f} s.",
              "",
              f"![success per GRPO step](docs/benchmarks/learning/{name}.png)", "",
              "```sh", doc["command"], "```"]
    return "\n".join(lines)
