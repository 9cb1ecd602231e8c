"""The REST calls both clients make, described once; the sync and async clients only send.

Each endpoint is a :class:`Request`: method, path, query, body and how to read the
answer. Nothing here does I/O, so :class:`RolloutClient` and :class:`AsyncRolloutClient`
cannot drift apart in paths or shapes.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx

from gateway.client.errors import (
    GatewayConnectionError,
    GatewayHTTPError,
    WaitTimeout,
    raise_for_response,
)
from gateway.client.types import (
    JobInfo,
    TrajectoryInfo,
    finished_from_json,
    group_samples_from_json,
    group_trees_from_json,
    infos_from_json,
    job_from_json,
    sample_from_json,
    samples_from_json,
    tree_from_json,
)
from gateway.schema.ids import ID_PATTERN
from gateway.schema.jobs import JobRef
from gateway.schema.mismatch import MismatchReport
from gateway.schema.samples import Branches, Sample, SampleTree
from gateway.schema.trajectories import HarnessKey
from gateway.schema.weights import WeightVersionChange

T = TypeVar("T")
PAGE = 1000  # rows per GET /trajectories page
DEFAULT_TIMEOUT_S = 30.0
#: seconds one request to ``GET /groups/{id}/samples`` waits on the server; a longer
#: wait is several of them, so no idle connection outlives a proxy's timeout
LONG_POLL_S = 60.0


#: a connection the server closed as a request went out on it (an idle keep-alive
#: connection reaped by the server's timeout at that moment): a GET is sent again, once
STALE_CONNECTION = (httpx.ReadError, httpx.RemoteProtocolError)


@dataclass(frozen=True, slots=True)
class Request(Generic[T]):
    method: str
    path: str
    parse: Callable[[Any], T]
    params: dict[str, Any] | None = None
    json: Any = None
    #: seconds; ``None`` keeps the client's default
    timeout: float | None = None


def check_id(value: str, what: str = "trajectory_id") -> str:
    """``value`` if the gateway accepts it as an id, else ``ValueError`` (before any call)."""
    if not ID_PATTERN.fullmatch(value):
        raise ValueError(f"invalid {what} {value!r}: use 1-128 characters from "
                         "[A-Za-z0-9._:@+=-], starting with a letter or digit")
    return value


def new_id(prefix: str = "traj") -> str:
    """A fresh id the gateway accepts, e.g. ``traj-3f9c0a1b2c4d``."""
    return check_id(f"{prefix}-{uuid.uuid4().hex[:12]}")


def openai_base_url(gateway_url: str, trajectory_id: str, group_id: str | None = None) -> str:
    """The ``OPENAI_BASE_URL`` that tags every call of a harness with its trajectory."""
    # validated ids only hold characters that are literal in a URL path
    root, traj = gateway_url.rstrip("/"), check_id(trajectory_id)
    if group_id is None:
        return f"{root}/t/{traj}/v1"
    return f"{root}/g/{check_id(group_id, 'group_id')}/t/{traj}/v1"


def session_headers(trajectory_id: str, group_id: str | None = None) -> dict[str, str]:
    """Headers that tag calls when the harness cannot change its base URL."""
    headers = {"X-Session-ID": check_id(trajectory_id)}
    if group_id is not None:
        headers["X-Group-Id"] = check_id(group_id, "group_id")
    return headers


def _dict(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise TypeError(f"expected a JSON object, got {type(body).__name__}")
    return body


def _given(**values: Any) -> dict[str, Any]:
    """The parameters that are set (None: left to the gateway's default)."""
    return {k: v for k, v in values.items() if v is not None}


def _job_id(body: Any) -> str:
    """The id of the job a request started (``202``)."""
    return JobRef.model_validate(body).job


def _path_id(value: str, what: str = "trajectory_id") -> str:
    return check_id(value, what)


class Endpoints:
    """One static method per REST call of the gateway the clients use."""

    @staticmethod
    def list_page(*, group_id: str | None, finished: bool | None, limit: int,
                  offset: int) -> Request[list[TrajectoryInfo]]:
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        if group_id is not None:
            params["group_id"] = check_id(group_id, "group_id")
        if finished is not None:
            params["finished"] = "true" if finished else "false"
        return Request("GET", "/trajectories", infos_from_json, params=params)

    @staticmethod
    def trajectory(trajectory_id: str) -> Request[dict[str, Any]]:
        return Request("GET", f"/trajectories/{_path_id(trajectory_id)}", _dict)

    @staticmethod
    def finish(trajectory_id: str, reward: float | None, *, metadata: dict[str, Any] | None,
               group_id: str | None, rewards: Mapping[str, float] | None = None
               ) -> Request[TrajectoryInfo]:
        body: dict[str, Any] = {"reward": reward}
        if rewards is not None:
            body["rewards"] = dict(rewards)
        if metadata is not None:
            body["metadata"] = metadata
        if group_id is not None:
            body["group_id"] = check_id(group_id, "group_id")
        return Request("POST", f"/trajectories/{_path_id(trajectory_id)}/finish",
                       finished_from_json, json=body)

    @staticmethod
    def sample(trajectory_id: str, branch: int | None = None, model: str | None = None
               ) -> Request[Sample]:
        return Request("GET", f"/trajectories/{_path_id(trajectory_id)}/sample",
                       sample_from_json, params=_given(branch=branch, model=model) or None)

    @staticmethod
    def branch_samples(trajectory_id: str, branches: Branches, model: str | None = None
                       ) -> Request[list[Sample]]:
        return Request("GET", f"/trajectories/{_path_id(trajectory_id)}/samples",
                       samples_from_json, params=_given(branches=branches, model=model))

    @staticmethod
    def group_samples(group_id: str, count: int | None, *, wait_s: float,
                      branches: Branches, model: str | None = None) -> Request[list[Sample]]:
        """One long poll of ``GET /groups/{id}/samples`` (answers 408 after ``wait_s``)."""
        params = _given(timeout_s=round(wait_s, 3), branches=branches, count=count,
                        model=model)
        return Request("GET", f"/groups/{_path_id(group_id, 'group_id')}/samples",
                       group_samples_from_json, params=params,
                       timeout=wait_s + DEFAULT_TIMEOUT_S)

    @staticmethod
    def tree(trajectory_id: str, model: str | None = None) -> Request[SampleTree]:
        return Request("GET", f"/trajectories/{_path_id(trajectory_id)}/tree",
                       tree_from_json, params=_given(model=model) or None)

    @staticmethod
    def group_trees(group_id: str, count: int | None, *, wait_s: float,
                    model: str | None = None) -> Request[list[SampleTree]]:
        """One long poll of ``GET /groups/{id}/trees`` (answers 408 after ``wait_s``)."""
        params = _given(timeout_s=round(wait_s, 3), count=count, model=model)
        return Request("GET", f"/groups/{_path_id(group_id, 'group_id')}/trees",
                       group_trees_from_json, params=params,
                       timeout=wait_s + DEFAULT_TIMEOUT_S)

    @staticmethod
    def mint_key(trajectory_id: str, group_id: str | None) -> Request[str]:
        body = None if group_id is None else {"group_id": check_id(group_id, "group_id")}
        return Request("POST", f"/trajectories/{_path_id(trajectory_id)}/key",
                       lambda b: HarnessKey.model_validate(b).key, json=body)

    @staticmethod
    def pause(*, mode: str | None, wait_idle: bool, timeout_s: float
              ) -> Request[dict[str, Any]]:
        body: dict[str, Any] = {"wait_idle": wait_idle, "timeout_s": timeout_s}
        if mode is not None:
            body["mode"] = mode
        return Request("POST", "/admin/pause", _dict, json=body,
                       timeout=timeout_s + DEFAULT_TIMEOUT_S if wait_idle else None)

    @staticmethod
    def resume(weight_version: str | None = None) -> Request[dict[str, Any]]:
        body = None if weight_version is None else {"weight_version": weight_version}
        return Request("POST", "/admin/resume", _dict, json=body)

    @staticmethod
    def weight_update(version: str, *, mode: str, weights_path: str | None,
                      timeout_s: float) -> Request[str]:
        body: dict[str, Any] = {"version": version, "mode": mode, "timeout_s": timeout_s,
                                "method": "reload" if weights_path else "external"}
        if weights_path:
            body["weights_path"] = weights_path
        return Request("POST", "/admin/weight-update", _job_id, json=body)

    @staticmethod
    def adapter_update(version: str, *, lora_path: str, base_model: str | None,
                       keep: int | None, timeout_s: float, model: str | None = None
                       ) -> Request[str]:
        body = _given(version=version, method="lora", lora_path=lora_path,
                      timeout_s=timeout_s, base_model=base_model, keep=keep, model=model)
        return Request("POST", "/admin/weight-update", _job_id, json=body)

    @staticmethod
    def weight_update_done(job_id: str) -> Request[dict[str, Any]]:
        return Request("POST", f"/admin/weight-update/{quote(job_id, safe='')}/done", _dict)

    @staticmethod
    def set_weight_version(version: str) -> Request[str | None]:
        return Request("PUT", "/admin/weight-version",
                       lambda b: WeightVersionChange.model_validate(b).previous,
                       json={"version": version})

    @staticmethod
    def pool() -> Request[dict[str, Any]]:
        return Request("GET", "/admin/pool", _dict)

    @staticmethod
    def change_pool(*, gpus: int | list[int | str] | None, layout: list[dict[str, Any]] | None,
                    tp: int | None) -> Request[str]:
        body = {k: v for k, v in (("gpus", gpus), ("layout", layout), ("tp", tp))
                if v is not None}
        if not body:
            raise ValueError("give gpus, layout or tp")
        return Request("PUT", "/admin/pool", _job_id, json=body)

    @staticmethod
    def abort(trajectory_id: str, reason: str | None) -> Request[dict[str, Any]]:
        body = {"reason": reason} if reason else None
        return Request("POST", f"/trajectories/{_path_id(trajectory_id)}/abort", _dict,
                       json=body)

    @staticmethod
    def restart(trajectory_id: str) -> Request[int]:
        return Request("POST", f"/trajectories/{_path_id(trajectory_id)}/restart",
                       lambda b: int(_dict(b)["next_attempt"]))

    @staticmethod
    def set_max_staleness(bound: int | None, model: str | None = None
                          ) -> Request[dict[str, Any]]:
        return Request("PUT", "/admin/staleness", _dict,
                       json={"max_staleness": bound, **_given(model=model)})

    @staticmethod
    def policy() -> Request[dict[str, Any]]:
        return Request("GET", "/admin/policy", _dict)

    @staticmethod
    def set_policy(name: str) -> Request[dict[str, Any]]:
        return Request("PUT", "/admin/policy", _dict, json={"policy": name})

    @staticmethod
    def job(job_id: str) -> Request[JobInfo]:
        return Request("GET", f"/admin/jobs/{quote(job_id, safe='')}", job_from_json)

    @staticmethod
    def backends() -> Request[list[dict[str, Any]]]:
        return Request("GET", "/admin/backends", lambda b: list(_dict(b)["data"]))

    @staticmethod
    def report_mismatch(report: MismatchReport) -> Request[MismatchReport]:
        return Request("POST", "/training/mismatch", MismatchReport.model_validate,
                       json=report.model_dump(mode="json", exclude={"received_at"}))

    @staticmethod
    def status() -> Request[dict[str, Any]]:
        return Request("GET", "/status", _dict)

    @staticmethod
    def health() -> Request[dict[str, Any]]:
        return Request("GET", "/health", _dict)


class ClientBase:
    """Configuration and URL helpers shared by both clients."""

    def __init__(self, base_url: str, *, admin_token: str | None, timeout: float,
                 poll_interval_s: float, trainer_token: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.admin_token = admin_token
        self.trainer_token = trainer_token
        self.timeout = timeout
        self.poll_interval_s = poll_interval_s

    def _headers(self, path: str) -> dict[str, str]:
        """The admin token on the admin API, the trainer token elsewhere (each falls
        back to the other: the admin token works on every route)."""
        if path.startswith("/admin"):
            token = self.admin_token or self.trainer_token
        else:
            token = self.trainer_token or self.admin_token
        return {"Authorization": f"Bearer {token}"} if token else {}

    def base_url_for(self, trajectory_id: str, group_id: str | None = None) -> str:
        """The OpenAI base URL for one trajectory: ``{gateway}/g/{group}/t/{id}/v1``."""
        return openai_base_url(self.base_url, trajectory_id, group_id)

    def request_kwargs(self, req: Request[Any]) -> dict[str, Any]:
        kw: dict[str, Any] = {"params": req.params, "json": req.json,
                              "headers": self._headers(req.path)}
        if req.timeout is not None:
            kw["timeout"] = req.timeout
        return kw


def parse(req: Request[T], response: httpx.Response) -> T:
    raise_for_response(response)
    return req.parse(response.json())


def connection_error(req: Request[Any], base_url: str, exc: httpx.TransportError
                     ) -> GatewayConnectionError:
    return GatewayConnectionError(
        f"{req.method} {base_url}{req.path} failed: {type(exc).__name__}: {exc}")


def long_poll_s(deadline: float, now: float) -> float:
    """How long the next ``GET /groups/{id}/samples`` may wait on the server."""
    return min(LONG_POLL_S, max(0.0, deadline - now))


def group_timeout(exc: GatewayHTTPError, group_id: str, count: int | None,
                  timeout_s: float) -> WaitTimeout | None:
    """The :class:`WaitTimeout` that the group route's 408 (fewer than ``count``
    finished) becomes, with the finished ids; ``None`` for any other error."""
    if exc.status_code != 408 or not isinstance(exc.detail, dict):
        return None
    ids = [str(i) for i in exc.detail.get("trajectory_ids") or ()]
    return WaitTimeout(f"group {group_id!r}: {len(ids)} of {count} finished after "
                       f"{timeout_s:g} s", finished=ids)


def pending(ids: Iterable[str], done: dict[str, TrajectoryInfo]) -> list[str]:
    return [i for i in ids if i not in done]
