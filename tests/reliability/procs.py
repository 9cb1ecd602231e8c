"""Real processes for fault injection: simulated vLLM servers and the gateway itself,
each a ``python -m gateway ...`` child that a test can SIGKILL or SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from tests.servers import free_port


class Child:
    """A ``python -m gateway <args>`` child serving HTTP on ``port``."""

    def __init__(self, args: Sequence[str], port: int, *, env: dict[str, str] | None = None,
                 log: Path | None = None) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        out = log.open("wb") if log else None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", *args],
            stdout=out or subprocess.DEVNULL, stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})}, start_new_session=True)
        if out is not None:
            out.close()  # the child has its own descriptor

    def wait_ready(self, path: str = "/health", timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"child exited with {self.proc.returncode}: {self.output()}")
            try:
                if httpx.get(self.url + path, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"child not ready in {timeout_s}s: {self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log else ""

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


def sim_backend(*, speed: float = 5.0, seed: int = 0) -> Child:
    port = free_port()
    child = Child(["sim-backend", "--port", str(port), "--speed", str(speed),
                   "--seed", str(seed), "--scheduling-policy", "fcfs"], port)
    child.wait_ready()
    return child
