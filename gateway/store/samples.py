"""Training samples rebuilt from stored prefix deltas, one per branch of a trajectory.

A trajectory's calls form a tree (``gateway.trajectories.branches``): each call is stored
on a branch, as the tokens its prompt adds at ``prompt_offset`` on that branch, and a
branch's first call names the branch it forked from. The calls are replayed in order:
a branch's sample starts as its parent's tokens up to the fork (context: loss mask 0,
since those generated tokens are trained in the parent's sample), then each call appends
its new prompt tokens (loss mask 0) and its completion (loss mask 1, with logprobs). Every
generated token is under loss mask 1 in exactly one sample.

Rows written before branches existed are all on branch 0; a call among them whose
prompt left the sequence (``prompt_offset`` short of its length) cuts the sample back to
it, and is reported as a mismatch, as before.

The data types are the API's own (:mod:`gateway.schema.samples`), so what this builds is
what the routes answer and the trainer client reads.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.schema.samples import CallSpan, Mismatch, Sample
from gateway.store.codec import unpack_floats, unpack_ids
from gateway.store.models import Call, Trajectory, TrajectoryAttempt

__all__ = ["CallSpan", "Mismatch", "Sample", "build_sample", "build_samples", "staleness"]


def _truncate(sample: Sample, length: int) -> None:
    del sample.token_ids[length:], sample.loss_mask[length:], sample.logprobs[length:]
    del sample.weight_versions[length:]
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
    sample.weight_versions += [""] * len(delta)
    mid = len(sample.token_ids)
    sample.token_ids += completion
    sample.loss_mask += [1] * len(completion)
    sample.logprobs += logprobs
    span = CallSpan(call.seq, call.id, start, mid, len(sample.token_ids), call.weight_version,
                    call.backend_id, call.tp, call.weight_segments)
    sample.weight_versions += _span_versions(span)
    sample.calls.append(span)


def _fork(sample: Sample, parent: Sample, position: int) -> None:
    """Start ``sample`` as ``parent``'s first ``position`` tokens, all of them context."""
    sample.token_ids = parent.token_ids[:position]
    sample.loss_mask = [0] * len(sample.token_ids)
    sample.logprobs = parent.logprobs[:position]
    sample.weight_versions = parent.weight_versions[:position]
    sample.fork_position = len(sample.token_ids)


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


BRANCH_CHOICES = ("all", "main", "longest")


def build_samples(trajectory: Trajectory, calls: Sequence[Call], *, attempt: int | None = None,
                  record: TrajectoryAttempt | None = None,
                  current_version: str | None = None, branches: str = "all") -> list[Sample]:
    """The training samples of one attempt of a trajectory (successful calls, in order),
    one per branch; by default its latest attempt. ``record`` gives an older attempt's
    reward. ``branches``: ``all`` (by branch id), ``main`` (the branch of the last call)
    or ``longest`` (the branch with the most generated tokens).

    ``weight_versions`` has one entry per token (``""`` for prompt tokens), split inside a
    call where it ran across a weight update; ``max_staleness`` (over the generated
    tokens) is measured against ``current_version`` (default: the newest version there)."""
    current = trajectory.attempt or 0
    attempt = current if attempt is None else attempt
    if attempt == current:
        reward, meta = trajectory.reward, trajectory.meta
    else:
        reward = record.reward if record is not None else None
        meta = record.meta if record is not None else None
    samples: dict[int, Sample] = {}
    last: Sample | None = None
    for call in sorted(calls, key=lambda c: (c.seq, c.started_at)):
        if call.status != "ok" or (call.attempt or 0) != attempt:
            continue
        branch = call.branch or 0
        last = samples.get(branch)
        if last is None:
            last = samples[branch] = Sample(
                trajectory.id, trajectory.group_id, reward, metadata=meta, attempt=attempt,
                branch=branch, parent_branch=call.parent_branch)
            parent = samples.get(call.parent_branch) if call.parent_branch is not None else None
            if parent is not None:
                _fork(last, parent, call.prompt_offset)
                if call.mismatch_pos is not None:  # drift: the harness's re-rendering
                    last.mismatches.append(Mismatch(call.seq, call.mismatch_pos,
                                                    len(parent.token_ids)))
        _append_call(last, call)
    if not samples:
        return [Sample(trajectory.id, trajectory.group_id, reward, metadata=meta,
                       attempt=attempt)]
    out = [samples[b] for b in sorted(samples)]
    for s in out:
        s.main = s is last
        s.num_branches = len(out)
        s.max_staleness = staleness(
            [v for v, m in zip(s.weight_versions, s.loss_mask, strict=True) if m],
            current_version)
    if branches == "main":
        return [s for s in out if s.main]
    if branches == "longest":
        return [max(out, key=lambda s: (sum(s.loss_mask), s.main))]
    return out


def build_sample(trajectory: Trajectory, calls: Sequence[Call], *, attempt: int | None = None,
                 record: TrajectoryAttempt | None = None,
                 current_version: str | None = None, branch: int | None = None) -> Sample:
    """One branch's sample (default: the main branch, the one of the attempt's last call);
    see :func:`build_samples`."""
    built = build_samples(trajectory, calls, attempt=attempt, record=record,
                          current_version=current_version)
    if branch is None:
        return next(s for s in built if s.main)
    found = next((s for s in built if s.branch == branch), None)
    if found is None:
        raise LookupError(f"no branch {branch} (branches: {[s.branch for s in built]})")
    return found
