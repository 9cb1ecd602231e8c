"""The ``rollout-gateway`` command tree: one root registers every command, each answers ``--help``."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from gateway.cli import app as gateway_app
from rollout_gateway.cli import app

ROOT = Path(__file__).resolve().parents[1]
TOP = ["serve", "migrate", "export", "sim-backend", "front", "haproxy-config", "demo", "bench"]
BENCH = ["sim", "steps", "soak", "overhead", "store", "headroom", "live", "vllm-cpu",
         "record", "tail", "page", "grid", "gpu-scan", "learn", "learn-two", "loop", "split",
         "relay",
         "routes", "viewer"]


def _names(group: object) -> list[str]:
    return list(getattr(group, "commands", {}))


def test_root_registers_every_command_in_order() -> None:
    root = get_command(app)
    assert _names(root) == TOP
    assert _names(root.commands["bench"]) == BENCH  # type: ignore[attr-defined]


def test_gateway_cli_alone_knows_nothing_of_the_benchmarks() -> None:
    names = _names(get_command(gateway_app))
    assert names == ["serve", "migrate", "export", "sim-backend", "front", "haproxy-config"]


@pytest.mark.parametrize("args", [[], *([c] for c in TOP), *(["bench", c] for c in BENCH)],
                         ids=lambda a: " ".join(a) or "root")
def test_help_of_every_command(args: list[str]) -> None:
    res = CliRunner().invoke(app, [*args, "--help"])
    assert res.exit_code == 0, res.output
    assert "Usage:" in res.output
    if args in ([], ["bench"]):
        for name in TOP if not args else BENCH:
            assert name in res.output


def test_bench_sim_runs_through_the_root() -> None:
    res = CliRunner().invoke(app, ["bench", "sim", "--workload", "math-code", "--gpus", "2",
                                   "--prompts", "1", "--group-size", "2", "--policy", "slime"])
    assert res.exit_code == 0, res.output
    assert "makespan" in res.output and "slime" in res.output


@pytest.mark.parametrize(("name", "why"), [
    ("straggler-lane-oracle", "hidden lengths"), ("nope", "unknown policy")])
def test_bench_live_refuses_what_a_live_gateway_cannot_run(name: str, why: str) -> None:
    res = CliRunner().invoke(app, ["bench", "live", "--policy", name])
    assert res.exit_code == 2 and why in res.output


def test_bench_live_accepts_the_static_layouts() -> None:
    from bench.runners.live_cli import LIVE_POLICIES

    assert {"verl-tp8", "slime-tp1", "straggler-lane"} <= set(LIVE_POLICIES)
    assert not {"progressive-oracle", "straggler-lane-oracle"} & set(LIVE_POLICIES)


def test_unknown_command_is_refused() -> None:
    res = CliRunner().invoke(app, ["bench", "nope"])
    assert res.exit_code != 0 and "No such command" in res.output


def test_installed_script_points_at_the_root() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["rollout-gateway"] == "rollout_gateway.cli:main"


@pytest.mark.parametrize("module", ["rollout_gateway", "gateway"])
def test_python_dash_m_runs_the_whole_cli(module: str) -> None:
    out = subprocess.run([sys.executable, "-m", module, "bench", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    for name in BENCH:
        assert name in out.stdout


@pytest.mark.parametrize(("args", "env"), [
    (["--policy", "nope"], {}), ([], {"ROLLOUT_GATEWAY_POLICY": "progressive-oracle"})])
def test_serve_refuses_a_policy_it_cannot_run_before_starting(
        args: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    res = CliRunner().invoke(app, ["serve", "--port", "0", *args])
    assert res.exit_code == 2 and "unknown policy" in res.output, res.output
    assert "straggler-lane" in res.output  # the names it does run


def test_sim_backend_takes_a_context_length() -> None:
    out = CliRunner().invoke(gateway_app, ["sim-backend", "--help"], env={"COLUMNS": "200"})
    assert out.exit_code == 0 and "--max-model-len" in out.output
    bad = CliRunner().invoke(gateway_app, ["sim-backend", "--max-model-len", "0"])
    assert bad.exit_code != 0
