"""Training samples rebuilt from stored prefix deltas.

A trajectory's token sequence is replayed call by call: truncate to the call's
``prompt_offset`` (equal to the current length unless the prompt diverged), append its
new prompt tokens (loss mask 0) and its completion (loss mask 1, with logprobs). What a
mismatch cut away does not appear in the sample, and the mismatch is reported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.store.codec import unpack_floats, unpack_ids
from gateway.store.models import Call, Trajectory, TrajectoryAttempt


@dataclass(slots=True)
class CallSpan:
    seq: int
    call_id: str
    prompt_start: int
    completion_start: int
    completion_end: int
    weight_version: str
    backend_id: str | None
    tp: int | None
    #: [[start, end, version], ...] relative to the call's completion, when the call ran
    #: across a weight update (``weight_version`` is then the first segment's).
    weight_segments: list[list[Any]] | None = None


@dataclass(slots=True)
class Mismatch:
    seq: int
    position: int
    previous_length: int


@dataclass(slots=True)
class Sample:
    trajectory_id: str
    group_id: str | None
    reward: float | None
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[str] = field(default_factory=list)
    calls: list[CallSpan] = field(default_factory=list)
    mismatches: list[Mismatch] = field(default_factory=list)
    metadata: dict[str, Any] | None = None
    attempt: int = 0
    #: Versions behind ``current`` of the oldest completion token (numeric versions
    #: only; None when a version is not an integer or there is no completion).
    max_staleness: int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return self.calls[0].completion_start if self.calls else len(self.token_ids)


def _truncate(sample: Sample, length: int) -> None:
    del sample.token_ids[length:], sample.loss_mask[length:], sample.logprobs[length:]
    kept = []
    for span in sample.calls:
        if span.prompt_start < length or (span.prompt_start == length == 0):
            span.completion_start = min(span.completion_start, length)
            span.completion_end = min(span.completion_end, length)
            kept.append(span)
    sample.calls = kept


def _append_call(sample: Sample, call: Call) -> None:
    previous = len(sample.token_ids)
    if call.prompt_offset < previous:
        sample.mismatches.append(Mismatch(call.seq, call.prompt_offset, previous))
        _truncate(sample, call.prompt_offset)
    delta = unpack_ids(call.prompt_delta)
    completion = unpack_ids(call.completion_ids)
    logprobs = unpack_floats(call.completion_logprobs) or [0.0] * len(completion)
    start = len(sample.token_ids)
    sample.token_ids += delta
    sample.loss_mask += [0] * len(delta)
    sample.logprobs += [0.0] * len(delta)
    mid = len(sample.token_ids)
    sample.token_ids += completion
    sample.loss_mask += [1] * len(completion)
    sample.logprobs += logprobs
    sample.calls.append(CallSpan(call.seq, call.id, start, mid, len(sample.token_ids),
                                 call.weight_version, call.backend_id, call.tp,
                                 call.weight_segments))


def _span_versions(span: CallSpan) -> list[str]:
    n = span.completion_end - span.completion_start
    out = [span.weight_version] * n
    for start, end, version in span.weight_segments or ():
        out[start:min(end, n)] = [version] * max(0, min(end, n) - start)
    return out


def staleness(versions: Sequence[str], current: str | None) -> int | None:
    """How many versions behind ``current`` (default: the newest here) the oldest is."""
    used = {v for v in versions if v}
    if not used:
        return None
    try:
        numbers = [int(v) for v in used]
        newest = int(current) if current is not None else max(numbers)
    except ValueError:
        return None
    return max(0, newest - min(numbers))


def build_sample(trajectory: Trajectory, calls: Sequence[Call], *, attempt: int | None = None,
                 record: TrajectoryAttempt | None = None,
                 current_version: str | None = None) -> Sample:
    """The single training sequence of one attempt of a trajectory (successful calls, in
    order); by default its latest attempt. ``record`` gives an older attempt's reward.

    ``weight_versions`` has one entry per token (``""`` for prompt tokens), split inside a
    call where it ran across a weight update; ``max_staleness`` is measured against
    ``current_version`` (default: the newest version in the sample)."""
    current = trajectory.attempt or 0
    attempt = current if attempt is None else attempt
    if attempt == current:
        reward, meta = trajectory.reward, trajectory.meta
    else:
        reward = record.reward if record is not None else None
        meta = record.meta if record is not None else None
    sample = Sample(trajectory.id, trajectory.group_id, reward, metadata=meta,
                    attempt=attempt)
    for call in sorted(calls, key=lambda c: (c.seq, c.started_at)):
        if call.status == "ok" and (call.attempt or 0) == attempt:
            _append_call(sample, call)
    versions: list[str] = []
    for span in sample.calls:
        versions += [""] * (span.completion_start - len(versions))
        versions += _span_versions(span)
    sample.weight_versions = versions
    sample.max_staleness = staleness(versions, current_version)
    return sample
