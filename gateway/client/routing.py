"""Routing replay on the trainer's side: the experts the rollout engine chose, forced in the
trainer's forward pass of a mixture-of-experts model (Rollout Routing Replay, R3, arXiv
2510.11370).

A MoE policy's RL is unstable when the trainer's router picks other experts than the
engine did for the same tokens (tiny numerical differences flip a top-k choice), because
the logprobs the loss compares then come from different sub-networks. R3 keeps the
engine's choice of experts and recomputes only their gate weights from the trainer's own
router logits, so the router still learns through them.

Routes come as vLLM returns them (``routed_experts``: base64 ``.npy``, positions x layers x
top-k, :func:`decode_routes`); a sample's routes are one row per position, ``-1`` where
no route is known (the last token, which the engine never forwarded; positions it did
not report), and the live router decides those.

:func:`capture_routes` records what a model routes (the reference a test compares with);
:func:`replay_routes` forces given routes. Both work on Hugging Face MoE blocks whose
router is a ``*TopKRouter`` returning ``(logits, scores, indices)`` with ``top_k``,
``weight`` and ``norm_topk_prob`` (Qwen3-MoE in transformers 5), one MoE layer after
another in module order. torch is imported by the caller (the ``learned`` extra).
"""

from __future__ import annotations

import base64
import contextlib
import io
from collections.abc import Iterator
from typing import Any

import numpy as np

UNKNOWN = -1


def decode_routes(data: str) -> np.ndarray:
    """vLLM's ``routed_experts`` field: ``(positions, layers, top_k)`` expert ids."""
    arr: np.ndarray = np.load(io.BytesIO(base64.b64decode(data)), allow_pickle=False)
    return arr


def routers(model: Any) -> list[Any]:
    """The model's top-k routers, one per MoE layer, in layer order."""
    found = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    if not found:
        raise ValueError(f"{type(model).__name__} has no top-k router: not a mixture-of-"
                         "experts model this replay knows (a *TopKRouter module)")
    return found


@contextlib.contextmanager
def capture_routes(model: Any) -> Iterator[list[np.ndarray]]:
    """Record the experts each router picks in the forward passes run inside: the list
    yielded gets one ``(positions, layers, top_k)`` array per forward (batch 1)."""
    rs = routers(model)
    seen: list[list[np.ndarray]] = [[] for _ in rs]
    hooks = [r.register_forward_hook(
        lambda _m, _i, out, j=j: seen[j].append(out[2].detach().cpu().numpy()))
        for j, r in enumerate(rs)]
    captured: list[np.ndarray] = []
    try:
        yield captured
    finally:
        for h in hooks:
            h.remove()
        for per_layer in zip(*seen, strict=True):
            captured.append(np.stack(per_layer, axis=1))


@contextlib.contextmanager
def replay_routes(model: Any, routes: np.ndarray) -> Iterator[None]:
    """Inside, every forward pass of ``model`` over one sequence of ``len(routes)`` tokens
    (batch 1) runs each position on the experts ``routes`` names (``(positions, layers,
    top_k)``; rows holding :data:`UNKNOWN` keep the live router's choice), weighted by
    the trainer's own router probabilities of those experts (renormalized when the router
    renormalizes): the gradient still reaches the router."""
    import torch

    rs = routers(model)
    routes = np.asarray(routes)
    if routes.ndim != 3 or routes.shape[1] != len(rs) or routes.shape[2] != rs[0].top_k:
        raise ValueError(f"routes of shape {routes.shape} do not fit this model: "
                         f"(positions, {len(rs)} MoE layers, top {rs[0].top_k})")
    forced = torch.as_tensor(routes.astype(np.int64))
    originals = [r.forward for r in rs]

    def replaying(router: Any, layer: int) -> Any:
        def forward(hidden_states: Any) -> tuple[Any, Any, Any]:
            h = hidden_states.reshape(-1, router.hidden_dim)
            logits = torch.nn.functional.linear(h, router.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            live = torch.topk(probs, router.top_k, dim=-1).indices
            want = forced[:, layer, :].to(live.device)
            if want.shape[0] != live.shape[0]:
                raise ValueError(f"routes for {want.shape[0]} positions, the forward pass "
                                 f"has {live.shape[0]} (replay needs batch 1, whole sequence)")
            known = (want >= 0).all(dim=-1, keepdim=True)
            index = torch.where(known, want, live)
            scores = probs.gather(-1, index)
            if router.norm_topk_prob:
                scores = scores / scores.sum(dim=-1, keepdim=True)
            return logits, scores.to(logits.dtype), index
        return forward

    try:
        for j, r in enumerate(rs):
            r.forward = replaying(r, j)
        yield
    finally:
        for r, f in zip(rs, originals, strict=True):
            r.forward = f


def sample_routes(parts: list[tuple[int, np.ndarray]], length: int, layers: int,
                  top_k: int) -> np.ndarray:
    """One sample's routes, aligned with its ``token_ids`` (``length`` positions): each
    ``(start, routes)`` part fills positions ``start ..``; the rest is :data:`UNKNOWN`."""
    out = np.full((length, layers, top_k), UNKNOWN, dtype=np.int32)
    for start, r in parts:
        end = min(length, start + len(r))
        if end > start:
            out[start:end] = r[:end - start]
    return out


def routes_of(sample: Any) -> np.ndarray | None:
    """A sample's routed experts (its ``routed_experts``, recorded by the gateway from the
    engine's answers): ``(len(token_ids), layers, top_k)`` int32, :data:`UNKNOWN` where no
    route is known; None when none of its calls recorded routes (a dense model)."""
    field = getattr(sample, "routed_experts", None)
    if field is None:
        return None
    arr = decode_routes(field).astype(np.int32)
    if len(arr) != len(sample.token_ids):
        raise ValueError(f"routes for {len(arr)} positions, the sample has "
                         f"{len(sample.token_ids)} tokens")
    return arr


def batch_routes(samples: list[Any], length: int | None = None) -> np.ndarray:
    """Samples' routes as one ``(batch, positions, layers, top_k)`` int32 array, padded
    on the right with :data:`UNKNOWN` to ``length`` (default: the longest): the per-token
    layout the R3 implementations of verl (Megatron router replay) and SkyRL take, each
    token's row of ``top_k`` expert ids per MoE layer. A sample without routes is all
    :data:`UNKNOWN` (its forward keeps the live router)."""
    per = [routes_of(s) for s in samples]
    shapes = {r.shape[1:] for r in per if r is not None}
    if len(shapes) != 1:
        raise ValueError("no sample has routes" if not shapes else
                         f"samples of routers of different shapes: {sorted(shapes)}")
    layers, top_k = shapes.pop()
    n = max(len(s.token_ids) for s in samples) if length is None else length
    out = np.full((len(samples), n, layers, top_k), UNKNOWN, dtype=np.int32)
    for i, r in enumerate(per):
        if r is not None:
            out[i, :min(n, len(r))] = r[:n]
    return out
