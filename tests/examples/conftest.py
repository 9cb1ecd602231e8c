"""The examples run as subprocesses against the same gateway + simulated pool fixtures."""

from __future__ import annotations

from tests.client.conftest import gateway, loop_thread, sim_urls

__all__ = ["gateway", "loop_thread", "sim_urls"]
