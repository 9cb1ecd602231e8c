"""A failed call leaves one line in the gateway's log: trajectory, door, status, reason.

The runtime holds one :class:`FailureLog` (``Runtime.failure_log``); the logger is
``gateway.failure_log``. Metrics count failures and a call that reached a backend leaves
its record; neither says
at a glance why a harness's call failed. Every call that fails logs once: when it ends
(:func:`gateway.proxy.lifecycle.end`: an engine's refusal, a broken or timed-out backend,
no backend, a queue timeout, a client that left), or when it is refused before it became
a call (:func:`refusals_logged`, around the relay's admission: a body the door cannot
read, an unknown model, no room to admit or record it).

Levels: WARNING for a 5xx, which the gateway or the pool owes (timeouts are 504s); INFO
for a 4xx, the client's own request, and for a client that went away (499, as nginx
names it). Repeats are rate-limited, never silenced: per door and status the first
failure logs at once, then at most one line per :data:`FAILURE_EVERY_S`, saying how many
like it were held back since the previous line.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import orjson

from gateway.errors import GatewayError
from gateway.loops import RateLimit
from gateway.schema.ids import ID_PATTERN

log = logging.getLogger(__name__)

#: at most one line per door and status this often (the first one always)
FAILURE_EVERY_S = 10.0
#: the status logged for a call whose client went away (nginx's "client closed request")
CLIENT_LEFT = 499


def describe(error: BaseException) -> tuple[int, str]:
    """The status the client was (or would have been) answered for ``error``, and why."""
    if isinstance(error, GatewayError):
        return error.status_code, error.message
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        return CLIENT_LEFT, str(error) or "cancelled"
    if isinstance(error, orjson.JSONDecodeError):  # the relay answers it as a 502
        return 502, "upstream answered with invalid JSON"
    return 500, f"{type(error).__name__}: {error}"


class FailureLog:
    """The gateway's log lines for failed calls (see the module docstring)."""

    def __init__(self, every_s: float = FAILURE_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self._clock = clock
        self._limits: dict[tuple[str, int], RateLimit] = {}

    def failed(self, trajectory: str | None, door: str, error: BaseException) -> None:
        """One failed call of ``trajectory`` (None: not known yet) through ``door``."""
        status, reason = describe(error)
        limit = self._limits.setdefault((door, status), RateLimit(self.every_s))
        if not limit.ready(self._clock()):
            return
        held = limit.take_held()
        more = (f" ({held} more {status} on {door} held back since the last line)"
                if held else "")
        log.log(logging.WARNING if status >= 500 else logging.INFO,
                "call failed: trajectory %s, door %s, status %d: %s%s", _shown(trajectory),
                door, status, " ".join(reason.split())[:300], more)


def _shown(trajectory: str | None) -> str:
    """The id as logged: one that was never validated (a refused call's) in quotes."""
    if trajectory is None:
        return "-"
    return trajectory if ID_PATTERN.fullmatch(trajectory) else repr(trajectory[:64])


@contextmanager
def refusals_logged(failures: FailureLog, door: str, path_trajectory: str | None,
                    headers: Mapping[str, str]) -> Iterator[None]:
    """Log a :class:`GatewayError` raised in the block: a call refused before it had a
    context (so before :func:`gateway.proxy.lifecycle.end` could log it), named by the
    trajectory in its path or ``X-Trajectory-Id`` if any (it was not tagged yet)."""
    try:
        yield
    except GatewayError as exc:
        failures.failed(path_trajectory or headers.get("x-trajectory-id"), door, exc)
        raise

