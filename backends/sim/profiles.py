"""Latency profiles of the simulated vLLM server.

A profile holds the constants of one (model, GPU, TP) combination for the per-step
latency model of ``DESIGN.md``::

    step_ms = T0 + sqrt(W^2 + (K*N)^2) + A*sum_decode_ctx/1000 + Q*sum_i n_i*(c_i+n_i/2)/1e6

``W`` is the weight-streaming floor of a step (memory bound), ``K*N`` the linear compute
(tokens in the step, TP all-reduce included); the quadrature sum makes a step cost
``max(W, K*N)`` away from the knee and a smooth blend near it. ``A`` is the KV read per
decode sequence, ``Q`` the quadratic attention of prefill chunks over their uncached
tokens. The constants ship with the package (``data/latency_constants.json``) so a
wheel install can plan pools without the repository's shared data.

``tp_penalty`` exists because Libra's measurement (arXiv 2606.03077) shows a stronger TP
trade-off than the fitted constants suggest under equal load: at TP > 1 the fixed
per-step cost (``T0``) and the per-token cost (``K``) are multiplied by
``1 + tp_penalty * log2(tp)``, i.e. all-reduce overhead that grows with the number of
participants. ``DEFAULT_TP_PENALTY`` is calibrated by ``bench/runners/fidelity.py``: under the
load documented there (many short requests at fixed per-instance concurrency; few long
ones) most of Libra's trade-off comes from load, and a small penalty (0.02-0.1 all fit
within 13%) finishes the job.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from functools import cache
from importlib import resources
from typing import Any

#: Calibrated against Libra's 8xTP1-vs-1xTP8 Qwen3-14B numbers (see docs/fidelity.md).
DEFAULT_TP_PENALTY = 0.08


@dataclass(frozen=True, slots=True)
class LatencyProfile:
    """Constants of the step-latency model for one (model, GPU, TP) combination."""

    model: str
    gpu: str
    tp: int
    T0_ms: float
    W_ms: float
    K_ms_per_tok: float
    A_ms_per_1k_ctx: float
    Q_ms_per_1e6: float
    kv_capacity_tokens: int
    block_size: int = 16
    tp_penalty: float = 0.0
    request_overhead_ms: float = 5.0
    placeholder: bool = False

    @property
    def key(self) -> str:
        return profile_key(self.model, self.gpu, self.tp)

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_capacity_tokens // self.block_size

    @property
    def tp_factor(self) -> float:
        """Multiplier on the TP-sensitive costs (1.0 at TP1 or with no penalty)."""
        return 1.0 + self.tp_penalty * math.log2(self.tp) if self.tp > 1 else 1.0

    def step_ms(
        self, *, num_tokens: int, decode_ctx_tokens: int = 0, prefill_attn: float = 0.0
    ) -> float:
        """Duration of one engine step in milliseconds.

        ``num_tokens`` is N (decode sequences + prefill tokens), ``decode_ctx_tokens`` the
        summed context of the decode sequences, ``prefill_attn`` the summed
        ``n_i*(c_i+n_i/2)`` of the prefill chunks.
        """
        f = self.tp_factor
        k_n = self.K_ms_per_tok * f * num_tokens
        return (
            self.T0_ms * f
            + math.sqrt(self.W_ms * self.W_ms + k_n * k_n)
            + self.A_ms_per_1k_ctx * decode_ctx_tokens / 1000.0
            + self.Q_ms_per_1e6 * prefill_attn / 1e6
        )


def profile_key(model: str, gpu: str, tp: int) -> str:
    return f"{model}/{gpu}/tp{tp}"


@cache
def _constants() -> dict[str, dict[str, Any]]:
    text = resources.files("backends.sim").joinpath("data/latency_constants.json").read_text()
    consts: dict[str, dict[str, Any]] = json.loads(text)["consts"]
    return consts


def available_profiles() -> list[str]:
    """Every ``model/gpu/tpN`` key that :func:`load_profile` accepts."""
    return sorted(_constants())


def load_profile(
    model: str, gpu: str, tp: int, *, tp_penalty: float | None = None
) -> LatencyProfile:
    """The profile for (model, GPU, TP); ``tp_penalty=None`` means the calibrated default.

    Model and GPU names match case-insensitively (``H100`` == ``h100``).
    """
    wanted = profile_key(model, gpu, tp).lower()
    by_lower = {k.lower(): k for k in _constants()}
    if wanted not in by_lower:
        raise ValueError(
            f"no latency profile for model={model!r} gpu={gpu!r} tp={tp}; "
            f"available: {', '.join(available_profiles())}"
        )
    key = by_lower[wanted]
    c = _constants()[key]
    name_model, name_gpu, _ = key.split("/")
    return LatencyProfile(
        model=name_model,
        gpu=name_gpu,
        tp=tp,
        T0_ms=float(c["T0_ms"]),
        W_ms=float(c["W_ms"]),
        K_ms_per_tok=float(c["K_ms_per_tok"]),
        A_ms_per_1k_ctx=float(c["A_ms_per_1k_ctx"]),
        Q_ms_per_1e6=float(c["Q_ms_per_1e6"]),
        kv_capacity_tokens=int(c["kv_capacity_tokens"]),
        tp_penalty=DEFAULT_TP_PENALTY if tp_penalty is None else tp_penalty,
        request_overhead_ms=float(c.get("request_overhead_ms", 5.0)),
        placeholder=bool(c.get("placeholder", False)),
    )


def with_penalty(profile: LatencyProfile, tp_penalty: float) -> LatencyProfile:
    """The same profile with another ``tp_penalty`` (used by calibration sweeps)."""
    return replace(profile, tp_penalty=tp_penalty)
