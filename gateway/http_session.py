"""The one aiohttp session the gateway shares: upstream calls, health checks, scrapes.

Made by the runtime at start and handed to whoever calls out (the proxy, the pool's
warm-ups, the status monitor). It sits below all of them, so the runtime that makes it
never has to import the proxy that uses it.
"""

from __future__ import annotations

import aiohttp

from gateway.config import UpstreamSettings


def make_session(settings: UpstreamSettings) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(
        limit=settings.max_connections, limit_per_host=0, ttl_dns_cache=300,
        enable_cleanup_closed=False, keepalive_timeout=settings.keepalive_s,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=settings.connect_timeout_s),
        auto_decompress=True,
        skip_auto_headers=("User-Agent",),
    )
