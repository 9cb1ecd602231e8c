"""Externally managed servers at fixed URLs: the launcher that launches nothing.

A static pool lets the pool manager treat servers someone else runs (a cluster
scheduler, a colleague's vLLM) like managed ones: registered with their TP degree,
drained before removal. It cannot start anything new, so such a pool cannot be
reconfigured, only shrunk.
"""

from __future__ import annotations

from collections.abc import Mapping

from backends.base import InstanceSpec, LaunchedInstance, LaunchError


class StaticLauncher:
    """``start`` looks the instance id up in ``urls``; ``stop`` forgets it."""

    name = "static"

    def __init__(self, urls: Mapping[str, str]) -> None:
        self.urls = {k: v.rstrip("/").removesuffix("/v1") for k, v in urls.items()}

    async def start(self, spec: InstanceSpec) -> LaunchedInstance:
        url = self.urls.get(spec.id)
        if url is None:
            raise LaunchError(f"{spec.id}: a static pool only has {sorted(self.urls)}")
        return LaunchedInstance(spec=spec, url=url, meta={"external": "true"})

    async def stop(self, instance: LaunchedInstance, *, grace_s: float = 10.0) -> None:
        """Nothing to stop: the server belongs to someone else."""

    async def alive(self, instance: LaunchedInstance) -> bool:
        """Always true: reachability is the health checker's business, not a crash."""
        return True

    async def close(self) -> None:
        pass
