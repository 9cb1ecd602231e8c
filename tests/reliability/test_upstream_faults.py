"""Backends that hang or fail: timeouts and retries per settings, the circuit breaker
(open, cool-down, half-open probe), and no client waiting past the configured limits."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time

import httpx
import orjson

from gateway.config import Settings, TraceSettings, UpstreamSettings
from tests.scripted_upstream import Script

CHAT = {"model": "scripted", "messages": [{"role": "user", "content": "x"}]}


def _settings(db: str, backends: list[str], **upstream: float) -> Settings:
    # slime = FCFS + least-loaded per call: with idle backends the tie goes to the first
    return Settings(database_url=db, backends=backends, policy="slime",
                    upstream=UpstreamSettings(health_interval_s=0.2, **upstream),
                    traces=TraceSettings(flush_interval_s=0.05))


def _timed_post(url: str, body: dict[str, object] = CHAT) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    return r, time.monotonic() - t0


def test_hanging_backend_is_timed_out_retried_and_broken(scripted, gateway, sqlite_url):
    hang, hang_seen = scripted(Script(mode="hang"))
    good, good_seen = scripted(Script())
    settings = _settings(sqlite_url, [hang, good], first_byte_timeout_s=0.4,
                         breaker_failures=2, breaker_cooldown_s=60)
    with gateway(settings) as (url, rt):
        times = []
        for _ in range(6):
            r, took = _timed_post(url)
            assert r.status_code == 200, r.text
            times.append(took)
        # two calls met the hang (each cost one first-byte timeout, then ran elsewhere);
        # then the breaker took the hanging backend out and calls went straight through
        assert len(hang_seen.bodies) == 2
        assert len(good_seen.bodies) == 6
        assert hang_seen.closed_early == 2  # timed-out attempts are closed upstream
        assert all(t < 0.4 + 0.5 for t in times[:2]), times
        assert all(t < 0.4 for t in times[2:]), times  # none waited for a first-byte timeout
        b_hang = next(b for b in rt.registry if b.url == hang)
        assert b_hang.healthy and b_hang.breaker_state == "open" and not b_hang.routable
        assert all(b.in_flight == 0 for b in rt.registry)


def test_no_client_waits_past_the_total_limit(scripted, gateway, sqlite_url):
    hangs = [scripted(Script(mode="hang"))[0] for _ in range(3)]
    settings = _settings(sqlite_url, hangs, first_byte_timeout_s=0.6, total_timeout_s=1.0,
                         max_attempts=3)
    with gateway(settings) as (url, _rt):
        r, took = _timed_post(url)
        assert r.status_code == 504
        assert r.json()["error"]["code"] == "upstream_timeout"
        # one deadline for all attempts: 0.6 s + what is left of 1.0 s, not 3 x 0.6 s
        assert 0.9 < took < 1.4, took


def test_5xx_opens_the_breaker_and_a_half_open_probe_closes_it(scripted, gateway, sqlite_url):
    bad_script = Script(mode="error500")
    bad, bad_seen = scripted(bad_script)
    good, _ = scripted(Script())
    # the cool-down is long enough that the first 8 calls end inside it on a loaded machine
    settings = _settings(sqlite_url, [bad, good], breaker_failures=3, breaker_cooldown_s=2.0)
    with gateway(settings) as (url, rt):
        b_bad = next(b for b in rt.registry if b.url == bad)
        for _ in range(8):
            r, _took = _timed_post(url)
            assert r.status_code == 200, r.text  # retried on the good backend
        assert len(bad_seen.bodies) == 3
        assert b_bad.breaker_state == "open" and b_bad.breaker_trips == 1

        time.sleep(2.1)  # cool-down over: half-open; the probe fails, so it opens again
        assert b_bad.breaker_state == "half_open"
        for _ in range(4):
            assert _timed_post(url)[0].status_code == 200
        assert len(bad_seen.bodies) == 4  # exactly one probe
        assert b_bad.breaker_trips == 2

        bad_script.mode = "ok"  # the backend recovers
        time.sleep(2.1)
        for _ in range(4):
            assert _timed_post(url)[0].status_code == 200
        assert b_bad.breaker_state == "closed"
        assert len(bad_seen.bodies) >= 6  # probe succeeded; back in rotation


def test_only_failing_backends_give_502_with_the_upstream_reason(scripted, gateway, sqlite_url):
    bad, seen = scripted(Script(mode="error500"))
    with gateway(_settings(sqlite_url, [bad], max_attempts=3)) as (url, _rt):
        r, _ = _timed_post(url)
        assert r.status_code == 502
        assert r.json()["error"]["message"]  # OpenAI envelope, upstream's own message
        assert len(seen.bodies) == 1  # one backend: nothing else to retry on


def test_backend_idle_mid_stream_is_cut_at_the_idle_limit(scripted, gateway, sqlite_url):
    url_up, seen = scripted(Script(tokens=5, token_delay_s=3.0))
    settings = _settings(sqlite_url, [url_up], idle_timeout_s=0.4)
    with gateway(settings) as (url, rt):
        t0 = time.monotonic()
        with httpx.stream("POST", f"{url}/t/idle-1/v1/chat/completions", timeout=30,
                          json={**CHAT, "stream": True}) as r:
            events = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        took = time.monotonic() - t0
        last = orjson.loads(events[-1][6:])
        assert last["error"]["code"] == "upstream_timeout"
        assert took < 0.4 + 0.5, took
        deadline = time.monotonic() + 3
        while seen.closed_early < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert seen.closed_early == 1 and seen.completed == 0  # the upstream call was closed
        assert all(b.in_flight == 0 for b in rt.registry)


class KeepAliveDropper:
    """A vLLM-shaped upstream that answers the first request on each connection and
    closes the connection, unanswered, when a second request arrives on it: what a client
    meets when the server's idle keep-alive close crosses the next request on the wire.
    ``every`` drops every request instead (a backend that breaks all its calls)."""

    def __init__(self, every: bool = False) -> None:
        self.every = every
        self.answered = self.dropped = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for n in itertools.count():
                head = await reader.readuntil(b"\r\n\r\n")
                request_line, *lines = head.decode().split("\r\n")
                length = next((int(ln.split(":", 1)[1]) for ln in lines
                               if ln.lower().startswith("content-length:")), 0)
                await reader.readexactly(length)
                if request_line.startswith("POST") and (n > 0 or self.every):
                    self.dropped += 1
                    return  # closed without a response
                body = self._answer(request_line)
                self.answered += request_line.startswith("POST")
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @staticmethod
    def _answer(request_line: str) -> bytes:
        if " /v1/models " in request_line:
            return orjson.dumps({"object": "list", "data": [{"id": "scripted"}]})
        if " /v1/chat/completions " not in request_line:
            return b"{}"
        ids = [1001, 1002]
        return orjson.dumps({
            "id": "chatcmpl-k", "object": "chat.completion", "model": "scripted",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "xx"},
                         "logprobs": {"content": [{"token": "x", "logprob": -0.5, "bytes": [120],
                                                   "top_logprobs": []} for _ in ids]},
                         "finish_reason": "length", "token_ids": ids}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            "prompt_token_ids": [1, 2, 3]})


@contextlib.contextmanager
def _dropper(loop_thread, every: bool = False):
    dropper = KeepAliveDropper(every)
    url = loop_thread.run(dropper.start())
    try:
        yield url, dropper
    finally:
        loop_thread.run(dropper.stop())


def test_a_stale_keepalive_connection_is_retried_on_a_fresh_one(loop_thread, gateway,
                                                                sqlite_url):
    with _dropper(loop_thread) as (up, dropper), \
            gateway(_settings(sqlite_url, [up], max_attempts=3)) as (url, rt):
        for i in range(4):  # back to back: each call after the first meets a reused connection
            r, _ = _timed_post(url, {**CHAT, "messages": [{"role": "user", "content": str(i)}]})
            assert r.status_code == 200, r.text
        assert dropper.answered == 4 and dropper.dropped >= 3
        (backend,) = rt.registry
        # a keep-alive race is not the backend's fault: nothing counted against it
        assert backend.call_failures == 0 and backend.breaker_state == "closed"
        assert backend.in_flight == 0


def test_a_backend_that_drops_every_call_is_still_counted_and_skipped(loop_thread, gateway,
                                                                      scripted, sqlite_url):
    good, good_seen = scripted(Script())
    with _dropper(loop_thread, every=True) as (bad, dropper), \
            gateway(_settings(sqlite_url, [bad, good], max_attempts=3)) as (url, rt):
        r, _ = _timed_post(url)  # slime ties go to the first backend: the dropper
        assert r.status_code == 200, r.text
        # the first drop is excused and the dropper tried once more, then the call moved on
        assert dropper.dropped == 2 and len(good_seen.bodies) == 1
        b_bad = next(b for b in rt.registry if b.url == bad)
        assert b_bad.call_failures == 1
