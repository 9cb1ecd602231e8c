"""LocalVLLMLauncher's process handling, without vLLM: fake "python" executables.

These run in the default test run; the real-engine tests are in ``test_real_vllm.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from backends.base import InstanceSpec, Launcher, LaunchError
from backends.vllm_local import API_SERVER_MODULE, LocalVLLMLauncher, group_members


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
    launcher = LocalVLLMLauncher(python=sys.executable, log_dir=tmp_path, start_timeout_s=30)
    with pytest.raises(LaunchError, match=r"exited with code 1[\s\S]*No module named"):
        await launcher.start(InstanceSpec(id="nomod", model="m"))


async def test_missing_executable_raises(tmp_path: Path) -> None:
    launcher = LocalVLLMLauncher(python=str(tmp_path / "nope"), log_dir=tmp_path)
    with pytest.raises(LaunchError, match="cannot run"):
        await launcher.start(InstanceSpec(id="x", model="m"))


async def test_start_timeout_kills_the_whole_group(tmp_path: Path) -> None:
    # A "server" that never answers and has a child that ignores SIGTERM.
    pidfile = tmp_path / "pid"
    fake = _script(
        tmp_path, f"echo $$ > {pidfile}\necho starting\n(trap '' TERM; sleep 60) &\nsleep 60"
    )
    launcher = LocalVLLMLauncher(
        python=fake, log_dir=tmp_path, start_timeout_s=1.0, poll_interval_s=0.1
    )
    with pytest.raises(LaunchError, match=r"not ready after 1 s[\s\S]*starting"):
        await launcher.start(InstanceSpec(id="slow", model="m"))
    assert group_members(int(pidfile.read_text())) == []


async def test_stop_and_alive_on_a_running_process(tmp_path: Path) -> None:
    # /health is never answered, so drive the handle through a start that times out is
    # not enough; instead use a real HTTP server as the fake vLLM.
    fake = _script(
        tmp_path,
        '[ "$9" = "--port" ] || exit 3\n'
        f'exec {sys.executable} -c "'
        "import http.server as h, sys;"
        "H=type('H',(h.BaseHTTPRequestHandler,),{'do_GET':lambda s:(s.send_response(200),"
        "s.end_headers()),'log_message':lambda *a:None});"
        'h.HTTPServer((\'127.0.0.1\', int(sys.argv[1])), H).serve_forever()" "${10}"',
    )
    launcher = LocalVLLMLauncher(python=fake, log_dir=tmp_path, poll_interval_s=0.05)
    instance = await launcher.start(InstanceSpec(id="fake", model="m"))
    pid = int(instance.meta["pid"])
    assert await launcher.alive(instance)
    assert group_members(pid) == [pid]
    await launcher.stop(instance, grace_s=2)
    assert not await launcher.alive(instance)
    assert group_members(pid) == []
    await launcher.stop(instance)  # idempotent
