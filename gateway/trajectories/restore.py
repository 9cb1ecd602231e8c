"""Resume a trajectory the gateway does not hold in memory from what the store recorded.

After a restart (or an eviction) the tracker has forgotten a trajectory's token state and
sequence number. The first call of such an id asks the store for its latest attempt and
rebuilds the state an uninterrupted gateway would hold: the next ``seq``, each branch's
last prompt + completion tokens (so the next prompt is stored as a delta on the branch it
extends; the messages behind them are not stored, so a harness's re-rendering of its
history is joined to the record again only from the second call after the restart),
its group, and whether the attempt was finished (a call on a finished attempt opens the
next one). Concurrent first calls of one id share one lookup.

Almost every id the gateway has not seen is new (an RL batch starts hundreds of fresh
trajectories at once), so the lookup starts with one existence query for all the unknown
ids that arrived within ``batch_window_s`` of each other; only ids the store knows are
then loaded one by one. A batch start costs one query, not one per trajectory.

The lookup is best effort: with the database unreachable the call goes on as a fresh
trajectory (logged and counted), never held or failed because of it; after a failed
lookup (at most ``timeout_s``) none is tried for ``cooldown_s``, so an outage does not
add a lookup timeout to every new trajectory's first call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from collections.abc import Callable

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.store import queries
from gateway.store.codec import unpack_ids
from gateway.store.samples import build_samples
from gateway.trajectories.branches import Branch, Tree
from gateway.trajectories.tracker import Tracker, TrajectoryState

log = logging.getLogger(__name__)


class Restorer:
    def __init__(self, tracker: Tracker, sessionmaker: async_sessionmaker[AsyncSession], *,
                 timeout_s: float = 1.0, cooldown_s: float = 5.0, batch_window_s: float = 0.001,
                 db_ok: Callable[[], bool] = lambda: True) -> None:
        self.tracker = tracker
        self.sessionmaker = sessionmaker
        self.timeout_s = timeout_s
        self.db_ok = db_ok
        self.cooldown_s = cooldown_s
        self.batch_window_s = batch_window_s
        self._down_until = 0.0  # after a failed lookup, skip lookups until then
        self.restored = 0
        self.failures = 0
        self.existence_queries = 0
        self._pending: dict[str, asyncio.Task[TrajectoryState | None]] = {}
        self._asking: dict[str, asyncio.Future[bool]] = {}  # the next existence query
        self._flusher: asyncio.Task[None] | None = None

    async def restore(self, trajectory_id: str) -> TrajectoryState | None:
        """The tracker's state for ``trajectory_id``, loaded from the store if the tracker
        does not know it; None when neither knows it (a new trajectory)."""
        state = self.tracker.get(trajectory_id)
        if state is not None or not self.db_ok() or time.monotonic() < self._down_until:
            return state
        task = self._pending.get(trajectory_id)
        if task is None:
            task = asyncio.create_task(self._load(trajectory_id))
            self._pending[trajectory_id] = task
            task.add_done_callback(lambda _t: self._pending.pop(trajectory_id, None))
        return await asyncio.shield(task)

    async def _known(self, trajectory_id: str) -> bool:
        """Whether the store has ``trajectory_id``, asked together with the other ids that
        arrive within the batch window."""
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._asking[trajectory_id] = fut
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._ask())
        return await fut

    async def _ask(self) -> None:
        """Ask for every id waiting, batch after batch, until none waits (ids that come
        while a query runs go into the next one)."""
        while self._asking:
            await asyncio.sleep(self.batch_window_s)
            asking, self._asking = self._asking, {}
            try:
                async with asyncio.timeout(self.timeout_s), self.sessionmaker() as session:
                    self.existence_queries += 1
                    known = await queries.known_trajectories(session, list(asking))
            except Exception as exc:  # every waiting call goes on as new (and rests)
                self._fail_waiting(asking, exc)
                return
            except asyncio.CancelledError:  # shutting down: nobody waits forever
                self._fail_waiting(asking, RuntimeError("restore lookup cancelled"))
                raise
            for tid, fut in asking.items():
                if not fut.done():
                    fut.set_result(tid in known)

    def _fail_waiting(self, asking: dict[str, asyncio.Future[bool]], exc: Exception) -> None:
        """Fail this batch and the ids that came while it ran."""
        waiting, self._asking = (*asking.values(), *self._asking.values()), {}
        for fut in waiting:
            if not fut.done():
                fut.set_exception(exc)

    async def _load(self, trajectory_id: str) -> TrajectoryState | None:
        try:
            if not await self._known(trajectory_id):
                return self.tracker.get(trajectory_id)  # new (or a call created it meanwhile)
            async with asyncio.timeout(self.timeout_s), self.sessionmaker() as session:
                point = await queries.restore_point(session, trajectory_id=trajectory_id)
        except Exception as exc:
            self.failures += 1
            self._down_until = time.monotonic() + self.cooldown_s  # never stall every call
            log.warning("could not restore trajectory %r from the store (%s: %s); it goes on "
                        "as new", trajectory_id, type(exc).__name__, exc)
            return None
        known = self.tracker.get(trajectory_id)
        if point is None or known is not None:  # new, or a call created it meanwhile
            return known
        state = _state_of(point)
        self.restored += 1
        log.info("restored trajectory %r attempt %d from the store (%d calls, %d tokens)",
                 trajectory_id, point.attempt, state.turns, len(state.sequence))
        return self.tracker.adopt(state)


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
    samples = build_samples(traj, calls, attempt=point.attempt)
    state.mismatches = sum(len(s.mismatches) for s in samples)
    for s in sorted(samples, key=lambda s: s.main):  # the main branch last: it stays main
        state.tree.adopt(Branch(s.branch, s.parent_branch, array("i", s.token_ids)))
    if point.finished and traj.finished_at is not None:
        state.finished_at, state.reward = traj.finished_at.timestamp(), traj.reward
        state.final_context, state.tree = len(state.sequence), Tree()
    return state
