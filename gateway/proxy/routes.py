"""Routed experts (MoE routing replay): what each call records, asking only for new positions.

A mixture-of-experts engine started with ``--enable-return-routed-experts`` (vLLM 0.32)
adds ``routed_experts`` to every choice of a non-streamed answer: base64 of a NumPy
``.npy`` array ``(positions, layers, top_k)`` of the experts each forwarded position was
routed to, from the request's ``routed_experts_prompt_start`` on (the last sampled token
was never forwarded and has none). See docs/real-vllm-wire-format.md and docs/moe.md.

The gateway holds each trajectory's tokens, so it asks only for what it lacks: a request
whose prompt extends a branch of its trajectory (token in, or the engine's own rendering
already extends the record, :mod:`gateway.proxy.tokens`) asks from the end of the
routes that branch already holds (``Branch.routes_end``); a continuation after a weight
update asks from the end of what its call has so far. The field is sent only when the
start is above 0 and the branch holds routes, so a dense model (or an engine without the
flag) never sees it: capture costs nothing there.

A call keeps what it received as ``[start, base64]`` pieces (no decoding on the request
path); the trace writer merges them into one ``.npy`` (:func:`gateway.store.routes.merge`)
stored in ``calls.routes`` from ``calls.routes_start``; the samples align them with the tokens
(:mod:`gateway.store.samples`).
"""

from __future__ import annotations

from typing import Any

from gateway.proxy.capture import ROUTES_START


def ask(body: dict[str, Any], start: int, *, client_chose: bool) -> int:
    """Ask the engine for routes from ``start`` (the positions before it are held); the
    start the answer's routes will have. The client's own choice stands."""
    if client_chose:
        value = body.get(ROUTES_START)
        return value if isinstance(value, int) and value >= 0 else 0
    if start > 0:
        body[ROUTES_START] = start
    else:
        body.pop(ROUTES_START, None)
    return max(0, start)
