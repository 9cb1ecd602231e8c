# mypy: disable-error-code="no-untyped-call"
# (torch's split, cuda.Event and cuda.Stream carry no annotations)
"""Per-TP decode step time of a real model architecture, measured on one GPU.

The simulator's least certain constant is how step time scales with the tensor-parallel
degree (``docs/tp-efficiency.md``). This script measures the GPU side of it: one engine
step of a random-weight model with the real architecture (Qwen3 / Llama dimensions),
sharded as Megatron-style TP shards it (attention heads, KV heads, MLP columns and the
vocabulary split ``tp`` ways), so the step of one TP-``tp`` rank is timed on one GPU.
Weights do not change step time, only shapes do.

What one rank runs per decode step, as vLLM does it: embedding, then per layer RMSNorm,
fused QKV projection, Qwen3's per-head q/k RMSNorm, rotary embedding, the new token's K/V
written into the cache, attention of one query per sequence over its cached context
(grouped-query heads packed into the query axis, as FlashInfer and FlashAttention do),
output projection, RMSNorm, fused gate/up projection, SiLU-and-mul, down projection; then
the final norm, the vocabulary shard's logits and a greedy pick. Decode steps are replayed
as CUDA graphs (vLLM captures decode batches up to 512 by default), so the time is GPU time
with no Python launch cost. Prefill chunks run eagerly (compute bound).

What one GPU cannot measure: the two all-reduces per layer that join the TP ranks, and
the engine's per-step CPU work (scheduling, input preparation, broadcasting to the TP
workers). ``bench/reports/gpu_scan.py`` adds both as explicit, labelled terms.

Only ``torch`` and the standard library: it runs on the lent GPU machine as it is
(``python3 bench/calibrate/decode_scan.py --out $OUT/scan.json``) and, with ``--tiny``,
on a CPU in the tests.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Arch:
    """The dimensions that set a decoder's step time (from each model's config.json)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    qk_norm: bool


ARCHS = {
    # Qwen/Qwen3-8B, Qwen3-14B, Qwen3-32B and meta-llama/Llama-3.1-8B config.json
    "qwen3-8b": Arch("qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936, True),
    "qwen3-14b": Arch("qwen3-14b", 40, 5120, 40, 8, 128, 17408, 151936, True),
    "qwen3-32b": Arch("qwen3-32b", 64, 5120, 64, 8, 128, 25600, 151936, True),
    "llama3.1-8b": Arch("llama3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256, False),
    # a CPU-sized stand-in with the same structure, for the tests
    "tiny": Arch("tiny", 4, 256, 4, 2, 64, 512, 1024, True),
}


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, 1e-6)


class Shard:
    """The weights one TP rank holds for ``n_layers`` distinct decoder layers."""

    def __init__(self, arch: Arch, tp: int, n_layers: int, dev: torch.device,
                 dtype: torch.dtype) -> None:
        if arch.heads % tp or arch.intermediate % tp:
            raise ValueError(f"{arch.name} does not split {tp} ways")
        self.arch, self.tp, self.dev, self.dtype = arch, tp, dev, dtype
        self.hq = arch.heads // tp
        self.hkv = max(1, arch.kv_heads // tp)  # KV heads are replicated past tp > kv_heads
        self.inter = arch.intermediate // tp
        self.vocab = math.ceil(arch.vocab / tp)
        d, h = arch.head_dim, arch.hidden

        def w(*shape: int) -> torch.Tensor:
            return torch.empty(*shape, device=dev, dtype=dtype).normal_(0, 0.02)

        self.layers = [
            {
                "ln1": torch.ones(h, device=dev, dtype=dtype),
                "qkv": w((self.hq + 2 * self.hkv) * d, h),
                "qn": torch.ones(d, device=dev, dtype=dtype),
                "kn": torch.ones(d, device=dev, dtype=dtype),
                "o": w(h, self.hq * d),
                "ln2": torch.ones(h, device=dev, dtype=dtype),
                "gate_up": w(2 * self.inter, h),
                "down": w(h, self.inter),
            }
            for _ in range(n_layers)
        ]
        self.embed = w(self.vocab, h)
        self.norm = torch.ones(h, device=dev, dtype=dtype)
        self.lm_head = w(self.vocab, h)

    def kv_cache(self, batch: int, ctx: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (batch, self.hkv, ctx, self.arch.head_dim)
        return [(torch.zeros(shape, device=self.dev, dtype=self.dtype),
                 torch.zeros(shape, device=self.dev, dtype=self.dtype)) for _ in self.layers]

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def decode_layers(self, x: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor]],
                      pos: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """One decode step of every held layer: ``x`` is [batch, hidden], one token each."""
        b, d, g = x.shape[0], self.arch.head_dim, self.hq // self.hkv
        for lw, (kc, vc) in zip(self.layers, caches, strict=True):
            qkv = _rms(x, lw["ln1"]) @ lw["qkv"].T
            q, k, v = qkv.split([self.hq * d, self.hkv * d, self.hkv * d], dim=-1)
            q, k = q.view(b, self.hq, d), k.view(b, self.hkv, d)
            if self.arch.qk_norm:
                q, k = _rms(q, lw["qn"]), _rms(k, lw["kn"])
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            kc[:, :, pos] = k
            vc[:, :, pos] = v.view(b, self.hkv, d)
            # grouped-query heads packed into the query axis: [b, hkv, g, d] over [b, hkv, ctx, d]
            att = F.scaled_dot_product_attention(q.view(b, self.hkv, g, d), kc, vc)
            x = x + att.reshape(b, self.hq * d) @ lw["o"].T
            gu = _rms(x, lw["ln2"]) @ lw["gate_up"].T
            gate, up = gu.chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ lw["down"].T
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm, this rank's vocabulary shard of the logits, a greedy pick."""
        return (_rms(x, self.norm) @ self.lm_head.T).argmax(dim=-1)

    def prefill_layers(self, x: torch.Tensor) -> torch.Tensor:
        """One prefill chunk of ``x.shape[0]`` new tokens of one sequence (no cached prefix)."""
        n, d = x.shape[0], self.arch.head_dim
        for lw in self.layers:
            qkv = _rms(x, lw["ln1"]) @ lw["qkv"].T
            q, k, v = qkv.split([self.hq * d, self.hkv * d, self.hkv * d], dim=-1)
            q = q.view(n, self.hq, d).transpose(0, 1)
            k = k.view(n, self.hkv, d).transpose(0, 1)
            v = v.view(n, self.hkv, d).transpose(0, 1)
            if self.arch.qk_norm:
                q, k = _rms(q, lw["qn"]), _rms(k, lw["kn"])
            rep = self.hq // self.hkv
            att = F.scaled_dot_product_attention(
                q[None], k.repeat_interleave(rep, 0)[None], v.repeat_interleave(rep, 0)[None],
                is_causal=True)[0]
            x = x + att.transpose(0, 1).reshape(n, self.hq * d) @ lw["o"].T
            gu = _rms(x, lw["ln2"]) @ lw["gate_up"].T
            gate, up = gu.chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ lw["down"].T
        return x


class Timer:
    """Milliseconds per call of ``fn``: CUDA events on a GPU, perf_counter on a CPU."""

    def __init__(self, dev: torch.device, reps: int, rounds: int) -> None:
        self.dev, self.reps, self.rounds = dev, reps, rounds

    def __call__(self, fn: Any) -> float:
        for _ in range(2):
            fn()
        samples = []
        for _ in range(self.rounds):
            if self.dev.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(self.reps):
                    fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / self.reps)
            else:
                t0 = time.perf_counter()
                for _ in range(self.reps):
                    fn()
                samples.append((time.perf_counter() - t0) * 1000 / self.reps)
        return float(statistics.median(samples))


def graphed(dev: torch.device, fn: Any) -> Any:
    """``fn`` captured as a CUDA graph (replayed by the returned callable); as is on a CPU."""
    if dev.type != "cuda":
        return fn
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def scan_shard(shard: Shard, plan: dict[str, list[Any]], timer: Timer,
               deadline: float, fuse: bool = False) -> list[dict[str, Any]]:
    """Decode points (batch, ctx) and prefill chunks of one rank; layer time scaled to the
    whole model from the ``len(shard.layers)`` distinct layers it holds.

    With ``fuse`` each decode point is also timed with the layers compiled by TorchInductor
    (elementwise work fused into a few kernels, as vLLM's compiled model runs), side by side
    with the plain graph, so the kernel-launch floor of the unfused step can be read off."""
    arch, held = shard.arch, len(shard.layers)
    # one code object is compiled for every shard and shape: lift dynamo's recompile cap,
    # past which it would silently run the function uncompiled
    for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 4096)
    compiled = torch.compile(shard.decode_layers, fullgraph=True, dynamic=False) if fuse else None
    scale = arch.layers / held
    rows: list[dict[str, Any]] = []
    half = arch.head_dim // 2
    for batch, ctx in plan["decode"]:
        if time.monotonic() > deadline:
            break
        caches = shard.kv_cache(batch, ctx)
        x = torch.empty(batch, arch.hidden, device=shard.dev, dtype=shard.dtype).normal_()
        ang = torch.rand(batch, 1, half, device=shard.dev)
        cos, sin = ang.cos().to(shard.dtype), ang.sin().to(shard.dtype)
        with torch.inference_mode():
            step = partial(shard.decode_layers, x, caches, ctx - 1, cos, sin)
            body = timer(graphed(shard.dev, step))
            head = timer(graphed(shard.dev, partial(shard.head, x)))
            row = {"kind": "decode", "batch": batch, "ctx": ctx, "layers_ms": body * scale,
                   "head_ms": head, "step_ms": body * scale + head}
            if compiled is not None:
                t0 = time.monotonic()
                try:
                    fstep = partial(compiled, x, caches, ctx - 1, cos, sin)
                    fused = timer(graphed(shard.dev, fstep))
                    row.update(fused_layers_ms=fused * scale, fused_step_ms=fused * scale + head)
                except Exception as exc:  # a compile failure is recorded, not fatal
                    row["fused_error"] = f"{type(exc).__name__}: {exc}"[:500]
                row["compile_s"] = round(time.monotonic() - t0, 1)
        rows.append(row)
        del caches
    for tokens in plan["prefill"]:
        if time.monotonic() > deadline:
            break
        x = torch.empty(tokens, arch.hidden, device=shard.dev, dtype=shard.dtype).normal_()
        with torch.inference_mode():
            body = timer(partial(shard.prefill_layers, x))
            head = timer(partial(shard.head, x[-1:]))
        rows.append({"kind": "prefill", "tokens": tokens, "ctx": 0, "layers_ms": body * scale,
                     "head_ms": head, "step_ms": body * scale + head})
    return rows


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def device_facts(dev: torch.device) -> dict[str, Any]:
    facts: dict[str, Any] = {"torch": torch.__version__, "device": str(dev)}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        facts.update(name=p.name, sms=p.multi_processor_count,
                     memory_gib=round(p.total_memory / 2**30, 1))
    return facts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file, rewritten after every shard")
    ap.add_argument("--models", default="qwen3-14b,qwen3-8b,qwen3-32b,llama3.1-8b")
    ap.add_argument("--tps", default="1,2,4,8")
    ap.add_argument("--batches", default="1,4,16,32,64,128,256,512")
    ap.add_argument("--ctx", type=int, default=1024, help="context of the batch sweep")
    ap.add_argument("--ctx-sweep", default="256,4096,16384", help="contexts at --ctx-batch")
    ap.add_argument("--ctx-batch", type=int, default=32)
    ap.add_argument("--prefill", default="512,2048,8192", help="prefill chunk sizes")
    ap.add_argument("--layers", type=int, default=4, help="distinct layers held per rank")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="start no new point after this many seconds")
    ap.add_argument("--fuse", action="store_true",
                    help="also time the layers compiled by TorchInductor (decode points only)")
    ap.add_argument("--tiny", action="store_true", help="the CPU-sized stand-in model, on the CPU")
    args = ap.parse_args(argv)

    dev = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    models = ["tiny"] if args.tiny else args.models.split(",")
    plan = {"decode": [(b, args.ctx) for b in ints(args.batches)]
            + [(args.ctx_batch, c) for c in ints(args.ctx_sweep)],
            "prefill": ints(args.prefill)}
    timer = Timer(dev, args.reps, args.rounds)
    deadline = time.monotonic() + args.budget_s
    result: dict[str, Any] = {"facts": device_facts(dev), "layers_held": args.layers,
                              "argv": sys.argv[1:] if argv is None else argv,
                              "archs": {}, "points": []}
    if dev.type == "cuda":  # bring the clocks up before the first timed point
        a = torch.randn(8192, 8192, device=dev, dtype=dtype)
        t_end = time.monotonic() + 2.0
        while time.monotonic() < t_end:
            a @ a
            torch.cuda.synchronize()
        del a
    started = time.monotonic()
    for name in models:
        arch = ARCHS[name]
        result["archs"][name] = asdict(arch)
        for tp in ints(args.tps):
            if time.monotonic() > deadline:
                break
            if arch.heads % tp or arch.intermediate % tp:
                continue
            shard = Shard(arch, tp, min(args.layers, arch.layers), dev, dtype)
            rows = scan_shard(shard, plan, timer, deadline, fuse=args.fuse)
            result["points"] += [{"model": name, "tp": tp, **r} for r in rows]
            del shard
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
            tail = next((r for r in rows if r["kind"] == "decode" and r["batch"] == 256), None)
            print(f"{time.monotonic() - started:6.1f}s {name} tp{tp}: {len(rows)} points"
                  + (f", 256 x {args.ctx}: {tail['step_ms']:.2f} ms" if tail else ""), flush=True)
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
