"""Routed experts, as vLLM 0.32 returns them for a mixture-of-experts model.

vLLM started with ``--enable-return-routed-experts`` adds ``routed_experts`` to every
choice of a non-streamed chat or completions answer (streams carry none): the experts the
router picked at each layer for each position the engine forwarded, base64 of NumPy
``.npy`` bytes, shape ``(num_tokens - 1 - start, num_layers, num_experts_per_tok)``,
dtype ``uint8`` up to 256 experts, else ``uint16``. ``num_tokens - 1``: the last sampled
token was never forwarded, so it has no route. ``start`` is the request's
``routed_experts_prompt_start`` (default 0; vLLM refuses one outside ``0 ..
prompt length``): positions the caller already holds from earlier turns are left out.

The simulated router is a hash of each position's token, the token before it, the
position, the layer, the weights' label and the adapter: the same context under the same
weights routes the same way (a recomputed prefix agrees with the routes returned for it
the turn before), other weights route otherwise, and each layer's ``k`` experts are
distinct. A route's meaning (that replaying it reproduces logprobs) is checked against a
real MoE forward elsewhere; here only the wire format, the positions and their
consistency are the contract.
"""

from __future__ import annotations

import base64
import io
import math
import zlib
from dataclasses import dataclass
from functools import cache

import numpy as np


@dataclass(frozen=True, slots=True)
class MoeShape:
    """The router's shape: MoE layers, experts per layer, experts per token."""

    num_layers: int
    num_experts: int
    top_k: int

    def __post_init__(self) -> None:
        if not (self.num_layers >= 1 and 1 <= self.top_k <= self.num_experts <= 65_536):
            raise ValueError(f"not a router shape: {self}")

    @property
    def dtype(self) -> type[np.unsignedinteger]:
        """vLLM's choice: one byte per id up to 256 experts."""
        return np.uint8 if self.num_experts <= 256 else np.uint16


#: Published configs: Qwen3-30B-A3B and Qwen3-235B-A22B (48 / 94 layers, 128 experts,
#: top 8), gpt-oss-120b (36 layers, 128 experts, top 4), GLM-4.5-Air (46 layers, 128
#: routed experts, top 8); ``tiny-moe`` is the tiny Qwen3-MoE built on these machines.
MOE_SHAPES = {"qwen3-30b-a3b": MoeShape(48, 128, 8), "qwen3-235b-a22b": MoeShape(94, 128, 8),
              "gpt-oss-120b": MoeShape(36, 128, 4), "glm-4.5-air": MoeShape(46, 128, 8),
              "tiny-moe": MoeShape(2, 8, 2)}

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, element-wise on uint64 (wrapping)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    out: np.ndarray = x ^ (x >> np.uint64(31))
    return out


def routed_experts(token_ids: list[int], start: int, shape: MoeShape,
                   salt: str = "") -> np.ndarray:
    """Routes of positions ``start .. len(token_ids) - 2``: ``(n, layers, top_k)``.

    ``token_ids`` is the whole sequence (prompt and output); ``salt`` names the weights
    (their label, and the adapter if any)."""
    n = len(token_ids) - 1 - start
    if n <= 0:
        return np.zeros((0, shape.num_layers, shape.top_k), dtype=shape.dtype)
    with np.errstate(over="ignore"):
        toks = np.asarray(token_ids, dtype=np.uint64)
        prev = np.concatenate([np.zeros(1, np.uint64), toks[:-1]])
        pos = np.arange(len(toks), dtype=np.uint64)
        seed = np.uint64(zlib.crc32(salt.encode()))
        h = _mix(toks * np.uint64(0x9E3779B97F4A7C15) ^ _mix(prev + seed) ^ (pos << np.uint64(20)))
        h = h[start:len(toks) - 1]
        layers = np.arange(shape.num_layers, dtype=np.uint64)
        hl = _mix(h[:, None] ^ (layers[None, :] * np.uint64(0xD6E8FEB86659FD93)))
    e = shape.num_experts
    first = (hl % np.uint64(e)).astype(np.int64)
    # k distinct experts: a start and a stride coprime with the expert count
    strides = _coprime_strides(e)
    stride = strides[((hl >> np.uint64(32)) % np.uint64(len(strides))).astype(np.int64)]
    ks = np.arange(shape.top_k, dtype=np.int64)
    ids = (first[..., None] + stride[..., None] * ks) % e
    return ids.astype(shape.dtype)


@cache
def _coprime_strides(e: int) -> np.ndarray:
    return np.array([s for s in range(1, max(2, e)) if math.gcd(s, e) == 1] or [1],
                    dtype=np.int64)


@dataclass(frozen=True, slots=True)
class RouteAsk:
    """One request's routes: the router, the first prompt position asked for, the weights."""

    shape: MoeShape
    start: int
    salt: str

    def field(self, token_ids: list[int], forwarded: bool) -> str | None:
        """The choice's ``routed_experts``: None if nothing was forwarded (an abort before
        the first step), as vLLM."""
        if not forwarded:
            return None
        return encode(routed_experts(token_ids, self.start, self.shape, self.salt))


def encode(routes: np.ndarray) -> str:
    """vLLM's wire form: base64 of the array's ``.npy`` bytes."""
    buf = io.BytesIO()
    np.save(buf, routes, allow_pickle=False)
    return base64.b64encode(buf.getbuffer()).decode("ascii")


def decode(data: str) -> np.ndarray:
    """What a client does with the field: ``np.load`` of the decoded bytes."""
    arr: np.ndarray = np.load(io.BytesIO(base64.b64decode(data)), allow_pickle=False)
    return arr
