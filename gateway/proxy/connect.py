"""Open a call's upstream response, trying other backends on early failures.

A call is retried on another backend only while nothing has reached the client
(connection refused, the connection dropped before the response headers, a first-byte
timeout, a 5xx answer), within ``max_attempts`` and one deadline (``total_timeout_s``
from arrival) for all attempts together. Every outcome feeds the backend's circuit
breaker but the first dropped connection per backend in a call (most often a keep-alive
connection the backend closed as the call went out): that backend stays eligible.
"""

from __future__ import annotations

import time

from gateway.dispatch.backends import CircuitBreaker
from gateway.errors import NoBackendAvailable, UpstreamError, UpstreamTimeout
from gateway.proxy import routes
from gateway.proxy.calls import CallContext
from gateway.proxy.lifecycle import dispatched, requeue
from gateway.proxy.tokens import PromptPlanner
from gateway.proxy.upstream import (
    UPSTREAM_HEADERS,
    UpstreamBroken,
    UpstreamConnectError,
    UpstreamResponse,
    open_upstream,
)
from gateway.runtime import Runtime

RETRYABLE_STATUS = frozenset({500, 502, 503, 504})


async def connect(rt: Runtime, breaker: CircuitBreaker, ctx: CallContext,
                  path: str, planner: PromptPlanner | None = None) -> UpstreamResponse:
    """Dispatch ``ctx`` and open its upstream call at ``path`` (the engine's route);
    ``planner`` (chat calls) prepares the prompt on the first backend it goes to."""
    tried = list[str]()
    limits = rt.settings.upstream
    deadline = ctx.arrived + limits.total_timeout_s
    last: UpstreamError | None = None
    excused: set[str] = set()  # backends whose dropped connection was not held against them
    for attempt in range(1, limits.max_attempts + 1):
        try:
            lease = await rt.dispatcher.acquire(ctx.view(), ctx.served or ctx.body["model"],
                                                tried, ctx.model or None)
        except NoBackendAvailable:
            if last is not None:  # every backend failed: say how the last one did
                raise last from None
            raise
        dispatched(rt, ctx, lease)
        if planner is not None:
            await _plan(planner, ctx, lease.backend.url)
            planner = None
        try:
            upstream = await open_upstream(
                rt.session, lease.backend.url + path, ctx.payload(),
                UPSTREAM_HEADERS, limits, deadline,
            )
        except (UpstreamConnectError, UpstreamBroken, UpstreamTimeout) as exc:
            stale = isinstance(exc, UpstreamBroken) and lease.backend.id not in excused
            if stale:  # likely a keep-alive race, not the backend's fault: try it again
                excused.add(lease.backend.id)
            else:
                breaker.failure(lease.backend, exc.message)
            if isinstance(exc, UpstreamConnectError):
                rt.registry_mark_down(lease.backend)
            if attempt == limits.max_attempts or time.monotonic() >= deadline:
                raise
            last = exc
            requeue(rt, ctx, keep_out=None if stale else tried)
            continue
        if upstream.status in RETRYABLE_STATUS:
            breaker.failure(lease.backend, f"answered {upstream.status}")
            if attempt < limits.max_attempts:
                upstream.close()
                last = UpstreamError(f"upstream answered {upstream.status}")
                requeue(rt, ctx, keep_out=tried)
                continue
        else:
            breaker.success(lease.backend)
        return upstream
    raise AssertionError("unreachable")


async def _plan(planner: PromptPlanner, ctx: CallContext, url: str) -> None:
    cont = ctx.continues
    usable = cont is not None and cont.echo_complete
    planned = await planner.plan(
        ctx.body, url, size=ctx.size,
        record=cont.sequence.tolist() if usable and cont else None,
        turn_end=cont.turn_end if cont else 0)
    ctx.kept_len = planned.kept
    # routed experts: the branch's are the prompt's first ones when the prompt extends it
    held = cont.routes_end.get(ctx.model or ctx.served, 0) if cont is not None \
        and planned.extends and planner.routes_new_only else 0
    ctx.capture.routes_start = routes.ask(ctx.body, held, client_chose=ctx.capture.asked.routes)

