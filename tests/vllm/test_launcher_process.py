"""LocalVLLMLauncher's process handling, without vLLM: fake "python" executables.

These run in the default test run; the real-engine tests are in ``test_real_vllm.py``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from backends.base import InstanceSpec, Launcher, LaunchError
from backends.engine_guard import TAG_VAR, start_ticks, tagged
from backends.engine_records import EngineRecord, ProcessId, reap_orphans, write_record
from backends.vllm_local import API_SERVER_MODULE, LocalVLLMLauncher, group_members
from gateway.pool.spec import PoolSpec, build_launcher, stream_interval


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "fake-python"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_is_a_launcher() -> None:
    assert isinstance(LocalVLLMLauncher(), Launcher)


def test_command_has_the_flags_the_gateway_relies_on() -> None:
    launcher = LocalVLLMLauncher(
        python="/py", model_path="/models/tiny", extra_args=("--enforce-eager",)
    )
    spec = InstanceSpec(id="a", model="tiny", tp=2, gpus=(2, 3), extra_args=("--seed", "1"))
    argv = launcher.command(spec, 8123)
    assert argv[:3] == ["/py", "-m", API_SERVER_MODULE]
    joined = " ".join(argv)
    for part in (
        "--model /models/tiny",
        "--served-model-name tiny",
        "--port 8123",
        "--tensor-parallel-size 2",
        "--enable-prefix-caching",
        "--scheduling-policy priority",
        "--enable-auto-tool-choice --tool-call-parser hermes",
    ):
        assert part in joined
    assert argv[-3:] == ["--enforce-eager", "--seed", "1"]


def test_stream_interval_one_passes_no_flag_and_the_pool_spec_sets_it() -> None:
    """One token an event is vLLM's own default (and what a vLLM before 0.12 knows): no
    flag; a pool spec's ``stream_interval`` reaches the engine's argv."""
    spec = InstanceSpec(id="a", model="tiny", tp=1, gpus=(0,))
    assert "--stream-interval" not in LocalVLLMLauncher().command(spec, 1)
    pool = PoolSpec.model_validate({"model": "tiny", "inventory": {"gpus": 1}, "launcher": {
        "kind": "vllm", "python": "/py", "stream_interval": 16}})
    launcher = build_launcher(pool)
    assert isinstance(launcher, LocalVLLMLauncher)
    argv = launcher.command(spec, 1)
    assert argv[argv.index("--stream-interval") + 1] == "16"
    assert stream_interval(pool) == 16
    with pytest.raises(ValueError, match="stream_interval"):
        PoolSpec.model_validate({"model": "tiny", "inventory": {"gpus": 1}, "launcher": {
            "kind": "vllm", "stream_interval": 0}})
    # the flag by hand would hide it from the weight updates: refused where it could hide
    for launcher, layout in (({"extra_args": ["--stream-interval", "8"]}, None),
                             ({}, [{"tp": 1, "extra_args": ["--stream-interval=8"]}])):
        with pytest.raises(ValueError, match="'stream_interval'"):
            PoolSpec.model_validate({"model": "tiny", "inventory": {"gpus": 1}, "launcher": {
                "kind": "vllm", **launcher}, "layout": layout})


def test_environment_places_gpus_or_cores() -> None:
    spec = InstanceSpec(id="a", model="m", tp=2, gpus=(2, 3))
    assert LocalVLLMLauncher().environment(spec)["CUDA_VISIBLE_DEVICES"] == "2,3"
    cpu = LocalVLLMLauncher(device="cpu", env={"VLLM_CPU_KVCACHE_SPACE": "2"})
    env = cpu.environment(spec)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "2|3"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert cpu.environment(InstanceSpec(id="b", model="m", tp=2))["VLLM_CPU_OMP_THREADS_BIND"] == (
        "0|1"
    )


@pytest.mark.parametrize(
    "spec",
    [
        InstanceSpec(id="a", model="m", tp=0),
        InstanceSpec(id="a", model="m", tp=2, gpus=(0,)),
        InstanceSpec(id="a", model="m", node="node-7"),
    ],
)
async def test_bad_spec_is_refused(spec: InstanceSpec) -> None:
    with pytest.raises(LaunchError):
        await LocalVLLMLauncher().start(spec)


async def test_exit_during_start_raises_with_log_tail(tmp_path: Path) -> None:
    # The project's own python has no vllm: the module import fails at once.
    launcher = LocalVLLMLauncher(python=sys.executable, log_dir=tmp_path, start_timeout_s=30,
                                 state_dir=tmp_path / "state")
    with pytest.raises(LaunchError, match=r"exited with code 1[\s\S]*No module named"):
        await launcher.start(InstanceSpec(id="nomod", model="m"))


async def test_missing_executable_raises(tmp_path: Path) -> None:
    launcher = LocalVLLMLauncher(python=str(tmp_path / "nope"), log_dir=tmp_path,
                                 state_dir=tmp_path / "state")
    with pytest.raises(LaunchError, match="cannot run"):
        await launcher.start(InstanceSpec(id="x", model="m"))


async def test_start_timeout_kills_the_whole_group(tmp_path: Path) -> None:
    # A "server" that never answers and has a child that ignores SIGTERM.
    pidfile = tmp_path / "pid"
    fake = _script(
        tmp_path,
        f"echo starting\n(trap '' TERM; sleep 60) &\necho $$ $PPID $! > {pidfile}\nsleep 60",
    )
    launcher = LocalVLLMLauncher(
        python=fake, log_dir=tmp_path, start_timeout_s=1.0, poll_interval_s=0.1,
        state_dir=tmp_path / "state",
    )
    with pytest.raises(LaunchError, match=r"not ready after 1 s[\s\S]*starting"):
        await launcher.start(InstanceSpec(id="slow", model="m"))
    engine, guard, child = map(int, pidfile.read_text().split())
    assert group_members(guard) == []
    assert start_ticks(engine) is None and start_ticks(child) is None


def _http_fake(tmp_path: Path) -> str:
    """A fake vLLM that answers ``GET /health`` on the port the launcher gives it."""
    return _script(
        tmp_path,
        '[ "$9" = "--port" ] || exit 3\n'
        f'exec {sys.executable} -c "'
        "import http.server as h, sys;"
        "H=type('H',(h.BaseHTTPRequestHandler,),{'do_GET':lambda s:(s.send_response(200),"
        "s.end_headers()),'log_message':lambda *a:None});"
        'h.HTTPServer((\'127.0.0.1\', int(sys.argv[1])), H).serve_forever()" "${10}"',
    )


async def test_stop_and_alive_on_a_running_process(tmp_path: Path) -> None:
    # /health is never answered, so drive the handle through a start that times out is
    # not enough; instead use a real HTTP server as the fake vLLM.
    fake = _http_fake(tmp_path)
    launcher = LocalVLLMLauncher(python=fake, log_dir=tmp_path, poll_interval_s=0.05,
                                 state_dir=tmp_path / "state")
    instance = await launcher.start(InstanceSpec(id="fake", model="m"))
    pid = int(instance.meta["pid"])  # the guard, leader of the engine's process group
    assert await launcher.alive(instance)
    assert sorted(group_members(pid)) == sorted([pid, int(instance.meta["engine_pid"])])
    assert [p.name for p in (tmp_path / "state").iterdir()] == [f"{instance.meta['tag']}.json"]
    await launcher.stop(instance, grace_s=2)
    assert list((tmp_path / "state").iterdir()) == []
    assert not await launcher.alive(instance)
    assert group_members(pid) == []
    await launcher.stop(instance)  # idempotent


async def test_the_guard_exits_with_the_engine_and_cleans_up(tmp_path: Path) -> None:
    state = tmp_path / "state"
    launcher = LocalVLLMLauncher(python=_http_fake(tmp_path), log_dir=tmp_path,
                                 poll_interval_s=0.05, state_dir=state)
    instance = await launcher.start(InstanceSpec(id="crash", model="m"))
    assert launcher.environment(instance.spec)["VLLM_SERVER_DEV_MODE"] == "1"
    os.kill(int(instance.meta["engine_pid"]), signal.SIGKILL)  # the engine crashes
    deadline = time.monotonic() + 10
    while await launcher.alive(instance):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    handle: Any = instance.handle
    assert handle.proc.returncode == 128 + signal.SIGKILL  # the engine's status, passed on
    assert tagged(instance.meta["tag"]) == [] and list(state.iterdir()) == []
    await launcher.stop(instance)


def _tagged_process(tag: str, *, stubborn: bool = False) -> subprocess.Popen[bytes]:
    script = "trap '' TERM; sleep 60" if stubborn else "sleep 60"
    return subprocess.Popen(["sh", "-c", script], env={**os.environ, TAG_VAR: tag},
                            start_new_session=True)


def test_reap_stops_only_the_engines_whose_gateway_is_gone(tmp_path: Path) -> None:
    dead = subprocess.Popen(["sleep", "60"])
    dead_owner = ProcessId.of(dead.pid)
    dead.kill()
    dead.wait()
    me = ProcessId.of(os.getpid())
    recycled = ProcessId(os.getpid(), (me.start_ticks or 0) + 1)  # our pid, not our start
    cases = {  # tag -> (owner, record changes, reaped?)
        "deadowner": (dead_owner, {}, True),
        "recycledpid": (recycled, {}, True),
        "liveowner": (me, {}, False),
        "otherhost": (dead_owner, {"host": "elsewhere"}, False),
        "lastboot": (dead_owner, {"boot_id": "before-the-reboot"}, False),
    }
    procs = {tag: _tagged_process(tag, stubborn=tag == "deadowner") for tag in cases}
    try:
        for tag, (owner, changes, _) in cases.items():
            record = EngineRecord.new(tag, procs[tag].pid, 8000, InstanceSpec(id=tag, model="m"),
                                      None)
            record.owner = owner
            for key, value in changes.items():
                setattr(record, key, value)
            write_record(tmp_path, record)
        reaped = reap_orphans(tmp_path, grace_s=0.5)
        assert sorted(r.record.tag for r in reaped) == ["deadowner", "recycledpid"]
        assert all(r.pids and not r.left for r in reaped)
        for tag, (_, _, gone) in cases.items():
            procs[tag].poll()
            assert (tagged(tag) == []) is gone, tag
        # a record from before the last boot names no process that can exist: dropped
        assert sorted(p.stem for p in tmp_path.glob("*.json")) == ["liveowner", "otherhost"]
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


async def test_a_killed_guard_takes_the_api_server_with_it(tmp_path: Path) -> None:
    # As when Ray kills an actor's children: the guard gets SIGKILL and can do nothing;
    # the kernel's parent-death signal (SIGTERM) stops the API server (real vLLM then
    # stops its engine core itself; what a server leaves is reaped at the next start).
    launcher = LocalVLLMLauncher(python=_http_fake(tmp_path), log_dir=tmp_path,
                                 poll_interval_s=0.05, state_dir=tmp_path / "state")
    instance = await launcher.start(InstanceSpec(id="guardless", model="m"))
    engine = int(instance.meta["engine_pid"])
    os.kill(int(instance.meta["pid"]), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while start_ticks(engine) is not None:
        assert time.monotonic() < deadline, "the API server outlived its guard"
        await asyncio.sleep(0.05)
    await launcher.stop(instance)
