"""Server-sent events, relayed event by event as upstream bytes arrive.

Each complete ``data:`` event is parsed once to capture its token ids and logprobs and,
only when the client did not ask for those, re-serialized without them; events are never
held back waiting for more.
"""

from __future__ import annotations

import orjson

from gateway.errors import GatewayError, openai_error_body
from gateway.proxy.capture import Capture

_DONE = b"[DONE]"


class SSEDecoder:
    def __init__(self, capture: Capture) -> None:
        self._capture = capture
        self._buf = b""

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to relay now: every event completed by ``chunk``, possibly rewritten."""
        buf = self._buf + chunk
        if b"\r\n" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._buf = buf
            return b""
        self._buf = buf[end + 2 :]
        return b"".join(self._event(ev) for ev in buf[:end].split(b"\n\n") if ev)

    def flush(self) -> bytes:
        rest, self._buf = self._buf.strip(), b""
        return self._event(rest) if rest else b""

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data:"):
            return event + b"\n\n"
        data = event[5:].strip()
        if data == _DONE or not data.startswith(b"{"):
            return event + b"\n\n"
        try:
            payload = orjson.loads(data)
        except orjson.JSONDecodeError:
            return event + b"\n\n"
        if not isinstance(payload, dict) or not self._capture.feed(payload, stream=True):
            return event + b"\n\n"
        return b"data: " + orjson.dumps(payload) + b"\n\n"


def error_event(exc: GatewayError) -> bytes:
    """The SSE event that tells an OpenAI client the stream failed (it raises APIError)."""
    body = openai_error_body(exc.message, error_type=exc.error_type, code=exc.code)
    return b"data: " + body + b"\n\n"
