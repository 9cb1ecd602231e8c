"""Training samples rebuilt from stored prefix deltas, one per branch of a trajectory.

A trajectory's calls form a tree (``gateway.trajectories.branches``): each call is stored
on a branch, as the tokens its prompt adds at ``prompt_offset`` on that branch, and a
branch's first call names the branch it forked from. The calls are replayed in order:
a branch's sample starts as its parent's tokens up to the fork, then each call appends
its new prompt tokens and its completion (with logprobs).

Which sample trains which generated token (loss mask 1): the *main* sample, the task's
conversation (:func:`_main`: not a title call, a memory subagent or a fallback answer
with its own system prompt, nor a reply the harness dropped or the history before a
compaction), trains every generated token in its sequence, inherited ones included;
every other generated token is trained in the sample of the branch that generated it.
So each generated token is under loss mask 1 in exactly one sample, and the sample a
trainer takes by default is the conversation the harness ended on, trained whole.

Rows written before branches existed are all on branch 0; a call among them whose
prompt left the sequence (``prompt_offset`` short of its length) cuts the sample back to
it, and is reported as a mismatch, as before.

The data types are the API's own (:mod:`gateway.schema.samples`), so what this builds is
what the routes answer and the trainer client reads.
"""

from __future__ import annotations

import io
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from gateway.schema.samples import CallSpan, Mismatch, Sample
from gateway.store.codec import unpack_floats, unpack_ids
from gateway.store.models import Call, Trajectory, TrajectoryAttempt
from gateway.store.routes import to_field

__all__ = ["CallSpan", "Mismatch", "Sample", "build_sample", "build_samples", "has_calls_for",
           "staleness"]


def _truncate_routes(parts: list[tuple[int, np.ndarray]], length: int) -> None:
    parts[:] = [(start, arr[:length - start]) for start, arr in parts if start < length]


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
                    call.backend_id, call.tp, call.weight_segments, call.constrained)
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


def has_calls_for(calls: Sequence[Call], model: str | None) -> bool:
    """Whether a trajectory has samples of ``model`` (a call for it; any, without one)."""
    return model is None or any(c.model == model for c in calls)


BRANCH_CHOICES = ("all", "main", "longest")


@dataclass(slots=True)
class BranchBuild:
    """A sample being built, with what its loss mask is decided from at the end: which
    of its positions the model generated, and which branch appended each; and the routed
    experts its calls recorded, as ``(first position, array)`` parts in call order."""

    sample: Sample
    generated: bytearray = field(default_factory=bytearray)
    origin: array[int] = field(default_factory=lambda: array("i"))
    last_seq: int = -1
    routes: list[tuple[int, np.ndarray]] = field(default_factory=list)
    routes_model: str | None = None


def _fork_from(built: BranchBuild, parent: BranchBuild, position: int) -> None:
    _fork(built.sample, parent.sample, position)
    built.generated = parent.generated[:position]
    built.origin = parent.origin[:position]
    built.routes, built.routes_model = list(parent.routes), parent.routes_model
    _truncate_routes(built.routes, position)


def _call_routes(call: Call) -> np.ndarray | None:
    if call.routes is None or call.routes_start is None:
        return None
    try:
        arr = np.load(io.BytesIO(call.routes), allow_pickle=False)
    except (ValueError, OSError):
        return None
    return arr if arr.ndim == 3 else None


def routes_window(parts: Sequence[tuple[int, np.ndarray]], start: int, stop: int
                  ) -> np.ndarray | None:
    """Positions ``start .. stop`` of a sample's routed experts (:func:`routes_field`),
    laid from its calls' parts: ``(stop - start, layers, top_k)`` int16, -1 where none is
    known; None without parts of one router shape. Only the window is built."""
    shapes = {arr.shape[1:] for _, arr in parts if len(arr)}
    if len(shapes) != 1:  # none, or calls of routers of other shapes: not one model's
        return None
    layers, top_k = shapes.pop()
    out = np.full((max(0, stop - start), layers, top_k), -1, dtype=np.int16)
    for first, arr in reversed(parts):  # the earlier call's route is laid last: it stays
        lo, hi = max(start, first), min(stop, first + len(arr))
        if hi > lo:
            out[lo - start:hi - start] = arr[lo - first:hi - first]
    return out


def routes_field(parts: Sequence[tuple[int, np.ndarray]], length: int) -> str | None:
    """A sample's ``routed_experts`` (:class:`Sample`): the parts laid on its positions,
    an earlier call's route kept where a later one recomputed the position (the route
    the token was generated or first read under)."""
    arr = routes_window(parts, 0, length)
    return None if arr is None else to_field(arr)


def _add_call(built: BranchBuild, call: Call, trains: bool = True, routes: bool = True
              ) -> None:
    """Append ``call``; its completion is generated (trainable) unless ``trains`` is
    False (another model's tokens, in a per-model sample: context)."""
    if call.prompt_offset < len(built.sample.token_ids):  # a legacy cut (``_truncate``)
        del built.generated[call.prompt_offset:], built.origin[call.prompt_offset:]
        _truncate_routes(built.routes, call.prompt_offset)
    _append_call(built.sample, call)
    found = _call_routes(call) if trains and routes else None  # another policy routes
    if found is not None:  # otherwise
        assert call.routes_start is not None
        if built.routes_model != call.model:  # one model's routes per sample
            built.routes, built.routes_model = [], call.model
        built.routes.append((call.routes_start, found))
    span = built.sample.calls[-1]
    built.generated += bytes(span.completion_start - len(built.generated))  # its prompt
    built.generated += (b"\x01" if trains else b"\x00") * (span.completion_end
                                                          - span.completion_start)
    built.origin.extend([built.sample.branch] * (span.completion_end - len(built.origin)))
    built.last_seq = call.seq


#: a branch sharing at most this many tokens with the branch it forked from started a
#: conversation of its own (a chat template's first header is a few tokens: a title call,
#: a subagent with its own system prompt); one sharing more goes on with the same one
#: (a restart from a summary under the same system prompt, a reply the harness dropped)
OWN_CONVERSATION_MAX_SHARED = 16


def _main(branches: Sequence[BranchBuild]) -> BranchBuild:
    """The task's conversation. Branches that go on with one conversation (each forked
    past the first few tokens of its parent) form a family; the family with the most
    calls is the task's, and its main branch is the one of its latest call: where the
    harness went on after a compaction, or after a reply it dropped. A title call, a
    memory subagent or a fallback answer with its own system prompt is a family of its
    own, so it is not main however late it comes. Between families of as many calls (a
    task answered in one call beside a one-call title or memory call), the one with the
    longest sequence is the task's: it carries the harness's tools and the task's
    history, where a side call carries a short instruction of its own (opencode's title
    call: 637 tokens against the task's 8.3k; Qwen Code's memory call 11.7k against
    15.6k). Generated tokens would pick whichever side call happened to ramble."""
    root: dict[int, int] = {}
    for b in branches:  # by branch id: a parent is always before its child
        parent, fork = b.sample.parent_branch, b.sample.fork_position
        joins = parent in root and fork > OWN_CONVERSATION_MAX_SHARED
        root[b.sample.branch] = root[parent] if joins and parent is not None \
            else b.sample.branch
    families: dict[int, list[BranchBuild]] = {}
    for b in branches:
        families.setdefault(root[b.sample.branch], []).append(b)

    def weight(family: list[BranchBuild]) -> tuple[int, int, int, int]:
        calls = sum(len(b.sample.calls) for b in family)
        return (calls, max(len(b.sample.token_ids) for b in family),
                sum(sum(b.generated) for b in family), max(b.last_seq for b in family))

    task = max(families.values(), key=weight)
    return max(task, key=lambda b: b.last_seq)


def _own(branches: Sequence[BranchBuild], main: BranchBuild) -> None:
    """Set each sample's loss mask so that every generated token is trained exactly once
    over the samples, and the main sample trains every generated token in its sequence.

    A generated token is known by the branch that appended it and its position (a fork
    shares its parent's positions). The main sample owns those in its sequence; any other
    is owned by the branch that generated it, and is context (loss mask 0) elsewhere."""
    in_main = {(main.origin[p], p) for p in range(len(main.generated)) if main.generated[p]}
    for b in branches:
        if b is main:
            b.sample.loss_mask = list(b.generated)
            continue
        mine = b.sample.branch
        b.sample.loss_mask = [
            1 if g and b.origin[p] == mine and (mine, p) not in in_main else 0
            for p, g in enumerate(b.generated)]


def build_branches(trajectory: Trajectory, calls: Sequence[Call], *,
                   attempt: int | None = None, record: TrajectoryAttempt | None = None,
                   model: str | None = None, routes: bool = True, encode: bool = True
                   ) -> tuple[list[BranchBuild], BranchBuild | None]:
    """Every branch of one attempt (successful calls, in order; by default the latest
    attempt), built with its loss mask decided (:func:`_own`), by branch id; and the main
    one (None without a successful call). ``record`` gives an older attempt's reward.

    ``model``: one policy's samples (a trajectory may call several: a solver and a
    verifier). Only the branches with a call for ``model`` are built into samples, each
    in full (a fork keeps the tokens it shares with another model's branch), and only
    ``model``'s generated tokens are trained; the main one is ``model``'s conversation the
    trajectory ended on, and the reward is ``model``'s own where the trainer gave one
    (``rewards``), else the trajectory's. ``routes``: False leaves routed experts out
    (who only needs the tokens); ``encode``: False leaves them as each branch's parts
    (``BranchBuild.routes``, for :func:`routes_window`), not encoded in its sample."""
    current = trajectory.attempt or 0
    attempt = current if attempt is None else attempt
    if attempt == current:
        reward, meta, rewards = trajectory.reward, trajectory.meta, trajectory.rewards
    else:
        reward = record.reward if record is not None else None
        meta = record.meta if record is not None else None
        rewards = record.rewards if record is not None else None
    if model is not None and rewards and model in rewards:  # the policy's own
        reward = rewards[model]
    built: dict[int, BranchBuild] = {}
    mine: set[int] = set()  # the branches with a call for ``model`` (any, without one)
    for call in sorted(calls, key=lambda c: (c.seq, c.started_at)):
        if call.status != "ok" or (call.attempt or 0) != attempt:
            continue
        branch = call.branch or 0
        this = built.get(branch)
        if this is None:
            this = built[branch] = BranchBuild(Sample(
                trajectory.id, trajectory.group_id, reward, metadata=meta, attempt=attempt,
                branch=branch, parent_branch=call.parent_branch))
            parent = built.get(call.parent_branch) if call.parent_branch is not None else None
            if parent is not None:
                _fork_from(this, parent, call.prompt_offset)
                if call.mismatch_pos is not None:  # drift: the harness's re-rendering
                    this.sample.mismatches.append(Mismatch(call.seq, call.mismatch_pos,
                                                           len(parent.sample.token_ids)))
        _add_call(this, call, model is None or call.model == model, routes)
        if model is None or call.model == model:
            mine.add(branch)
    if not mine:
        return [BranchBuild(Sample(trajectory.id, trajectory.group_id, reward,
                                   metadata=meta, attempt=attempt))], None
    ordered = [built[b] for b in sorted(built) if b in mine]
    main = _main(ordered)
    _own(ordered, main)
    for b in ordered:
        b.sample.main = b is main
        b.sample.num_branches = len(ordered)
        if b.routes and encode:
            b.sample.routed_experts = routes_field(b.routes, len(b.sample.token_ids))
    return ordered, main


def build_samples(trajectory: Trajectory, calls: Sequence[Call], *, attempt: int | None = None,
                  record: TrajectoryAttempt | None = None,
                  current_version: str | None = None, branches: str = "all",
                  model: str | None = None, routes: bool = True) -> list[Sample]:
    """The training samples of one attempt of a trajectory, one per branch
    (:func:`build_branches`). ``branches``: ``all`` (by branch id; every generated token
    trained in exactly one), ``main`` (the task's conversation, :func:`_main`, trained
    whole) or ``longest`` (the sample training the most generated tokens).

    ``weight_versions`` has one entry per token (``""`` for prompt tokens), split inside a
    call where it ran across a weight update; ``max_staleness`` (over the generated
    tokens) is measured against ``current_version`` (default: the newest version there).
    ``model``: one policy's samples (:func:`build_branches`)."""
    ordered, main = build_branches(trajectory, calls, attempt=attempt, record=record,
                                   model=model, routes=routes)
    out = [b.sample for b in ordered]
    for s in out:
        s.max_staleness = staleness(
            [v for v, m in zip(s.weight_versions, s.loss_mask, strict=True) if m],
            current_version)
    if branches == "main" and main is not None:
        return [main.sample]
    if branches == "longest":
        return [max(out, key=lambda s: (sum(s.loss_mask), s.main))]
    return out


def build_sample(trajectory: Trajectory, calls: Sequence[Call], *, attempt: int | None = None,
                 record: TrajectoryAttempt | None = None,
                 current_version: str | None = None, branch: int | None = None) -> Sample:
    """One branch's sample (default: the main branch, the task's conversation trained
    whole); see :func:`build_samples`."""
    built = build_samples(trajectory, calls, attempt=attempt, record=record,
                          current_version=current_version)
    if branch is None:
        return next(s for s in built if s.main)
    found = next((s for s in built if s.branch == branch), None)
    if found is None:
        raise LookupError(f"no branch {branch} (branches: {[s.branch for s in built]})")
    return found
