"""Host the gateway and a simulated pool inside one process (demo, live benchmarks)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import socket
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from backends.sim.runner import start_sim_servers
from backends.sim.state import SimServerConfig
from gateway.app import create_app
from gateway.config import DispatchSettings, Settings
from gateway.serving import uvicorn_config


class _EmbeddedServer(uvicorn.Server):
    """Leaves signal handling to the host program."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[no-untyped-def]
        yield


@contextlib.contextmanager
def rare_full_collections(every: int = 500) -> Iterator[None]:
    """Python's full garbage collections ``every`` young ones instead of every 10 while
    the block runs (and the heap built so far frozen out of them).

    A process that holds a pool's worth of simulated engines, the gateway and the agents
    keeps millions of token ids alive; a full collection walks all of them (~300 ms on
    the 2-core machine, 22 times in 80 s of the demo, at 3x collecting a few dozen
    objects each) and every engine on the event loop loses that much simulated time.
    Young collections still run, so short-lived cycles are still freed."""
    old = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(old[0], old[1], every)
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def serve_gateway(settings: Settings, app: FastAPI | None = None) -> AsyncIterator[str]:
    """Run the gateway (``app``, default ``create_app(settings)``) on ``settings.server``
    until the block exits; yields its URL."""
    host, port = settings.server.host, settings.server.port
    config = uvicorn_config(app or create_app(settings), settings, log_level="warning",
                            lifespan="on", timeout_graceful_shutdown=5)
    server = _EmbeddedServer(config)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("the gateway exited during start-up")
            await asyncio.sleep(0.02)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await task


@contextlib.asynccontextmanager
async def sim_pool(configs: Sequence[SimServerConfig]) -> AsyncIterator[list[str]]:
    """Simulated servers in this process (cheap to start; shares this process's core)."""
    async with start_sim_servers(configs) as urls:
        yield urls


def _free_block(count: int, host: str = "127.0.0.1") -> int:
    """A first port such that ``count`` consecutive ports are free."""
    for _ in range(50):
        first = free_port(host)
        if first + count < 65535 and all(port_is_free(host, first + i) for i in range(count)):
            return first
    raise RuntimeError(f"no block of {count} free ports")


@contextlib.asynccontextmanager
async def sim_pool_process(
    *, count: int, model: str, gpu: str, tp: int = 1, speed: float = 1.0, seed: int = 0,
    scheduling_policy: str = "priority", host: str = "127.0.0.1", ready_timeout_s: float = 30,
) -> AsyncIterator[list[str]]:
    """``rollout-gateway sim-backend --count N`` in a child process, so the simulated pool
    gets its own core instead of competing with the gateway and the harness for one GIL."""
    port = _free_block(count, host)
    args = ["-m", "gateway", "sim-backend", "--host", host, "--port", str(port),
            "--count", str(count), "--model", model, "--gpu", gpu, "--tp", str(tp),
            "--speed", str(speed), "--seed", str(seed), "--scheduling-policy", scheduling_policy]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *args, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE)
    urls = [f"http://{host}:{port + i}" for i in range(count)]
    try:
        await _wait_healthy(urls, proc, ready_timeout_s)
        yield urls
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def _wait_healthy(urls: list[str], proc: asyncio.subprocess.Process,
                        timeout_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with httpx.AsyncClient(timeout=1) as http:
        while True:
            if proc.returncode is not None:
                err = await proc.stderr.read() if proc.stderr else b""
                raise RuntimeError(f"sim-backend exited: {err.decode(errors='replace')[-800:]}")
            try:
                codes = [(await http.get(f"{u}/health")).status_code for u in urls]
                if all(code == 200 for code in codes):
                    return
            except httpx.HTTPError:
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError("simulated pool not healthy in time")
            await asyncio.sleep(0.2)


#: Simulated start-up of a new instance: the restart cost the policies are told
#: (``DispatchSettings.restart_s``, Libra's ~10.8 s for a real vLLM), so the cost a live
#: relayout pays and the one the simulator charges cannot drift apart.
SIM_STARTUP_S: float = DispatchSettings.model_fields["restart_s"].default


def sim_pool_spec(path: Path, layout: Sequence[int], *, model: str, gpu: str, speed: float,
                  seed: int = 0, startup_s: float = SIM_STARTUP_S,
                  clock: str | None = None) -> Path:
    """Write a managed-pool spec (``--pool``) for ``layout`` (TP per instance) on
    ``sum(layout)`` simulated GPUs, started by the in-process sim launcher (on the shared
    clock ``clock``, if named: :func:`backends.sim.clock.shared_clock`)."""
    spec = {"model": model, "inventory": {"gpus": sum(layout)},
            "launcher": {"kind": "sim", "profile": model, "gpu": gpu, "speed": speed,
                         "seed": seed, "startup_s": startup_s,
                         "options": {"clock": clock} if clock else {}},
            "layout": [{"tp": tp} for tp in layout]}
    path.write_text(json.dumps(spec, indent=2))
    return path


async def wait_routable(http: httpx.AsyncClient, gateway: str, count: int,
                        timeout_s: float = 60) -> list[dict[str, Any]]:
    """Wait until ``count`` backends are routable (a managed pool's initial start); their
    rows from ``GET /status``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        backends: list[dict[str, Any]] = (await http.get(f"{gateway}/status")).json()["backends"]
        if sum(b["routable"] for b in backends) >= count:
            return backends
        if asyncio.get_running_loop().time() > deadline:
            raise RuntimeError(f"the managed pool has not started {count} instances in time")
        await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def pool_settings(spec_path: Path, layout: Sequence[int], *, model: str, gpu: str,
                        speed: float, seed: int,
                        static: contextlib.AbstractAsyncContextManager[list[str]] | None = None,
                        clock: str | None = None) -> AsyncIterator[dict[str, Any]]:
    """``Settings`` fields for a simulated pool: a managed one (a spec file at
    ``spec_path``, its servers on the shared clock ``clock`` if named), or, with
    ``static``, the backends that fixed pool yields while open."""
    if static is None:
        yield {"pool": sim_pool_spec(spec_path, layout, model=model, gpu=gpu, speed=speed,
                                     seed=seed, clock=clock)}
        return
    async with static as backends:
        yield {"backends": backends}
