"""SimLauncher implements the launcher protocol over in-process simulated servers."""

from __future__ import annotations

import httpx
import pytest

from backends.base import InstanceSpec, Launcher, LaunchError
from backends.sim.launcher import SimLauncher
from backends.sim.state import SimServerConfig


async def test_start_serves_the_spec_and_stop_ends_it() -> None:
    launcher = SimLauncher(SimServerConfig(speed=100), startup_s=0.5)
    assert isinstance(launcher, Launcher)
    inst = await launcher.start(InstanceSpec(id="a", model="qwen3-14b", tp=4))
    try:
        async with httpx.AsyncClient(base_url=inst.url) as http:
            assert (await http.get("/health")).status_code == 200
            stats = (await http.get("/sim/stats")).json()
        assert stats["profile"] == "qwen3-14b/H100/tp4"
        assert await launcher.alive(inst)
    finally:
        await launcher.stop(inst, grace_s=2)
    assert not await launcher.alive(inst)
    await launcher.close()


async def test_unknown_model_is_a_launch_error() -> None:
    with pytest.raises(LaunchError, match="available"):
        await SimLauncher(startup_s=0).start(InstanceSpec(id="b", model="nope"))
