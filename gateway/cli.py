"""The gateway's commands: ``serve``, ``migrate``, ``export``, ``sim-backend``.

``rollout_gateway.cli`` mounts them, with ``demo`` and the ``bench`` group, as the
``rollout-gateway`` command; this module knows nothing of the benchmarks.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any

import typer

from gateway.config import Settings
from gateway.policies.registry import LIVE_NAMES, resolve_name

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

app = typer.Typer(help="Trajectory-aware gateway for agentic RL rollouts.", no_args_is_help=True,
                  pretty_exceptions_show_locals=False)


def _settings(**overrides: object) -> Settings:
    values = {k: v for k, v in overrides.items() if v not in (None, [], ())}
    return Settings(**values)  # type: ignore[arg-type]


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="bind address")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="bind port")] = 8000,
    backend: Annotated[list[str] | None, typer.Option(
        help="an OpenAI-compatible backend URL (repeatable); URL#tp=N declares its TP")] = None,
    pool: Annotated[Path | None, typer.Option(help="pool spec file (managed pool)")] = None,
    database_url: Annotated[str | None, typer.Option(help="SQLAlchemy async URL")] = None,
    policy: Annotated[str | None, typer.Option(
        help="scheduling policy (default replay; docs/policies.md)")] = None,
    wait_ready: Annotated[bool | None, typer.Option(
        "--wait-ready/--no-wait-ready",
        help="open the port only once the pool's initial engines are up (exit 3 if none "
        "comes up); default: open it at once, GET /ready answers 503 until then "
        "(ROLLOUT_GATEWAY_SERVER__WAIT_READY)")] = None,
    log_level: Annotated[str, typer.Option()] = "info",
    shards: Annotated[int, typer.Option(
        help="run N gateway processes behind HAProxy, each with its part of the pool "
        "(needs Postgres and haproxy; docs/deployment.md, 'Shards')")] = 1,
    haproxy: Annotated[str, typer.Option(help="the haproxy binary (--shards)")] = "haproxy",
    state_dir: Annotated[Path, typer.Option(
        help="where --shards writes the shards' pool specs and haproxy.cfg")]
    = Path(".rollout-gateway/shards"),
    rebalance_s: Annotated[float | None, typer.Option(
        min=0, help="with --shards: compare the shards' load this often and move engines to the "
        "busiest (0: only on request; ROLLOUT_GATEWAY_SHARDS__REBALANCE_S)")] = None,
) -> None:
    """Run the gateway. With a pool, a log line says when its engines are up."""
    from gateway.app import create_app
    from gateway.serving import uvicorn_config

    base = Settings()
    settings = base.model_copy(update={
        "server": base.server.model_copy(update={
            "host": host, "port": port,
            **({"wait_ready": wait_ready} if wait_ready is not None else {})}),
        **({"backends": Settings(backends=backend).backends} if backend else {}),
        **({"pool": pool} if pool else {}),
        **({"database_url": database_url} if database_url else {}),
        **({"policy": resolve_name(policy)} if policy else {}),
        **({"shards": base.shards.model_copy(update={"rebalance_s": rebalance_s})}
           if rebalance_s is not None else {}),
    })
    if shards > 1:
        _serve_shards(settings, shards, haproxy, state_dir, log_level, backend, pool)
        return
    try:
        if settings.policy not in LIVE_NAMES:
            raise ValueError(f"unknown policy {settings.policy!r} (--policy or "
                             f"ROLLOUT_GATEWAY_POLICY); a live gateway runs one of: "
                             f"{', '.join(LIVE_NAMES)}")
        settings.check_safe_to_serve()
        if settings.pool is not None:  # a bad spec fails here, with the reason, not at start
            from gateway.pool.spec import load_pool_spec

            load_pool_spec(settings.pool)
    except ValueError as exc:  # PoolSpecError is one
        raise typer.BadParameter(str(exc)) from None
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    tune_gc()
    fastapi_app = create_app(settings)
    config = uvicorn_config(fastapi_app, settings, log_level=log_level)
    _server(config, fastapi_app, settings.server.shutdown_delay_s).run()


def _serve_shards(settings: Settings, shards: int, haproxy: str, state_dir: Path,
                  log_level: str, backend: list[str] | None, pool: Path | None) -> None:
    """``serve --shards N`` (gateway/shards/launch.py)."""
    from gateway.shards.launch import ShardPlan, check, run

    plan = ShardPlan(shards, settings.server.host, settings.server.port,
                     backends=list(backend or settings.backends),
                     pool=pool or settings.pool, database_url=settings.database_url,
                     policy=settings.policy, haproxy=haproxy, state_dir=state_dir,
                     log_level=log_level, front=settings.shards)
    try:
        check(plan)
        settings.check_safe_to_serve()
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    raise typer.Exit(asyncio.run(run(plan)))


#: The serving process's young-generation GC threshold (CPython's default: 700).
GC_YOUNG_THRESHOLD = 7000


def tune_gc() -> None:
    """Collect the young generation after 7000 net container allocations instead of 700.

    The count is allocations minus deallocations, and a call's objects die by reference
    count when it ends, so at the default the collector ran on the live objects of the
    calls in flight (about 30 young and 3 middle passes a second at 200 req/s, the
    middle ones pausing the loop 3-10 ms on a busy core) and found nothing to free. At
    7000 it did not run at all during a 10 s run at 200 req/s, and the gateway's p99
    fell (measured side by side with the default). Cyclic garbage is still collected, a
    little later. Freezing the startup heap (``gc.freeze``) was measured too and made
    p99 worse, so it is not done."""
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)


def freeze_startup_heap() -> None:
    """Move everything alive once the app has started (imported modules, the app, its
    settings and engines: some 300,000 objects) out of the collector's reach.

    A full collection otherwise walks all of them, 70-240 ms on one core with the event
    loop stopped (measured at 500 req/s, bench overhead's load, with gc.callbacks timing
    each collection): the gateway's p99 tail. They live until the process ends anyway.
    Called once, in the serving process only (tests build many apps in one process)."""
    gc.collect()
    gc.freeze()


def _server(config: uvicorn.Config, fastapi_app: FastAPI, delay_s: float) -> uvicorn.Server:
    import uvicorn

    class GatewayServer(uvicorn.Server):
        """SIGTERM starts a two-step stop: ``/health`` answers 503 at once while calls are
        still served for ``delay_s`` (load balancers take the gateway out), then uvicorn's
        graceful shutdown stops accepting and waits for calls in flight; the lifespan then
        flushes the trace writer. SIGINT (and a second SIGTERM) skip the delay."""

        exit_at: float | None = None

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            rt = getattr(fastapi_app.state, "runtime", None)
            if rt is not None:
                rt.ready = False
            if sig == signal.SIGTERM and self.exit_at is None and delay_s > 0:
                self._captured_signals.append(sig)
                self.exit_at = time.monotonic() + delay_s
                return
            super().handle_exit(sig, frame)

        async def startup(self, sockets: list[Any] | None = None) -> None:
            await super().startup(sockets=sockets)
            freeze_startup_heap()

        async def on_tick(self, counter: int) -> bool:
            if self.exit_at is not None and time.monotonic() >= self.exit_at:
                self.should_exit = True
            return await super().on_tick(counter)

    return GatewayServer(config)


@app.command()
def migrate(
    database_url: Annotated[str | None, typer.Option(help="defaults to the settings' URL")] = None,
    revision: Annotated[str, typer.Option()] = "head",
) -> None:
    """Apply the schema migrations (Alembic) to the database."""
    from gateway.store.db import upgrade

    url = database_url or Settings().database_url
    upgrade(url, revision)
    typer.echo(f"database at {url.split('@')[-1]} is at revision {revision}")


@app.command()
def export(
    out: Annotated[Path, typer.Argument(help="output file")],
    fmt: Annotated[str, typer.Option("--format", help="jsonl or parquet")] = "jsonl",
    database_url: Annotated[str | None, typer.Option()] = None,
    group_id: Annotated[str | None, typer.Option(help="only this group")] = None,
    branches: Annotated[str, typer.Option(
        help="which branches of a trajectory become rows: all (every generated token once, "
        "under loss mask 1), main (the task's conversation, trained whole), longest, or "
        "tree (a row per trajectory: its branches as one prefix tree, each token once)")
    ] = "all",
    model: Annotated[str | None, typer.Option(
        help="one policy's samples: the model name its calls asked for (a trajectory may "
        "call several); only its generated tokens are trained")] = None,
) -> None:
    """Export finished trajectories as training samples (a row per branch)."""
    from gateway.store.export import export_samples

    if fmt not in ("jsonl", "parquet"):
        raise typer.BadParameter("--format must be jsonl or parquet")
    if branches not in ("all", "main", "longest", "tree"):
        raise typer.BadParameter("--branches must be all, main, longest or tree")
    settings = Settings()
    url = database_url or settings.database_url
    count = asyncio.run(export_samples(url, out, fmt=fmt, group_id=group_id,
                                       branches=branches, model=model,
                                       routes_dir=settings.traces.routes_dir))
    typer.echo(f"wrote the samples of {count} trajectories to {out}")


@app.command("sim-backend")
def sim_backend(
    port: Annotated[int, typer.Option(help="first port")] = 8100,
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    model: Annotated[str, typer.Option(help="latency profile's model")] = "qwen3-14b",
    gpu: Annotated[str, typer.Option(help="H100, A100 or cpu")] = "H100",
    tp: Annotated[int, typer.Option(help="tensor-parallel degree")] = 1,
    speed: Annotated[float, typer.Option(help="time compression factor")] = 1.0,
    count: Annotated[int, typer.Option(help="servers on consecutive ports")] = 1,
    seed: Annotated[int, typer.Option()] = 0,
    scheduling_policy: Annotated[str, typer.Option(help="fcfs or priority")] = "priority",
    max_model_len: Annotated[int | None, typer.Option(
        min=1, help="context in tokens, prompt and output (default: the model's own, "
        "40960 for Qwen3; 131072 as Qwen3 serves with YaRN)")] = None,
    enable_lora: Annotated[bool, typer.Option(
        help="serve LoRA adapters loaded at run time (vLLM --enable-lora with "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING)")] = False,
    routed_experts: Annotated[str | None, typer.Option(
        "--enable-return-routed-experts", metavar="ROUTER",
        help="answer with each position's routed experts (vLLM "
        "--enable-return-routed-experts) of this router: qwen3-30b-a3b, "
        "qwen3-235b-a22b, gpt-oss-120b, glm-4.5-air, tiny-moe")] = None,
) -> None:
    """Run simulated vLLM servers (one process, consecutive ports)."""
    from backends.sim.runner import run_sim_backends

    run_sim_backends(host=host, port=port, model=model, gpu=gpu, tp=tp, speed=speed,
                     count=count, seed=seed, scheduling_policy=scheduling_policy,
                     max_model_len=max_model_len, enable_lora=enable_lora,
                     routed_experts=routed_experts)


@app.command("front")
def front(
    shard: Annotated[list[str], typer.Option(
        help="a shard's base URL, in shard order (repeatable)")],
    host: Annotated[str, typer.Option(help="bind address")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="bind port")] = 8100,
    log_level: Annotated[str, typer.Option()] = "info",
) -> None:
    """The front of a sharded gateway: one admin, trajectory and status API over the
    shards (gateway/shards/front.py; `serve --shards N` starts one itself)."""
    import uvicorn

    from gateway.shards.front import create_front_app

    settings = Settings()
    uvicorn.run(create_front_app(shard, settings.admin_token, settings.shards,
                                 credentials=settings), host=host, port=port,
                log_level=log_level)


@app.command("haproxy-config")
def haproxy_config_cmd(
    shard: Annotated[list[str], typer.Option(help="a shard's host:port, in order (repeatable)")],
    front: Annotated[str, typer.Option(help="the front's host:port")],
    bind: Annotated[str, typer.Option(help="where HAProxy listens")] = "0.0.0.0:8000",
    out: Annotated[Path | None, typer.Option(help="write here (default: print)")] = None,
) -> None:
    """HAProxy's configuration for shards on other machines (docs/deployment.md, "Shards")."""
    from gateway.shards.haproxy import ProxyPlan, haproxy_config

    text = haproxy_config(ProxyPlan(bind, [s.removeprefix("http://") for s in shard],
                                    front.removeprefix("http://")))
    if out is None:
        typer.echo(text, nl=False)
    else:
        out.write_text(text)
        typer.echo(f"wrote {out}")
