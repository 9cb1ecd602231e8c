"""``rollout-gateway bench gpu-scan``: what a measured GPU decode scan says of the cost
model's TP scaling (``docs/tp-efficiency.md``, "Measured on an H100").

The scan (``bench/calibrate/decode_scan.py``, run on a lent GPU) times one TP rank's
decode step of the real architectures on one GPU. One GPU cannot time the two all-reduces
per layer that join the ranks, nor the engine's CPU work per step, so this report adds both
as explicit terms and shows the TP8/TP1 ratio across them:

    ratio = (G1 + c) / (G8 + s * AR8 + c)

``G`` the measured GPU step of one rank at the band's reference load (256 sequences of
1024 tokens), ``AR8`` the simulator's own all-reduce term at TP8
(:meth:`backends.sim.profiles.LatencyProfile.tp_comm_ms`), ``s`` a multiplier on it and
``c`` the engine's per-step CPU time that the GPU waits for (0 for an engine that hides it
behind the forward pass). Solving for ``c`` says how CPU-bound an engine must be to sit at
each published point of the band.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from backends.sim.profiles import SCALING_CTX, SCALING_SEQS, TP_BAND, load_profile, tp_scaling

SCAN = Path("docs/benchmarks/gpu/h100-decode-scan.json")
FUSED = Path("docs/benchmarks/gpu/h100-decode-fused.json")
#: multipliers on the simulator's all-reduce term: as modelled, and three times it (the
#: all-reduce latencies SGLang measured for vLLM's custom all-reduce on 8 H100s, without
#: CUDA graphs, read as bytes, sit between the two at the reference load's message size)
AR_SCALES = (1.0, 3.0)
#: unhidden engine CPU per step, milliseconds
CPU_MS = (0.0, 2.0, 5.0, 10.0, 20.0)


@dataclass(frozen=True)
class Point:
    """GPU step times (ms) of one model at the reference load, per TP degree."""

    model: str
    plain: dict[int, float]  # the layers as separate kernels in one CUDA graph
    fused: dict[int, float]  # the layers compiled by TorchInductor (elementwise work fused)

    def ar_ms(self, tp: int, gpu: str) -> float:
        return load_profile(self.model, gpu, tp).tp_comm_ms(SCALING_SEQS)

    def ratio(self, *, gpu: str, fused: bool, ar_scale: float, cpu_ms: float) -> float:
        g = self.fused if fused else self.plain
        return (g[1] + cpu_ms) / (g[8] + ar_scale * self.ar_ms(8, gpu) + cpu_ms)

    def cpu_for(self, target: float, *, gpu: str, fused: bool, ar_scale: float) -> float:
        """The unhidden CPU per step (ms) at which the ratio falls to ``target``."""
        g = self.fused if fused else self.plain
        eight = g[8] + ar_scale * self.ar_ms(8, gpu)
        return max(0.0, (g[1] - target * eight) / (target - 1.0))


def load_scan(path: Path) -> dict[str, Any]:
    try:
        doc: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the scan {path}: {exc}") from None
    if not isinstance(doc.get("points"), list):
        raise ValueError(f"{path} is not a decode scan (no 'points' list)")
    return doc


def reference_points(scan: dict[str, Any], fused: dict[str, Any] | None) -> list[Point]:
    """One :class:`Point` per model the scan timed at the reference load at TP1 and TP8."""
    def at_ref(doc: dict[str, Any], key: str) -> dict[tuple[str, int], float]:
        return {(p["model"], p["tp"]): p[key] for p in doc["points"]
                if p["kind"] == "decode" and p["batch"] == SCALING_SEQS
                and p["ctx"] == SCALING_CTX and key in p}

    plain = at_ref(scan, "step_ms")
    fz = at_ref(fused, "fused_step_ms") if fused else {}
    out = []
    for model in dict.fromkeys(m for m, _ in plain):
        p = {tp: plain[(model, tp)] for tp in (1, 2, 4, 8) if (model, tp) in plain}
        f = {tp: fz[(model, tp)] for tp in (1, 2, 4, 8) if (model, tp) in fz}
        if 1 in p and 8 in p:
            out.append(Point(model, p, f if {1, 8} <= f.keys() else p))
    return out


def profile_rows(scan: dict[str, Any], gpu: str) -> list[dict[str, Any]]:
    """The simulator's calibrated step (all-reduce included) next to the measured GPU step
    plus the same all-reduce term, at batches 1, 64 and 256 of 1024-token contexts."""
    rows = []
    for p in scan["points"]:
        if p["kind"] != "decode" or p["ctx"] != SCALING_CTX or p["batch"] not in (1, 64, 256):
            continue
        prof = load_profile(p["model"], gpu, p["tp"])
        b = p["batch"]
        sim = prof.step_ms(num_tokens=b, decode_ctx_tokens=b * SCALING_CTX)
        comm = prof.tp_comm_ms(b)
        rows.append({"model": p["model"], "tp": p["tp"], "batch": b, "sim_ms": sim,
                     "measured_ms": p["step_ms"] + comm, "comm_ms": comm,
                     "sim_over_measured": sim / (p["step_ms"] + comm)})
    return rows


def gpu_scan(
    scan: Annotated[Path, typer.Option(help="decode scan JSON (plain CUDA graphs)")] = SCAN,
    fused: Annotated[Path | None, typer.Option(
        help="decode scan JSON with --fuse (TorchInductor) timings")] = FUSED,
    gpu: Annotated[str, typer.Option(help="the profiles' GPU the scan ran on")] = "H100",
) -> None:
    """What a measured GPU decode scan says of the cost model's TP8/TP1 ratio."""
    from rich.console import Console
    from rich.table import Table

    try:
        doc = load_scan(scan)
        fdoc = load_scan(fused) if fused and fused.exists() else None
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    console = Console()
    facts = doc.get("facts", {})
    console.print(f"scan: {scan} on {facts.get('name', facts.get('device', '?'))} "
                  f"(torch {facts.get('torch', '?')})")

    t = Table(title="calibrated profile vs measured GPU step + the profile's all-reduce (ms)")
    for col in ("model", "TP", "batch", "profile", "measured+AR", "AR", "profile/measured"):
        t.add_column(col, justify="right")
    for r in profile_rows(doc, gpu):
        t.add_row(r["model"], str(r["tp"]), str(r["batch"]), f"{r['sim_ms']:.2f}",
                  f"{r['measured_ms']:.2f}", f"{r['comm_ms']:.2f}", f"{r['sim_over_measured']:.2f}")
    console.print(t)

    points = reference_points(doc, fdoc)
    t = Table(title=f"TP8/TP1 at {SCALING_SEQS} x {SCALING_CTX}: measured GPU step, "
                    "all-reduce x s, unhidden CPU c ms per step")
    t.add_column("model")
    t.add_column("calibrated", justify="right")
    t.add_column("kernels")
    t.add_column("AR x", justify="right")
    for c in CPU_MS:
        t.add_column(f"c={c:g}", justify="right")
    for name, band in TP_BAND.items():
        t.add_column(f"c for {name} ({band}x)", justify="right")
    for p in points:
        for is_fused in (False, True):
            for s in AR_SCALES:
                t.add_row(p.model, f"{tp_scaling(p.model, gpu):.2f}",
                          "fused" if is_fused else "plain", f"{s:g}",
                          *(f"{p.ratio(gpu=gpu, fused=is_fused, ar_scale=s, cpu_ms=c):.2f}"
                            for c in CPU_MS),
                          *(f"{p.cpu_for(b, gpu=gpu, fused=is_fused, ar_scale=s):.0f}"
                            for b in TP_BAND.values()))
    console.print(t)
