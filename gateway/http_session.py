"""The aiohttp sessions the gateway calls engines with.

One is shared by the request path and the rest (upstream calls, the pool's warm-ups,
the status monitor's scrapes): made by the runtime at start and handed to whoever calls
out. It sits below all of them, so the runtime that makes it never has to import the
proxy that uses it. The health checks have a small one of their own
(:func:`make_health_session`).
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


#: connections the health checks may hold to one backend: its ``/health`` and
#: ``/v1/models`` go one after the other, a check the admin API asks for may overlap
HEALTH_CONNECTIONS_PER_BACKEND = 2


def make_health_session(settings: UpstreamSettings) -> aiohttp.ClientSession:
    """The health checks' own session, apart from the shared pool: a check's timeout
    counts the wait for a connection, so with that pool full of long streams a check
    would time out and a working backend be marked unhealthy."""
    connector = aiohttp.TCPConnector(
        limit=0, limit_per_host=HEALTH_CONNECTIONS_PER_BACKEND, ttl_dns_cache=300,
        enable_cleanup_closed=False, keepalive_timeout=settings.keepalive_s,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=settings.health_timeout_s,
                                      sock_connect=settings.connect_timeout_s),
        skip_auto_headers=("User-Agent",),
    )
