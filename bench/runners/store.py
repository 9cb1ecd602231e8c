"""``rollout-gateway bench store``: trace-recording rate into Postgres and its size.

Three measurements, each on a fresh database:

- **writer**: swe-like call records (long prompts, ~350-token completions with
  logprobs, ~400-token observations, text kept as with ``store_text``) submitted to the
  gateway's own :class:`~gateway.store.writer.TraceWriter` as fast as it takes them;
  the writer's sustained rate, no HTTP involved.
- **end-to-end**: the same shape of trajectories driven through a gateway process
  (``python -m gateway serve``) against ``bench/harness/fast_upstream.py``: every turn sends the
  whole conversation, the upstream answers with the full ``prompt_token_ids`` (which
  extend the previous prompt+completion token for token), the gateway stores only the
  new tokens. Rate = tokens that reached the database / time until the last one did.
- **linearity**: trajectories of 10, 20, 40 and 80 turns through the gateway; bytes of
  each trajectory's rows (``pg_column_size``, TOAST included) against its length, with a
  fitted exponent (1 = linear; storing full prompts would approach 2).
- **routes** (``--routes ROUTER``, MoE routing replay): the writer measurement on fewer
  trajectories, without routed experts and with them on every call (the positions the
  gateway asks for: each turn's new prompt tokens and completion, random expert ids as
  incompressible as the simulated router's) in each store the writer has for them:
  segment files beside the database (``files``, the default,
  :mod:`gateway.store.route_files`) and the calls' rows (``database``); the three
  alternated ``routes_repeats`` times on fresh databases: each store's rate over the
  rate without, and the routes' bytes per token as stored.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench.harness import procs
from bench.harness.fast_upstream import sample, text_of
from bench.runners.overhead import machine, postgres_db

Progress = Callable[[str], None]
SYSTEM_TOKENS, TASK_TOKENS, COMPLETION_TOKENS = 1000, 500, 350


@dataclass
class StoreOptions:
    writer_trajectories: int = 400
    e2e_trajectories: int = 32
    turns: int = 20
    concurrency: int = 32
    linear_turns: list[int] = field(default_factory=lambda: [10, 20, 40, 80])
    server_cpus: str | None = "0"
    side_cpus: str | None = "1"
    pg_admin: str = "postgresql://postgres@127.0.0.1:5432/postgres"
    seed: int = 1
    out: Path = Path("artifacts/bench/store")
    routes: str | None = None  # a router of backends.sim.routes.MOE_SHAPES
    routes_trajectories: int = 40
    routes_repeats: int = 2


def observation_sizes(rng: np.random.Generator, turns: int) -> list[int]:
    """Tool observation lengths: LN(400, 1.1) capped at 6000 (the swe workload)."""
    return [int(min(6000, max(10, x))) for x in rng.lognormal(np.log(400), 1.1, turns)]


def words_text(n: int, offset: int) -> str:
    ids, _ = sample(n, offset)
    return text_of(ids)


# ---------------------------------------------------------------- sizes in Postgres
async def table_bytes(url: str) -> dict[str, int]:
    import asyncpg

    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        await conn.execute("VACUUM ANALYZE calls")
        await conn.execute("VACUUM ANALYZE trajectories")
        row = await conn.fetchrow(
            "SELECT pg_total_relation_size('calls') AS calls, "
            "pg_total_relation_size('trajectories') AS trajectories, "
            "coalesce(sum(length(prompt_delta) + length(completion_ids)) / 4, 0) AS tokens, "
            "count(*) AS n FROM calls")
        return {"calls_bytes": int(row["calls"]), "trajectories_bytes": int(row["trajectories"]),
                "tokens": int(row["tokens"]), "calls": int(row["n"])}
    finally:
        await conn.close()


async def trajectory_bytes(url: str) -> dict[str, dict[str, int]]:
    import asyncpg

    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        rows = await conn.fetch(
            "SELECT trajectory_id, sum(pg_column_size(c.*)) AS bytes, count(*) AS calls, "
            "sum(length(prompt_delta) + length(completion_ids)) / 4 AS tokens, "
            "sum(prompt_len) AS full_prompt_tokens FROM calls c GROUP BY trajectory_id")
        return {r["trajectory_id"]: {k: int(r[k]) for k in
                                     ("bytes", "calls", "tokens", "full_prompt_tokens")}
                for r in rows}
    finally:
        await conn.close()


def per_token(sizes: dict[str, int]) -> float | None:
    total = sizes["calls_bytes"] + sizes["trajectories_bytes"]
    return total / sizes["tokens"] if sizes["tokens"] else None


# ---------------------------------------------------------------- writer, directly
def _routes_piece(rng: np.random.Generator, start: int, end: int, layers: int, top_k: int,
                  experts: int) -> list[Any]:
    """The engine's answer for positions ``start .. end``: ``[start, base64 .npy]``."""
    import base64
    import io

    ids = rng.integers(0, experts, size=(end - start, layers, top_k), dtype=np.uint8)
    buf = io.BytesIO()
    np.save(buf, ids, allow_pickle=False)
    return [start, base64.b64encode(buf.getvalue()).decode()]


def synthetic_records(opts: StoreOptions, trajectories: int | None = None,
                      routes: str | None = None) -> list[Any]:
    """Call records as the gateway builds them for swe-like trajectories; with
    ``routes`` (a router's name), the routed experts it would ask each turn for."""
    from backends.sim.routes import MOE_SHAPES
    from gateway.store.records import CallRecord

    rng = np.random.default_rng(opts.seed)
    shape = MOE_SHAPES[routes] if routes else None
    out: list[CallRecord] = []
    for t in range(opts.writer_trajectories if trajectories is None else trajectories):
        length = 0
        for seq, obs in enumerate(observation_sizes(rng, opts.turns)):
            new = SYSTEM_TOKENS + TASK_TOKENS if seq == 0 else obs + 6
            delta, _ = sample(new, t * 1009 + seq * 31)
            comp, lps = sample(COMPLETION_TOKENS, t * 2003 + seq * 17 + 5)
            out.append(CallRecord(
                id=f"w{t:05d}{seq:03d}", trajectory_id=f"wt-{t}", group_id=f"wg-{t // 8}",
                seq=seq, endpoint="chat", model="bench", weight_version="0",
                started_at=time.time(), backend_id="b0", backend_url="http://127.0.0.1:1",
                tp=1, finish_reason="stop", queued_ms=0.1, total_ms=2.0,
                prompt_len=length + new, prompt_offset=length, prompt_delta=delta,
                completion_ids=comp, completion_logprobs=lps,
                prompt_tokens=length + new, completion_tokens=len(comp),
                request_messages=[{"role": "tool", "content": text_of(delta)}],
                completion_text=text_of(comp)))
            if shape is not None:  # from the previous turn's last token (never forwarded)
                out[-1].routes = [_routes_piece(
                    rng, max(0, length - 1), length + new + len(comp) - 1,
                    shape.num_layers, shape.top_k, shape.num_experts)]
            length += new + len(comp)
    return out


async def writer_rate(url: str, opts: StoreOptions, say: Progress,
                      records: list[Any] | None = None, routes_dir: Path | None = None,
                      max_queued: int | None = None) -> dict[str, Any]:
    """The writer's sustained rate into ``url``; routed experts into segment files in
    ``routes_dir`` if given, else into the calls' rows; with ``max_queued``, records are
    submitted only while fewer wait (below ``traces.routes_backlog``, past which the
    writer leaves routes out)."""
    from gateway.config import TraceSettings
    from gateway.store.db import make_engine, make_sessionmaker, upgrade
    from gateway.store.route_files import RouteFiles
    from gateway.store.writer import TraceWriter

    await asyncio.to_thread(upgrade, url)
    if records is None:
        say("writer: building records")
        records = synthetic_records(opts)
    engine = make_engine(url)
    files = RouteFiles(routes_dir) if routes_dir is not None else None
    writer = TraceWriter(make_sessionmaker(engine, files), TraceSettings(), route_files=files)
    writer.start()
    say(f"writer: {len(records)} calls into Postgres")
    started = time.perf_counter()
    for i, rec in enumerate(records):
        if max_queued is not None:  # a pool's pace: never so far ahead that routes go
            await _fewer_queued(writer, max_queued)
        elif i % 1000 == 0:  # let the writer run; back off while its queue is half full
            await asyncio.sleep(0.01 if writer.queue_depth * 2 > 100_000 else 0)
        writer.submit(rec)
    await writer.drain(600)
    elapsed = time.perf_counter() - started
    await writer.close()
    await engine.dispose()
    sizes = await table_bytes(url)
    return {"calls": writer.written, "dropped": writer.dropped,
            "routes_dropped": writer.routes_dropped + writer.routes_unwritten,
            "elapsed_s": elapsed,
            "calls_per_s": writer.written / elapsed, "tokens_per_s": sizes["tokens"] / elapsed,
            **sizes, "bytes_per_token": per_token(sizes)}


async def _fewer_queued(writer: Any, n: int) -> None:
    """Wait until fewer than ``n`` records wait for ``writer`` (polled: it has no event)."""
    for _ in range(10**7):
        if writer.queue_depth < n:
            return
        await asyncio.sleep(0.001)


# ---------------------------------------------------------------- through the gateway
async def drive_trajectory(session: Any, url: str, tid: str, turns: int, seed: int) -> int:
    """One swe-like conversation through ``url``; returns the calls it made."""
    rng = np.random.default_rng(seed)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": words_text(SYSTEM_TOKENS, seed)},
        {"role": "user", "content": words_text(TASK_TOKENS, seed + 1)}]
    headers = {"content-type": "application/json", "x-trajectory-id": tid,
               "x-group-id": f"g-{seed // 8}"}
    for turn, obs in enumerate(observation_sizes(rng, turns)):
        body = orjson.dumps({"model": "bench", "messages": messages,
                             "max_tokens": COMPLETION_TOKENS})
        async with session.post(f"{url}/v1/chat/completions", data=body,
                                headers=headers) as resp:
            answer = orjson.loads(await resp.read())
            if resp.status != 200:
                raise RuntimeError(f"gateway answered {resp.status}: {answer}")
        messages.append({"role": "assistant",
                         "content": answer["choices"][0]["message"]["content"]})
        messages.append({"role": "tool", "content": words_text(obs, seed * 100 + turn)})
    return turns


async def drive(url: str, plan: list[tuple[str, int, int]], concurrency: int,
                say: Progress) -> int:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    done = 0

    async def one(tid: str, turns: int, seed: int) -> int:
        nonlocal done
        async with sem:
            n = await drive_trajectory(session, url, tid, turns, seed)
        done += 1
        say(f"end-to-end: {done}/{len(plan)} trajectories")
        return n

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=300)) as session:
        return sum(await asyncio.gather(*(one(*p) for p in plan)))


async def wait_recorded(url: str, calls: int, timeout_s: float = 120) -> float:
    """Seconds (perf_counter) at which ``calls`` rows were in the table."""
    import asyncpg

    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            if await conn.fetchval("SELECT count(*) FROM calls") >= calls:
                return time.perf_counter()
            await asyncio.sleep(0.02)
    finally:
        await conn.close()
    raise RuntimeError(f"fewer than {calls} calls recorded after {timeout_s:g}s")


def through_gateway(plan: list[tuple[str, int, int]], opts: StoreOptions, say: Progress,
                    work: Path, label: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run ``plan`` (trajectory id, turns, seed) through a gateway process on a fresh DB;
    returns (rates and sizes, per-trajectory bytes)."""
    with postgres_db(opts.pg_admin, f"rg_bench_store_{label}") as db, \
            procs.fast_upstream(opts.side_cpus, work / "upstream.log") as upstream, \
            procs.gateway(upstream, db, opts.server_cpus, log=work / f"gateway-{label}.log",
                          env={"ROLLOUT_GATEWAY_DISPATCH__CAP_PER_GPU": "4096",
                               "ROLLOUT_GATEWAY_TRACES__SPOOL_PATH":
                                   str(work / f"spool-{label}.jsonl")}) as url:
        started = time.perf_counter()
        calls = asyncio.run(drive(url, plan, opts.concurrency, say))
        answered = time.perf_counter()
        recorded = asyncio.run(wait_recorded(db, calls))
        sizes = asyncio.run(table_bytes(db))
        per_traj = asyncio.run(trajectory_bytes(db))
    elapsed = recorded - started
    return ({"calls": calls, "elapsed_s": elapsed, "answer_s": answered - started,
             "calls_per_s": calls / elapsed, "tokens_per_s": sizes["tokens"] / elapsed,
             **sizes, "bytes_per_token": per_token(sizes)}, per_traj)


def linearity(opts: StoreOptions, say: Progress, work: Path) -> dict[str, Any]:
    plan = [(f"lin-{n}", n, 7000 + n) for n in opts.linear_turns]
    _, per_traj = through_gateway(plan, opts, say, work, "linear")
    rows = [{"turns": n, **per_traj[f"lin-{n}"]} for n in opts.linear_turns]
    x = np.log([r["tokens"] for r in rows])
    fit = float(np.polyfit(x, np.log([r["bytes"] for r in rows]), 1)[0])
    naive = float(np.polyfit(x, np.log([r["full_prompt_tokens"] * 4 for r in rows]), 1)[0])
    t = np.log([r["turns"] for r in rows])
    return {"trajectories": rows, "exponent_bytes_vs_tokens": fit,
            "exponent_bytes_vs_turns": float(np.polyfit(t, np.log([r["bytes"] for r in rows]),
                                                        1)[0]),
            "exponent_full_prompts_vs_tokens": naive}


def run_store(opts: StoreOptions, say: Progress, command: str) -> dict[str, Any]:
    import tempfile

    opts.out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"command": command, "machine": machine(),
                           "placement": {"server_cpus": opts.server_cpus,
                                         "side_cpus": opts.side_cpus},
                           "shape": {"system_tokens": SYSTEM_TOKENS, "task_tokens": TASK_TOKENS,
                                     "completion_tokens": COMPLETION_TOKENS,
                                     "observation_tokens": "LN(400, 1.1) cap 6000",
                                     "turns": opts.turns}}
    started = time.time()
    with postgres_db(opts.pg_admin, "rg_bench_store_writer") as db:
        doc["writer"] = asyncio.run(writer_rate(db, opts, say))
    with tempfile.TemporaryDirectory() as tmp:
        plan = [(f"e2e-{i}", opts.turns, i) for i in range(opts.e2e_trajectories)]
        doc["end_to_end"], _ = through_gateway(plan, opts, say, Path(tmp), "e2e")
        doc["linearity"] = linearity(opts, say, Path(tmp))
    doc["wall_s"] = time.time() - started
    doc["targets"] = store_targets(doc)
    return doc


def store_targets(doc: dict[str, Any]) -> dict[str, Any]:
    w, e = doc["writer"], doc["end_to_end"]
    return {
        "writer_tokens_per_s_ge_200k": {"value": w["tokens_per_s"],
                                        "met": w["tokens_per_s"] >= 200_000},
        "end_to_end_tokens_per_s_ge_200k": {"value": e["tokens_per_s"],
                                            "met": e["tokens_per_s"] >= 200_000},
        "bytes_per_token_le_8": {"value": e["bytes_per_token"],
                                 "met": (e["bytes_per_token"] or 1e9) <= 8.0},
        "linear_growth": {"value": doc["linearity"]["exponent_bytes_vs_tokens"],
                          "met": doc["linearity"]["exponent_bytes_vs_tokens"] <= 1.1},
    }
