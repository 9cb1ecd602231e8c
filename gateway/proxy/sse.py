"""Server-sent events, relayed as upstream bytes arrive: every event an upstream read
completes goes out at once, never held back waiting for more.

The plain token events of a read go together through the fast path
(:mod:`gateway.proxy.token_runs`). Every other event, and any the fast path refuses,
takes the general path: parsed once with ``orjson`` (capture needs its ids, logprobs,
text, tool calls and finish reason), stripped of what the gateway injected and the
client did not ask for, and re-serialized only if something was stripped.
"""

from __future__ import annotations

import orjson

from gateway.envelopes import openai_error_body
from gateway.errors import GatewayError
from gateway.proxy.capture import Capture
from gateway.proxy.token_runs import token_run

#: bytes per fast run at most (about 50 token events): a longer run costs more per event,
#: its copies no longer fitting the CPU's caches
_WINDOW = 16_384


class SSEDecoder:
    def __init__(self, capture: Capture, *, fast: bool = True) -> None:
        self._capture = capture
        self._buf = b""
        # off (or /v1/completions, which the fast path does not take): every event
        # takes the general path, with no fast attempt per event
        self._fast = fast and capture.chat
        self._started = False  # the stream's first event (the role chunk) is behind

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to relay now: every event completed by ``chunk``, possibly rewritten."""
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._buf = buf
            return b""
        self._buf = buf[end + 2 :]
        if not self._fast:
            return self._each(buf[:end])
        out: list[bytes] = []
        pos = 0
        if not self._started:  # the role chunk
            self._started = True
            first = buf.find(b"\n\n", 0, end)
            pos = end if first < 0 else first
            out.append(self._each(buf[:pos]))
            pos += 2
        while pos < end:  # in windows; the fast path stops at any other event
            cut = buf.find(b"\n\n", pos + _WINDOW, end)
            cut = end if cut < 0 else cut
            relayed, stop = self._run(buf, pos, cut)
            out.append(relayed)
            if stop < 0:  # not JSON somewhere: every event on its own
                out.append(self._each(buf[pos:cut]))
            elif stop < cut:  # an event of another shape: on its own, then on
                after = buf.find(b"\n\n", stop, cut)
                cut = cut if after < 0 else after
                out.append(self._each(buf[stop:cut]))
            pos = cut + 2
        return out[0] if len(out) == 1 else b"".join(out)

    def _each(self, block: bytes) -> bytes:
        """The general path: every event of ``block`` on its own."""
        if b"\n\n" not in block:
            return self._event(block) if block else b""
        return b"".join([self._event(ev) for ev in block.split(b"\n\n") if ev])

    def _run(self, buf: bytes, start: int, end: int) -> tuple[bytes, int]:
        """The fast path (:mod:`gateway.proxy.token_runs`) on ``buf[start:end]``: what it
        relays, and where it stopped."""
        return token_run(buf, start, end, self._capture)

    def flush(self) -> bytes:
        rest, self._buf = self._buf.strip(), b""
        return self._event(rest) if rest else b""

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data:"):
            return event + b"\n\n"
        data = event[5:].strip()
        if not data.startswith(b"{"):  # [DONE] and anything else that is not an object
            return event + b"\n\n"
        try:
            payload = orjson.loads(data)
        except orjson.JSONDecodeError:
            return event + b"\n\n"
        if type(payload) is not dict or not self._capture.feed(payload, stream=True):
            return event + b"\n\n"
        if not payload:  # an event the client did not ask for (the usage chunk)
            return b""
        return b"data: " + orjson.dumps(payload) + b"\n\n"


def error_event(exc: GatewayError) -> bytes:
    """The SSE event that tells an OpenAI client the stream failed (it raises APIError)."""
    body = openai_error_body(exc.message, error_type=exc.error_type, code=exc.code)
    return b"data: " + body + b"\n\n"
