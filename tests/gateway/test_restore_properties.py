"""Property-based restarts and store faults: a sample never depends on what went wrong.

The lifecycle state machine (``test_lifecycle_properties.py``) drives the tracker,
scheduler and dispatcher with no store. This one adds what it leaves out: the store and
the process. A hypothesis ``RuleBasedStateMachine`` runs agents against one gateway
"process" at a time (tracker, trace writer with its spool, restorer, engine: what a
restart throws away), doing for each call what the proxy does (restore the trajectory if
the process does not hold it, ``touch``, arrive, dispatch, finish, record), while it
injects, between calls, at random:

- **gateway restarts** (graceful: the writer writes what it holds, or spools it when the
  store does not take it in time, and the next process replays the spool);
- **store stalls**: a lock held on ``trajectories, calls`` for 0.03 s or 0.45 s, shorter
  and longer than a call waits (``restore.wait_s``): ACCESS EXCLUSIVE (reads and writes
  wait) or SHARE (writes wait, reads go on: a ``CREATE INDEX``), also while a process
  stops (its writer then spools) and as the next one takes its first calls;
- **lookup failures**: the database unreachable for 0.03 s or 0.45 s (a TCP relay in front
  of Postgres refuses and cuts connections), and backends terminated
  (``pg_terminate_backend``) under the gateway;
- trajectory finishes and id reuse (the next attempt), side calls (a new branch).

Beside it runs the reference: the same calls, on a tracker that never restarts and never
meets a fault. A call the gateway refuses (503: the store could not say what it holds of
the trajectory) is not run and not given to the reference; the agent sends it again later.
Properties:

- each call the gateway runs is recorded exactly as the reference records it (``seq``,
  attempt, branch, fork, prompt offset and delta): checked call by call;
- ``(attempt, seq)`` is unique per trajectory, among the calls answered and in the store,
  and the stored seqs of each attempt are 0..n-1;
- at the end the store holds exactly the reference's calls, and every branch's training
  sample (tokens, loss mask, logprobs, spans) equals the reference's.

Postgres only (a lock on SQLite in WAL mode does not stop readers). The ``ci`` profile
keeps it under a minute on 2 cores; ``HYPOTHESIS_PROFILE=deep`` searches longer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from gateway.config import RestoreSettings, TraceSettings
from gateway.errors import StoreUnavailable
from gateway.store import queries
from gateway.store.codec import unpack_ids
from gateway.store.db import make_engine, make_sessionmaker
from gateway.store.inserts import call_row
from gateway.store.models import Call, Trajectory
from gateway.store.records import CallRecord
from gateway.store.samples import Sample, build_samples
from gateway.store.spool import Spool
from gateway.store.writer import TraceWriter
from gateway.trajectories.restore import Restorer
from gateway.trajectories.state import TrajectoryState
from gateway.trajectories.tracker import Tracker
from tests.conftest import PG_ADMIN_DSN
from tests.store.relay import TcpRelay

AGENTS = 3
RESTORE = RestoreSettings(wait_s=0.25, query_timeout_s=0.2, retry_after_s=1)
TRACES = TraceSettings(flush_interval_s=0.01, retry_backoff_s=0.02, retry_backoff_max_s=0.1)
FAULT_S = [0.03, 0.45]  # shorter and longer than a call waits for the store
FAULTS = ["", "stall", "writes", "outage", "terminate"]
TALLY: Counter[str] = Counter()  # what the examples did (printed with -s)


def run_call(tracker: Tracker, state: TrajectoryState, prompt: list[int],
             completion: list[int], now: float) -> CallRecord:
    """What the proxy does with one call that reaches a backend and answers (relay
    ``_prepare``, ``connect``, ``lifecycle.end``), given the trajectory's state."""
    tracker.call_arrived(state, [], now)
    tracker.call_dispatched(state, "b0", 0.0)
    placed = tracker.call_finished(state, now=now, llm_s=0.001, prompt=prompt,
                                   completion=completion, ok=True)
    assert placed is not None
    return CallRecord(
        id=uuid.uuid4().hex, trajectory_id=state.id, group_id=state.group_id,
        seq=tracker.record_seq(state), attempt=state.attempt, endpoint="chat", model="m",
        weight_version="0", started_at=now, prompt_len=len(prompt),
        prompt_offset=placed.offset, prompt_delta=placed.delta, completion_ids=completion,
        completion_logprobs=[-0.5] * len(completion), mismatch_pos=placed.mismatch_pos,
        branch=placed.branch, parent_branch=placed.parent)


def recorded(rec: CallRecord | Call) -> tuple[Any, ...]:
    """What a call's record says about the sample (not ids or timings)."""
    def ids(value: bytes | list[int]) -> list[int]:
        return list(unpack_ids(value)) if isinstance(value, bytes) else list(value)

    return (rec.attempt, rec.seq, rec.branch, rec.parent_branch, rec.prompt_offset,
            ids(rec.prompt_delta), rec.prompt_len, ids(rec.completion_ids), rec.mismatch_pos)


def sample_view(samples: Sequence[Sample]) -> list[tuple[Any, ...]]:
    return [(s.branch, s.parent_branch, s.fork_position, s.main, s.token_ids, s.loss_mask,
             s.logprobs, [(c.seq, c.prompt_start, c.completion_start, c.completion_end)
                          for c in s.calls],
             [(m.seq, m.position) for m in s.mismatches]) for s in samples]


class Process:
    """One gateway process: what a restart throws away."""

    def __init__(self, url: str, spool: Path) -> None:
        self.engine = make_engine(url)
        sessionmaker = make_sessionmaker(self.engine)
        self.tracker = Tracker()
        self.writer = TraceWriter(sessionmaker, TRACES, Spool(spool, 10**8))
        self.writer.start()
        self.restorer = Restorer(self.tracker, sessionmaker, settings=RESTORE,
                                 written=lambda t, s: self.writer.stored(t, timeout_s=s))
        self.sessionmaker = sessionmaker

    async def stop(self) -> None:
        """SIGTERM: the writer gets a moment to write, then spools the rest."""
        await self.restorer.close()
        await self.writer.close(timeout_s=0.1)
        await self.engine.dispose()


@dataclass
class Agent:
    tid: str
    attempt: int = 0
    context: list[int] = field(default_factory=list)
    calls: int = 0  # served in this attempt


class RestartsAndStalls(RuleBasedStateMachine):
    def __init__(self, url: str, spool_dir: Path) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.url, self.run_id = url, uuid.uuid4().hex[:10]
        self.spool = spool_dir / f"{self.run_id}.jsonl"
        self.relay = TcpRelay(5432)
        self.loop.run_until_complete(self.relay.up())
        self.via = url.replace("127.0.0.1:5432", f"127.0.0.1:{self.relay.port}")
        direct = PG_ADMIN_DSN.rsplit("/", 1)[0] + "/" + url.rsplit("/", 1)[1]
        self.admin: asyncpg.Connection = self.loop.run_until_complete(asyncpg.connect(direct))
        self.killer: asyncpg.Connection = self.loop.run_until_complete(asyncpg.connect(direct))
        self.gw = self._start()
        self.reference = Tracker()
        self.agents = [Agent(f"{self.run_id}-{i}") for i in range(AGENTS)]
        for agent in self.agents:
            agent.context = self._opening(agent)
        self.served: list[CallRecord] = []
        self.expected: dict[str, list[CallRecord]] = {a.tid: [] for a in self.agents}
        self.refused = 0
        self.stall_task: asyncio.Task[None] | None = None
        self.outage_task: asyncio.Task[None] | None = None
        self.tokens = 1000
        self.restarts = 0

    def _start(self) -> Process:
        async def start() -> Process:
            return Process(self.via, self.spool)

        return self.loop.run_until_complete(start())

    @staticmethod
    def _opening(agent: Agent) -> list[int]:
        return [1, 2, 3 + agent.attempt]

    def _group(self) -> str:
        return f"{self.run_id}-g"

    def _end(self, task: asyncio.Task[None] | None) -> None:
        """Wait for a fault in progress to end (preconditions on wall-clock time would
        make hypothesis's replays differ)."""
        if task is not None:
            self.loop.run_until_complete(task)

    # ------------------------------------------------------------------ the calls
    async def _serve(self, agent: Agent, prompt: list[int], completion: list[int]
                     ) -> CallRecord | None:
        """One call through this process, as the proxy serves it; None when refused."""
        gw = self.gw
        if gw.tracker.get(agent.tid) is None:
            refused: StoreUnavailable | None = None
            try:
                await gw.restorer.restore(agent.tid)
            except StoreUnavailable as exc:
                refused = exc
            if refused is not None:
                assert refused.status_code == 503 and "Retry-After" in refused.headers
                assert gw.tracker.get(agent.tid) is None  # nothing was guessed
                return None
        state = gw.tracker.touch(agent.tid, self._group(), time.time())
        rec = run_call(gw.tracker, state, prompt, completion, time.time())
        assert gw.writer.submit(rec)
        return rec

    @rule(turns=st.lists(st.tuples(st.integers(0, AGENTS - 1),
                                    st.sampled_from([False, False, False, True])),
                          min_size=1, max_size=4))
    def calls(self, turns: list[tuple[int, bool]]) -> None:
        """Agents' next turns, one after the other (``True``: a side call, which opens a
        branch, instead of the next turn)."""
        for pick, side in turns:
            self._call(pick, side)

    def _call(self, pick: int, side: bool) -> None:
        agent = self.agents[pick]
        prompt = [9, 9, *agent.context[:2]] if side else list(agent.context)
        completion = [self.tokens, self.tokens + 1 + pick]
        rec = self.loop.run_until_complete(self._serve(agent, prompt, completion))
        if rec is None:
            event("call refused (503)")
            self.refused += 1
            return
        event("call served")
        self.tokens += 2
        ref_state = self.reference.touch(agent.tid, self._group(), time.time())
        want = run_call(self.reference, ref_state, prompt, completion, time.time())
        assert recorded(rec) == recorded(want), (agent.tid, rec, want)
        self.served.append(rec)
        self.expected[agent.tid].append(want)
        agent.calls += 1
        if not side:
            agent.context = [*prompt, *completion, 50 + agent.calls]

    @rule(pick=st.integers(0, AGENTS - 1))
    def finish(self, pick: int) -> None:
        """``POST /trajectories/{id}/finish`` (api/trajectories.py), then the id is reused.
        (The trainer sends it again until the database takes it: an outage ends first.)"""
        agent = self.agents[pick]
        if not agent.calls:
            return
        self._end(self.outage_task)
        if not self.loop.run_until_complete(self._finish(agent)):
            self.refused += 1
            return
        self.reference.finish(agent.tid, 1.0, time.time())
        agent.attempt, agent.calls = agent.attempt + 1, 0
        agent.context = self._opening(agent)

    async def _finish(self, agent: Agent) -> bool:
        gw = self.gw
        try:
            live = gw.tracker.get(agent.tid) or await gw.restorer.restore(agent.tid)
        except StoreUnavailable:
            return False
        assert live is not None and live.attempt == agent.attempt
        async with gw.sessionmaker() as session, session.begin():
            await queries.finish_trajectory(session, trajectory_id=agent.tid,
                                            group_id=self._group(), reward=1.0,
                                            metadata=None, now=time.time(),
                                            attempt=live.attempt)
        gw.tracker.finish(agent.tid, 1.0, time.time())
        return True

    # ------------------------------------------------------------------ the faults
    @rule(backlog=st.booleans(), after=st.sampled_from(FAULTS),
          seconds=st.sampled_from(FAULT_S))
    def restart(self, backlog: bool, after: str, seconds: float) -> None:
        """A graceful restart. ``backlog``: writes are held up (a SHARE lock, as a
        ``CREATE INDEX`` takes) and each agent takes a turn just before it, so the old
        writer stops holding records it spools for the next process. ``after``: a store
        fault starting as the new process takes its first calls (the issue's scenario)."""
        if backlog:
            self.stall(seconds, "SHARE")
            for pick in range(AGENTS):
                self._call(pick, False)
        self.loop.run_until_complete(self.gw.stop())
        self.gw = self._start()
        self.restarts += 1
        if after:
            self.fault(after, seconds)

    @rule(kind=st.sampled_from(FAULTS[1:]), seconds=st.sampled_from(FAULT_S))
    def fault(self, kind: str, seconds: float) -> None:
        """A store fault starting now; the calls that follow meet it."""
        if kind == "stall":
            self.stall(seconds, "ACCESS EXCLUSIVE")
        elif kind == "writes":
            self.stall(seconds, "SHARE")
        elif kind == "outage":
            self.outage(seconds)
        else:
            self.terminate()

    def stall(self, seconds: float, mode: str) -> None:
        """Hold a lock on the tables for ``seconds`` (after the stall in progress, if
        any): ACCESS EXCLUSIVE stops reads and writes; SHARE (what a ``CREATE INDEX``
        takes) stops writes only."""
        self._end(self.stall_task)
        locked = self.loop.create_future()

        async def hold() -> None:
            async with self.admin.transaction():
                await self.admin.execute(f"LOCK TABLE trajectories, calls IN {mode} MODE")
                locked.set_result(None)
                await asyncio.sleep(seconds)

        self.stall_task = self.loop.create_task(hold())
        self.loop.run_until_complete(locked)

    def outage(self, seconds: float) -> None:
        """The database unreachable for ``seconds`` (connections refused and cut), after
        the outage in progress, if any."""
        self._end(self.outage_task)
        async def out() -> None:
            await asyncio.sleep(seconds)
            await self.relay.up()

        self.loop.run_until_complete(self.relay.down())
        self.outage_task = self.loop.create_task(out())

    def terminate(self) -> None:
        """Terminate the backends serving this process (an operator, a failover)."""
        async def kill() -> None:
            await self.killer.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE client_port = ANY($1::int[])", self.relay.upstream_ports())

        self.loop.run_until_complete(kill())

    @rule(seconds=st.sampled_from([0.01, 0.1]))
    def pause(self, seconds: float) -> None:
        """Time passes (faults end, the writer flushes)."""
        self.loop.run_until_complete(asyncio.sleep(seconds))

    # ------------------------------------------------------------------ properties
    @invariant()
    def no_seq_is_given_twice(self) -> None:
        keys = [(r.trajectory_id, r.attempt, r.seq) for r in self.served]
        assert len(keys) == len(set(keys))

    def teardown(self) -> None:
        TALLY.update(examples=1, served=len(self.served), refused=self.refused,
                     restarts=self.restarts)
        try:
            self.loop.run_until_complete(self._settle_and_check())
        finally:
            self.loop.run_until_complete(self._close())
            self.loop.close()

    async def _settle_and_check(self) -> None:
        for task in (self.stall_task, self.outage_task):
            if task is not None:
                await task
        assert await self.gw.writer.drain(30), "the writer did not catch up"
        async with self.gw.sessionmaker() as session:
            for agent in self.agents:
                calls = list(await queries.get_calls(session, trajectory_id=agent.tid))
                traj = await queries.get_trajectory(session, trajectory_id=agent.tid)
                self._check(agent, traj, calls)

    def _check(self, agent: Agent, traj: Trajectory | None, calls: list[Call]) -> None:
        want = self.expected[agent.tid]
        keys = [(c.attempt, c.seq) for c in calls]
        assert len(keys) == len(set(keys)), f"{agent.tid}: duplicate (attempt, seq) {keys}"
        for attempt in {a for a, _ in keys}:
            seqs = sorted(s for a, s in keys if a == attempt)
            assert seqs == list(range(len(seqs))), (agent.tid, attempt, seqs)
        assert sorted(map(recorded, calls)) == sorted(map(recorded, want)), agent.tid
        if traj is None:
            assert not want
            return
        reference = [Call(**call_row(r)) for r in want]
        for attempt in {r.attempt for r in want}:
            got = build_samples(traj, calls, attempt=attempt)
            wanted = build_samples(traj, reference, attempt=attempt)
            assert sample_view(got) == sample_view(wanted), (agent.tid, attempt)
            assert all(sum(s.loss_mask) for s in got)

    async def _close(self) -> None:
        for task in (self.stall_task, self.outage_task):
            if task is not None and not task.done():
                task.cancel()
        with contextlib.suppress(Exception):
            await self.relay.up()
        await self.gw.stop()
        await self.admin.close()
        await self.killer.close()
        with contextlib.suppress(Exception):
            await self.relay.down()


DEEP = os.environ.get("HYPOTHESIS_PROFILE") == "deep"


@pytest.mark.postgres
@pytest.mark.timeout(1800 if DEEP else 300)
def test_restarts_and_store_faults_never_change_a_sample(postgres_url: str) -> None:
    examples, steps = (80, 30) if DEEP else (20, 15)
    with tempfile.TemporaryDirectory() as spool_dir:
        run_state_machine_as_test(
            lambda: RestartsAndStalls(postgres_url, Path(spool_dir)),
            settings=settings(max_examples=examples, stateful_step_count=steps,
                              deadline=None))
    print(f"\nrestore state machine: {dict(TALLY)}")
