"""A call's context on every relay path, and the record it leaves behind."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.adapters import Adapter
from gateway.dispatch.dispatcher import Lease
from gateway.errors import GatewayError
from gateway.policies.base import CallView
from gateway.proxy.bodies import stored_chars
from gateway.proxy.capture import Capture
from gateway.proxy.doors import Translation
from gateway.runtime import Runtime
from gateway.store.records import CallRecord
from gateway.store.routes import coverage
from gateway.trajectories.branches import Continuation, words
from gateway.trajectories.state import TrajectoryState, TurnFacts
from gateway.trajectories.tools import after_last_assistant


@dataclass(slots=True)
class CallContext:
    id: str
    endpoint: str
    state: TrajectoryState
    body: dict[str, Any]
    seq: int  # provisional until the call is recorded (Tracker.record_seq)
    stream: bool
    arrived: float
    started_wall: float
    capture: Capture
    headers: dict[str, str]
    lease: Lease | None = None
    weight_version: str = ""
    dispatched_at: float | None = None
    # its backend's decode clock (seconds, tokens) when it was dispatched
    decode_mark: tuple[float, float] | None = None
    first_byte: float | None = None
    retries: int = 0
    door: Translation | None = None  # a front door answering in its own wire format
    #: (first completion token, weight version) for each continuation after an abort.
    segments: list[tuple[int, str]] = field(default_factory=list)
    #: the boundary a resume recorded at the tokens received by then; an abort's end that
    #: arrives after it (the engine's exact count) replaces it
    resume_mark: tuple[int, str] | None = None
    continuations: int = 0
    #: the request's messages as digests, and the branch they continue (if any)
    digests: tuple[bytes, ...] = ()
    continues: Continuation | None = None
    #: prompt tokens the engine runs from the record (token in), when it does
    kept_len: int | None = None
    requested_model: str | None = None  # the client's model name, when an alias mapped it
    #: the model the call is for, after aliases: a served model or a LoRA family of one
    #: (:mod:`gateway.adapters`); its record names it, its weight version is this one's
    model: str = ""
    #: the served model its engines run (a LoRA family's base; else ``model``), even
    #: while they are asked for an adapter (``body["model"]``)
    served: str = ""
    constrained: str | None = None  # gateway/proxy/constraints.py
    size: int = 0  # the request's bytes as received
    #: when its last token arrived, where the call went on after it (a stream's routes
    #: request, gateway/proxy/routes.py): its LLM time ends there
    generated_at: float | None = None

    def view(self) -> CallView:
        st = self.state
        return CallView(st.id, self.seq, st.context_tokens)

    def bind(self, lease: Lease, weight_version: str, adapter: Adapter | None = None
             ) -> None:
        """Dispatched to ``lease``: stamped with the weight label its engine reported
        (``weight_version``, its model's, when the engine reports none), or run on
        ``adapter`` (its model's current LoRA adapter) and stamped with its version;
        the engine names the request after the call, so it can be aborted alone."""
        self.lease = lease
        if adapter is not None:
            self.body["model"] = adapter.name
            self.weight_version = adapter.version
        else:
            self.body["model"] = self.served or self.body["model"]
            self.weight_version = lease.backend.weight_version or weight_version
        self.dispatched_at = time.monotonic()
        self.decode_mark = lease.backend.decode_clock
        self.body["request_id"] = self.id
        if lease.priority is not None:
            self.body["priority"] = lease.priority

    def mark_version(self, version: str) -> None:
        """Tokens from the ones received so far on come from ``version`` (a stream its
        engine kept in place over a weight update, marked as the engine resumes)."""
        if self.resume_mark is not None:
            self.segments.append(self.resume_mark)
        self.resume_mark = (len(self.capture.completion(0).token_ids), version)

    def version_starts(self) -> list[tuple[int, str]]:
        """Every recorded boundary: continuations' and the last resume's."""
        return [*self.segments, *([self.resume_mark] if self.resume_mark else [])]

    def payload(self) -> bytes:
        return orjson.dumps(self.body)


def _status(error: BaseException | None) -> str:
    if error is None:
        return "ok"
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        return "cancelled"
    return "error"


def _measure(rt: Runtime, ctx: CallContext, llm_s: float, tokens: int, running: int) -> None:
    """Report the call's decode speed to the scheduler's :class:`SpeedMeter`: from the
    first byte on for a stream; else, on an engine that keeps a decode clock, the engine's
    mean time per token from the call's dispatch to the scrape after it (or the latest,
    where one came between); else the whole call less the profile's prefill estimate, which
    on an engine unlike the profile leaves its prefill and queueing in. One engine's calls
    that are not streamed are timed one way: a call timed whole also holds the host's time
    per call (HTTP, the gateway), which a pool run compressed multiplies (at 20x a TP1
    measured 4.7x the profile, and mixed with engine-timed calls replay once chose a slow
    TP2: docs/policies.md), so a call waits for the scrape that says which way."""
    assert ctx.lease is not None
    backend = ctx.lease.backend
    tp = backend.tp or 1
    prompt = len(ctx.capture.prompt_ids or ())
    meter = rt.dispatcher.scheduler.meter
    if ctx.stream and ctx.first_byte is not None and ctx.dispatched_at is not None:
        meter.observe(tp, llm_s - (ctx.first_byte - ctx.dispatched_at), tokens - 1, running,
                      prompt + tokens - 1)  # the first token came with the prefill
        return

    def report(step_s: float | None) -> None:
        if step_s is not None:
            meter.observe_engine(tp, step_s, running, prompt + tokens)
        elif backend.decode_clock is None:  # its engine keeps no clock: the call, whole
            prior = meter.prior.get(tp)
            decode_s = llm_s - (prompt * prior.prefill_s_per_token / meter.time_scale
                                if prior is not None else 0.0)
            meter.observe(tp, decode_s, tokens, running, prompt + tokens)

    backend.time_decode(ctx.decode_mark, report)


def record_call(rt: Runtime, ctx: CallContext, *, error: BaseException | None,
                backend_ok: bool | None) -> None:
    """A dispatched call ended: release its backend, place it in its trajectory, tell the
    policy, hand the record to the writer. Only :meth:`gateway.proxy.lifecycle.Call.end` calls
    it, once per call."""
    assert ctx.lease is not None
    rt.live_calls.remove(ctx.id)
    status = _status(error)
    running = ctx.lease.backend.in_flight  # this call included, before it is released
    ctx.lease.release(ok=status != "error" if backend_ok is None else backend_ok)
    ended = time.monotonic()
    now = ctx.generated_at or ended  # the LLM's part ends at its last token
    dispatched = ctx.dispatched_at or now
    cap = ctx.capture.completion(0)
    placed = rt.tracker.call_finished(
        ctx.state, now=time.time(), llm_s=now - dispatched,
        prompt=ctx.capture.prompt_ids if status == "ok" else None,
        completion=cap.token_ids, ok=status == "ok", turn=_turn_facts(ctx),
    )
    rt.dispatcher.scheduler.call_completed(ctx.state, ok=status == "ok")
    if status == "ok" and not ctx.continuations:  # one that spanned a pause says nothing
        _measure(rt, ctx, now - dispatched, len(cap.token_ids), running)  # of a speed
    ctx.seq = rt.tracker.record_seq(ctx.state)  # in placement order, gap-free
    rec = CallRecord(
        id=ctx.id, trajectory_id=ctx.state.id, group_id=ctx.state.group_id, seq=ctx.seq,
        attempt=ctx.state.attempt,
        endpoint=ctx.endpoint, model=ctx.model or str(ctx.body.get("model")),
        weight_version=_fit(ctx.weight_version, "weight_version"), started_at=ctx.started_wall,
        backend_id=_fit(ctx.lease.backend.id, "backend_id"),
        backend_url=_fit(ctx.lease.backend.url, "backend_url"),
        tp=ctx.lease.backend.tp or 1, status=status,
        finish_reason=cap.finish_reason and _fit(cap.finish_reason, "finish_reason"),
        error=_describe(error), queued_ms=(dispatched - ctx.arrived) * 1000,
        ttft_ms=(ctx.first_byte - dispatched) * 1000 if ctx.first_byte and ctx.stream else None,
        total_ms=(ended - ctx.arrived) * 1000,
        prompt_len=len(ctx.capture.prompt_ids or ()),
        completion_ids=cap.token_ids,
        completion_logprobs=cap.logprobs if len(cap.logprobs) == len(cap.token_ids) else None,
        prompt_tokens=_usage(ctx.capture.usage, "prompt_tokens"),
        completion_tokens=_usage(ctx.capture.usage, "completion_tokens"),
    )
    rec.weight_segments = weight_segments(ctx.weight_version, ctx.version_starts(),
                                          len(cap.token_ids))
    if placed is not None:
        rec.prompt_offset, rec.prompt_delta, rec.mismatch_pos = (
            placed.offset, placed.delta, placed.mismatch_pos)
        rec.branch, rec.parent_branch = placed.branch, placed.parent
    rec.kept_len, rec.requested_model = ctx.kept_len, ctx.requested_model
    rec.constrained = ctx.constrained
    rec.routes = cap.routes or None
    if cap.routes:
        ctx.lease.backend.returns_routes = True
    _attach_text(rt, ctx, rec)
    rt.writer.submit(rec)
    _observe(rt, ctx, rec)


def _turn_facts(ctx: CallContext) -> TurnFacts:
    """What placing the call in its trajectory's tree needs from the request side."""
    cap = ctx.capture.completion(0)
    calls = [(c["function"]["name"], c["function"]["arguments"])
             for c in cap.tool_calls.values()]
    # a branch the request continued with the model's turn whole: leaving its tokens is
    # drift; an edited or dropped turn is a real change of history (a branch, no mismatch)
    cont = ctx.continues
    return TurnFacts(expected=cont.branch if cont and cont.echo_complete else None,
                     digests=ctx.digests, said=words("".join(cap.text), calls),
                     routes=coverage(cap.routes) if cap.routes else None,
                     model=ctx.model or ctx.served)


def weight_segments(first: str, later: list[tuple[int, str]], total: int
                    ) -> list[list[Any]] | None:
    """``[[start, end, version], ...]`` over ``total`` completion tokens; None if the
    version at dispatch produced them all."""
    if not later:
        return None
    starts = [(0, first), *sorted(later, key=lambda s: s[0])]
    out: list[list[Any]] = []
    for i, (start, version) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else total
        if end <= start:
            continue
        if out and out[-1][2] == version:
            out[-1][1] = end
        else:
            out.append([start, end, version])
    return out if any(seg[2] != first for seg in out) else None


def _attach_text(rt: Runtime, ctx: CallContext, rec: CallRecord) -> None:
    if len(ctx.capture.choices) > 1:
        rec.extra_choices = [
            {"index": i, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
             "text": "".join(c.text),
             "logprobs": c.logprobs if len(c.logprobs) == len(c.token_ids) else None}
            for i, c in sorted(ctx.capture.choices.items()) if i != 0
        ]
    if not rt.settings.traces.store_text:
        return
    cap = ctx.capture.completion(0)
    rec.completion_text = "".join(cap.text)
    msgs = ctx.body.get("messages")
    if isinstance(msgs, list):
        start = after_last_assistant(msgs)
        rec.request_messages = msgs[start:]
        if cap.tool_calls:
            rec.request_messages = [*rec.request_messages,
                                    {"role": "assistant", "tool_calls": list(
                                        cap.tool_calls.values())}]
    elif "prompt" in ctx.body:
        rec.request_messages = [{"prompt": ctx.body["prompt"]}]


def _usage(usage: dict[str, Any] | None, key: str) -> int | None:
    value = usage.get(key) if usage else None
    return value if isinstance(value, int) else None


#: what the ``calls`` columns hold of the strings an engine or the pool decides (the
#: engine's finish reason and weight label, a backend's id and URL): longer ones are cut
#: here, since one value too long makes Postgres refuse the record's whole batch
_COLUMN_CHARS = {name: stored_chars(name)
                 for name in ("finish_reason", "weight_version", "backend_id", "backend_url")}


def _fit(value: str, column: str) -> str:
    return value[:_COLUMN_CHARS[column]]


def _describe(error: BaseException | None) -> str | None:
    if error is None:
        return None
    if isinstance(error, GatewayError):
        return error.message[:1000]
    return f"{type(error).__name__}: {error}"[:1000]


def _observe(rt: Runtime, ctx: CallContext, rec: CallRecord) -> None:
    m = rt.metrics
    m.calls.labels(ctx.endpoint, rec.status).inc()
    m.queue_time.observe(rec.queued_ms / 1000)
    m.duration.observe(rec.total_ms / 1000)
    if rec.ttft_ms is not None:
        m.ttft.observe(rec.ttft_ms / 1000)
    if rec.status == "ok":
        m.tokens.labels("prompt").inc(rec.prompt_len)
        m.tokens.labels("completion").inc(len(rec.completion_ids))
    if ctx.retries:
        m.retries.inc(ctx.retries)
    cap = ctx.capture
    if cap.fast:
        m.relayed_events.labels("fast").inc(cap.fast)
    if cap.chunks > cap.fast:
        m.relayed_events.labels("general").inc(cap.chunks - cap.fast)
