"""Fixtures for the real-vLLM tests: the CPU build of vLLM, the tiny model, one server.

The vLLM environment is mandatory for tests marked ``vllm``: when its python is missing
they FAIL and say how to create it (``scripts/setup-vllm-cpu.sh``); they never skip.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from backends.base import InstanceSpec, LaunchedInstance
from backends.vllm_local import LocalVLLMLauncher
from tests.servers import forget_updates
from tests.vllm.truth import REDRAW, SERVED_NAME, reload_weights

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VLLM_PYTHON = Path.home() / ".cache/rollout-gateway/vllm-cpu/bin/python"


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The python of the CPU vLLM environment (``ROLLOUT_GATEWAY_VLLM_PYTHON``)."""
    python = Path(os.environ.get("ROLLOUT_GATEWAY_VLLM_PYTHON", DEFAULT_VLLM_PYTHON))
    if not python.exists():
        pytest.fail(
            f"The real-vLLM tests need the CPU vLLM environment, and {python} does not "
            "exist. Create it with scripts/setup-vllm-cpu.sh (a few minutes, ~3.5 GB) or "
            "point ROLLOUT_GATEWAY_VLLM_PYTHON at an existing one.",
            pytrace=False,
        )
    return str(python)


@pytest.fixture(scope="session")
def tiny_model_dir(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight model, built once per session with the vLLM python."""
    out = tmp_path_factory.mktemp("models") / "tiny"
    subprocess.run(
        [vllm_python, "-m", "backends.tinymodel", str(out)],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
        timeout=120,
    )
    return out


#: vLLM flags and environment for LoRA adapters loaded at run time (rank-8 test adapters)
LORA_ARGS = ("--enable-lora", "--max-lora-rank", "8")
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def cpu_launcher(vllm_python: str, model_dir: Path, log_dir: Path, *,
                 extra_args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> LocalVLLMLauncher:
    """A launcher for the tiny model on the CPU build (flags from the CPU note)."""
    return LocalVLLMLauncher(
        python=vllm_python,
        model_path=str(model_dir),
        served_model_name=SERVED_NAME,
        device="cpu",
        extra_args=("--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager",
                    *extra_args),
        env={"VLLM_SERVER_DEV_MODE": "1", **(env or {})},  # /pause, /resume, weight routes
        start_timeout_s=180,
        log_dir=log_dir,
    )


@contextlib.asynccontextmanager
async def own_engine_gateway(vllm_python: str, model_dir: Path, work: Path,
                             name: str, *, lora: bool = False, lora_slots: int = 2,
                             **settings: Any) -> AsyncIterator[str]:
    """A gateway (its URL; admin token ``tok``; more ``settings``) over one TP1 engine of
    its own, for a test that changes the engine's weights (``lora``: with LoRA adapters
    loaded at run time, ``lora_slots`` of them); both stopped on exit."""
    from gateway.app import create_app
    from tests.gateway.conftest import make_settings
    from tests.servers import free_port, serve_app, stop_app

    slots = ("--max-loras", str(lora_slots))
    launcher = cpu_launcher(vllm_python, model_dir, work / "logs",
                            extra_args=(*LORA_ARGS, *slots) if lora else (),
                            env=LORA_ENV if lora else None)
    launcher.start_timeout_s = 300  # on a loaded machine: 30 s idle, 145 s seen
    engine = await launcher.start(InstanceSpec(id=name, model=SERVED_NAME, gpus=(0,)))
    config = make_settings(f"sqlite+aiosqlite:///{work / 'gw.db'}", [engine.url],
                           admin_token="tok", **settings)
    port = free_port()
    try:
        server, task = await serve_app(create_app(config), port)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            await stop_app(server, task)
    finally:
        await launcher.close()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def _tp1_engine(
    vllm_python: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[LaunchedInstance]:
    launcher = cpu_launcher(vllm_python, tiny_model_dir, tmp_path_factory.mktemp("logs"))
    instance = await launcher.start(InstanceSpec(id="tp1", model=SERVED_NAME, gpus=(0,)))
    yield instance
    await launcher.close()


@pytest_asyncio.fixture(loop_scope="session")
async def tp1_server(_tp1_engine: LaunchedInstance, tiny_model_dir: Path
                     ) -> AsyncIterator[LaunchedInstance]:
    """ONE real vLLM TP1 server for the session (about 30 s to start on two cores), on
    the tiny model's own weights for each test: a test that loads others (the weight
    truth tests) leaves them behind, and which test runs next on the engine depends on
    how the suite was split (``make test`` runs files on two workers)."""
    yield _tp1_engine
    await reload_weights(_tp1_engine.url, str(tiny_model_dir))
    await forget_updates(_tp1_engine.url)  # no label, no adapter: as a fresh engine


@pytest.fixture(scope="session")
def checkpoints(vllm_python: str, tiny_model_dir: Path,
                tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """{"A": the tiny model, "B": the same with other weights}."""
    b = tmp_path_factory.mktemp("ckpt") / "B"
    subprocess.run([vllm_python, "-c", REDRAW, str(tiny_model_dir), str(b), "7"],
                   check=True, capture_output=True, timeout=120, cwd=REPO_ROOT)
    return {"A": str(tiny_model_dir), "B": str(b)}
