"""The sharded front checks a trajectory-API caller before it asks the shards anything
with its own admin token: a caller without the trainer's credential gets its 401 or 403
at once and makes no shard flush its trace writer (a flush waits on the store: with the
store down, a flood of unauthenticated reads used to hold every shard's admin API).

Two stand-in shards (real HTTP servers) record every request they get and take
``FLUSH_S`` to answer ``POST /admin/flush``, as a shard whose store is down does; the
front under test is the real one, over real sockets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse

from gateway.config import Settings
from gateway.shards.front import create_front_app
from tests.servers import LoopThread, app_in_thread

ADMIN, TRAINER, HARNESS = "adm-Secret-1", "trn-Secret-2", "hk-Secret-3"
FLUSH_S = 3.0
Seen = list[tuple[str, str, str | None]]  # (method, path, authorization)


def stand_in(seen: Seen) -> FastAPI:
    """A shard that answers every path, slowly for a flush, and holds no trajectory."""
    app = FastAPI()

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def any_path(request: Request, path: str) -> JSONResponse:
        seen.append((request.method, f"/{path}", request.headers.get("authorization")))
        if path == "admin/flush":
            await asyncio.sleep(FLUSH_S)
        if path.endswith("/live"):
            return JSONResponse({"detail": "not tracked here"}, status_code=404)
        return JSONResponse({"path": f"/{path}", "data": []})

    return app


@pytest.fixture(scope="module")
def front() -> Iterator[tuple[str, Seen]]:
    seen: Seen = []
    lt = LoopThread()
    settings = Settings(admin_token=ADMIN, trainer_token=TRAINER, api_keys=[HARNESS])
    with app_in_thread(lt, lambda: stand_in(seen)) as s0, \
            app_in_thread(lt, lambda: stand_in(seen)) as s1, \
            app_in_thread(lt, lambda: create_front_app([s0, s1], ADMIN,
                                                       credentials=settings)) as url:
        yield url, seen
    lt.stop()


READS = ["/trajectories/x/sample", "/trajectories/x", "/trajectories",
         "/groups/g/samples?timeout_s=0"]


@pytest.mark.parametrize(("token", "status"), [(None, 401), ("wrong", 401),
                                               (HARNESS, 403)])
def test_a_caller_without_the_trainers_credential_makes_no_shard_flush(
        front: tuple[str, Seen], token: str | None, status: int) -> None:
    url, seen = front
    seen.clear()
    headers = {} if token is None else {"authorization": f"Bearer {token}"}
    t0 = time.monotonic()
    with httpx.Client(base_url=url, timeout=30, headers=headers) as http:
        for path in READS:
            r = http.get(path)
            assert r.status_code == status, (path, r.text)
            assert "trainer token" in r.json()["detail"]
        assert http.post("/trajectories/x/finish", json={"reward": 1.0}).status_code == status
    assert time.monotonic() - t0 < FLUSH_S  # none waited on a flush
    assert seen == []  # no flush, no owner lookup, nothing forwarded


def test_many_unauthenticated_reads_at_once_leave_the_operator_alone(
        front: tuple[str, Seen]) -> None:
    url, seen = front
    seen.clear()

    async def flood() -> tuple[list[int], float]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            reads = [asyncio.create_task(http.get("/trajectories/x/sample"))
                     for _ in range(150)]
            t0 = time.monotonic()
            pause = await http.post("/admin/pause", headers={"authorization": f"Bearer {ADMIN}"})
            took = time.monotonic() - t0
            assert pause.status_code == 200, pause.text
            return [r.status_code for r in await asyncio.gather(*reads)], took

    statuses, pause_s = asyncio.run(flood())
    assert statuses == [401] * 150
    assert pause_s < FLUSH_S, pause_s
    assert {p for _, p, _ in seen} == {"/admin/pause"}


def test_the_trainer_is_served_after_a_flush_with_the_fronts_own_token(
        front: tuple[str, Seen]) -> None:
    url, seen = front
    seen.clear()
    r = httpx.get(f"{url}/trajectories/x/sample", timeout=30,
                  headers={"authorization": f"Bearer {TRAINER}"})
    assert r.status_code == 200 and r.json()["path"] == "/trajectories/x/sample", r.text
    flushes = [auth for m, p, auth in seen if (m, p) == ("POST", "/admin/flush")]
    assert flushes == [f"Bearer {ADMIN}"] * 2  # every shard, with the front's token
    assert ("GET", "/trajectories/x/sample", f"Bearer {TRAINER}") in seen  # the caller's


def test_trainer_reports_go_to_one_shard_and_harness_keys_to_none(
        front: tuple[str, Seen]) -> None:
    """``/training/mismatch`` lives on the first shard (the merged /status shows its
    board); a harness key is refused by the front itself."""
    url, seen = front
    seen.clear()
    r = httpx.post(f"{url}/training/mismatch", json={"mode": "sync"}, timeout=30,
                   headers={"authorization": f"Bearer {HARNESS}"})
    assert r.status_code == 403 and seen == [], (r.text, seen)
    r = httpx.post(f"{url}/training/mismatch", json={"mode": "sync"}, timeout=30,
                   headers={"authorization": f"Bearer {TRAINER}"})
    assert r.status_code == 200 and r.json()["path"] == "/training/mismatch", r.text
    assert seen == [("POST", "/training/mismatch", f"Bearer {TRAINER}")]
