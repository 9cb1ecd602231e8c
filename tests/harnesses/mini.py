"""Running mini-swe-agent's ``mini`` CLI as shipped (base URL, key, model and a step limit
set, nothing else), for its tests on the simulated pool and on real vLLM CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.harnesses.conftest import MODEL

TASK = "Print the contents of hello.txt."


def run_mini(base_url: str, tmp_path: Path, *, steps: int, model: str = MODEL,
             settings: Sequence[str] = (), timeout_s: float = 120) -> tuple[dict[str, Any], float]:
    """mini-swe-agent's CLI on :data:`TASK` against ``base_url`` (an OpenAI ``/v1`` URL),
    in a scratch work directory with its own HOME; ``settings`` are more ``-c key=value``
    overrides. Its saved trajectory (``-o``) and the run's wall time."""
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    (work / "hello.txt").write_text("hello\n")
    mini = Path(sys.executable).with_name("mini")
    out = tmp_path / "traj.json"
    env = {**os.environ, "HOME": str(home), "MSWEA_CONFIGURED": "true",
           "MSWEA_COST_TRACKING": "ignore_errors", "MSWEA_SILENT_STARTUP": "1"}
    overrides = [f"agent.step_limit={steps}", f"model.model_kwargs.api_base={base_url}",
                 "model.model_kwargs.api_key=EMPTY", *settings]
    start = time.monotonic()
    proc = subprocess.run(
        [str(mini), "-m", f"openai/{model}", "-t", TASK, "-y", "--exit-immediately",
         "-o", str(out), "-c", "mini.yaml", *(a for o in overrides for a in ("-c", o))],
        cwd=work, env=env, capture_output=True, text=True, timeout=timeout_s,
        stdin=subprocess.DEVNULL, check=False)
    wall = time.monotonic() - start
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), wall


def rejected_replies(messages: list[dict[str, Any]]) -> list[bool]:
    """Per model call, in order: whether mini-swe-agent rejected the reply (a format error
    message in the reply's place) rather than keeping it (an assistant message)."""
    out = []
    for m in messages[2:]:  # after the system prompt and the task
        if m["role"] == "assistant":
            out.append(False)
        elif m.get("extra", {}).get("interrupt_type") == "FormatError":
            out.append(True)
    return out
