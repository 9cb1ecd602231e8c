"""Hosting simulated servers: many uvicorn servers in one process and event loop.

One process can host a whole simulated pool (8 servers on 2 cores) because the servers
only sleep between token batches. ``start_sim_servers`` is for tests and the demo (free
ports, in-process); ``run_sim_backends`` is what ``rollout-gateway sim-backend`` runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Sequence

from backends.sim.engine import SchedulingPolicy
from backends.sim.hosting import bind, sim_server
from backends.sim.routes import MOE_SHAPES
from backends.sim.state import SimServerConfig


@contextlib.asynccontextmanager
async def start_sim_servers(configs: Sequence[SimServerConfig], host: str = "127.0.0.1"
                            ) -> AsyncIterator[list[str]]:
    """Run one server per config on free ports; yields their base URLs (no ``/v1``)."""
    sockets = [bind(host, 0) for _ in configs]
    servers = [sim_server(c) for c in configs]
    tasks: list[asyncio.Task[None]] = []
    try:
        tasks = [asyncio.create_task(s.serve(sockets=[sock]))
                 for s, sock in zip(servers, sockets, strict=True)]
        while not all(s.started for s in servers):
            failed = [t for t in tasks if t.done()]
            if failed:
                raise RuntimeError("a simulated server exited during start")
            await asyncio.sleep(0.01)
        yield [f"http://{host}:{sock.getsockname()[1]}" for sock in sockets]
    finally:
        for s in servers:
            s.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)
        for sock in sockets:
            sock.close()


def run_sim_backends(*, host: str = "127.0.0.1", port: int = 8100, model: str = "qwen3-14b",
                     gpu: str = "H100", tp: int = 1, speed: float = 1.0, count: int = 1,
                     seed: int = 0, scheduling_policy: str = "fcfs",
                     max_model_len: int | None = None, enable_lora: bool = False,
                     routed_experts: str | None = None) -> None:
    """Serve ``count`` simulated servers on ports ``port .. port+count-1`` until SIGINT/TERM.

    Each server gets seed ``seed + i`` so their outputs differ; ``max_model_len`` (None:
    the model's native context) is their context in tokens.
    """
    if scheduling_policy not in ("fcfs", "priority"):
        raise ValueError(f"scheduling_policy must be fcfs or priority, not {scheduling_policy!r}")
    policy: SchedulingPolicy = "priority" if scheduling_policy == "priority" else "fcfs"
    if max_model_len is not None and max_model_len < 1:
        raise ValueError(f"max_model_len must be positive, not {max_model_len}")
    moe = None
    if routed_experts is not None:
        moe = MOE_SHAPES.get(routed_experts.lower())
        if moe is None:
            raise ValueError(f"unknown router {routed_experts!r}; known: {sorted(MOE_SHAPES)}")
    configs = [SimServerConfig(model=model, gpu=gpu, tp=tp, speed=speed, seed=seed + i,
                               scheduling_policy=policy, max_model_len=max_model_len,
                               enable_lora=enable_lora, moe=moe,
                               enable_return_routed_experts=moe is not None)
               for i in range(count)]
    configs[0].profile()  # unknown profile: fail before binding anything
    asyncio.run(_run_forever(configs, host, port))


async def _run_forever(configs: list[SimServerConfig], host: str, port: int) -> None:
    sockets = [bind(host, port + i) for i in range(len(configs))]
    servers = [sim_server(c) for c in configs]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(s.serve(sockets=[sock]))
             for s, sock in zip(servers, sockets, strict=True)]
    print(f"simulated vLLM ({configs[0].profile().key}, speed {configs[0].speed}x, "
          f"context {configs[0].context_len} tokens) on "
          + ", ".join(f"http://{host}:{port + i}" for i in range(len(configs))), flush=True)
    await stop.wait()
    for s in servers:
        s.should_exit = True
    await asyncio.gather(*tasks, return_exceptions=True)
    for sock in sockets:
        sock.close()
