"""``bench store --routes``: the trace writer's rate with MoE routed experts, in each
store it has for them, beside the disk alone (:mod:`bench.runners.store`'s writer
measurement on fewer trajectories; docs/moe.md, "Storage")."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.runners.overhead import postgres_db
from bench.runners.store import Progress, StoreOptions, synthetic_records, writer_rate

#: the runs of the routes measurement: without routes, the disk alone taking the routes'
#: bytes (the bound on any store of them), then each store of them
ROUTE_MODES = ("without", "disk", "files", "database")
#: records waiting at most, in every run of it: half the writer's ``routes_backlog``
ROUTES_QUEUED = 1_000


def disk_rate(records: list[Any], routes_dir: Path, batch: int) -> dict[str, Any]:
    """The disk alone: the records' routes, decoded beforehand, appended to segment files
    ``batch`` calls at a time and flushed (``fdatasync``) as the writer does, nothing else.
    No store of these bytes can write them faster."""
    from gateway.store.route_files import RouteFiles
    from gateway.store.routes import merge

    blobs = [m[1] for r in records if r.routes and (m := merge(r.routes)) is not None]
    files = RouteFiles(routes_dir)
    started = time.perf_counter()
    for i in range(0, len(blobs), batch):
        files.append(blobs[i:i + batch])
    elapsed = time.perf_counter() - started
    return {"calls": len(blobs), "elapsed_s": elapsed, "calls_per_s": len(blobs) / elapsed,
            "mb_per_s": sum(map(len, blobs)) / elapsed / 1e6}


async def routes_bytes(url: str) -> int:
    import asyncpg

    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        return int(await conn.fetchval("SELECT coalesce(sum(pg_column_size(routes)), 0) "
                                       "FROM calls"))
    finally:
        await conn.close()


#: the runs of the routes measurement: without routes, the disk alone taking the routes'
#: bytes (the bound on any store of them), then each store of them
ROUTE_MODES = ("without", "disk", "files", "database")
#: records waiting at most, in every run of it: half the writer's ``routes_backlog``
ROUTES_QUEUED = 1_000


def routes_rate(opts: StoreOptions, say: Progress) -> dict[str, Any]:
    """The writer without routed experts and with them in each store, alternated on fresh
    databases (and fresh segment directories)."""
    import shutil
    import tempfile

    assert opts.routes is not None
    from backends.sim.routes import MOE_SHAPES
    from gateway.config import TraceSettings

    shape = MOE_SHAPES[opts.routes]
    say(f"routes: building records ({opts.routes_trajectories} trajectories, twice)")
    plain = synthetic_records(opts, opts.routes_trajectories)
    routed = synthetic_records(opts, opts.routes_trajectories, opts.routes)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in ROUTE_MODES}
    for i in range(opts.routes_repeats):
        for mode in ROUTE_MODES:
            # the records are written as they are: fresh copies for each run
            records = [replace(r) for r in (plain if mode == "without" else routed)]
            tmp = Path(tempfile.mkdtemp(prefix="rg-routes-"))
            say(f"routes: run {i + 1}/{opts.routes_repeats}, {mode}")
            try:
                if mode == "disk":
                    run = disk_rate(records, tmp, TraceSettings().batch_size)
                    runs[mode].append(run)
                    continue
                with postgres_db(opts.pg_admin, "rg_bench_store_routes") as db:
                    run = asyncio.run(writer_rate(
                        db, opts, say, records, routes_dir=tmp if mode == "files" else None,
                        max_queued=ROUTES_QUEUED))
                    run["routes_bytes"] = asyncio.run(routes_bytes(db)) + sum(
                        p.stat().st_size for p in tmp.iterdir())
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            runs[mode].append(run)
    tokens = runs["files"][0]["tokens"]
    out: dict[str, Any] = {
        "router": opts.routes, "layers": shape.num_layers, "top_k": shape.top_k,
        "experts": shape.num_experts, "trajectories": opts.routes_trajectories, "runs": runs,
        "raw_bytes_per_token": shape.num_layers * shape.top_k * np.dtype(shape.dtype).itemsize}
    for mode in ROUTE_MODES[1:]:
        ratios = [w["calls_per_s"] / o["calls_per_s"]
                  for o, w in zip(runs["without"], runs[mode], strict=True)]
        out[mode] = {"rate_ratio": ratios, "rate_ratio_mean": float(np.mean(ratios))}
        if mode != "disk":
            out[mode]["routes_bytes_per_token"] = runs[mode][0]["routes_bytes"] / tokens \
                if tokens else None
    # the bound: the rate a target of 0.9 of the writer's asks, against the disk's own
    per_call = runs["files"][0]["routes_bytes"] / runs["files"][0]["calls"]
    out["bound"] = {"bytes_per_call": per_call,
                    "needed_mb_per_s": 0.9 * float(np.mean(
                        [r["calls_per_s"] for r in runs["without"]])) * per_call / 1e6,
                    "disk_mb_per_s": float(np.mean([r["mb_per_s"] for r in runs["disk"]]))}
    return out
