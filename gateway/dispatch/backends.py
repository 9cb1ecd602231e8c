"""The registry of backends the gateway can route to, and their health checks.

A backend is one OpenAI-compatible server (a vLLM instance, a simulated one, or any
external URL). Externally managed backends come from ``--backend URL`` (optionally
``URL#tp=N`` to declare the tensor-parallel degree, which is recorded on every call);
managed pools add and remove theirs through the pool manager.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp
import orjson

from backends.base import ServerState
from gateway.config import UpstreamSettings
from gateway.http_session import make_health_session
from gateway.loops import Periodic

log = logging.getLogger(__name__)
#: calls a backend holds for its next scrape to time (a backend no longer scraped, being
#: unhealthy, drops its oldest)
MAX_CLOCK_WAITERS = 4096


@dataclass(slots=True)
class Backend:
    id: str
    url: str
    tp: int | None = None
    models: set[str] = field(default_factory=set)
    state: ServerState = ServerState.READY
    healthy: bool = False
    in_flight: int = 0
    served: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    last_check: float | None = None
    last_error: str | None = None
    source: str = "static"
    gpus: tuple[int, ...] = ()
    call_failures: int = 0  # consecutive failed calls (the circuit breaker's count)
    breaker_tripped: bool = False
    breaker_open_until: float = 0.0  # time.monotonic()
    breaker_trips: int = 0
    #: the weight label the engine itself reported (``GET /weight_info``) when it was
    #: admitted or last updated; its calls are stamped with it (None: not known)
    weight_version: str | None = None
    #: whether its answers carry routed experts (a MoE engine started with
    #: ``--enable-return-routed-experts``), as last seen (None: not seen yet)
    returns_routes: bool | None = None
    routes_probe: bool = False  # a stream's routes request is finding that out
    #: (seconds, tokens) of decode the engine reported at its last scrape (its
    #: inter-token latency histogram; None: it reports none, or not scraped yet): the
    #: speed meter times a call that is not streamed on it, since the call's own time
    #: holds its prefill, its wait behind other prefills and the host's time per call
    decode_clock: tuple[float, float] | None = None
    #: calls waiting for the next scrape to be timed (:meth:`time_decode`)
    clock_waiters: deque[tuple[tuple[float, float] | None, Callable[[float | None], None]]] = \
        field(default_factory=lambda: deque(maxlen=MAX_CLOCK_WAITERS), repr=False)

    def time_decode(self, mark: tuple[float, float] | None,
                    report: Callable[[float | None], None]) -> None:
        """Hand ``report`` the engine's mean seconds per token since ``mark`` (its decode
        clock when a call was dispatched): now, where a scrape since saw it decode; else
        at the next scrape, the span that holds the call's own decode. A call dispatched
        before the engine's first scrape (no mark) takes the span between the next two,
        the nearest its engine timed. None where there is nothing to time: the engine
        keeps no clock (:attr:`decode_clock` None then), or decoded nothing in the span,
        or restarted in it."""
        if self.decode_clock is not None and (step := clock_step(mark, self.decode_clock)):
            report(step)
        else:
            self.clock_waiters.append((mark, report))

    def read_decode_clock(self, clock: tuple[float, float] | None) -> None:
        """A scrape's decode clock (None: the engine reports none); the calls waiting for
        it are timed."""
        self.decode_clock = clock
        waiting = list(self.clock_waiters)
        self.clock_waiters.clear()
        for mark, report in waiting:
            if clock is None:
                report(None)
            elif mark is None:  # from here to the next scrape
                self.clock_waiters.append((clock, report))
            else:
                report(clock_step(mark, clock))

    @property
    def breaker_state(self) -> str:
        """``closed``; ``open`` (cooling down); ``half_open`` (one probe call may pass)."""
        if not self.breaker_tripped:
            return "closed"
        return "open" if time.monotonic() < self.breaker_open_until else "half_open"

    @property
    def routable(self) -> bool:
        if not (self.healthy and self.state is ServerState.READY):
            return False
        breaker = self.breaker_state
        # half-open: a single probe, i.e. only while nothing else is in flight there
        return breaker == "closed" or (breaker == "half_open" and self.in_flight == 0)


def clock_step(before: tuple[float, float] | None, after: tuple[float, float]) -> float | None:
    """Mean seconds per token between two readings of an engine's decode clock; None where
    there is no first reading, or it decoded nothing between them or restarted (its
    counters went back)."""
    if before is None:
        return None
    seconds, tokens = after[0] - before[0], after[1] - before[1]
    return seconds / tokens if tokens > 0 and seconds > 0 else None


def parse_backend_spec(spec: str, index: int) -> Backend:
    """``http://host:port[/v1][#tp=N]`` -> Backend."""
    parts = urlsplit(spec)
    tp = None
    if parts.fragment:
        key, _, value = parts.fragment.partition("=")
        if key != "tp" or not value.isdigit() or int(value) < 1:
            raise ValueError(f"backend {spec!r}: the only fragment understood is #tp=N")
        tp = int(value)
    url = spec.split("#", 1)[0].rstrip("/").removesuffix("/v1")
    return Backend(id=f"b{index}", url=url, tp=tp)


class BackendRegistry:
    def __init__(self) -> None:
        self._backends: dict[str, Backend] = {}
        self.changed = asyncio.Event()

    def __iter__(self) -> Iterator[Backend]:
        return iter(list(self._backends.values()))

    def __len__(self) -> int:
        return len(self._backends)

    def get(self, backend_id: str) -> Backend | None:
        return self._backends.get(backend_id)

    def add(self, backend: Backend) -> Backend:
        if backend.id in self._backends:
            raise ValueError(f"backend id {backend.id!r} already registered")
        self._backends[backend.id] = backend
        self.changed.set()
        return backend

    def remove(self, backend_id: str) -> Backend | None:
        backend = self._backends.pop(backend_id, None)
        self.changed.set()
        return backend

    def models(self) -> list[str]:
        return sorted({m for b in self._backends.values() if b.healthy for m in b.models})

    def known_models(self) -> set[str]:
        return {m for b in self._backends.values() for m in b.models}

    def routable(self, model: str, exclude: Iterable[str] = ()) -> list[Backend]:
        skip = set(exclude)
        return [
            b
            for b in self._backends.values()
            if b.routable and b.id not in skip and (not b.models or model in b.models)
        ]


def backend_at_fault(status: int) -> bool:
    """Whether an upstream answer with HTTP ``status`` counts against the backend (its
    breaker, its ``failures`` on ``/status``): a 5xx, 408 or 429 does; any other 4xx is
    the engine refusing the client's request (bad parameters, a prompt longer than the
    context, an unknown model), which says nothing about the backend's health."""
    return status >= 500 or status in (408, 429)


class CircuitBreaker:
    """Passive health from real calls: ``breaker_failures`` consecutive failures open a
    backend's breaker for ``breaker_cooldown_s``; then one probe call is let through
    (half-open). Its success closes the breaker, its failure opens it again.

    This complements :class:`HealthChecker`: a backend can answer ``/health`` while every
    completion fails (5xx) or hangs, which only real calls reveal.
    """

    def __init__(self, settings: UpstreamSettings) -> None:
        self._settings = settings

    def success(self, backend: Backend) -> None:
        backend.call_failures = 0
        if backend.breaker_tripped:
            log.info("backend %s (%s): probe call succeeded; breaker closed",
                     backend.id, backend.url)
            backend.breaker_tripped = False

    def failure(self, backend: Backend, reason: str) -> None:
        backend.call_failures += 1
        backend.last_error = reason[:300]
        probe_failed = backend.breaker_tripped and backend.breaker_state == "half_open"
        if probe_failed or (not backend.breaker_tripped
                            and backend.call_failures >= self._settings.breaker_failures):
            backend.breaker_tripped = True
            backend.breaker_open_until = time.monotonic() + self._settings.breaker_cooldown_s
            backend.breaker_trips += 1
            log.warning("backend %s (%s): breaker open for %gs after %d failed calls (%s)",
                        backend.id, backend.url, self._settings.breaker_cooldown_s,
                        backend.call_failures, backend.last_error)


class GarbledReply(ValueError):
    """A backend answered ``/v1/models`` with JSON that is not OpenAI's model list."""


def model_ids(reply: object) -> set[str]:
    """The model ids of a ``/v1/models`` reply, ``{"data": [{"id": ...}, ...]}`` (an
    object without ``data`` lists none); :class:`GarbledReply` for any other shape. A LoRA
    adapter's card (vLLM names its base model in ``parent``) is not a model: calls reach
    an adapter through its base model (``gateway.adapters``)."""
    if not isinstance(reply, dict):
        raise GarbledReply(f"/v1/models answered a JSON {type(reply).__name__}, not an "
                           "object with a 'data' list; marked unhealthy")
    data = reply.get("data", [])
    if not isinstance(data, list) or not all(isinstance(m, dict) for m in data):
        raise GarbledReply("/v1/models answered 'data' that is not a list of objects; "
                           "marked unhealthy")
    return {m["id"] for m in data if isinstance(m.get("id"), str)
            and m.get("parent") in (None, m["id"])}


class HealthChecker:
    """Polls ``/health`` and ``/v1/models`` of every backend; marks them (un)healthy.

    The checks go through connections of their own (:func:`make_health_session`, opened
    at the first check, closed by :meth:`close`), never the relay's shared pool: a pool
    full of streams must not make a working backend look down."""

    def __init__(self, registry: BackendRegistry, settings: UpstreamSettings) -> None:
        self._registry = registry
        self._settings = settings
        #: sees a backend's ``/v1/models`` reply before it is (re)admitted: None admits
        #: it, else why not (``gateway.weights.adopt``), asking the engine what it needs
        #: on the checks' own connections (never the relay's: a full pool must not stall
        #: an admission)
        self.on_fresh: Callable[[Backend, object, aiohttp.ClientSession],
                                Awaitable[str | None]] | None = None
        self._fresh_lock = asyncio.Lock()  # one backend at a time: they share what it finds
        self._own: aiohttp.ClientSession | None = None
        self._closed = False
        self.loop = Periodic("health-checker", self.check_all, settings.health_interval_s,
                             immediately=True, logger=log)

    def start(self) -> None:
        self.loop.start()

    async def close(self) -> None:
        self._closed = True
        await self.loop.close()
        if self._own is not None:
            await self._own.close()

    def _session(self) -> aiohttp.ClientSession:
        if self._closed:
            raise RuntimeError("the health checker is closed")
        if self._own is None:
            self._own = make_health_session(self._settings)
        return self._own

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(b) for b in self._registry))

    async def check(self, backend: Backend) -> bool:
        session = self._session()
        try:
            async with session.get(f"{backend.url}/health") as resp:
                ok = resp.status == 200
            if ok and (not backend.models or not backend.healthy):
                async with session.get(f"{backend.url}/v1/models") as r:
                    reply = orjson.loads(await r.read())
                backend.models = model_ids(reply)
                if self.on_fresh is not None and (
                        why := await self._fresh(backend, reply, session)):
                    ok, backend.last_error = False, why
        except GarbledReply as exc:
            ok = False
            if backend.last_error != str(exc):  # once per distinct reply, not every round
                log.warning("backend %s (%s): %s", backend.id, backend.url, exc)
            backend.last_error = str(exc)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            ok = False
            backend.last_error = f"{type(exc).__name__}: {exc}"[:300]
        self.record(backend, ok)
        return ok

    async def _fresh(self, backend: Backend, reply: object,
                     session: aiohttp.ClientSession) -> str | None:
        assert self.on_fresh is not None
        try:
            async with self._fresh_lock:
                why = await self.on_fresh(backend, reply, session)
        except Exception as exc:  # a bug here must not admit an engine unchecked
            log.exception("backend %s (%s): checking what it holds failed", backend.id,
                          backend.url)
            return f"checking what it holds failed: {type(exc).__name__}: {exc}"[:300]
        if why is not None:
            log.warning("backend %s (%s) is not admitted: %s", backend.id, backend.url, why)
        return why

    def record(self, backend: Backend, ok: bool) -> None:
        backend.last_check = time.time()
        if ok:
            backend.consecutive_failures = 0
            if not backend.healthy:
                log.info("backend %s (%s) is healthy", backend.id, backend.url)
            backend.healthy = True
            return
        backend.consecutive_failures += 1
        if backend.healthy and backend.consecutive_failures >= self._settings.unhealthy_after:
            log.warning("backend %s (%s) is unhealthy: %s", backend.id, backend.url,
                        backend.last_error)
            backend.healthy = False
