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

At TP > 1 every step also pays the tensor-parallel all-reduces, additively
(``tp_comm_ms``): two per layer (after attention and after the MLP), each a fixed
launch/sync latency (``ALLREDUCE_US``, ~10 us on NVLink) plus a ring all-reduce of the
step's activations, ``2*(tp-1)/tp * tokens * hidden * 2 bytes`` over ``LINK_GBPS``. With
that term and vLLM-like admission (``max_num_seqs`` per instance, not per GPU) the fitted
constants reproduce Libra's 8xTP1-vs-1xTP8 numbers (arXiv 2606.03077) at the loads it
measured, and the trade-off moves with load as it should: at a few sequences per instance
high TP wins (weight streaming dominates, split 8 ways); at tens to hundreds TP1 wins
(weights are amortized, and TP pays the all-reduces and a worse compute efficiency).
See ``docs/fidelity.md`` (``bench/runners/fidelity.py``).

``tp_penalty`` (a multiplier ``1 + tp_penalty*log2(tp)`` on ``T0`` and ``K``) is the knob
of the TP-efficiency band: how much faster one TP8 instance decodes than one TP1 instance
is the cost model's least certain premise (published measurements disagree by 2-3x), so
benchmarks are run across a band of it (:data:`TP_BAND`, :func:`penalty_for`; sources in
``docs/tp-efficiency.md``). It defaults to 0 (``calibrated``: the fit to Libra's table,
which scales TP better than any published measurement does).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from functools import cache
from importlib import resources
from typing import Any

#: A multiplicative per-TP slowdown on top of the all-reduce term (0: the all-reduce term
#: below models the TP cost; a profile may set its own).
DEFAULT_TP_PENALTY = 0.0
#: Fixed cost of one all-reduce (launch + sync), microseconds.
ALLREDUCE_US = 10.0
#: Achieved all-reduce bus bandwidth, GB/s (NVLink-class).
LINK_GBPS = 260.0
#: (layers, hidden size) per model, for the all-reduce volume.
ARCH = {"qwen3-14b": (40, 5120), "qwen3-8b": (36, 4096), "llama3.1-8b": (32, 4096),
        "qwen3-32b": (64, 5120), "qwen2.5-32b": (64, 5120), "tiny": (2, 64)}
#: The context (tokens) a simulated server of each model has unless told otherwise: what
#: ``vllm serve`` gives the model, its config's ``max_position_embeddings``. Qwen3 8B, 14B
#: and 32B: 40,960 (32,768 trained natively, plus room to answer; 131,072 with YaRN,
#: ``--rope-scaling '{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":
#: 32768}' --max-model-len 131072``, which ``sim-backend --max-model-len 131072`` stands
#: for); Llama 3.1 8B: 131,072; Qwen2.5-32B-Instruct: 32,768 (131,072 with YaRN); the
#: tiny CPU model: 4,096 (backends/tinymodel.py).
NATIVE_CONTEXT = {"qwen3-14b": 40960, "qwen3-8b": 40960, "qwen3-32b": 40960,
                  "llama3.1-8b": 131072, "qwen2.5-32b": 32768, "tiny": 4096}
#: ... of a model not in :data:`NATIVE_CONTEXT` (a latency profile passed in directly)
DEFAULT_CONTEXT = 40960


def native_context(model: str) -> int:
    """The context a simulated server of ``model`` has by default (:data:`NATIVE_CONTEXT`)."""
    return NATIVE_CONTEXT.get(model.lower(), DEFAULT_CONTEXT)


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
    layers: int = 40
    hidden: int = 5120
    allreduce_us: float = ALLREDUCE_US
    link_gbps: float = LINK_GBPS
    request_overhead_ms: float = 5.0
    placeholder: bool = False
    kv_bytes_per_token: int = 0  # the whole model's KV per token (0: not known)

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

    def tp_comm_ms(self, num_tokens: int) -> float:
        """All-reduce time of one step over ``num_tokens`` tokens (0 at TP1)."""
        if self.tp <= 1:
            return 0.0
        nbytes = 2.0 * (self.tp - 1) / self.tp * num_tokens * self.hidden * 2
        one_us = self.allreduce_us + nbytes / (self.link_gbps * 1e3)
        return 2 * self.layers * one_us / 1000.0

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
            + self.tp_comm_ms(num_tokens)
        )


@dataclass(frozen=True, slots=True)
class LoraCost:
    """What serving LoRA adapters costs an engine started with ``--enable-lora``.

    * ``step_overhead``: a step whose tokens all run on adapters takes ``1 +
      step_overhead`` times as long (the LoRA shrink/expand kernels beside every adapted
      layer); a mixed batch pays in proportion to its tokens on adapters. vLLM's own
      LoRA throughput benchmark (``benchmark_throughput.py``, PR 11267: Llama-2-7B, one
      A100, rank 8) measured 2,694 output tokens/s on the base model and 1,788 on one
      adapter, a step 1.51x as long: the default, the costliest published figure on a
      GPU; vLLM's TPU LoRA work reported 8-24% (PR 15655), and the kernels run at the
      padded ``max_lora_rank``, whatever the adapter's own rank.
    * ``idle_overhead``: what ``--enable-lora`` costs a step with no adapter in it (10.5%
      before vLLM PR 25914, 1.4% after: the default).
    * ``load_s``: loading one adapter holds the engine between two steps (vLLM runs
      ``add_lora`` on the engine core's loop). No GPU measurement is published; 0.2 s is
      reading and copying a rank-16 all-linear adapter of a 14B model (about 130 MB) at
      ~1 GB/s from the page cache; 9-12 ms measured here on CPU for the tiny model.
    """

    step_overhead: float = 0.51
    idle_overhead: float = 0.014
    load_s: float = 0.2

    def factor(self, adapter_tokens: int, num_tokens: int) -> float:
        """The multiplier on a step of ``num_tokens`` tokens, ``adapter_tokens`` of them
        on adapters."""
        if num_tokens <= 0:
            return 1.0
        return 1.0 + self.idle_overhead + self.step_overhead * adapter_tokens / num_tokens


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
    layers, hidden = ARCH.get(name_model.lower(), (40, 5120))
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
        layers=layers,
        hidden=hidden,
        request_overhead_ms=float(c.get("request_overhead_ms", 5.0)),
        placeholder=bool(c.get("placeholder", False)),
        kv_bytes_per_token=int(c.get("kv_bytes_per_token_total", 0)),
    )


#: vLLM's default ``gpu_memory_utilization``: the share of each GPU's memory an engine
#: takes, the premise of every profile's ``kv_capacity_tokens`` (Qwen3-14B on one H100:
#: 0.9 x 80 GiB less 29.5 GB of weights and ~6 GB of activations leaves the 41.7 GB of KV
#: the profile holds).
VLLM_MEMORY_UTILIZATION = 0.9
#: memory per GPU, GiB (the profiles' A100 is the 80 GB part)
GPU_MEMORY_GIB = {"h100": 80, "a100": 80}


def at_memory_utilization(p: LatencyProfile, utilization: float) -> LatencyProfile:
    """``p`` on an engine that takes ``utilization`` of each GPU's memory instead of
    vLLM's default: the weights and activations stay, the KV cache gives up the
    difference on every GPU of the instance. A colocated rollout runs so (the trainer's
    state keeps part of each GPU: verl's default is 0.5). ``ValueError`` when no KV is
    left, or the profile does not say its KV bytes per token or GPU memory."""
    if abs(utilization - VLLM_MEMORY_UTILIZATION) < 1e-9:
        return p
    gib = GPU_MEMORY_GIB.get(p.gpu.lower())
    if not 0.0 < utilization <= 1.0 or gib is None or p.kv_bytes_per_token <= 0:
        raise ValueError(f"cannot put {p.key} at gpu_memory_utilization {utilization}: "
                         f"it must be in (0, 1] and the profile must know its GPU's memory "
                         f"and KV bytes per token")
    delta = p.tp * (utilization - VLLM_MEMORY_UTILIZATION) * gib * 2**30
    tokens = p.kv_capacity_tokens + int(delta // p.kv_bytes_per_token)
    if tokens < 16 * p.block_size:
        raise ValueError(f"{p.key} does not fit at gpu_memory_utilization {utilization}: "
                         f"its weights and activations leave no KV cache")
    return replace(p, kv_capacity_tokens=tokens)


#: The reference load of the TP-efficiency band: one instance, 256 sequences in flight,
#: each holding 1024 tokens of context (decode steps, no prefill).
SCALING_SEQS, SCALING_CTX = 256, 1024
#: TP8-over-TP1 decode throughput of one instance at the reference load: the band drawn
#: from published measurements of 7-14B models on H100/A100 (docs/tp-efficiency.md). Low:
#: vLLM 0.5.4, CPU-bound (Llama-3.1-8B-FP8 on H100, 1.16x); high: vLLM 0.6 multi-step
#: (Mistral-Nemo-12B on H100, 2.12x); mid: their geometric mean. ``calibrated`` is the model
#: as shipped (``tp_penalty`` 0, fitted to Libra's table: 3.2-4.7x), above every published
#: serving measurement and within 0.86-1.16x of the GPU step times measured on an H100
#: (``bench gpu-scan``): the published ratios are CPU-bound engines, the calibrated one a
#: GPU-bound engine.
TP_BAND = {"low": 1.15, "mid": 1.6, "high": 2.2}
#: every name ``--tp-efficiency`` accepts
TP_POINTS = ("low", "mid", "high", "calibrated")


def tp_scaling(model: str, gpu: str, tp_penalty: float = 0.0, tp: int = 8) -> float:
    """Decode throughput of one TP-``tp`` instance over one TP1 instance at the band's
    reference load (:data:`SCALING_SEQS` sequences of :data:`SCALING_CTX` context)."""
    one = load_profile(model, gpu, 1, tp_penalty=tp_penalty)
    many = load_profile(model, gpu, tp, tp_penalty=tp_penalty)
    n, ctx = SCALING_SEQS, SCALING_SEQS * SCALING_CTX
    return one.step_ms(num_tokens=n, decode_ctx_tokens=ctx) / many.step_ms(
        num_tokens=n, decode_ctx_tokens=ctx)


def penalty_for(model: str, gpu: str, where: str | float) -> float:
    """The ``tp_penalty`` that puts (model, GPU) at a point of the TP-efficiency band.

    ``where`` is ``"low"``, ``"mid"``, ``"high"`` (:data:`TP_BAND`), ``"calibrated"``
    (penalty 0), or a TP8/TP1 ratio (e.g. ``2.0``) from 1 up to the calibrated model's.
    """
    top = tp_scaling(model, gpu, 0.0)
    if isinstance(where, str):
        if where not in TP_POINTS:
            raise ValueError(f"unknown TP-efficiency point {where!r}; use one of "
                             f"{', '.join(TP_POINTS)} or a TP8/TP1 ratio")
        target = top if where == "calibrated" else TP_BAND[where]
    else:
        target = float(where)
    if not 1.0 <= target <= top + 1e-9:
        raise ValueError(f"TP8/TP1 ratio {target:.2f} is outside what the model of "
                         f"{model}/{gpu} can express (1.0-{top:.2f})")
    if target >= top - 1e-9:
        return 0.0
    lo, hi = 0.0, 1.0
    while tp_scaling(model, gpu, hi) > target:  # the ratio falls as the penalty grows
        lo, hi = hi, hi * 2
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tp_scaling(model, gpu, mid) > target else (lo, mid)
    return round((lo + hi) / 2, 4)


def with_penalty(profile: LatencyProfile, tp_penalty: float) -> LatencyProfile:
    """The same profile with another ``tp_penalty`` (used by calibration sweeps)."""
    return replace(profile, tp_penalty=tp_penalty)
