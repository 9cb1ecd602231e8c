"""The LiteLLM proxy, as the overhead benchmark's point of comparison.

LiteLLM is not a dependency of this project: the benchmark installs it into a throwaway
virtual environment (default ``~/.cache/rollout-gateway/litellm-venv``) and runs its
proxy as a separate process with one worker per CPU it is given, configured with the
fast upstream as an OpenAI-compatible model and a request-logging callback that appends every call
(request, response, timings) to a JSON-lines file, so it records each call as our
gateway does.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from bench.harness.hosting import free_port
from bench.harness.procs import process

#: the version the recorded overhead runs measured (docs/benchmarks/history-overhead-store-sim.md)
LITELLM_SPEC = "litellm[proxy]==1.106.2"
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

# LiteLLM's "Production Best Practices" (docs.litellm.ai/docs/proxy/prod) as far as they
# apply without a database or Redis: the master key from the environment, no verbose or
# debug logging (LITELLM_LOG=ERROR below), a request timeout, one worker per CPU the proxy
# gets ("setting workers equal to CPU count gives optimal performance",
# docs.litellm.ai/docs/benchmarks), and a custom callback as the logging path. No
# retries: the upstream never fails here, and a retry would only hide an error.
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
  set_verbose: false
  request_timeout: 600
  num_retries: 0
general_settings:
  master_key: os.environ/LITELLM_MASTER_KEY
  disable_error_logs: true
"""

# LiteLLM's own published capacity figure, for a per-core comparison: 4 instances of
# 4 vCPU (4 workers each) served 1,170 req/s against a fake OpenAI endpoint with median
# 100 ms and p99 240 ms (docs.litellm.ai/docs/benchmarks, "4 Instances").
PUBLISHED = {"rps": 1170.0, "vcpus": 16, "p50_ms": 100.0, "p99_ms": 240.0,
             "source": "https://docs.litellm.ai/docs/benchmarks (4 instances x 4 vCPU)"}


def cpus_in(cpus: str | None) -> int:
    """How many CPUs a taskset list names ("0", "0-3", "0,2"); all of them when None."""
    if not cpus:
        return os.cpu_count() or 1
    n = 0
    for part in cpus.split(","):
        lo, _, hi = part.partition("-")
        n += int(hi or lo) - int(lo) + 1
    return n


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
    """The LiteLLM proxy (one worker per CPU in ``cpus``) in front of ``upstream``;
    yields its base URL.

    Calls must carry ``Authorization: Bearer <master_key>`` (LiteLLM refuses to start
    without a key; checking it is part of what every call costs there)."""
    cfg = write_config(workdir, upstream)
    port = free_port()
    cmd = [str(venv / "bin" / "litellm"), "--config", str(cfg), "--host", "127.0.0.1",
           "--port", str(port), "--num_workers", str(cpus_in(cpus))]
    env = {"PYTHONPATH": str(workdir), "LITELLM_MASTER_KEY": master_key,
           "LITELLM_LOG": "ERROR", "LITELLM_MODE": "PRODUCTION",
           "DISABLE_SCHEMA_UPDATE": "true", "LITELLM_DONT_SHOW_FEEDBACK_BOX": "true"}
    url = f"http://127.0.0.1:{port}"
    with process(cmd, ready_url=f"{url}/health/liveliness", cpus=cpus, env=env,
                 log=workdir / "litellm.log", timeout_s=180):
        yield url


def readiness(url: str, key: str) -> dict[str, object]:
    """LiteLLM's own readiness report (``/health/readiness``): status, version, DB, cache."""
    req = urllib.request.Request(f"{url}/health/readiness",
                                 headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            got: dict[str, object] = json.loads(resp.read())
    except (OSError, ValueError) as exc:
        return {"status": "unreachable", "error": str(exc)}
    return {k: got.get(k) for k in ("status", "litellm_version", "db", "cache",
                                    "success_callbacks") if k in got}


def log_errors(log: Path, keep: int = 5) -> dict[str, object]:
    """Error lines in the proxy's own output (its log level is ERROR): how many, the first."""
    if not log.exists():
        return {"count": 0, "first": []}
    lines = [ln for ln in log.read_text(errors="replace").splitlines()
             if "ERROR" in ln or "Traceback" in ln or "Exception" in ln]
    return {"count": len(lines), "first": [ln[:300] for ln in lines[:keep]]}
