"""The guard in front of every local vLLM engine: no engine outlives its gateway unseen.

::

    gateway --pipe--> guard (session and group leader) --> vLLM API server --> engine core,
                                                                              TP workers

A gateway can end without stopping anything (SIGKILL, the OOM killer, a crash). Its
engines run in their own session, so nothing would reach them: they would keep their
GPUs while a restarted gateway starts new engines on the same ones. So the launcher does
not start vLLM itself but this guard (stdlib only, run as ``python -I engine_guard.py``),
which starts vLLM as its child and watches three things at once:

- **the gateway**: the launcher keeps the write end of a pipe whose read end only the
  guard holds. The kernel closes it when the gateway's process ends, however it ends,
  so the guard reads end-of-file at once (no polling, no pid that could be reused);
- **the engine**: when the API server exits (a crash), the guard stops what is left of
  it and exits with the same status (``128 + signal`` if it was killed), which is what
  the launcher's crash detection sees;
- **signals**: SIGTERM, SIGINT or SIGHUP to the guard stop the engine as well.

Stopping means SIGTERM to every process of the engine, then SIGKILL to whatever is left
after the grace period. "Every process of the engine" is found by a tag: the launcher puts
``ROLLOUT_GATEWAY_ENGINE_TAG=<tag>`` in the engine's environment, and every process vLLM
starts (the engine core and TP workers, forked or spawned by ``multiprocessing``)
inherits it, so each is found in ``/proc/<pid>/environ`` even if it left the process
group. A process that merely reuses an old pid does not carry the tag, so it is never
killed.

If the guard itself is killed, the API server gets SIGTERM from the kernel
(``PR_SET_PDEATHSIG``); what that leaves behind is found by the next gateway on the host
through the engine's record (``backends.vllm_local``), which the guard deletes once
nothing of its engine is left.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

TAG_VAR = "ROLLOUT_GATEWAY_ENGINE_TAG"
PR_SET_PDEATHSIG = 1
POLL_S = 0.1


# -- /proc (Linux) --------------------------------------------------------------------


def _stat_fields(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name: state, ppid, pgrp, ..."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2 :].split()


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot), or None if it is gone or a zombie.
    With the pid it names one process for as long as the machine runs."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] == b"Z":
        return None
    return int(fields[19])


def _pids() -> Iterable[int]:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            yield int(entry.name)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid``."""
    return [pid for pid in _pids()
            if (f := _stat_fields(pid)) is not None and int(f[2]) == pgid and f[0] != b"Z"]


def children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid``."""
    return [p for p in _pids()
            if (f := _stat_fields(p)) is not None and int(f[1]) == pid and f[0] != b"Z"]


def tagged(tag: str, *, exclude: Sequence[int] = ()) -> list[int]:
    """Live processes whose environment carries ``TAG_VAR=tag`` (ours to read: same user)."""
    needle = f"{TAG_VAR}={tag}".encode()
    found = []
    for pid in _pids():
        if pid in exclude:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0") and start_ticks(pid) is not None:
            found.append(pid)
    return found


def _kill(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def stop_tagged(tag: str, grace_s: float, *, exclude: Sequence[int] = ()) -> list[int]:
    """SIGTERM every process carrying ``tag``; SIGKILL what is left after ``grace_s``.
    Blocking. Returns the pids still alive at the end (stuck in the kernel)."""
    _kill(tagged(tag, exclude=exclude), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while (left := tagged(tag, exclude=exclude)) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    for _ in range(50):
        if not left:
            return []
        _kill(left, signal.SIGKILL)
        time.sleep(POLL_S)
        left = tagged(tag, exclude=exclude)
    return left


# -- the guard process ----------------------------------------------------------------


def _die_with(parent: int) -> Callable[[], None]:
    """``preexec_fn``: the engine gets SIGTERM when its parent (the guard) dies."""

    def setup() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the guard died before prctl took effect
            os._exit(1)

    return setup


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _say(message: str) -> None:
    print(f"[engine guard {os.getpid()}] {message}", flush=True)


def run(tag: str, gateway_fd: int, grace_s: float, record: Path | None,
        argv: Sequence[str]) -> int:
    """Run ``argv`` under guard (module docstring); the exit status to leave with."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    received: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: received.append(signum))
    engine = subprocess.Popen(argv, preexec_fn=_die_with(os.getpid()))
    poller = select.poll()
    poller.register(gateway_fd, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    engine_fd: int | None = None
    with contextlib.suppress(AttributeError, OSError):  # without a pidfd: poll every 0.5 s
        engine_fd = os.pidfd_open(engine.pid)
        poller.register(engine_fd, select.POLLIN)
    reason = ""
    while not reason:
        events = {fd for fd, _ in poller.poll(None if engine_fd is not None else 500)}
        if engine.poll() is not None:
            reason = f"the engine exited with code {engine.returncode}"
        elif gateway_fd in events:
            reason = "the gateway is gone (its end of the pipe closed)"
        elif received:
            reason = f"signal {signal.Signals(received[0]).name}"
        if wake_r in events:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 64)
    if engine.poll() is None:
        _say(f"{reason}: stopping the engine (tag {tag}, grace {grace_s:g} s)")
    left = stop_tagged(tag, grace_s, exclude=(os.getpid(),))
    status = _exit_status(engine.wait())
    if left:
        _say(f"processes {left} of the engine did not exit; keeping its record")
    elif record is not None:
        with contextlib.suppress(OSError):
            record.unlink()
    return status


def main(args: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run a vLLM engine under guard.")
    parser.add_argument("--tag", required=True)
    parser.add_argument("--fd", type=int, required=True, help="read end of the gateway pipe")
    parser.add_argument("--grace", type=float, default=10.0)
    parser.add_argument("--record", type=Path)
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    ns = parser.parse_args(args)
    argv = ns.argv[1:] if ns.argv[:1] == ["--"] else ns.argv
    if not argv:
        parser.error("no engine command after --")
    try:
        return run(ns.tag, ns.fd, ns.grace, ns.record, argv)
    except OSError as exc:  # the engine could not be started at all
        _say(f"cannot run {argv[0]}: {exc}")
        return 127


if __name__ == "__main__":
    sys.exit(main())
