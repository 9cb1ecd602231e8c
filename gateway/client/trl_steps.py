"""What each step of :class:`gateway.client.trl.GatewayGRPO` did, as the gateway saw it:
its :class:`StepRecord` (rewards, versions, staleness, the logprob check and the
training-inference mismatch, timings) and the weight :class:`Push` after it."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from gateway.client.trl_rows import LogprobCheck
from gateway.schema.mismatch import MismatchReport


@dataclass(slots=True)
class Push:
    """One weight push: saved, then reloaded by every engine as ``version``."""

    version: str
    path: str
    save_s: float
    push_s: float  # the weight-update job, pause to resume
    phases: dict[str, float]  # the job's phases (pause, update, resume) in seconds


@dataclass(slots=True)
class StepRecord:
    """What one training step did, as the gateway saw it; timings in seconds."""

    step: int
    version: str  # the weight version the step's rollouts ran on
    groups: list[str]
    rewards: list[float | None]
    completion_tokens: int  # generated tokens (loss mask 1) in the batch
    versions: dict[str, int]  # generated tokens per stamped weight version
    #: generated tokens whose version is not ``version`` (a push landed mid-call)
    off_version_tokens: int
    calls_across_update: int  # calls with weight segments (ran across a push)
    max_staleness: int | None
    dropped_tokens: int = 0  # generated tokens of branches left out (``multi_branch``)
    logprobs: LogprobCheck | None = None
    #: training-inference mismatch of the batch (``check_logprobs``), as the gateway
    #: judged it (or as judged here with the default limits if it could not be posted)
    mismatch: MismatchReport | None = None
    rollout_s: float = 0.0
    fetch_s: float = 0.0
    train_s: float = 0.0  # batch handed to TRL -> its optimizer step done
    push: Push | None = None  # the push after the step

    @property
    def mean_reward(self) -> float | None:
        scored = [r for r in self.rewards if r is not None]
        return statistics.fmean(scored) if scored else None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mean_reward": self.mean_reward,
                "mismatch": self.mismatch.model_dump(mode="json") if self.mismatch else None}
