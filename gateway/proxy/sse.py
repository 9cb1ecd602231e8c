"""Server-sent events, relayed event by event as upstream bytes arrive.

Each complete ``data:`` event is parsed once (one ``orjson.loads``: capture needs its ids,
logprobs, text, tool calls and finish reason, and orjson reads a token event faster than
any byte scan written in Python could pick those out) and re-serialized only when the
client did not ask for fields the gateway injected; otherwise its bytes are relayed as
they came. Events are never held back waiting for more.
"""

from __future__ import annotations

import orjson

from gateway.envelopes import openai_error_body
from gateway.errors import GatewayError
from gateway.proxy.capture import Capture


class SSEDecoder:
    def __init__(self, capture: Capture) -> None:
        self._capture = capture
        self._buf = b""

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
        events = buf[:end].split(b"\n\n")
        if len(events) == 1:  # the usual chunk: one whole event (one token)
            return self._event(events[0]) if events[0] else b""
        event = self._event
        return b"".join([event(ev) for ev in events if ev])

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
