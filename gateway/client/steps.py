"""Step modes a trainer can choose: how each training batch of GRPO groups is gathered.

A :class:`StepRunner` runs one agent per trajectory (your ``launch`` coroutine, given the
trajectory id, its group id and the group's prompt; it returns the reward, or the reward
and a metadata dict to store with it) and hands the
trainer batches of ``batch`` complete groups of ``group_size`` samples each::

    async with AsyncRolloutClient(url, admin_token=TOKEN) as gw, \\
            StepRunner(gw, launch, prompts, batch=32, group_size=8,
                       mode=StepMode("async", max_staleness=1)) as steps:
        for step in range(100):
            batch = await steps.next_batch()          # StepBatch: samples + staleness
            train_on(batch.samples)                   # + steps.report_mismatch(batch, ...)
            await gw.update_weights(str(step + 1), push=push_weights,
                                    mode="abort-and-continue")

The modes (docs/step-modes.md has their trade-offs, and ``rollout-gateway bench loop``
their samples per hour):

* ``sync``: start ``batch`` groups, return when all are complete. On-policy.
* ``overprovisioned`` (APRIL): keep ``ceil(batch*(1+over))`` groups going and return the
  first ``batch`` to complete; the rest are *carried* into the next step (they continue
  across the weight update, their older tokens one version stale) or, with
  ``carry=False``, aborted.
* ``async`` (AReaL): groups keep starting in the background while the trainer trains;
  ``next_batch`` returns the next ``batch`` complete groups. At most
  ``(steps taken + max_staleness + 1) * batch`` groups are started, and the gateway aborts
  a trajectory once it started more than ``max_staleness`` versions behind
  (``PUT /admin/staleness``); the runner restarts it (``on_stale="restart"``, the id's next
  attempt) or drops its group (``"drop"``).
* ``tail-batching`` (RollPacker): short rounds start ``ceil(batch*(1+over))`` groups of
  ``ceil(group_size*(1+over_members))`` samples and return the first ``batch`` groups to
  have ``group_size`` samples; every other sample is aborted and the prompts of
  incomplete groups are deferred. Once ``batch`` prompts are deferred they run as a long
  round, to completion. On-policy; short samples are trained first.

Trajectories the runner stops are aborted at the gateway (``POST
/trajectories/{id}/abort``): their engine requests end at once, and their later calls are
refused, so a harness stops at its next call. A ``launch`` that raises for another reason
ends its trajectory with no reward and ``metadata.error`` (the group still completes).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Self

from gateway.client.aio import AsyncRolloutClient
from gateway.client.errors import ConflictError, GatewayClientError, NotFoundError
from gateway.client.mismatch import MismatchLimits, MismatchReport, measure_mismatch
from gateway.client.types import SampleBatch

Mode = Literal["sync", "overprovisioned", "async", "tail-batching"]
MODES: tuple[Mode, ...] = ("sync", "overprovisioned", "async", "tail-batching")
#: ``launch(trajectory_id, group_id, prompt) -> reward`` or ``(reward, metadata)``
Outcome = float | tuple[float | None, dict[str, Any]] | None
Launch = Callable[[str, str, Any], Awaitable[Outcome]]


@dataclass(frozen=True, slots=True)
class StepMode:
    mode: Mode = "sync"
    over: float = 0.25  # extra groups (overprovisioned, tail-batching)
    over_members: float = 0.25  # extra samples per group (tail-batching's short rounds)
    carry: bool = True  # overprovisioned: carry unfinished groups (else abort them)
    max_staleness: int | None = 1  # async (and carried groups): the gateway's bound
    on_stale: Literal["restart", "drop"] = "restart"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown step mode {self.mode!r}; use one of {', '.join(MODES)}")
        if self.over < 0 or self.over_members < 0:
            raise ValueError("over and over_members must be >= 0")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError("max_staleness must be >= 0 (or None: no bound)")
        if self.on_stale not in ("restart", "drop"):
            raise ValueError("on_stale must be 'restart' or 'drop'")


@dataclass(slots=True)
class StepBatch:
    step: int
    groups: dict[str, list[str]]  # group id -> the trajectory ids trained
    samples: SampleBatch
    version: str  # the gateway's weight version when the batch was taken
    lag_tokens: Counter[int] = field(default_factory=Counter)  # generated tokens by lag
    restarts: int = 0  # so far, in the whole run
    aborted: int = 0
    deferred: int = 0

    @property
    def max_staleness(self) -> int:
        return max(self.lag_tokens, default=0)


@dataclass(slots=True)
class _Group:
    gid: str
    prompt: Any
    members: list[str]
    need: int
    done: list[str] = field(default_factory=list)


class StepRunner:
    """Gathers batches of complete groups under a :class:`StepMode` (module docstring)."""

    def __init__(self, gw: AsyncRolloutClient, launch: Launch, prompts: Iterable[Any], *,
                 batch: int, group_size: int, mode: StepMode | None = None,
                 run_id: str | None = None) -> None:
        if batch < 1 or group_size < 1:
            raise ValueError("batch and group_size must be >= 1")
        self.gw, self.launch, self.mode = gw, launch, mode or StepMode()
        self.batch, self.size = batch, group_size
        self.run_id = run_id or f"run-{uuid.uuid4().hex[:8]}"
        self._prompts: Iterator[Any] = iter(prompts)
        self._n = itertools.count()
        self._groups: dict[str, _Group] = {}  # started, not taken or cut
        self._ready: deque[str] = deque()  # complete, in order of completion
        self._deferred: deque[Any] = deque()
        self._cut: set[str] = set()
        self._tasks: set[asyncio.Future[None]] = set()
        self._runs: dict[str, asyncio.Future[None]] = {}  # trajectory id -> its harness
        self._changed = asyncio.Event()
        self._round: set[str] = set()  # sync and long rounds: the groups behind the barrier
        #: groups ever started and not dropped, trained ones included: AReaL's admission
        #: rule bounds this by ``(steps taken + max_staleness + 1) * batch``, so at most
        #: ``(max_staleness + 1) * batch`` groups are ever started and not yet trained
        self._admitted = 0
        self._taken = 0
        self.restarts = self.aborted = 0

    async def __aenter__(self) -> Self:
        if self.mode.mode in ("async", "overprovisioned"):
            await self.gw.set_max_staleness(self.mode.max_staleness)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---------------------------------------------------------------- trajectories
    async def _run(self, tid: str, g: _Group) -> None:
        try:
            await self._attempts(tid, g)
        finally:
            self._runs.pop(tid, None)

    async def _attempts(self, tid: str, g: _Group) -> None:
        while True:
            try:
                result = await self.launch(tid, g.gid, g.prompt)
                reward, meta = result if isinstance(result, tuple) else (result, None)
                await self.gw.finish(tid, reward, group_id=g.gid, metadata=meta)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a harness can fail any way
                if tid in self._cut or g.gid not in self._groups:
                    return
                why = await self._aborted_why(tid)
                if why is None:  # the harness failed: the trajectory ends with no reward
                    with contextlib.suppress(GatewayClientError):
                        await self.gw.finish(tid, None, group_id=g.gid,
                                             metadata={"error": repr(exc)[:300]})
                elif self.mode.on_stale == "restart":
                    await self.gw.restart(tid)
                    self.restarts += 1
                    continue
                else:
                    self._drop(g)
                    return
            if tid in self._cut or g.gid not in self._groups:
                return
            self._member_done(g, tid)
            return

    async def _aborted_why(self, tid: str) -> str | None:
        with contextlib.suppress(GatewayClientError):
            meta = (await self.gw.trajectory(tid)).get("metadata") or {}
            why = meta.get("aborted") if isinstance(meta, dict) else None
            return str(why) if why else None
        return None

    def _member_done(self, g: _Group, tid: str) -> None:
        g.done.append(tid)
        if len(g.done) == g.need:
            self._cut_members([t for t in g.members if t not in g.done], "group complete")
            self._ready.append(g.gid)
        self._changed.set()

    def _cut_members(self, tids: list[str], reason: str) -> None:
        for tid in tids:
            if tid not in self._cut:
                self._cut.add(tid)
                self.aborted += 1
                self._spawn(self._abort(tid, reason))

    async def _abort(self, tid: str, reason: str) -> None:
        try:
            await self.gw.abort(tid, reason)
        except ConflictError:  # finished first: nothing to abort
            pass
        except NotFoundError:  # no call reached the gateway yet: stop the harness here
            run = self._runs.get(tid)
            if run is not None:
                run.cancel()

    def _drop(self, g: _Group) -> None:
        """Stop a whole group (not trained): its running members are aborted."""
        if self._groups.pop(g.gid, None) is None:
            return
        self._admitted -= 1
        self._round.discard(g.gid)
        if g.gid in self._ready:
            self._ready.remove(g.gid)
        self._cut_members([t for t in g.members if t not in g.done], "group dropped")
        self._changed.set()

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Future[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _start(self, prompt: Any, members: int) -> str:
        gid = f"{self.run_id}-g{next(self._n)}"
        g = _Group(gid, prompt, [f"{gid}-{m}" for m in range(members)], self.size)
        self._groups[gid] = g
        self._admitted += 1
        for tid in g.members:
            self._runs[tid] = self._spawn(self._run(tid, g))
        return gid

    def _start_new(self, n: int, members: int | None = None) -> list[str]:
        out = []
        for _ in range(n):
            prompt = next(self._prompts, None)
            if prompt is None:
                break
            out.append(self._start(prompt, members or self.size))
        return out

    # ---------------------------------------------------------------- steps
    async def _wait(self, done: Callable[[], bool], timeout_s: float) -> None:
        async with asyncio.timeout(timeout_s):
            while not done():
                if not self._groups and not self._tasks:
                    raise RuntimeError("no group can complete: the prompts ran out")
                self._changed.clear()
                await self._changed.wait()

    def _plan(self) -> Callable[[], bool]:
        """Start what this step starts; the condition it waits for."""
        m, b = self.mode, self.batch
        extra = math.ceil(b * (1 + m.over))
        if m.mode == "sync" or (m.mode == "tail-batching" and len(self._deferred) >= b
                                and not self._groups):
            if not self._round:
                self._round = set(
                    self._start_new(b) if m.mode == "sync"
                    else [self._start(self._deferred.popleft(), self.size) for _ in range(b)])
            return lambda: all(len(self._groups[g].done) >= self.size for g in self._round
                               if g in self._groups)
        if m.mode == "overprovisioned":
            self._start_new(max(0, extra - len(self._groups)))
        elif m.mode == "async":
            room = ((self._taken + m.max_staleness + 1) * b if m.max_staleness is not None
                    else self._taken * b + extra)
            self._start_new(max(0, room - self._admitted))
        elif not self._groups:  # tail-batching: a short round
            self._start_new(extra, math.ceil(self.size * (1 + m.over_members)))
        return lambda: len(self._ready) >= b

    async def next_batch(self, *, timeout_s: float = 3600.0) -> StepBatch:
        """The next ``batch`` complete groups, as samples, with their staleness. A complete
        group that waited past the bound (its oldest token more than ``max_staleness``
        versions behind the weights now) is not handed over: its stale members run again
        (``on_stale="restart"``) or it is dropped, and the next group is taken. If the
        samples cannot be fetched, the error is raised and the groups stay ready for the
        next call."""
        async with asyncio.timeout(timeout_s):
            while True:
                await self._wait(self._plan(), timeout_s)
                take = [self._ready.popleft() for _ in range(min(self.batch, len(self._ready)))]
                ids = [t for gid in take for t in self._groups[gid].done]
                try:
                    version = str((await self.gw.status()).get("weight_version", ""))
                    samples = await self.gw.samples(ids)
                except BaseException:  # not taken: the next call takes them again
                    self._ready.extendleft(reversed(take))
                    raise
                stale = self._stale(samples, version)
                if not stale:
                    break
                self._set_aside(take, stale)
        groups = {gid: list(self._groups.pop(gid).done) for gid in take}
        self._round -= set(take)
        self._after_take()
        self._taken += 1
        return StepBatch(self._taken, groups, samples, version,
                         lag_tokens=lag_tokens(samples, version), restarts=self.restarts,
                         aborted=self.aborted, deferred=len(self._deferred))

    def _stale(self, samples: SampleBatch, version: str) -> set[str]:
        bound = self.mode.max_staleness
        if bound is None or self.mode.mode not in ("async", "overprovisioned"):
            return set()
        return {s.trajectory_id for s in samples
                if max(lag_tokens(SampleBatch([s]), version), default=0) > bound}

    def _set_aside(self, take: list[str], stale: set[str]) -> None:
        """Put the fresh groups back at the head of the queue; rerun or drop the rest."""
        for gid in reversed(take):
            g = self._groups[gid]
            bad = [t for t in g.done if t in stale]
            if not bad:
                self._ready.appendleft(gid)
            elif self.mode.on_stale == "drop":
                self._drop(g)
            else:
                for tid in bad:  # a finished id called again opens its next attempt
                    g.done.remove(tid)
                    self.restarts += 1
                    self._spawn(self._run(tid, g))

    def _after_take(self) -> None:
        m = self.mode
        if m.mode == "overprovisioned" and not m.carry:
            for g in list(self._groups.values()):
                self._drop(g)
        elif m.mode == "tail-batching" and not self._round:  # a short round's tail
            for g in list(self._groups.values()):
                self._deferred.append(g.prompt)
                self._drop(g)

    async def report_mismatch(self, batch: StepBatch, logprobs: Sequence[Sequence[float]], *,
                              limits: MismatchLimits | None = None) -> MismatchReport:
        """The batch's training-inference mismatch, given the trainer's logprob of every
        token of every sample (:func:`gateway.client.mismatch.trainer_logprobs` computes
        them with a transformers model), tagged with this runner's step mode and run, and
        posted to the gateway (status page, Prometheus); the report as judged there."""
        report = measure_mismatch(batch.samples.samples, logprobs, mode=self.mode.mode,
                                  step=batch.step, run_id=self.run_id, limits=limits)
        return await self.gw.report_mismatch(report)

    async def close(self) -> None:
        """Abort every trajectory still running and wait for the runner's tasks."""
        for g in list(self._groups.values()):
            self._drop(g)
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=30)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)


def lag_tokens(samples: SampleBatch, version: str) -> Counter[int]:
    """Generated (loss-masked) tokens by how many versions behind ``version`` they are
    (integer versions only; others are not counted)."""
    out: Counter[int] = Counter()
    try:
        now = int(version)
    except ValueError:
        return out
    for s in samples:
        for mask, v in zip(s.loss_mask, s.weight_versions, strict=False):
            if mask and v:
                with contextlib.suppress(ValueError):
                    out[now - int(v)] += 1
    return out
