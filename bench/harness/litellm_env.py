"""The LiteLLM proxy, as the overhead benchmark's point of comparison.

LiteLLM is not a dependency of this project: the benchmark installs it into a throwaway
virtual environment (default ``~/.cache/rollout-gateway/litellm-venv``) and runs its
proxy as a separate process with one worker, configured with the fast upstream as an
OpenAI-compatible model and a request-logging callback that appends every call
(request, response, timings) to a JSON-lines file, so it records each call as our
gateway does.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from bench.harness.hosting import free_port
from bench.harness.procs import process

LITELLM_SPEC = "litellm[proxy]==1.106.2"  # the version measured in BENCHMARKS.md
DEFAULT_VENV = Path.home() / ".cache" / "rollout-gateway" / "litellm-venv"

_LOGGER = '''\
import json
from litellm.integrations.custom_logger import CustomLogger


class FileLogger(CustomLogger):
    """Appends one JSON line per call: what the proxy received and answered."""

    def __init__(self):
        self.fh = open(LOG_PATH, "a", buffering=1 << 16)

    async def async_log_success_event(self, kwargs, response_obj, start_time, end_time):
        rec = {"model": kwargs.get("model"), "messages": kwargs.get("messages"),
               "response": response_obj.model_dump() if response_obj is not None else None,
               "start": start_time.timestamp(), "end": end_time.timestamp()}
        self.fh.write(json.dumps(rec, default=str) + "\\n")

    async def async_log_failure_event(self, kwargs, response_obj, start_time, end_time):
        self.fh.write(json.dumps({"error": str(kwargs.get("exception"))}) + "\\n")


handler = FileLogger()
'''

_CONFIG = """\
model_list:
  - model_name: bench
    litellm_params:
      model: openai/bench
      api_base: {upstream}/v1
      api_key: bench
litellm_settings:
  callbacks: file_logger.handler
  drop_params: true
general_settings:
  disable_spend_logs: false
"""


def venv_python(venv: Path = DEFAULT_VENV) -> Path:
    return venv / "bin" / "python"


def ensure_venv(venv: Path = DEFAULT_VENV, timeout_s: float = 600) -> tuple[Path, float]:
    """The LiteLLM venv's python (created and installed if missing); seconds it took."""
    py = venv_python(venv)
    started = time.monotonic()
    if not (venv / "bin" / "litellm").exists():
        venv.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True,
                       timeout=timeout_s)
        subprocess.run([str(py), "-m", "pip", "install", "-q", LITELLM_SPEC], check=True,
                       timeout=timeout_s, stdout=subprocess.DEVNULL)
    return py, time.monotonic() - started


def write_config(workdir: Path, upstream: str) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "litellm-requests.jsonl"
    (workdir / "file_logger.py").write_text(f"LOG_PATH = {str(log_path)!r}\n" + _LOGGER)
    cfg = workdir / "litellm.yaml"
    cfg.write_text(_CONFIG.format(upstream=upstream))
    return cfg


def version(venv: Path = DEFAULT_VENV) -> str:
    out = subprocess.run([str(venv_python(venv)), "-c",
                          "import importlib.metadata as m; print(m.version('litellm'))"],
                         capture_output=True, text=True, check=False)
    return out.stdout.strip() or "unknown"


@contextlib.contextmanager
def litellm_proxy(upstream: str, workdir: Path, cpus: str | None,
                  master_key: str, venv: Path = DEFAULT_VENV) -> Iterator[str]:
    """The LiteLLM proxy (one worker) in front of ``upstream``; yields its base URL.

    Calls must carry ``Authorization: Bearer <master_key>`` (LiteLLM refuses to start
    without a key; checking it is part of what every call costs there)."""
    cfg = write_config(workdir, upstream)
    port = free_port()
    cmd = [str(venv / "bin" / "litellm"), "--config", str(cfg), "--host", "127.0.0.1",
           "--port", str(port), "--num_workers", "1"]
    env = {"PYTHONPATH": str(workdir), "LITELLM_MASTER_KEY": master_key,
           "LITELLM_LOG": "ERROR", "LITELLM_MODE": "PRODUCTION",
           "DISABLE_SCHEMA_UPDATE": "true", "LITELLM_DONT_SHOW_FEEDBACK_BOX": "true"}
    url = f"http://127.0.0.1:{port}"
    with process(cmd, ready_url=f"{url}/health/liveliness", cpus=cpus, env=env,
                 log=workdir / "litellm.log", timeout_s=180):
        yield url
