"""The asyncio trainer-side client (``httpx.AsyncClient``); same methods as the sync one."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
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


def _now() -> float:
    return asyncio.get_running_loop().time()


class AsyncRolloutClient:
    """Async twin of :class:`gateway.client.RolloutClient` (see its docstrings).

    ``concurrency`` bounds the sample requests :meth:`samples` keeps in flight.
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *,
                 admin_token: str | None = None, trainer_token: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S,
                 poll_interval_s: float = 0.5, concurrency: int = 16,
                 http: httpx.AsyncClient | None = None) -> None:
        self._cfg = ClientBase(base_url, admin_token=admin_token, trainer_token=trainer_token,
                               timeout=timeout_s, poll_interval_s=poll_interval_s)
        self._http = http or httpx.AsyncClient(base_url=self._cfg.base_url, timeout=timeout_s)
        self._owns_http = http is None
        self._concurrency = concurrency

    @property
    def base_url(self) -> str:
        return self._cfg.base_url

    def base_url_for(self, trajectory_id: str, group_id: str | None = None) -> str:
        """The OpenAI base URL for one trajectory: ``{gateway}/g/{group}/t/{id}/v1``."""
        return self._cfg.base_url_for(trajectory_id, group_id)

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def _send(self, req: Request[T]) -> T:
        for attempt in (0, 1):
            try:
                response = await self._http.request(req.method, req.path,
                                                    **self._cfg.request_kwargs(req))
                break
            except STALE_CONNECTION as exc:
                if req.method != "GET" or attempt:
                    raise connection_error(req, self.base_url, exc) from exc
            except httpx.TransportError as exc:
                raise connection_error(req, self.base_url, exc) from exc
        return parse(req, response)

    # -- trajectories ------------------------------------------------------------------

    async def list_trajectories(self, *, group_id: str | None = None,
                                finished: bool | None = None) -> list[TrajectoryInfo]:
        out: list[TrajectoryInfo] = []
        while True:
            page = await self._send(Endpoints.list_page(
                group_id=group_id, finished=finished, limit=PAGE, offset=len(out)))
            out += page
            if len(page) < PAGE:
                return out

    async def trajectory(self, trajectory_id: str) -> dict[str, Any]:
        return await self._send(Endpoints.trajectory(trajectory_id))

    async def finish(self, trajectory_id: str, reward: float | None = None, *,
                     metadata: dict[str, Any] | None = None,
                     group_id: str | None = None,
                     rewards: Mapping[str, float] | None = None) -> TrajectoryInfo:
        return await self._send(Endpoints.finish(trajectory_id, reward, metadata=metadata,
                                                 group_id=group_id, rewards=rewards))

    async def finish_many(self, rewards: Mapping[str, float | None], *,
                          group_id: str | None = None) -> list[TrajectoryInfo]:
        return list(await asyncio.gather(
            *(self.finish(t, r, group_id=group_id) for t, r in rewards.items())))

    async def wait_for_group(self, group_id: str, count: int, *,
                             timeout_s: float = 600.0) -> list[TrajectoryInfo]:
        deadline = _now() + timeout_s
        while True:
            done = await self.list_trajectories(group_id=group_id, finished=True)
            if len(done) >= count:
                return done
            if _now() >= deadline:
                raise WaitTimeout(f"group {group_id!r}: {len(done)} of {count} finished "
                                  f"after {timeout_s:g} s", finished=done)
            await asyncio.sleep(self._cfg.poll_interval_s)

    async def wait_for_trajectories(self, ids: Iterable[str], *,
                                    timeout_s: float = 600.0) -> list[TrajectoryInfo]:
        wanted = list(ids)
        done: dict[str, TrajectoryInfo] = {}
        deadline = _now() + timeout_s
        while True:
            for tid in pending(wanted, done):
                with contextlib.suppress(NotFoundError):
                    info = detail_info(await self.trajectory(tid))
                    if info.finished:
                        done[tid] = info
            if not pending(wanted, done):
                return [done[i] for i in wanted]
            if _now() >= deadline:
                raise WaitTimeout(f"{len(done)} of {len(wanted)} trajectories finished "
                                  f"after {timeout_s:g} s", finished=list(done.values()))
            await asyncio.sleep(self._cfg.poll_interval_s)

    async def mint_key(self, trajectory_id: str, group_id: str | None = None) -> str:
        return await self._send(Endpoints.mint_key(trajectory_id, group_id))

    async def sample(self, trajectory_id: str, branch: int | None = None, *,
                     model: str | None = None) -> Sample:
        return await self._send(Endpoints.sample(trajectory_id, branch, model))

    async def branch_samples(self, trajectory_id: str, branches: Branches = "all", *,
                             model: str | None = None) -> list[Sample]:
        return await self._send(Endpoints.branch_samples(trajectory_id, branches, model))

    async def samples(self, ids: Iterable[str], *, branches: Branches = "all",
                      model: str | None = None) -> SampleBatch:
        """Samples in the order of ``ids`` (each one's branches together), fetched
        ``concurrency`` trajectories at a time."""
        gate = asyncio.Semaphore(self._concurrency)

        async def one(tid: str) -> list[Sample]:
            async with gate:
                return await self.branch_samples(tid, branches, model=model)

        found = await asyncio.gather(*(one(i) for i in ids))
        return SampleBatch([s for branch_list in found for s in branch_list])

    async def fetch_group(self, group_id: str, count: int | None = None, *,
                          timeout_s: float = 600.0, branches: Branches = "all",
                          model: str | None = None) -> SampleBatch:
        """See :meth:`gateway.client.RolloutClient.fetch_group` (one long poll at a time)."""
        return SampleBatch(await self._poll_group(
            lambda wait: Endpoints.group_samples(group_id, count, branches=branches,
                                                 wait_s=wait, model=model),
            group_id, count, timeout_s))

    async def tree(self, trajectory_id: str, *, model: str | None = None) -> SampleTree:
        """A trajectory's branches as one prefix tree: each token once, every generated
        token under loss mask 1 once (docs/token-capture.md); score it in one forward
        pass with :func:`gateway.client.trees.tree_logprobs`."""
        return await self._send(Endpoints.tree(trajectory_id, model))

    async def fetch_group_trees(self, group_id: str, count: int | None = None, *,
                                timeout_s: float = 600.0, model: str | None = None
                                ) -> list[SampleTree]:
        """:meth:`fetch_group`, each trajectory as one prefix tree
        (``GET /groups/{id}/trees``)."""
        return await self._poll_group(
            lambda wait: Endpoints.group_trees(group_id, count, wait_s=wait, model=model),
            group_id, count, timeout_s)

    async def _poll_group(self, request: Callable[[float], Request[T]], group_id: str,
                    count: int | None, timeout_s: float) -> T:
        """Long polls of a group route until it answers or ``timeout_s`` passes."""
        deadline = _now() + timeout_s
        while True:
            try:
                return await self._send(request(long_poll_s(deadline, _now())))
            except GatewayHTTPError as exc:
                timeout = group_timeout(exc, group_id, count, timeout_s)
                if timeout is None:
                    raise
                if _now() >= deadline:
                    raise timeout from None

    # -- weight sync -------------------------------------------------------------------

    async def pause(self, *, mode: str | None = None, wait_idle: bool = False,
                    timeout_s: float = 60.0) -> dict[str, Any]:
        return await self._send(Endpoints.pause(mode=mode, wait_idle=wait_idle,
                                                timeout_s=timeout_s))

    async def resume(self, weight_version: str | None = None) -> dict[str, Any]:
        return await self._send(Endpoints.resume(weight_version))

    async def update_weights(self, version: str, *,
                             push: Callable[[], Awaitable[object]] | None = None,
                             weights_path: str | None = None,
                             mode: str = "abort-and-continue",
                             timeout_s: float = 600.0) -> JobInfo:
        """See :meth:`gateway.client.RolloutClient.update_weights`; ``push`` is async."""
        if (push is None) == (weights_path is None):
            raise ValueError("give exactly one of push and weights_path")
        job_id = await self._send(Endpoints.weight_update(version, mode=mode,
                                                          weights_path=weights_path,
                                                          timeout_s=timeout_s))
        if push is not None:
            deadline = _now() + timeout_s
            while not waiting_for_weights(job := await self.job(job_id)):
                if job.done or _now() >= deadline:
                    return await self.wait_job(job_id, timeout_s=timeout_s)
                await asyncio.sleep(0.02)
            try:
                await push()
            finally:
                await self._send(Endpoints.weight_update_done(job_id))
        return await self.wait_job(job_id, timeout_s=timeout_s)

    async def update_adapter(self, version: str, lora_path: str, *,
                             base_model: str | None = None, keep: int | None = None,
                             timeout_s: float = 600.0, model: str | None = None
                             ) -> JobInfo:
        """See :meth:`gateway.client.RolloutClient.update_adapter`."""
        job_id = await self._send(Endpoints.adapter_update(
            version, lora_path=lora_path, base_model=base_model, keep=keep,
            timeout_s=timeout_s, model=model))
        return await self.wait_job(job_id, timeout_s=timeout_s)

    async def set_weight_version(self, version: str) -> str | None:
        return await self._send(Endpoints.set_weight_version(version))

    @contextlib.asynccontextmanager
    async def weight_sync(self, version: str | None = None, *, wait_idle: bool = True,
                          timeout_s: float = 600.0) -> AsyncIterator[dict[str, Any]]:
        paused = await self.pause(wait_idle=wait_idle, timeout_s=timeout_s)
        try:
            yield paused
            if version is not None:
                await self.set_weight_version(version)
        finally:
            await self.resume()

    # -- pool --------------------------------------------------------------------------

    async def pool(self) -> dict[str, Any]:
        return await self._send(Endpoints.pool())

    async def backends(self) -> list[dict[str, Any]]:
        return await self._send(Endpoints.backends())

    async def resize_pool(self, gpus: int | list[int | str] | None = None, *,
                          layout: list[dict[str, Any]] | None = None, tp: int | None = None,
                          wait: bool = True, timeout_s: float = 600.0) -> JobInfo:
        job_id = await self._send(Endpoints.change_pool(gpus=gpus, layout=layout, tp=tp))
        return await self.wait_job(job_id, timeout_s=timeout_s) if wait else await self.job(job_id)

    async def abort(self, trajectory_id: str, reason: str | None = None) -> dict[str, Any]:
        return await self._send(Endpoints.abort(trajectory_id, reason))

    async def restart(self, trajectory_id: str) -> int:
        return await self._send(Endpoints.restart(trajectory_id))

    async def set_max_staleness(self, bound: int | None, *, model: str | None = None
                                ) -> dict[str, Any]:
        return await self._send(Endpoints.set_max_staleness(bound, model))

    async def policy(self) -> dict[str, Any]:
        return await self._send(Endpoints.policy())

    async def set_policy(self, name: str) -> dict[str, Any]:
        return await self._send(Endpoints.set_policy(name))

    async def report_mismatch(self, report: MismatchReport) -> MismatchReport:
        """Post a step's training-inference mismatch (see :meth:`RolloutClient.report_mismatch`)."""
        return await self._send(Endpoints.report_mismatch(report))

    async def job(self, job_id: str) -> JobInfo:
        return await self._send(Endpoints.job(job_id))

    async def wait_job(self, job_id: str, *, timeout_s: float = 600.0) -> JobInfo:
        deadline = _now() + timeout_s
        while not (job := await self.job(job_id)).done:
            if _now() >= deadline:
                raise WaitTimeout(f"job {job_id} still {job.status.value} after {timeout_s:g} s")
            await asyncio.sleep(min(self._cfg.poll_interval_s, 0.2))
        if not job.succeeded:
            raise JobFailed(f"job {job_id} {job.status.value}: {'; '.join(job.errors)}",
                            job=job.raw)
        return job

    # -- gateway -----------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        return await self._send(Endpoints.status())

    async def wait_ready(self, *, timeout_s: float = 30.0) -> None:
        deadline = _now() + timeout_s
        while True:
            try:
                await self._send(Endpoints.health())
                return
            except GatewayClientError:
                if _now() >= deadline:
                    raise
            await asyncio.sleep(0.1)
