"""Training-inference mismatch: the trainer's logprob of every trained token against the
one the engine recorded when it sampled it.

The two differ even on the same weights (bf16 kernels, batch-dependent reductions, a
sampler that masks the distribution for a forced tool call); they differ a lot when the
trainer is handed something other than what happened (a logprob shifted by one token,
loss mask 1 on a tool's output, a stale version). With ``d = logp_trainer - logp_engine``
per token and ``r = exp(d)`` the importance ratio that TIS/MIS corrections use:

* ``mean_abs_diff``: mean ``|d|`` (what slime and verl log as a probability/logprob diff);
* ``kl``: the k3 estimate ``mean(r - 1 - d)`` of KL(engine || trainer) on the engine's
  own samples: unbiased and never negative (Schulman's estimators);
* ``log_ratio_mean``: the k1 estimate ``mean(-d)`` of the same KL (can be negative);
* ``ratio_percentiles``: r at the 1st, 5th, 50th, 95th and 99th percentiles;
* ``outside_share``: the share of tokens whose r is outside ``RATIO_BAND`` (0.8, 1.25).

The client builds a :class:`MismatchReport` per training step (``gateway.client.mismatch``)
and posts it to ``POST /training/mismatch``; the gateway judges it against its limits
(``TrainingSettings``), shows it on ``/status`` and the status page, and exports it to
Prometheus. docs/training-mismatch.md has the figures and how TIS/MIS use them.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

#: importance ratios outside this band count in ``outside_share``
RATIO_BAND = (0.8, 1.25)
PERCENTILES = (1, 5, 50, 95, 99)
PERCENTILE_KEYS = tuple(f"p{p}" for p in PERCENTILES)
MAX_VERSIONS = 64  # weight versions in one report (a step spans a few)


class MismatchStats(BaseModel):
    """The mismatch over one set of trained tokens."""

    model_config = ConfigDict(allow_inf_nan=False)

    tokens: int = Field(ge=0)
    mean_abs_diff: float = Field(ge=0)
    max_abs_diff: float = Field(ge=0)
    kl: float = Field(ge=0, description="k3 estimate of KL(engine || trainer) per token")
    log_ratio_mean: float = Field(description="k1: mean(logp_engine - logp_trainer)")
    ratio_percentiles: dict[str, float] = Field(
        description="importance ratio exp(logp_trainer - logp_engine) at p1, p5, p50, p95, p99")
    outside_share: float = Field(ge=0, le=1, description="share of tokens with a ratio "
                                 f"outside [{RATIO_BAND[0]}, {RATIO_BAND[1]}]")

    @field_validator("ratio_percentiles")
    @classmethod
    def _percentiles(cls, value: dict[str, float]) -> dict[str, float]:
        if sorted(value) != sorted(PERCENTILE_KEYS):
            raise ValueError(f"ratio_percentiles needs exactly {', '.join(PERCENTILE_KEYS)}")
        return {k: value[k] for k in PERCENTILE_KEYS}

    @classmethod
    def of(cls, trainer: np.ndarray, engine: np.ndarray) -> MismatchStats:
        """The figures of paired per-token logprobs (finite, same length, at least one)."""
        d = np.asarray(trainer, dtype=np.float64) - np.asarray(engine, dtype=np.float64)
        if d.size == 0:
            raise ValueError("no token to compare")
        # the ratio of a token the trainer finds far likelier overflows; clip the log
        ratio = np.exp(np.clip(d, -50.0, 50.0))
        pct = np.percentile(ratio, PERCENTILES)
        return cls(
            tokens=int(d.size), mean_abs_diff=float(np.abs(d).mean()),
            max_abs_diff=float(np.abs(d).max()),
            kl=max(0.0, float((ratio - 1.0 - d).mean())), log_ratio_mean=float(-d.mean()),
            ratio_percentiles={f"p{p}": float(v) for p, v in zip(PERCENTILES, pct, strict=True)},
            outside_share=float(((ratio < RATIO_BAND[0]) | (ratio > RATIO_BAND[1])).mean()))


class MismatchLimits(BaseModel):
    """When a step's mismatch raises the alarm (any one limit passed)."""

    kl: float = Field(0.01, gt=0, description="k3 KL per token")
    outside_share: float = Field(0.05, gt=0, le=1, description=(
        f"share of tokens with an importance ratio outside [{RATIO_BAND[0]}, {RATIO_BAND[1]}]"))
    mean_abs_diff: float = Field(0.1, gt=0, description="mean |logp_trainer - logp_engine|")


def alarms(stats: MismatchStats, limits: MismatchLimits) -> list[str]:
    """Each limit ``stats`` passes, in words (empty: no alarm)."""
    found = []
    if stats.kl > limits.kl:
        found.append(f"KL {stats.kl:.4g} > {limits.kl:g}")
    if stats.outside_share > limits.outside_share:
        found.append(f"{stats.outside_share:.1%} of tokens with a ratio outside "
                     f"[{RATIO_BAND[0]}, {RATIO_BAND[1]}] > {limits.outside_share:.1%}")
    if stats.mean_abs_diff > limits.mean_abs_diff:
        found.append(f"mean |logprob diff| {stats.mean_abs_diff:.4g} > {limits.mean_abs_diff:g}")
    return found


class MismatchReport(BaseModel):
    """One training step's mismatch, overall and per weight version the tokens were
    sampled on. ``mode`` is the step mode the batch was gathered in (``sync``,
    ``overprovisioned``, ``async``, ``tail-batching``, or the trainer's own word)."""

    run_id: str | None = Field(None, max_length=200)
    step: int | None = None
    mode: str = Field("sync", min_length=1, max_length=64)
    samples: int = Field(0, ge=0)
    #: trained tokens left out: no recorded logprob (an engine that did not return one),
    #: or a non-finite logprob on either side
    skipped_tokens: int = Field(0, ge=0)
    #: the tokens sampled freely (None: every trained token was constrained)
    overall: MismatchStats | None
    by_version: dict[str, MismatchStats] = Field(default_factory=dict,
                                                 max_length=MAX_VERSIONS)
    #: the tokens of constrained calls (a forced tool call, structured output), apart:
    #: the engine reports the masked distribution's logprobs there, so their gap is
    #: real and large, and is not held against the limits
    constrained: MismatchStats | None = None
    #: the limits passed, filled in by whoever judged the report (client or gateway)
    alarms: list[str] = Field(default_factory=list)
    received_at: float | None = None  # set by the gateway

    @field_validator("by_version")
    @classmethod
    def _versions(cls, value: dict[str, MismatchStats]) -> dict[str, MismatchStats]:
        if any(not 0 < len(v) <= 128 for v in value):
            raise ValueError("a weight version is 1 to 128 characters")
        return value

    def judged(self, limits: MismatchLimits) -> MismatchReport:
        """This report with ``alarms`` judged against ``limits`` (overall and per version)."""
        if self.overall is None:
            return self.model_copy(update={"alarms": []})
        found = alarms(self.overall, limits)
        for version, stats in self.by_version.items():
            found += [f"version {version}: {a}" for a in alarms(stats, limits)
                      if len(self.by_version) > 1]
        return self.model_copy(update={"alarms": found})


Pairs = tuple[list[float], list[float]]  # (trainer, engine) logprobs of the same tokens


def report_of(pairs: Mapping[str, Pairs], *, constrained: Pairs | None = None,
              mode: str = "sync", step: int | None = None, run_id: str | None = None,
              samples: int = 0, skipped: int = 0,
              limits: MismatchLimits | None = None) -> MismatchReport:
    """A report from per-version ``(trainer, engine)`` logprob lists of freely sampled
    tokens, and those of constrained calls apart."""
    kept = {v: p for v, p in pairs.items() if p[0]}
    if not kept and not (constrained and constrained[0]):
        raise ValueError("no trained token with a recorded logprob to compare")
    overall = None
    if kept:
        overall = MismatchStats.of(np.concatenate([np.asarray(p[0]) for p in kept.values()]),
                                   np.concatenate([np.asarray(p[1]) for p in kept.values()]))
    report = MismatchReport(
        run_id=run_id, step=step, mode=mode, samples=samples, skipped_tokens=skipped,
        overall=overall,
        by_version={v: MismatchStats.of(np.asarray(t), np.asarray(e))
                    for v, (t, e) in sorted(kept.items())},
        constrained=(MismatchStats.of(np.asarray(constrained[0]), np.asarray(constrained[1]))
                     if constrained and constrained[0] else None))
    return report.judged(limits or MismatchLimits())
