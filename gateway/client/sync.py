"""The blocking trainer-side client (``httpx.Client``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any, Self, TypeVar

import httpx

from gateway.client._base import (
    DEFAULT_TIMEOUT_S,
    PAGE,
    STALE_CONNECTION,
    ClientBase,
    Endpoints,
    Request,
    connection_error,
    group_timeout,
    long_poll_s,
    parse,
    pending,
)
from gateway.client.errors import (
    GatewayClientError,
    GatewayHTTPError,
    JobFailed,
    NotFoundError,
    WaitTimeout,
)
from gateway.client.types import (
    JobInfo,
    SampleBatch,
    TrajectoryInfo,
    detail_info,
    waiting_for_weights,
)
from gateway.schema.mismatch import MismatchReport
from gateway.schema.samples import Branches, Sample, SampleTree

T = TypeVar("T")


class RolloutClient:
    """Talks to one gateway over its REST API; the gateway's store is the only truth.

    ``base_url`` is the gateway's root (``http://host:8000``, no ``/v1``). Once the
    gateway has credentials configured, the trajectory API needs ``trainer_token`` (or
    the admin token), and pause/resume, weight versions, the pool and the policy need
    ``admin_token``; each is sent where it is needed. Use as a context manager, or call
    :meth:`close`.
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *,
                 admin_token: str | None = None, trainer_token: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S,
                 poll_interval_s: float = 0.5, http: httpx.Client | None = None) -> None:
        self._cfg = ClientBase(base_url, admin_token=admin_token, trainer_token=trainer_token,
                               timeout=timeout_s, poll_interval_s=poll_interval_s)
        self._http = http or httpx.Client(base_url=self._cfg.base_url, timeout=timeout_s)
        self._owns_http = http is None

    @property
    def base_url(self) -> str:
        return self._cfg.base_url

    def base_url_for(self, trajectory_id: str, group_id: str | None = None) -> str:
        """The OpenAI base URL for one trajectory: ``{gateway}/g/{group}/t/{id}/v1``."""
        return self._cfg.base_url_for(trajectory_id, group_id)

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _send(self, req: Request[T]) -> T:
        for attempt in (0, 1):
            try:
                response = self._http.request(req.method, req.path,
                                              **self._cfg.request_kwargs(req))
                break
            except STALE_CONNECTION as exc:
                if req.method != "GET" or attempt:
                    raise connection_error(req, self.base_url, exc) from exc
            except httpx.TransportError as exc:
                raise connection_error(req, self.base_url, exc) from exc
        return parse(req, response)

    # -- trajectories ------------------------------------------------------------------

    def list_trajectories(self, *, group_id: str | None = None,
                          finished: bool | None = None) -> list[TrajectoryInfo]:
        """Every matching trajectory, oldest first (pages through ``GET /trajectories``)."""
        out: list[TrajectoryInfo] = []
        while True:
            page = self._send(Endpoints.list_page(group_id=group_id, finished=finished,
                                                  limit=PAGE, offset=len(out)))
            out += page
            if len(page) < PAGE:
                return out

    def trajectory(self, trajectory_id: str) -> dict[str, Any]:
        """``GET /trajectories/{id}``: the trajectory with its calls' token traces."""
        return self._send(Endpoints.trajectory(trajectory_id))

    def finish(self, trajectory_id: str, reward: float | None = None, *,
               metadata: dict[str, Any] | None = None,
               group_id: str | None = None,
               rewards: Mapping[str, float] | None = None) -> TrajectoryInfo:
        """Mark a trajectory finished with its reward (idempotent: the last call wins);
        ``rewards``: each policy's own by model name, where its calls were of several
        (a solver and a verifier): the samples of one policy carry its own."""
        return self._send(Endpoints.finish(trajectory_id, reward, metadata=metadata,
                                           group_id=group_id, rewards=rewards))

    def finish_many(self, rewards: Mapping[str, float | None], *,
                    group_id: str | None = None) -> list[TrajectoryInfo]:
        return [self.finish(t, r, group_id=group_id) for t, r in rewards.items()]

    def wait_for_group(self, group_id: str, count: int, *,
                       timeout_s: float = 600.0) -> list[TrajectoryInfo]:
        """Block until ``count`` trajectories of ``group_id`` are finished; returns them.

        Raises :class:`WaitTimeout` (with ``finished``) when ``timeout_s`` seconds pass first.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            done = self.list_trajectories(group_id=group_id, finished=True)
            if len(done) >= count:
                return done
            if time.monotonic() >= deadline:
                raise WaitTimeout(f"group {group_id!r}: {len(done)} of {count} finished "
                                  f"after {timeout_s:g} s", finished=done)
            time.sleep(self._cfg.poll_interval_s)

    def wait_for_trajectories(self, ids: Iterable[str], *,
                              timeout_s: float = 600.0) -> list[TrajectoryInfo]:
        """Block until every id is finished (ids not recorded yet count as unfinished)."""
        wanted = list(ids)
        done: dict[str, TrajectoryInfo] = {}
        deadline = time.monotonic() + timeout_s
        while True:
            for tid in pending(wanted, done):
                with contextlib.suppress(NotFoundError):
                    info = detail_info(self.trajectory(tid))
                    if info.finished:
                        done[tid] = info
            if not pending(wanted, done):
                return [done[i] for i in wanted]
            if time.monotonic() >= deadline:
                raise WaitTimeout(f"{len(done)} of {len(wanted)} trajectories finished "
                                  f"after {timeout_s:g} s", finished=list(done.values()))
            time.sleep(self._cfg.poll_interval_s)

    def mint_key(self, trajectory_id: str, group_id: str | None = None) -> str:
        """A harness key for this trajectory only (and ``group_id``, if given: without
        one its calls have no group): hand the harness ``OPENAI_BASE_URL={gateway}/v1``
        and ``OPENAI_API_KEY=<key>``; its calls are tagged with the trajectory, and a call
        naming another trajectory or group is refused."""
        return self._send(Endpoints.mint_key(trajectory_id, group_id))

    def sample(self, trajectory_id: str, branch: int | None = None, *,
               model: str | None = None) -> Sample:
        """One branch of a trajectory as a training sample (token ids, loss mask,
        logprobs, ...); by default its main branch (the one of its last call). ``model``
        (here and in the other sample methods): one policy's samples, when a trajectory
        calls several (docs/weight-updates.md, "Several policies")."""
        return self._send(Endpoints.sample(trajectory_id, branch, model))

    def branch_samples(self, trajectory_id: str, branches: Branches = "all", *,
                       model: str | None = None) -> list[Sample]:
        """A trajectory's branches as samples (docs/token-capture.md: trees)."""
        return self._send(Endpoints.branch_samples(trajectory_id, branches, model))

    def samples(self, ids: Iterable[str], *, branches: Branches = "all",
                model: str | None = None) -> SampleBatch:
        """The samples of ``ids``, in order; every branch of each by default, so every
        generated token is in the batch under loss mask 1 exactly once."""
        return SampleBatch([s for i in ids
                            for s in self.branch_samples(i, branches, model=model)])

    def fetch_group(self, group_id: str, count: int | None = None, *,
                    timeout_s: float = 600.0, branches: Branches = "all",
                    model: str | None = None) -> SampleBatch:
        """Samples of a group's finished trajectories (each one's branches together, by
        creation time); with ``count``, wait until that many are finished. The gateway
        waits and answers the whole group at once (``GET /groups/{id}/samples``).
        Raises :class:`WaitTimeout` (``finished``: the ids) when ``timeout_s`` passes."""
        return SampleBatch(self._poll_group(
            lambda wait: Endpoints.group_samples(group_id, count, branches=branches,
                                                 wait_s=wait, model=model),
            group_id, count, timeout_s))

    def tree(self, trajectory_id: str, *, model: str | None = None) -> SampleTree:
        """A trajectory's branches as one prefix tree: each token once, every generated
        token under loss mask 1 once (docs/token-capture.md); score it in one forward
        pass with :func:`gateway.client.trees.tree_logprobs`."""
        return self._send(Endpoints.tree(trajectory_id, model))

    def fetch_group_trees(self, group_id: str, count: int | None = None, *,
                          timeout_s: float = 600.0, model: str | None = None
                          ) -> list[SampleTree]:
        """:meth:`fetch_group`, each trajectory as one prefix tree
        (``GET /groups/{id}/trees``)."""
        return self._poll_group(
            lambda wait: Endpoints.group_trees(group_id, count, wait_s=wait, model=model),
            group_id, count, timeout_s)

    def _poll_group(self, request: Callable[[float], Request[T]], group_id: str,
                    count: int | None, timeout_s: float) -> T:
        """Long polls of a group route until it answers or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self._send(request(long_poll_s(deadline, time.monotonic())))
            except GatewayHTTPError as exc:
                timeout = group_timeout(exc, group_id, count, timeout_s)
                if timeout is None:
                    raise
                if time.monotonic() >= deadline:
                    raise timeout from None

    # -- weight sync -------------------------------------------------------------------

    def pause(self, *, mode: str | None = None, wait_idle: bool = False,
              timeout_s: float = 60.0) -> dict[str, Any]:
        """Hold (``mode="wait"``) or refuse (``"reject"``) new calls; in-flight ones finish.
        With ``wait_idle`` the answer comes once nothing is in flight (``idle`` says if)."""
        return self._send(Endpoints.pause(mode=mode, wait_idle=wait_idle, timeout_s=timeout_s))

    def resume(self, weight_version: str | None = None) -> dict[str, Any]:
        """Open the gate; with ``weight_version``, set it (and tell paused engines) first."""
        return self._send(Endpoints.resume(weight_version))

    def update_weights(self, version: str, *, push: Callable[[], object] | None = None,
                       weights_path: str | None = None, mode: str = "abort-and-continue",
                       timeout_s: float = 600.0) -> JobInfo:
        """One weight update on every engine: pause (``mode``: ``wait``, ``keep`` or
        ``abort-and-continue``), then either the engines reload ``weights_path`` or
        ``push()`` runs (the trainer sends the weights itself), then ``version`` is set
        and the engines resume. Returns the finished job (phases with timings); raises
        :class:`JobFailed` if a step failed (the gateway resumed with the old version)."""
        if (push is None) == (weights_path is None):
            raise ValueError("give exactly one of push and weights_path")
        job_id = self._send(Endpoints.weight_update(version, mode=mode,
                                                    weights_path=weights_path,
                                                    timeout_s=timeout_s))
        if push is not None:
            deadline = time.monotonic() + timeout_s
            while not waiting_for_weights(job := self.job(job_id)):
                if job.done or time.monotonic() >= deadline:
                    return self.wait_job(job_id, timeout_s=timeout_s)
                time.sleep(0.02)
            try:
                push()
            finally:  # the job resumes either way; if push raised, it raises here
                self._send(Endpoints.weight_update_done(job_id))
        return self.wait_job(job_id, timeout_s=timeout_s)

    def update_adapter(self, version: str, lora_path: str, *, base_model: str | None = None,
                       keep: int | None = None, timeout_s: float = 600.0,
                       model: str | None = None) -> JobInfo:
        """A LoRA weight update, no engine paused: every engine loads the adapter at
        ``lora_path`` (a directory the engines can read: ``adapter_config.json`` and the
        adapter's weights, as peft's ``save_pretrained`` writes them), and calls on
        ``base_model`` (default: the one model served) run on it from now on, stamped with
        ``version``; calls running finish on the adapter they started on. ``keep``: adapters
        kept loaded, this one included (default: the staleness bound + 1). ``model``: the
        adapter family (a policy calls ask for by that name, served on ``base_model``'s
        engines with its own weight version; default: the base model's own). Returns the
        finished job; raises :class:`JobFailed` if an engine refused it (it was unloaded
        again from the others: nothing changed)."""
        job_id = self._send(Endpoints.adapter_update(version, lora_path=lora_path,
                                                     base_model=base_model, keep=keep,
                                                     timeout_s=timeout_s, model=model))
        return self.wait_job(job_id, timeout_s=timeout_s)

    def set_weight_version(self, version: str) -> str | None:
        """Stamp calls dispatched from now on with ``version``; returns the previous one."""
        return self._send(Endpoints.set_weight_version(version))

    @contextlib.contextmanager
    def weight_sync(self, version: str | None = None, *, wait_idle: bool = True,
                    timeout_s: float = 600.0) -> Iterator[dict[str, Any]]:
        """Pause (waiting until idle), run the block (load the new weights), then set
        ``version`` and resume. The gateway resumes even if the block raises, and the
        version is only bumped when it did not."""
        paused = self.pause(wait_idle=wait_idle, timeout_s=timeout_s)
        try:
            yield paused
            if version is not None:
                self.set_weight_version(version)
        finally:
            self.resume()

    # -- pool --------------------------------------------------------------------------

    def pool(self) -> dict[str, Any]:
        """``GET /admin/pool``: instances, layout, pause state (see docs/pool.md)."""
        return self._send(Endpoints.pool())

    def backends(self) -> list[dict[str, Any]]:
        return self._send(Endpoints.backends())

    def resize_pool(self, gpus: int | list[int | str] | None = None, *,
                    layout: list[dict[str, Any]] | None = None, tp: int | None = None,
                    wait: bool = True, timeout_s: float = 600.0) -> JobInfo:
        """Resize (``gpus``) and/or re-lay-out (``layout=[{"tp": 2, "count": 2}]``) the
        managed pool. With ``wait`` block until the job ends; raises :class:`JobFailed`."""
        job_id = self._send(Endpoints.change_pool(gpus=gpus, layout=layout, tp=tp))
        return self.wait_job(job_id, timeout_s=timeout_s) if wait else self.job(job_id)

    def abort(self, trajectory_id: str, reason: str | None = None) -> dict[str, Any]:
        """Abort the trajectory's live attempt (docs/step-modes.md): calls generating on
        an engine end with ``finish_reason: "abort"``, later calls are refused (409
        ``trajectory_aborted``) until :meth:`restart`; it is left out of group fetches."""
        return self._send(Endpoints.abort(trajectory_id, reason))

    def restart(self, trajectory_id: str) -> int:
        """Lift an abort; returns the attempt the id's next call opens."""
        return self._send(Endpoints.restart(trajectory_id))

    def set_max_staleness(self, bound: int | None, *, model: str | None = None
                          ) -> dict[str, Any]:
        """Abort live trajectories that started (first call) more than ``bound`` weight
        versions behind (checked at each version change; None lifts it); with ``model``,
        that model's bound alone (its versions counted apart)."""
        return self._send(Endpoints.set_max_staleness(bound, model))

    def policy(self) -> dict[str, Any]:
        """``GET /admin/policy``: the active scheduling policy and the ones available."""
        return self._send(Endpoints.policy())

    def set_policy(self, name: str) -> dict[str, Any]:
        """Switch the scheduling policy at run time (queued calls are rescheduled)."""
        return self._send(Endpoints.set_policy(name))

    def report_mismatch(self, report: MismatchReport) -> MismatchReport:
        """Post a step's training-inference mismatch (:mod:`gateway.client.mismatch`); the
        answer is the report as the gateway judged it (``alarms`` against its limits)."""
        return self._send(Endpoints.report_mismatch(report))

    def job(self, job_id: str) -> JobInfo:
        return self._send(Endpoints.job(job_id))

    def wait_job(self, job_id: str, *, timeout_s: float = 600.0) -> JobInfo:
        deadline = time.monotonic() + timeout_s
        while not (job := self.job(job_id)).done:
            if time.monotonic() >= deadline:
                raise WaitTimeout(f"job {job_id} still {job.status.value} after {timeout_s:g} s")
            time.sleep(min(self._cfg.poll_interval_s, 0.2))
        if not job.succeeded:
            raise JobFailed(f"job {job_id} {job.status.value}: {'; '.join(job.errors)}",
                            job=job.raw)
        return job

    # -- gateway -----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return self._send(Endpoints.status())

    def wait_ready(self, *, timeout_s: float = 30.0) -> None:
        """Block until ``GET /health`` answers 200 (the gateway has started)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._send(Endpoints.health())
                return
            except GatewayClientError:
                if time.monotonic() >= deadline:
                    raise
            time.sleep(0.1)

