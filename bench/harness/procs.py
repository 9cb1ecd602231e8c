"""Child processes for the benchmarks: pinned to cores, awaited until healthy, stopped.

Each benchmarked server runs as its own process so that the load generator, the
upstream and the server under test never share an interpreter (or a GIL); ``cpus``
pins a process with ``taskset`` so that the placement on a small machine is explicit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

from bench.harness.hosting import free_port

PY = sys.executable


def pinned(cmd: Sequence[str], cpus: str | None) -> list[str]:
    """``cmd`` under ``taskset -c cpus`` (unchanged if no cpus or no taskset)."""
    if cpus and shutil.which("taskset"):
        return ["taskset", "-c", cpus, *cmd]
    return list(cmd)


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float,
              log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log and log.exists() else ""
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}: {tail}")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready within {timeout_s:g}s")


@contextlib.contextmanager
def process(cmd: Sequence[str], *, ready_url: str, cpus: str | None = None,
            env: dict[str, str] | None = None, log: Path | None = None,
            timeout_s: float = 60, cwd: Path | None = None
            ) -> Iterator[subprocess.Popen[bytes]]:
    """Start ``cmd`` (pinned to ``cpus``), wait for ``ready_url`` to answer 200, yield."""
    out = log.open("wb") if log else subprocess.DEVNULL
    proc = subprocess.Popen(pinned(cmd, cpus), env={**os.environ, **(env or {})},
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=cwd)
    try:
        wait_http(ready_url, proc, timeout_s, log)
        yield proc
    finally:
        stop(proc)
        if log:
            out.close()  # type: ignore[union-attr]


def stop(proc: subprocess.Popen[bytes], grace_s: float = 15) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def fast_upstream(cpus: str | None, log: Path | None = None,
                  interval_ms: float = 0.0, stream_interval: int = 1) -> Iterator[str]:
    """``bench.harness.fast_upstream`` in its own process; yields its base URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with process([PY, "-m", "bench.harness.fast_upstream", "--port", str(port),
                  "--interval-ms", str(interval_ms),
                  "--stream-interval", str(stream_interval)],
                 ready_url=f"{url}/health", cpus=cpus, log=log):
        yield url


@contextlib.contextmanager
def gateway(upstream: str, database_url: str, cpus: str | None, *,
            env: dict[str, str] | None = None, log: Path | None = None,
            source: Path | None = None) -> Iterator[str]:
    """``python -m gateway serve`` (uvloop + httptools) against ``upstream``; yields URL.
    ``source``: another checkout of the repository to run the gateway from (the
    process starts there, so its packages come first on ``sys.path``)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [PY, "-m", "gateway", "serve", "--port", str(port), "--backend", upstream,
           "--database-url", database_url, "--log-level", "warning"]
    with process(cmd, ready_url=f"{url}/health", cpus=cpus, env=env, log=log, timeout_s=90,
                 cwd=source):
        yield url


@contextlib.contextmanager
def plain_proxy(upstream: str, cpus: str | None, log: Path | None = None) -> Iterator[str]:
    """``bench.harness.plain_proxy`` (forwards bytes, records nothing); yields its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with process([PY, "-m", "bench.harness.plain_proxy", "--upstream", upstream,
                  "--port", str(port)], ready_url=f"{url}/health", cpus=cpus, log=log):
        yield url
