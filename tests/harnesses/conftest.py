"""Harnesses the gateway does not own, driven unmodified against simulated vLLM servers."""

from tests.gateway.conftest import gateway_at, loop_thread, sim_pool  # noqa: F401
