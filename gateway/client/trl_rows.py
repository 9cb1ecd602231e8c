"""What TRL gets of one gateway sample: its rollout row, and the check that the
trainer's logprobs of the generated tokens match the engine's (see :mod:`.trl`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gateway.client.mismatch import trainer_logprobs
from gateway.schema.samples import Sample

#: a generated token "matches" when the trainer's logprob is this close to the engine's
#: (bf16 engine, fp32 trainer on the tiny model: about 0.01)
LOGPROB_TOL = 0.05


@dataclass(slots=True)
class LogprobCheck:
    """The trainer's logprob of every generated token against the engine's."""

    tokens: int
    matched: int  # within ``LOGPROB_TOL``
    max_gap: float
    #: ``trajectory#seq`` of calls with a token past the tolerance: the weights differ,
    #: or the engine sampled from a constrained distribution (a forced tool call,
    #: structured output), whose logprobs are those of the masked distribution
    off_calls: list[str]


def to_trl_row(sample: Sample) -> dict[str, list[Any]]:
    """One gateway sample as TRL's rollout row: the prompt is what came before the first
    completion; the completion is the rest, with ``env_mask`` = the loss mask there."""
    n = sample.num_prompt_tokens
    if n >= len(sample.token_ids):
        raise ValueError(f"trajectory {sample.trajectory_id!r} has no generated token "
                         "(no successful model call): TRL cannot train on it")
    return {"prompt_ids": sample.token_ids[:n], "completion_ids": sample.token_ids[n:],
            "logprobs": sample.logprobs[n:], "env_mask": sample.loss_mask[n:]}


def check_logprobs(model: Any, samples: Sequence[Sample]) -> LogprobCheck:
    """Recompute every generated token's logprob with ``model`` (one forward pass per
    sample) and compare it with the engine's, call by call."""
    return compare_logprobs(samples, trainer_logprobs(model, samples))


def compare_logprobs(samples: Sequence[Sample],
                     logprobs: Sequence[Sequence[float]]) -> LogprobCheck:
    """The trainer's ``logprobs`` (aligned with each sample's tokens, see
    :func:`gateway.client.mismatch.trainer_logprobs`) against the engine's, call by call."""
    tokens = matched = 0
    worst = 0.0
    off: list[str] = []
    for s, mine in zip(samples, logprobs, strict=True):
        for c in s.calls:
            a, b = c.completion_start, c.completion_end
            if b <= a or a == 0:
                continue
            gap = (torch.tensor(mine[a:b]) - torch.tensor(s.logprobs[a:b])).abs()
            tokens, matched = tokens + (b - a), matched + int((gap <= LOGPROB_TOL).sum())
            worst = max(worst, float(gap.max()))
            if float(gap.max()) > LOGPROB_TOL:
                off.append(f"{s.trajectory_id}#{c.seq}")
    return LogprobCheck(tokens, matched, worst, off)
