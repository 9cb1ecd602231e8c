"""The deployment files stay valid (docker compose cannot run here, but it can parse)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _compose() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


def test_compose_file_is_valid():
    cmd = _compose()
    if cmd is None:
        if os.environ.get("CI"):
            pytest.fail("docker compose (or docker-compose) is needed to validate the compose "
                        "file; .ci/run installs it")
        pytest.skip("no docker compose on this machine")
    env = {**os.environ, "ROLLOUT_GATEWAY_ADMIN_TOKEN": "test-token"}
    out = subprocess.run([*cmd, "-f", str(ROOT / "docker-compose.yml"), "config"],
                         capture_output=True, text=True, env=env, check=False)
    assert out.returncode == 0, out.stderr
    assert "migrate" in out.stdout and "gateway" in out.stdout
    assert "service_completed_successfully" in out.stdout


def test_compose_sharded_profile_is_valid():
    cmd = _compose()
    if cmd is None:
        if os.environ.get("CI"):
            pytest.fail("docker compose (or docker-compose) is needed; .ci/run installs it")
        pytest.skip("no docker compose on this machine")
    env = {**os.environ, "ROLLOUT_GATEWAY_ADMIN_TOKEN": "test-token"}
    out = subprocess.run([*cmd, "-f", str(ROOT / "docker-compose.yml"), "--profile", "sharded",
                          "config"], capture_output=True, text=True, env=env, check=False)
    assert out.returncode == 0, out.stderr
    for service in ("shard0:", "shard1:", "front:", "haproxy-config:", "haproxy:"):
        assert service in out.stdout, service
    assert "http://shard0:8000" in out.stdout and "haproxy:2.6" in out.stdout


def test_compose_vllm_has_the_routes_the_gateway_uses_and_keeps_them_private():
    """Pause and weight updates need vLLM's dev-mode routes; those take no credential, so
    the engine's port is not published (only the gateway reaches it)."""
    vllm = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["vllm"]
    assert str(vllm["environment"].get("VLLM_SERVER_DEV_MODE")) == "1"
    assert "ports" not in vllm
