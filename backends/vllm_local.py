"""Local vLLM servers: one ``python -m vllm.entrypoints.openai.api_server`` per instance.

Each instance runs under a guard (:mod:`backends.engine_guard`) in its own process group
(``start_new_session``): stopping it signals the guard, the API server *and* the
engine-core and worker processes it forked; nothing is left behind when the API server
dies first, and nothing outlives the gateway: when the gateway's process ends, however
it ends, the guard stops the engine. Each engine also has a record in ``state_dir``
(:mod:`backends.engine_records`); before its first start the launcher reaps the engines
of gateways that died on this host. Readiness is the first ``200`` from
``GET /health``: vLLM binds its HTTP port only after the engine is up.

Flags every instance gets (the gateway relies on them; see
``docs/real-vllm-wire-format.md``):

- ``--enable-prefix-caching`` and ``--scheduling-policy priority``: without the latter a
  request's ``priority`` is silently ignored, not rejected;
- ``--enable-prompt-tokens-details``: ``usage.prompt_tokens_details.cached_tokens``;
- ``--enable-auto-tool-choice --tool-call-parser PARSER``: without them vLLM answers 400
  to any request with ``tools`` (the default ``tool_choice`` is ``"auto"``).

and in the environment ``VLLM_SERVER_DEV_MODE=1`` (unless ``env`` says otherwise): vLLM
registers its ``/pause``, ``/resume``, ``/is_paused`` and weight routes only in dev mode,
and the gateway's engine pauses and weight updates use them (``docs/weight-updates.md``).
Dev mode also opens vLLM's other development routes, so keep engine ports reachable by
the gateway only (the default host is loopback).

GPU placement: on ``device="cuda"`` the instance sees ``CUDA_VISIBLE_DEVICES`` = its GPU
ids; on ``device="cpu"`` (the CPU build of vLLM used by the tests) the "GPUs" are CPU
cores and become ``VLLM_CPU_OMP_THREADS_BIND`` (``(0, 1)`` -> ``"0|1"``: one core per TP
rank).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import aiohttp

from backends import engine_guard
from backends.base import InstanceSpec, LaunchedInstance, LaunchError
from backends.engine_guard import TAG_VAR, children, group_members, stop_tagged
from backends.engine_records import (
    EngineRecord,
    default_state_dir,
    new_tag,
    reap_orphans,
    record_path,
    remove_record,
    write_record,
)

log = logging.getLogger(__name__)
Device = Literal["cuda", "cpu"]

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: tokens a streamed event carries after the first (vLLM's ``--stream-interval``, from
#: vLLM 0.12; 1, vLLM's default, passes no flag). Above 1 the engine and the gateway read,
#: parse and send one event per N tokens; but vLLM then holds up to N-1 tokens it made
#: unsent across a pause, so a weight update cannot freeze a stream in place and know
#: which weights made them: it waits for such streams instead (docs/pool.md)
STREAM_INTERVAL = 1
GUARD_SCRIPT = engine_guard.__file__
LOG_TAIL_BYTES = 4000


@dataclass(slots=True)
class _Process:
    """What ``LaunchedInstance.handle`` holds for a local server: the guard's process
    (the group leader), the write end of its pipe, the engine's tag."""

    proc: asyncio.subprocess.Process
    pgid: int
    port: int
    tag: str
    pipe: int
    stopped: bool = False
    stop_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class LocalVLLMLauncher:
    """Starts vLLM OpenAI servers as local processes (see the module docstring).

    ``model_path`` is what vLLM loads (default: ``spec.model``); the server answers to
    ``served_model_name`` (default: ``spec.model``), so a pool can name its model
    ``"tiny"`` while loading it from a directory. ``state_dir`` holds the engines'
    records (default: ``~/.local/state/rollout-gateway/engines``); ``orphan_grace_s`` is
    how long an engine gets between SIGTERM and SIGKILL when its gateway is gone.
    """

    name = "vllm-local"

    def __init__(
        self,
        *,
        python: str = sys.executable,
        model_path: str | None = None,
        served_model_name: str | None = None,
        device: Device = "cuda",
        host: str = "127.0.0.1",
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        tool_call_parser: str | None = "hermes",
        stream_interval: int = STREAM_INTERVAL,
        start_timeout_s: float = 600.0,
        poll_interval_s: float = 0.5,
        log_dir: Path | None = None,
        state_dir: Path | None = None,
        orphan_grace_s: float = 10.0,
    ) -> None:
        self.python = python
        self.model_path = model_path
        self.served_model_name = served_model_name
        self.device: Device = device
        self.host = host
        self.extra_args = tuple(extra_args)
        self.env = dict(env or {})
        self.tool_call_parser = tool_call_parser
        self.stream_interval = stream_interval
        self.start_timeout_s = start_timeout_s
        self.poll_interval_s = poll_interval_s
        self._log_dir = log_dir
        self.state_dir = Path(state_dir) if state_dir else default_state_dir()
        self.orphan_grace_s = orphan_grace_s
        self._running: dict[int, LaunchedInstance] = {}
        self._reaped = False
        self._reap_lock = asyncio.Lock()

    # -- the Launcher protocol -------------------------------------------------------

    async def start(self, spec: InstanceSpec) -> LaunchedInstance:
        _validate(spec)
        await self.reap_orphans()
        port = self._free_port()
        log_path = await self._log_path(spec, port)
        tag = new_tag()
        handle = await self._spawn(spec, port, tag, log_path)
        instance = LaunchedInstance(
            spec=spec,
            url=f"http://{_url_host(self.host)}:{port}",
            handle=handle,
            log_path=str(log_path),
            meta={"pid": str(handle.proc.pid), "port": str(port), "device": self.device,
                  "tag": tag},
        )
        self._running[handle.proc.pid] = instance
        try:
            record = EngineRecord.new(tag, handle.proc.pid, port, spec, str(log_path))
            await asyncio.to_thread(write_record, self.state_dir, record)
        except OSError as exc:  # the guard still covers the gateway's death
            log.warning("%s: cannot write the engine record in %s: %s", spec.id,
                        self.state_dir, exc)
        try:
            await self._await_ready(instance, handle)
        except BaseException:
            await self.stop(instance, grace_s=5.0)
            raise
        engine = await asyncio.to_thread(children, handle.proc.pid)
        if engine:
            instance.meta["engine_pid"] = str(engine[0])
        return instance

    async def _spawn(self, spec: InstanceSpec, port: int, tag: str, log_path: Path) -> _Process:
        """Start the guard, which starts vLLM (``command``) as its child."""
        pipe_r, pipe_w = os.pipe()  # both ends close-on-exec; only pipe_r is passed on
        guard = [sys.executable, "-I", GUARD_SCRIPT, "--tag", tag, "--fd", str(pipe_r),
                 "--grace", f"{self.orphan_grace_s:g}",
                 "--record", str(record_path(self.state_dir, tag)), "--"]
        log_file = await asyncio.to_thread(log_path.open, "ab")
        try:
            proc = await asyncio.create_subprocess_exec(
                *guard, *self.command(spec, port),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=asyncio.subprocess.STDOUT,
                env={**self.environment(spec), TAG_VAR: tag},
                start_new_session=True,
                pass_fds=(pipe_r,),
            )
        except OSError as exc:
            os.close(pipe_w)
            raise LaunchError(f"{spec.id}: cannot run the engine guard: {exc}") from exc
        finally:
            log_file.close()
            os.close(pipe_r)
        return _Process(proc=proc, pgid=proc.pid, port=port, tag=tag, pipe=pipe_w)

    async def reap_orphans(self) -> None:
        """Once per launcher, before its first start: stop the engines on this host whose
        gateway is gone (:func:`backends.engine_records.reap_orphans`)."""
        async with self._reap_lock:
            if self._reaped:
                return
            self._reaped = True
            try:
                reaped = await asyncio.to_thread(reap_orphans, self.state_dir,
                                                 self.orphan_grace_s)
            except OSError as exc:
                log.warning("cannot look for orphaned engines in %s: %s", self.state_dir, exc)
                return
        for r in reaped:
            log.warning("stopped %s, left running by a gateway that is gone (pids %s)%s",
                        r.record.describe(), r.pids,
                        f"; {r.left} would not exit" if r.left else "")

    async def stop(self, instance: LaunchedInstance, *, grace_s: float = 10.0) -> None:
        handle = _handle(instance)
        async with handle.stop_lock:
            if handle.stopped:
                return
            await _terminate_group(handle, grace_s)
            # a process of the engine that left the group still carries its tag
            await asyncio.to_thread(stop_tagged, handle.tag, 1.0)
            handle.stopped = True
            os.close(handle.pipe)
            await asyncio.to_thread(remove_record, self.state_dir, handle.tag)
            self._running.pop(handle.proc.pid, None)

    async def alive(self, instance: LaunchedInstance) -> bool:
        handle = _handle(instance)
        return not handle.stopped and handle.proc.returncode is None

    async def close(self) -> None:
        await asyncio.gather(*(self.stop(i) for i in list(self._running.values())))

    # -- building the process ---------------------------------------------------------

    def command(self, spec: InstanceSpec, port: int) -> list[str]:
        """The argv that starts ``spec`` on ``port``: on ``spec.weights_path`` when the pool
        set one (its current weights), with the launcher model's tokenizer."""
        base = self.model_path or spec.model
        argv = [
            self.python, "-m", API_SERVER_MODULE,
            "--model", spec.weights_path or base,
            "--served-model-name", self.served_model_name or spec.model,
            "--host", self.host,
            "--port", str(port),
            "--tensor-parallel-size", str(spec.tp),
            "--enable-prefix-caching",
            "--scheduling-policy", "priority",
            "--enable-prompt-tokens-details",
            "--disable-access-log-for-endpoints", "/health,/metrics",
        ]  # fmt: skip
        if spec.weights_path and spec.weights_path != base:  # a checkpoint may lack one
            argv += ["--tokenizer", base]
        if self.tool_call_parser:
            argv += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_call_parser]
        if self.stream_interval > 1:
            argv += ["--stream-interval", str(self.stream_interval)]
        return [*argv, *self.extra_args, *spec.extra_args]

    def environment(self, spec: InstanceSpec) -> dict[str, str]:
        """The child's environment: ours, the configured overrides, then placement."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_SERVER_DEV_MODE": "1", **self.env}
        if self.device == "cuda":
            if spec.gpus:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, spec.gpus))
        else:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            # vLLM's "auto" binding refuses TP > 1 on one NUMA node; name the cores.
            cores = spec.gpus or (tuple(range(spec.tp)) if spec.tp > 1 else ())
            if cores:
                env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, cores))
        return env

    def _free_port(self) -> int:
        # The kernel may hand the same free port to two starts in a row; vLLM binds it
        # only after its imports, so avoid the ports of our own instances explicitly.
        taken = {_handle(i).port for i in self._running.values()}
        while (port := _free_port(self.host)) in taken:
            pass
        return port

    async def _log_path(self, spec: InstanceSpec, port: int) -> Path:
        if self._log_dir is None:
            self._log_dir = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="vllm-logs-"))
        await asyncio.to_thread(self._log_dir.mkdir, parents=True, exist_ok=True)
        return self._log_dir / f"{spec.id}-{port}.log"

    # -- readiness ----------------------------------------------------------------------

    async def _await_ready(self, instance: LaunchedInstance, handle: _Process) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.start_timeout_s
        timeout = aiohttp.ClientTimeout(total=2.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                if handle.proc.returncode is not None:
                    tail = await _log_tail(instance.log_path)
                    raise LaunchError(
                        f"{instance.spec.id}: vLLM exited with code {handle.proc.returncode} "
                        f"during start; log {instance.log_path}:\n{tail}"
                    )
                if await _healthy(session, instance.url):
                    return
                if loop.time() >= deadline:
                    tail = await _log_tail(instance.log_path)
                    raise LaunchError(
                        f"{instance.spec.id}: not ready after {self.start_timeout_s:.0f} s; "
                        f"log {instance.log_path}:\n{tail}"
                    )
                await asyncio.sleep(self.poll_interval_s)


async def _terminate_group(handle: _Process, grace_s: float) -> None:
    """SIGTERM the whole group, SIGKILL whatever is left after ``grace_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    _signal_group(handle.pgid, signal.SIGTERM)
    while await asyncio.to_thread(group_members, handle.pgid):
        if loop.time() >= deadline:
            _signal_group(handle.pgid, signal.SIGKILL)
            break
        await asyncio.sleep(0.1)
    await handle.proc.wait()
    # Children that outlived their parent keep the group id; finish them too (bounded:
    # a process stuck in uninterruptible sleep must not hang the pool manager).
    for _ in range(50):
        if not await asyncio.to_thread(group_members, handle.pgid):
            return
        _signal_group(handle.pgid, signal.SIGKILL)
        await asyncio.sleep(0.1)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def _healthy(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(f"{url}/health") as resp:
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def _log_tail(path: str | None) -> str:
    if path is None:
        return ""

    def read() -> str:
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - LOG_TAIL_BYTES))
                return f.read().decode(errors="replace")
        except OSError as exc:
            return f"(log unreadable: {exc})"

    return await asyncio.to_thread(read)


def _validate(spec: InstanceSpec) -> None:
    if spec.tp < 1:
        raise LaunchError(f"{spec.id}: tp must be >= 1, got {spec.tp}")
    if spec.gpus and len(spec.gpus) != spec.tp:
        raise LaunchError(f"{spec.id}: tp={spec.tp} needs {spec.tp} GPUs, got {spec.gpus}")
    if spec.node != "local":
        raise LaunchError(f"{spec.id}: the local launcher cannot place on node {spec.node!r}")


def _handle(instance: LaunchedInstance) -> _Process:
    if not isinstance(instance.handle, _Process):
        raise TypeError(f"{instance.spec.id} was not started by LocalVLLMLauncher")
    return instance.handle


def _free_port(host: str) -> int:
    """A port that is free now (the server binds it a few seconds later; races are rare
    and surface as a LaunchError with "address already in use" in the log)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


__all__ = ["API_SERVER_MODULE", "LocalVLLMLauncher", "group_members"]
