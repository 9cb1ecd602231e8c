"""``rollout-gateway bench learn-two``: two policies learn at once through one gateway.

Per seed, ``examples/lookup_task.py``'s warm start, then a gateway over a managed pool of
real vLLM CPU engines serving it with LoRA on and two adapter families declared on it
(``solver`` and ``checker``), and ``examples/two_policies.py``: every trajectory has the
solver answer the lookup task, then the checker, each rewarded for its own answer
(``finish``'s ``rewards``); after each step each adapter trains on its own samples and is
pushed as its family's. The JSON holds each policy's success per step and its summary
over seeds (as ``bench learn``'s); both must rise.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from bench.runners.learn import ROOT, VLLM_PYTHON, _run, _serve, _stop, summarize

POLICIES = ("solver", "checker")


def learn_two(
    seeds: Annotated[int, typer.Option(help="seeds 0..N-1 (warm start and GRPO)")] = 3,
    steps: Annotated[int, typer.Option(help="GRPO steps per seed")] = 24,
    groups: Annotated[int, typer.Option(help="prompts per step")] = 4,
    group_size: Annotated[int, typer.Option(help="trajectories per prompt")] = 8,
    lr: Annotated[float, typer.Option(help="the adapters' learning rate")] = 2e-3,
    rank: Annotated[int, typer.Option(help="LoRA rank of both adapters")] = 16,
    port: Annotated[int, typer.Option(help="the gateway's port")] = 8019,
    work_dir: Annotated[Path, typer.Option(help="models, adapters, logs")] = Path(
        "learn-two-run"),
    vllm_python: Annotated[Path, typer.Option(help="the CPU build of vLLM's python")] = Path(
        os.environ.get("ROLLOUT_GATEWAY_VLLM_PYTHON", VLLM_PYTHON)),
    json_out: Annotated[Path | None, typer.Option("--json", help="results")] = None,
) -> None:
    """Two LoRA policies (a solver and a checker) in every trajectory, both trained: each
    one's success per step over seeds."""
    work = work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    subprocess.run([str(vllm_python), "-m", "backends.tinymodel", str(work / "tiny")],
                   cwd=ROOT, check=True, capture_output=True)
    doc: dict[str, Any] = {"benchmark": "learn-two", "command": shlex.join(
        ["rollout-gateway", *sys.argv[1:]]), "options": {
        "seeds": seeds, "steps": steps, "groups": groups, "group_size": group_size,
        "lr": lr, "rank": rank}, "seeds": {}}
    families = ",".join(f"{p}=tiny" for p in POLICIES)
    for seed in range(seeds):
        policy = work / f"policy-{seed}"
        _run(["examples/lookup_task.py", "warm-start", "--base", str(work / "tiny"),
              "--out", str(policy), "--seed", str(seed)], work / f"warm-{seed}.log")
        # the adapters of both families, two versions each, loaded at once
        gateway = _serve(work, vllm_python, 1, port, rank, model=policy, slots=4,
                         env={"ROLLOUT_GATEWAY_LORA_MODELS": families})
        try:
            out = work / f"two-{seed}.json"
            _run(["examples/two_policies.py", "--gateway", f"http://127.0.0.1:{port}",
                  "--model-path", str(policy), "--work-dir", str(work / f"run-{seed}"),
                  "--steps", str(steps), "--groups", str(groups), "--group-size",
                  str(group_size), "--lr", str(lr), "--rank", str(rank), "--seed",
                  str(seed), "--json", str(out)], work / f"two-{seed}.log",
                 echo=f"seed {seed} ")
        finally:
            _stop(gateway)
        run = json.loads(out.read_text())
        doc["seeds"][str(seed)] = {p: {
            "success": [s[p]["success"] for s in run["steps"]],
            "versions": [s[p]["served_version"] for s in run["steps"]],
            "stamped": [s[p]["stamped"] for s in run["steps"]],
            "trained_tokens": [s[p]["trained_tokens"] for s in run["steps"]],
        } for p in POLICIES} | {"step_s": statistics.fmean(s["step_s"] for s in run["steps"]),
                                "total_s": run["total_s"]}
    doc["summary"] = {p: _summary(doc, p) for p in POLICIES}
    doc["total_s"] = round(time.monotonic() - t0, 1)
    for p, s in doc["summary"].items():
        typer.echo(f"{p}: success {s['start'][0]:.2f} -> {s['end'][0]:.2f} (rise "
                   f"{s['rise'][0]:+.2f} +- {s['rise'][1]:.2f} over {seeds} seeds)")
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(doc, indent=1) + "\n")


def _summary(doc: dict[str, Any], policy: str) -> dict[str, Any]:
    """:func:`bench.runners.learn.summarize` of one policy's curves (the steps' time is
    the two policies' together)."""
    runs = {seed: {"success": r[policy]["success"], "timings": [
        {"rollout_s": r["step_s"], "fetch_s": 0.0, "train_s": 0.0, "push_s": 0.0}]}
        for seed, r in doc["seeds"].items()}
    return summarize({"seeds": runs})
