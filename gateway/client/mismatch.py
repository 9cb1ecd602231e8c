"""Training-inference mismatch, measured by the trainer every step.

The engine recorded each generated token's logprob when it sampled it
(``Sample.logprobs``); the trainer recomputes the same logprob in its forward pass.
Comparing the two over the tokens the trainer is about to train (loss mask 1) tells
whether the batch lines up token for token, whether the engines serve the weights being
trained, and how far off-policy the step is: the figures TIS/MIS corrections need
(:mod:`gateway.schema.mismatch` defines them; docs/training-mismatch.md says how verl,
slime and SkyRL take the recorded logprobs)::

    logps = trainer_logprobs(model, batch.samples)          # or your own forward pass
    report = measure_mismatch(batch.samples, logps, mode="async", step=step)
    report = await gw.report_mismatch(report)               # status page, Prometheus
    if report.alarms:
        log.warning("mismatch: %s", "; ".join(report.alarms))

A defect in what reaches the trainer shows here at once: logprobs shifted by one token,
loss mask 1 on a tool's output (the engine recorded no sampling logprob there), tokens
re-tokenized from text, or engines still on old weights all move the figures by orders
of magnitude past the alarm limits.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from gateway.schema.mismatch import MismatchLimits, MismatchReport, report_of
from gateway.schema.samples import Sample

__all__ = ["MismatchLimits", "MismatchReport", "measure_mismatch", "trainer_logprobs"]


def measure_mismatch(samples: Sequence[Sample], logprobs: Sequence[Sequence[float]], *,
                     mode: str = "sync", step: int | None = None, run_id: str | None = None,
                     limits: MismatchLimits | None = None) -> MismatchReport:
    """The mismatch of one batch. ``logprobs[i][j]`` is the trainer's logprob of token
    ``j`` of ``samples[i]`` given the tokens before it (aligned with ``Sample.logprobs``;
    entry 0 is never read). Every token under loss mask 1 is compared, grouped by the
    weight version the engine sampled it on; tokens of constrained calls (a forced tool
    call, structured output: ``CallSpan.constrained``) are reported apart, as
    ``constrained``, and not held against ``limits``."""
    if len(samples) != len(logprobs):
        raise ValueError(f"{len(samples)} samples but {len(logprobs)} logprob rows")
    pairs: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    forced: tuple[list[float], list[float]] = ([], [])
    skipped = 0
    for s, row in zip(samples, logprobs, strict=True):
        if len(row) != len(s.token_ids):
            raise ValueError(f"trajectory {s.trajectory_id!r} branch {s.branch}: "
                             f"{len(row)} logprobs for {len(s.token_ids)} tokens")
        masked = {j for c in s.calls if c.constrained
                  for j in range(c.completion_start, c.completion_end)}
        for j, mask in enumerate(s.loss_mask):
            if not mask:
                continue
            mine = float(row[j]) if j else math.nan
            theirs = s.logprobs[j] if j < len(s.logprobs) else None
            if theirs is None or not math.isfinite(mine) or not math.isfinite(theirs):
                skipped += 1
                continue
            version = s.weight_versions[j] if j < len(s.weight_versions) else ""
            t, e = forced if j in masked else pairs[version or "?"]
            t.append(mine)
            e.append(float(theirs))
    return report_of(pairs, constrained=forced, mode=mode, step=step, run_id=run_id,
                     samples=len(samples), skipped=skipped, limits=limits)


def trainer_logprobs(model: Any, samples: Sequence[Sample]) -> list[list[float]]:
    """Each sample's per-token logprobs under ``model`` (a causal LM called with
    ``input_ids``, e.g. a transformers model): one no-grad forward pass per sample, in
    float32; entry 0 is NaN (nothing precedes it). Needs torch (extra ``learned``)."""
    import torch

    out: list[list[float]] = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.token_ids], device=_device(model))
            logits = model(input_ids=ids).logits[0].float()
            own = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0]
            out.append([math.nan, *own.cpu().tolist()])
    return out


def _device(model: Any) -> Any:
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return "cpu"
