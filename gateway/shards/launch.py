"""``rollout-gateway serve --shards N``: a sharded gateway on one machine.

It applies the migrations once, splits the pool into N parts (static backends round
robin; a managed pool's GPU inventory into N contiguous blocks, its initial layout
placed block by block), starts N ``rollout-gateway serve`` processes on loopback ports
after the public one, the front (:mod:`gateway.shards.front`) on the port after those,
and HAProxy on the public port with a generated configuration
(:mod:`gateway.shards.haproxy`). Everything stops together on SIGINT or SIGTERM; a shard
that dies is reported and the others go on serving (HAProxy's health check takes it out,
and the trajectories hashed to it move to the others, which restore them from the store).

Every shard gets the same credentials, so the harness-key secret (``KEY_SECRET``, else
derived from the admin or trainer token) is the same everywhere and a key minted through
any shard works on all of them. The store must be Postgres: several processes write it
at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from gateway.config import ShardSettings
from gateway.pool.spec import (
    PoolSpec,
    StaticLauncherSpec,
    load_pool_spec,
    parse_pool_spec,
)
from gateway.shards.haproxy import ProxyPlan, haproxy_config

log = logging.getLogger(__name__)
READY_TIMEOUT_S = 120.0


@dataclass(slots=True)
class ShardPlan:
    shards: int
    host: str = "127.0.0.1"
    port: int = 8000
    backends: list[str] = field(default_factory=list)
    pool: Path | None = None
    database_url: str = ""
    policy: str | None = None
    haproxy: str = "haproxy"
    state_dir: Path = Path(".rollout-gateway/shards")
    log_level: str = "info"
    front: ShardSettings = field(default_factory=ShardSettings)

    def shard_port(self, i: int) -> int:
        return self.port + 1 + i

    @property
    def front_port(self) -> int:
        return self.port + 1 + self.shards


def check(plan: ShardPlan) -> None:
    """ValueError, saying what to change, unless the plan can run."""
    if plan.shards < 2:
        raise ValueError("--shards needs 2 or more (one process is plain `serve`)")
    if not plan.database_url.startswith("postgresql"):
        raise ValueError("shards share one store and write it at once: give a Postgres "
                         "URL (--database-url postgresql+asyncpg://...); SQLite is one "
                         "process's store")
    if bool(plan.backends) == bool(plan.pool):
        raise ValueError("give the pool to split: --backend URL (repeatable) or --pool FILE")
    if plan.backends and len(plan.backends) < plan.shards:
        raise ValueError(f"{len(plan.backends)} backends cannot be split into "
                         f"{plan.shards} shards: each shard needs one")
    if shutil.which(plan.haproxy) is None:
        raise ValueError(f"HAProxy ({plan.haproxy!r}) is not installed: apt-get install "
                         "haproxy (2.6 or newer), or --haproxy PATH")


def split_backends(backends: list[str], n: int) -> list[list[str]]:
    return [backends[i::n] for i in range(n)]


def split_pool(spec: PoolSpec, n: int) -> list[dict[str, Any]]:
    """The pool spec of each of ``n`` shards (as data): contiguous GPU blocks per node,
    the initial layout's instances placed in the first block with room."""
    data = spec.model_dump(mode="json", exclude_none=True)
    if isinstance(spec.launcher, StaticLauncherSpec):
        parts = split_backends(list(data["launcher"]["backends"]), n)
        return [{**data, "launcher": {**data["launcher"], "backends": p}} for p in parts]
    blocks: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    for node in spec.inventory.nodes:
        ids = node.ids()
        size = -(-len(ids) // n)
        for i in range(n):
            if ids[i * size:(i + 1) * size]:
                blocks[i].append({"name": node.name, "gpus": ids[i * size:(i + 1) * size]})
    free = [sum(len(b["gpus"]) for b in nodes) for nodes in blocks]
    layouts: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    entries = () if spec.layout == "probe" else spec.layout or ()
    for entry in entries:
        for _ in range(entry.count):
            one = {**entry.model_dump(mode="json", exclude_none=True), "count": 1}
            k = next((i for i in range(n) if free[i] >= entry.tp), None)
            if k is None:
                raise ValueError(f"the layout does not split into {n} shards: a TP{entry.tp} "
                                 f"instance fits in no shard's {free} free GPUs")
            layouts[k].append(one)
            free[k] -= entry.tp
    out = []
    for i in range(n):
        part = {**data, "inventory": {"nodes": blocks[i]}}
        part.pop("layout", None)
        if spec.layout == "probe":  # each shard probes every degree of its own GPUs
            part["layout"] = "probe"
        elif spec.layout is not None:
            part["layout"] = layouts[i]
        state = part["launcher"].get("state_dir")
        if state:
            part["launcher"]["state_dir"] = str(Path(state) / f"shard{i}")
        out.append(part)
    return out


def record_pool(plan: ShardPlan, shard: int, pool: dict[str, Any]) -> None:
    """Rewrite shard ``shard``'s pool spec with the GPUs and instances it has now (after
    engines moved between shards), so a shard restarted with the command line logged at
    start-up starts on its own GPUs, not the block it began with."""
    path = plan.state_dir / f"pool-shard{shard}.yaml"
    spec = yaml.safe_load(path.read_text())
    spec["inventory"] = {"nodes": [{"name": n["node"], "gpus": n["gpus"]}
                                   for n in pool["inventory"]]}
    spec["layout"] = [{"tp": i["tp"], "gpus": i["gpus"], "node": i["node"], "id": i["id"]}
                      for i in pool["instances"] if i["id"] in pool.get("planned", [i["id"]])]
    parse_pool_spec(spec)  # never write a spec the shard could not start from
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(spec, sort_keys=False))
    tmp.replace(path)


SPOOL_ENV = "ROLLOUT_GATEWAY_TRACES__SPOOL_PATH"
SHARD_ENV = "ROLLOUT_GATEWAY_SHARD_INDEX"


def shard_env(plan: ShardPlan, shard: int) -> dict[str, str]:
    """Shard ``shard``'s environment. Each shard owns its spool file (a second process
    is refused one another holds): a configured spool path becomes one per shard. Each
    knows its index: the store they share has one owner of its upkeep, shard 0 (it clears
    expired routes, :mod:`gateway.store.retention`)."""
    env = dict(os.environ)
    env[SHARD_ENV] = str(shard)
    env["ROLLOUT_GATEWAY_DATABASE_URL"] = plan.database_url
    env["ROLLOUT_GATEWAY_AUTO_MIGRATE"] = "false"  # applied once, here
    if env.get(SPOOL_ENV):
        path = Path(env[SPOOL_ENV])
        env[SPOOL_ENV] = str(path.with_name(f"{path.stem}.shard{shard}{path.suffix}"))
    return env


def shard_commands(plan: ShardPlan) -> list[list[str]]:
    base = [sys.executable, "-m", "gateway", "serve", "--host", "127.0.0.1",
            "--log-level", plan.log_level]
    if plan.policy:
        base += ["--policy", plan.policy]
    cmds = []
    if plan.pool is not None:
        specs = split_pool(load_pool_spec(plan.pool), plan.shards)
        plan.state_dir.mkdir(parents=True, exist_ok=True)
        for i, spec in enumerate(specs):
            path = plan.state_dir / f"pool-shard{i}.yaml"
            path.write_text(yaml.safe_dump(spec, sort_keys=False))
            cmds.append([*base, "--port", str(plan.shard_port(i)), "--pool", str(path)])
    else:
        for i, part in enumerate(split_backends(plan.backends, plan.shards)):
            cmds.append([*base, "--port", str(plan.shard_port(i)),
                         *(a for url in part for a in ("--backend", url))])
    return cmds


def _front_server() -> type:
    import uvicorn

    class FrontServer(uvicorn.Server):
        """uvicorn without its own signal handlers: the launcher stops everything."""

        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            yield

    return FrontServer


async def _wait_healthy(urls: list[str], procs: list[asyncio.subprocess.Process]) -> None:
    deadline = asyncio.get_running_loop().time() + READY_TIMEOUT_S
    async with httpx.AsyncClient(timeout=2.0) as http:
        for url, proc in zip(urls, procs, strict=True):
            while True:
                if proc.returncode is not None:
                    raise RuntimeError(f"the shard at {url} exited ({proc.returncode}) "
                                       "during start-up: see its log above")
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"{url}/health")).status_code == 200:
                        break
                if asyncio.get_running_loop().time() > deadline:
                    raise RuntimeError(f"the shard at {url} did not answer in "
                                       f"{READY_TIMEOUT_S:g} s")
                await asyncio.sleep(0.2)


async def run(plan: ShardPlan) -> int:
    """Start everything, serve until a signal, stop everything. The exit status."""
    import uvicorn

    from gateway.config import Settings
    from gateway.serving import StreamsEndAtShutdown
    from gateway.shards.front import create_front_app
    from gateway.store.db import upgrade

    await asyncio.to_thread(upgrade, plan.database_url)
    cmds = shard_commands(plan)
    for i, cmd in enumerate(cmds):  # how to restart one by hand
        log.info("shard %d: %s", i, " ".join(cmd))
    procs = [await asyncio.create_subprocess_exec(*cmd, env=shard_env(plan, i))
             for i, cmd in enumerate(cmds)]
    urls = [f"http://127.0.0.1:{plan.shard_port(i)}" for i in range(plan.shards)]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    front: uvicorn.Server | None = None
    front_task: asyncio.Task[None] | None = None
    proxy: asyncio.subprocess.Process | None = None
    try:
        await _wait_healthy(urls, procs)
        shared = Settings()  # the shards' own environment: their tokens and keys
        persist = functools.partial(record_pool, plan) if plan.pool is not None else None
        config = uvicorn.Config(create_front_app(urls, shared.admin_token, plan.front,
                                                 persist, credentials=shared),
                                host="127.0.0.1",
                                port=plan.front_port, log_level="warning", lifespan="on",
                                http=StreamsEndAtShutdown)
        front = _front_server()(config)
        front_task = asyncio.create_task(front.serve())
        plan.state_dir.mkdir(parents=True, exist_ok=True)
        cfg = plan.state_dir / "haproxy.cfg"
        cfg.write_text(haproxy_config(ProxyPlan(
            f"{plan.host}:{plan.port}", [u.removeprefix("http://") for u in urls],
            f"127.0.0.1:{plan.front_port}")))
        proxy = await asyncio.create_subprocess_exec(plan.haproxy, "-f", str(cfg), "-db")
        log.info("sharded gateway: %d shards on %s, front on %d, HAProxy on %s:%d (%s)",
                 plan.shards, ", ".join(urls), plan.front_port, plan.host, plan.port, cfg)
        await _until_stop(stop, procs, proxy, front_task)
        return 0
    finally:
        await _stop_all(procs, proxy, front)
        if front_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(front_task, 10)


async def _until_stop(stop: asyncio.Event, procs: list[asyncio.subprocess.Process],
                      proxy: asyncio.subprocess.Process, front_task: asyncio.Task[None]) -> None:
    reported: set[int] = set()
    while not stop.is_set():
        if proxy.returncode is not None or front_task.done():
            log.error("HAProxy or the front stopped: stopping the sharded gateway")
            return
        for i, p in enumerate(procs):
            if p.returncode is not None and i not in reported:
                reported.add(i)
                log.error("shard %d exited (%s); the other shards go on", i, p.returncode)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


async def _stop_all(procs: list[asyncio.subprocess.Process],
                    proxy: asyncio.subprocess.Process | None,
                    front: Any) -> None:
    if proxy is not None and proxy.returncode is None:
        proxy.terminate()
        await proxy.wait()
    if front is not None:
        front.should_exit = True
    for p in procs:
        if p.returncode is None:
            p.send_signal(signal.SIGINT)  # straight to the graceful stop
    for p in procs:
        try:
            await asyncio.wait_for(p.wait(), 60)
        except TimeoutError:
            p.kill()
            await p.wait()
