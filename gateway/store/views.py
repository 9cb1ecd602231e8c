"""A trajectory laid out for the viewer (:mod:`gateway.schema.views`), from its stored calls.

The samples are built as the trainer gets them (:func:`gateway.store.samples.build_branches`),
so what the viewer shows trained is what trains. On top of them:

- **Why a branch opened**, told from where it forks from its parent (its first call's
  prompt left the parent's tokens there) and which call's prompt or reply holds that
  position: within the first ``OWN_CONVERSATION_MAX_SHARED`` tokens, the chat template's first
  header, it is a conversation of its own (*changed system prompt*); where one of the
  parent's calls began to generate, or within the ``GENERATION_PROMPT`` tokens before
  that open the model's turn, that call's reply was left out and its prompt sent again,
  perhaps with a message more (*dropped turn*: a reply the harness rejected, a
  regenerated turn); inside a reply,
  the harness kept only its start (*edited turn*); inside a prompt, earlier messages
  changed (*edited history*: a compaction, a truncation, an edited message). A branch
  that is not the task's conversation and either has a system prompt of its own or ran at
  most ``SIDE_CALLS`` calls while another branch went on after it is a *side call* (a
  title, a memory extraction, a subagent, a fallback answer); the branches the task's
  conversation goes on from never are.
- **Where the time went**: each call's queue and LLM time and the gap since the
  trajectory's previous call ended (its tool call and the harness's own work).
- **Token in**: the turns the harness re-rendered, which a later call ran from the record
  (``kept_len``): the previous call's reply on the same branch.

Pure: no I/O.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from itertools import pairwise

from gateway.schema.samples import CallSpan, Sample
from gateway.schema.views import (
    BranchKind,
    GroupMember,
    GroupView,
    ViewBranch,
    ViewCall,
    ViewTokens,
)
from gateway.store.models import Call, Trajectory
from gateway.store.samples import (
    OWN_CONVERSATION_MAX_SHARED,
    BranchBuild,
    build_branches,
    staleness,
)

#: a branch that is not the task's and ran at most this many calls while another branch
#: went on after it is a side call
SIDE_CALLS = 2
#: tokens a chat template opens the model's turn with (ChatML: ``<|im_start|>``,
#: ``assistant``, a newline): a fork within them left that turn out
GENERATION_PROMPT = 8
#: logprobs are sent rounded: the viewer draws a heat scale, the samples keep float32
LOGPROB_DIGITS = 4


def view_calls(calls: Sequence[Call], *, text: bool) -> list[ViewCall]:
    """One attempt's calls in order, each with its share of time; text only if ``text``."""
    out: list[ViewCall] = []
    ended: float | None = None  # when the latest call before this one ended
    for c in sorted(calls, key=lambda c: (c.seq, c.started_at)):
        start = c.started_at.timestamp()
        gap = None if ended is None or start < ended else (start - ended) * 1000
        ended = max(ended or start, start + c.total_ms / 1000)
        extra = {"messages": c.request_messages, "completion_text": c.completion_text} \
            if text else {}
        out.append(ViewCall(
            seq=c.seq, id=c.id, branch=c.branch or 0, parent_branch=c.parent_branch,
            model=c.model, requested_model=c.requested_model, endpoint=c.endpoint,
            status=c.status, error=c.error, finish_reason=c.finish_reason,
            backend_id=c.backend_id, tp=c.tp, weight_version=c.weight_version,
            weight_segments=c.weight_segments, started_at=start, queued_ms=c.queued_ms,
            llm_ms=max(0.0, c.total_ms - c.queued_ms), ttft_ms=c.ttft_ms,
            total_ms=c.total_ms, tool_gap_ms=gap, prompt_len=c.prompt_len,
            completion_len=len(c.completion_ids or b"") // 4, kept_len=c.kept_len,
            mismatch_pos=c.mismatch_pos, constrained=c.constrained, **extra))
    return out


def _span_at(position: int, branch: Sample, by_id: dict[int, BranchBuild]
             ) -> CallSpan | None:
    """The call whose prompt or reply holds ``position`` of ``branch``'s sequence: one of
    its own calls, or past its fork one of the branch it shares that position with."""
    while True:
        if position >= branch.fork_position or branch.parent_branch not in by_id:
            return next((c for c in branch.calls
                         if c.prompt_start <= position < c.completion_end), None)
        branch = by_id[branch.parent_branch].sample


def _fork_reason(sample: Sample, parent: Sample, by_id: dict[int, BranchBuild]
                 ) -> tuple[BranchKind, str]:
    """What the parent holds where ``sample`` forks from it (module docstring)."""
    f, p = sample.fork_position, parent.branch
    if f <= OWN_CONVERSATION_MAX_SHARED:
        return "changed system prompt", (
            f"shares only its first {f} tokens with branch {p}: a conversation of its own "
            "(another system prompt)")
    span = _span_at(f, parent, by_id)
    if span is None:
        return "edited history", (
            f"holds all {f} tokens of branch {p} but not its messages (the harness re-sent "
            "them otherwise)")
    n = span.completion_end - span.completion_start
    if span.completion_start - GENERATION_PROMPT <= f <= span.completion_start:
        return "dropped turn", (
            f"sends call #{span.seq}'s prompt again without its reply ({n} tokens), at "
            f"position {f} of branch {p}")
    if f > span.completion_start:
        return "edited turn", (
            f"keeps {f - span.completion_start} of the {n} tokens call #{span.seq} "
            f"generated, then differs (position {f} of branch {p})")
    return "edited history", (
        f"differs from branch {p} at position {f}, in call #{span.seq}'s prompt: earlier "
        "messages changed (a compaction, a truncation, an edited message)")


def _main_line(main: BranchBuild, by_id: dict[int, BranchBuild]) -> set[int]:
    """The main branch and the branches it goes on from (each fork past the first few
    tokens: one conversation, not a side call's own)."""
    line, s = {main.sample.branch}, main.sample
    while s.parent_branch in by_id and s.fork_position > OWN_CONVERSATION_MAX_SHARED:
        s = by_id[s.parent_branch].sample
        line.add(s.branch)
    return line


def _opening(b: BranchBuild, by_id: dict[int, BranchBuild], main: BranchBuild,
             line: set[int], last_seq: int) -> tuple[BranchKind, str]:
    s = b.sample
    parent = by_id.get(s.parent_branch) if s.parent_branch is not None else None
    kind: BranchKind
    if parent is None:
        kind, reason = "first call", "the attempt's first call opened it"
        if s.parent_branch is not None:  # forked from a branch of another policy
            reason = f"forked from branch {s.parent_branch}, which is not shown"
    else:
        kind, reason = _fork_reason(s, parent.sample, by_id)
    if s.branch not in line and (kind == "changed system prompt"
                                 or (len(s.calls) <= SIDE_CALLS and b.last_seq < last_seq)):
        return "side call", (f"a side call beside branch {main.sample.branch}, the task's "
                             f"conversation: {reason}")
    return kind, reason


def view_branches(ordered: Sequence[BranchBuild], main: BranchBuild,
                  current_version: str | None) -> list[ViewBranch]:
    """The attempt's branches, each with why it opened (module docstring)."""
    by_id = {b.sample.branch: b for b in ordered}
    line = _main_line(main, by_id)
    last_seq = max(b.last_seq for b in ordered)
    out = []
    for b in ordered:
        s = b.sample
        kind, reason = _opening(b, by_id, main, line, last_seq)
        trained = [v for v, m in zip(s.weight_versions, s.loss_mask, strict=True) if m]
        out.append(ViewBranch(
            branch=s.branch, parent_branch=s.parent_branch, fork_position=s.fork_position,
            opened_by=s.calls[0].seq if s.calls else None, kind=kind, reason=reason,
            main=b is main, calls=[c.seq for c in s.calls], length=len(s.token_ids),
            trained=sum(s.loss_mask), max_staleness=staleness(trained, current_version)))
    return out


def _version_runs(s: Sample, generated: bytearray) -> list[tuple[int, int, str]]:
    runs: list[tuple[int, int, str]] = []
    for p, (g, v) in enumerate(zip(generated, s.weight_versions, strict=True)):
        if not g:
            continue
        if runs and runs[-1][1] == p and runs[-1][2] == v:
            runs[-1] = (runs[-1][0], p + 1, v)
        else:
            runs.append((p, p + 1, v))
    return runs


def _token_in(spans: Sequence[CallSpan], kept: dict[str, int | None]
              ) -> list[tuple[int, int, int]]:
    """The replies later calls ran from the record: call ``i``'s ``kept_len`` covers the
    previous call's reply on the path, which the harness had re-rendered."""
    out = []
    for prev, span in pairwise(spans):
        k = kept.get(span.call_id)
        if k is not None and k > prev.completion_start:
            out.append((prev.completion_start, min(k, prev.completion_end), span.seq))
    return out


def view_tokens(b: BranchBuild, main: BranchBuild, calls: Sequence[Call],
                model: str | None = None) -> ViewTokens:
    """One branch's sample for reading: mask, logprobs of what was generated, version runs,
    call spans, token-in spans, mismatches, and whether routed experts were recorded (the
    branches may be built without them: they are fetched by window; with ``model``,
    that model's)."""
    s = b.sample
    kept = {c.id: c.kept_len for c in calls}
    # a call holds routes iff it holds their start (the routes themselves may be unread);
    # a per-model sample has only its model's
    routed = {c.id for c in calls if c.routes_start is not None
              and (model is None or c.model == model)}
    logprobs: list[float | None] = [
        round(lp, LOGPROB_DIGITS) if g else None
        for g, lp in zip(b.generated, s.logprobs, strict=True)]
    return ViewTokens(
        branch=s.branch, main=b is main, token_ids=s.token_ids, loss_mask=s.loss_mask,
        logprobs=logprobs, versions=_version_runs(s, b.generated),
        calls=[(c.seq, c.prompt_start, c.completion_start, c.completion_end)
               for c in s.calls],
        token_in=_token_in(s.calls, kept),
        mismatches=[(m.seq, m.position) for m in s.mismatches],
        has_routes=any(c.call_id in routed for c in s.calls))


def _member(trajectory: Trajectory, calls: Sequence[Call], current: str,
            model: str | None, phase: str | None) -> GroupMember:
    attempt = trajectory.attempt or 0
    ordered, main = build_branches(trajectory, calls, attempt=attempt, model=model,
                                   routes=False)
    s = main.sample if main is not None else None
    gen = [v for v, g in zip(s.weight_versions, main.generated, strict=True) if g] \
        if s is not None and main is not None else []
    trained = [v for v, m in zip(s.weight_versions, s.loss_mask, strict=True) if m] \
        if s is not None else []
    mine = [c for c in calls if c.status == "ok" and (c.attempt or 0) == attempt
            and (model is None or c.model == model)]
    reward = trajectory.reward
    if model is not None and trajectory.rewards and model in trajectory.rewards:
        reward = trajectory.rewards[model]  # the policy's own
    return GroupMember(
        id=trajectory.id, attempt=attempt, finished=trajectory.finished_at is not None,
        reward=reward, advantage=None, advantage_unscaled=None,
        calls=len(mine), branches=len(ordered) if main is not None else 0,
        length=len(s.token_ids) if s is not None else 0,
        trained=sum(s.loss_mask) if s is not None else 0,
        generated=sum(len(c.completion_ids or b"") // 4 for c in mine),  # int32 ids
        max_staleness=staleness(trained, current),
        versions=sorted(set(gen), key=lambda v: (not v.isdigit(), int(v) if v.isdigit()
                                                 else 0, v)),
        phase=phase)


def group_view(group_id: str, rows: Sequence[tuple[Trajectory, Sequence[Call]]], *,
               current_version: str, model: str | None,
               phases: dict[str, str]) -> GroupView:
    """A group's trajectories side by side, each with the advantage GRPO would give it:
    (reward - mean) / (std + 1e-4), the mean and the population std over the finished
    ones with a reward, one reward each (``gateway.client.advantages``, which the
    ``StepRunner`` loops and TRL's ``AsyncGRPOTrainer`` through the gateway train with),
    and the unscaled reward - mean."""
    members = [_member(t, c, current_version, model, phases.get(t.id)) for t, c in rows]
    rewards = [m.reward for m in members if m.finished and m.reward is not None]
    mean = statistics.fmean(rewards) if rewards else None
    std = statistics.pstdev(rewards) if rewards else None
    for m in members:
        if mean is not None and std is not None and m.finished and m.reward is not None:
            m.advantage_unscaled = m.reward - mean
            m.advantage = (m.reward - mean) / (std + 1e-4)
    return GroupView(group_id=group_id, current_version=current_version, reward_mean=mean,
                     reward_std=std, members=members)
