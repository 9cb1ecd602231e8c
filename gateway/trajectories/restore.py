"""Resume a trajectory the gateway does not hold in memory from what the store recorded.

After a restart (or an eviction) the tracker has forgotten a trajectory's token state and
sequence number. The first call of such an id asks the store for its latest attempt and
rebuilds the state an uninterrupted gateway would hold: the next ``seq``, each branch's
last prompt + completion tokens (so the next prompt is stored as a delta on the branch it
extends; the messages behind them are not stored, so a harness's re-rendering of its
history is joined to the record again only from the second call after the restart),
its group, and whether the attempt was finished (a call on a finished attempt opens the
next one). Concurrent first calls of one id share one lookup.

**The store decides; nothing is guessed.** Whether an id the gateway does not hold is new
is known only to the store. When the store cannot answer (unreachable, a lock held on its
tables, connections cut), the call waits for it, up to ``restore.wait_s``, with the lookup
tried again on fresh connections, and is then refused with 503 ``store_unavailable`` and
``Retry-After``, without having run. It is never served as a new trajectory.

Why refuse rather than serve the call and fix its record later: what the call records
(its ``seq``, the branch it extends, the prompt delta and its offset) and what the engine
runs (with token in, the branch's recorded tokens) both come from the state the store
holds. Run without it, the call either guesses, and a wrong guess corrupts the sample
(``seq`` again from 0, duplicate ``(attempt, seq)``, the prompt stored whole on a new
branch, mismatches, loss tokens missing), or holds its record until the store answers and
re-places it, which a second restart loses and which still cannot give the engine the
record's tokens. A refused call has no side effect, a 503 with
``Retry-After`` is what OpenAI clients retry on their own (the official SDKs honour the
header), and a harness that gives up sees an error instead of a training sample silently
wrong.

**Consistent with what is durable.** The database is not all that was recorded: calls the
previous process answered may still be in the spool its trace writer left (the database
was down at shutdown; this process's writer replays it first), and records of an id this
process forgot may still be in its own writer's queue. A lookup first waits (within the
same bound) until the writer has both in the database (``TraceWriter.stored``), so the
restored ``seq`` follows the last recorded call and never repeats within an attempt. A
killed process (SIGKILL) loses what its writer held only in memory (RELIABILITY.md, known
gaps): those calls were never recorded, so the state restored is that of the calls that
were, and their numbers go to the next calls without a duplicate.

Almost every id the gateway has not seen is new (an RL batch starts hundreds of fresh
trajectories at once), so the lookup starts with one existence query for all the unknown
ids that arrived within ``batch_window_s`` of each other; only ids the store knows are
then loaded one by one. A batch start costs one query, not one per trajectory. An id the
store answered it does not know is new.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from array import array
from collections.abc import Awaitable, Callable
from typing import TypeVar

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.config import RestoreSettings
from gateway.errors import StoreUnavailable
from gateway.store import queries
from gateway.store.codec import unpack_ids
from gateway.store.samples import build_samples
from gateway.trajectories.branches import Branch, Tree
from gateway.trajectories.state import TrajectoryState
from gateway.trajectories.tracker import Tracker

log = logging.getLogger(__name__)
T = TypeVar("T")
#: ``TraceWriter.stored``: wait until a trajectory's records are in the database
Written = Callable[[str, float], Awaitable[bool]]
_BACKOFF_S = (0.05, 1.0)  # between tries of a failed lookup query: first, most
_LOG_EVERY_S = 10.0  # at most one warning per this while calls are being refused


class _NoAnswer(Exception):
    """The store did not answer a lookup before the call's deadline."""


class Restorer:
    def __init__(self, tracker: Tracker, sessionmaker: async_sessionmaker[AsyncSession], *,
                 settings: RestoreSettings | None = None,
                 written: Written | None = None) -> None:
        self.tracker = tracker
        self.sessionmaker = sessionmaker
        self.settings = settings or RestoreSettings()
        self._written = written
        self.restored = 0
        self.failures = 0  # calls refused: the store did not answer within ``wait_s``
        self.retries = 0  # lookup queries that failed or timed out and were tried again
        self.existence_queries = 0
        self.last_error: str | None = None
        self._pending: dict[str, asyncio.Task[TrajectoryState | None]] = {}
        self._asking: dict[str, asyncio.Future[bool]] = {}  # the next existence query
        self._flusher: asyncio.Task[None] | None = None
        self._refused_since_log = 0
        self._logged_at = -_LOG_EVERY_S

    async def restore(self, trajectory_id: str) -> TrajectoryState | None:
        """The tracker's state for ``trajectory_id``, loaded from the store if the tracker
        does not know it; None when neither knows it (a new trajectory).

        Raises :class:`StoreUnavailable` when the store did not answer within
        ``restore.wait_s``: the caller must not go on as if the trajectory were new."""
        state = self.tracker.get(trajectory_id)
        if state is not None:
            return state
        task = self._pending.get(trajectory_id)
        if task is None:
            task = asyncio.create_task(self._load(trajectory_id))
            self._pending[trajectory_id] = task
            task.add_done_callback(lambda t: self._done(trajectory_id, t))
        return await asyncio.shield(task)

    def _done(self, trajectory_id: str, task: asyncio.Task[TrajectoryState | None]) -> None:
        self._pending.pop(trajectory_id, None)
        if not task.cancelled():
            task.exception()  # retrieved: its callers (if still there) got it

    async def close(self) -> None:
        """Stop the lookups in progress (shutdown); their calls are refused."""
        tasks = [t for t in (self._flusher, *self._pending.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _load(self, trajectory_id: str) -> TrajectoryState | None:
        deadline = time.monotonic() + self.settings.wait_s
        try:
            point = await self._lookup(trajectory_id, deadline)
        except (_NoAnswer, asyncio.CancelledError) as exc:
            self._refused(trajectory_id, exc)
            raise StoreUnavailable(
                f"the trajectory store could not be reached within {self.settings.wait_s:g} s "
                f"to resume trajectory {trajectory_id!r} ({exc or 'shutting down'}); the "
                "call was not run: retry it", retry_after_s=self.settings.retry_after_s
            ) from None
        known = self.tracker.get(trajectory_id)
        if point is None or known is not None:  # new, or a call created it meanwhile
            return known
        state = _state_of(point)
        self.restored += 1
        log.info("restored trajectory %r attempt %d from the store (%d calls, %d tokens)",
                 trajectory_id, point.attempt, state.recorded, len(state.sequence))
        return self.tracker.adopt(state)

    async def _lookup(self, trajectory_id: str, deadline: float) -> queries.RestorePoint | None:
        """What the store holds of ``trajectory_id`` once every record of it is there;
        None if it holds nothing (a new trajectory)."""
        if self._written is not None and not await self._written(
                trajectory_id, max(0.0, deadline - time.monotonic())):
            raise _NoAnswer("the trace writer has not yet stored all of its calls")
        if not await self._known(trajectory_id, deadline):
            return None
        return await self._until(
            deadline, lambda s: queries.restore_point(s, trajectory_id=trajectory_id))

    def _refused(self, trajectory_id: str, exc: BaseException) -> None:
        self.failures += 1
        self._refused_since_log += 1
        now = time.monotonic()
        if now - self._logged_at >= _LOG_EVERY_S:
            log.warning("refusing the first call of trajectory %r with 503: the store did "
                        "not say what it holds of it within %g s (%s; last error: %s); "
                        "%d call(s) refused since the last such warning", trajectory_id,
                        self.settings.wait_s, exc or "shutting down", self.last_error,
                        self._refused_since_log)
            self._logged_at, self._refused_since_log = now, 0

    async def _known(self, trajectory_id: str, deadline: float) -> bool:
        """Whether the store has ``trajectory_id``, asked together with the other ids that
        arrive within the batch window."""
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._asking[trajectory_id] = fut
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._ask())
        try:
            async with asyncio.timeout_at(_loop_time(deadline)):
                return await fut  # on timeout ``fut`` is cancelled: the batcher drops it
        except TimeoutError:
            raise _NoAnswer("no answer to the existence query") from None

    async def _ask(self) -> None:
        """Ask for every id waiting, batch after batch, until none waits. Ids that come
        while a query runs go into the next one; a failed query is tried again (with
        those ids) until every call waiting on it has given up."""
        backoff = _BACKOFF_S[0]
        while self._asking:
            await asyncio.sleep(self.settings.batch_window_s)
            asking = {tid: f for tid, f in self._asking.items() if not f.done()}
            self._asking = {}
            if not asking:
                continue
            try:
                self.existence_queries += 1
                known = await self._once(_existence_query(list(asking)))
            except Exception as exc:
                self._failed(exc)
                self._asking = asking | self._asking
                await asyncio.sleep(_jitter(backoff))
                backoff = min(backoff * 2, _BACKOFF_S[1])
                continue
            backoff = _BACKOFF_S[0]
            for tid, fut in asking.items():
                if not fut.done():
                    fut.set_result(tid in known)

    async def _until(self, deadline: float,
                     query: Callable[[AsyncSession], Awaitable[T]]) -> T:
        """``query``'s answer, tried again after failures until ``deadline``."""
        backoff = _BACKOFF_S[0]
        while True:
            try:
                return await self._once(query, deadline)
            except Exception as exc:
                self._failed(exc)
                pause = _jitter(backoff)
                if time.monotonic() + pause >= deadline:
                    raise _NoAnswer(f"{type(exc).__name__}: {exc}"[:300]) from None
                await asyncio.sleep(pause)
                backoff = min(backoff * 2, _BACKOFF_S[1])

    async def _once(self, query: Callable[[AsyncSession], Awaitable[T]],
                    deadline: float | None = None) -> T:
        """One try of ``query`` on its own session, within ``query_timeout_s`` (and
        ``deadline``). A try that overruns is cancelled and left to give its connection
        back in the background, so a stalled connection never holds up the next try."""
        task = asyncio.create_task(self._on_session(query))
        limit = time.monotonic() + self.settings.query_timeout_s
        try:
            async with asyncio.timeout_at(_loop_time(min(limit, deadline or limit))):
                return await asyncio.shield(task)
        finally:
            if not task.done():
                task.cancel()
                task.add_done_callback(_consume)

    async def _on_session(self, query: Callable[[AsyncSession], Awaitable[T]]) -> T:
        async with self.sessionmaker() as session:
            return await query(session)

    def _failed(self, exc: Exception) -> None:
        self.retries += 1
        self.last_error = f"{type(exc).__name__}: {exc}"[:300] if str(exc) else \
            type(exc).__name__
        log.debug("restore lookup failed (%s); trying again", self.last_error)


def _existence_query(ids: list[str]) -> Callable[[AsyncSession], Awaitable[set[str]]]:
    return lambda session: queries.known_trajectories(session, ids)


def _jitter(seconds: float) -> float:
    """``seconds`` give or take half: lookups that failed together do not retry together."""
    return seconds * (0.5 + random.random())


def _loop_time(monotonic_deadline: float) -> float:
    """A ``time.monotonic()`` deadline on the running loop's clock."""
    return asyncio.get_running_loop().time() + (monotonic_deadline - time.monotonic())


def _consume(task: asyncio.Task[object]) -> None:
    """Retrieve an abandoned try's outcome (it was cancelled or failed: nobody waits)."""
    if not task.cancelled():
        task.exception()


def _state_of(point: queries.RestorePoint) -> TrajectoryState:
    traj, calls = point.trajectory, point.calls
    created = min((c.started_at for c in calls), default=traj.created_at)
    state = TrajectoryState(traj.id, traj.group_id, created_at=created.timestamp(),
                            attempt=point.attempt)
    state.recorded = max((c.seq for c in calls), default=-1) + 1
    state.turns = state.recorded
    ok = [c for c in calls if c.status == "ok"]
    state.calls_done, state.calls_failed = len(ok), len(calls) - len(ok)
    lengths = [len(unpack_ids(c.completion_ids)) for c in ok]
    state.completion_tokens = sum(lengths)
    state.last_completion_tokens = lengths[-1] if lengths else 0
    state.prompt_tokens = sum(c.prompt_len for c in ok)
    state.queue_time_s = sum(c.queued_ms for c in calls) / 1000
    state.llm_time_s = sum(max(0.0, c.total_ms - c.queued_ms) for c in calls) / 1000
    if calls:
        state.backend_id, state.model = calls[-1].backend_id, calls[-1].model
        for call in sorted(calls, key=lambda c: c.seq, reverse=True):
            state.first_versions[call.model] = call.weight_version
    samples = build_samples(traj, calls, attempt=point.attempt, routes=False)
    state.mismatches = sum(len(s.mismatches) for s in samples)
    # the branch of the last call adopted last: the live tree's current branch again
    for s in sorted(samples, key=lambda s: s.calls[-1].seq if s.calls else -1):
        state.tree.adopt(Branch(s.branch, s.parent_branch, array("i", s.token_ids)))
    if point.finished and traj.finished_at is not None:
        state.finished_at, state.reward = traj.finished_at.timestamp(), traj.reward
        state.final_context, state.tree = len(state.sequence), Tree()
    return state
