"""Engine-level pauses through the gateway against real vLLM (CPU build, tiny model).

vLLM 0.32 on CPU supports every pause mode (``/pause?mode=abort|wait|keep``, needs
``VLLM_SERVER_DEV_MODE=1``), ``/update_weight_version`` and ``/weight_info``. The
abort-and-continue check is on token ids: each call ends with exactly ``max_tokens``
tokens, split by the trace into the version before and after the update. It pauses
three times: whenever it happens to come, with the engine mid-generation for certain,
and with every call still in the engine's queue (vLLM then ends a stream without any
finish chunk: the case that used to reach the client as a bare ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from backends.base import LaunchedInstance
from gateway.app import create_app
from tests.gateway.conftest import make_settings
from tests.servers import LoopThread, app_in_thread
from tests.vllm.conftest import SERVED_NAME

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]
N = 600
LONG = 1800  # the tiny model's context is 2048
ADMIN = {"authorization": "Bearer tok"}


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.stop()


async def _call(http: httpx.AsyncClient, chat: bool, stream: bool, tid: str,
                seen: dict[str, int] | None = None, tokens: int = N) -> dict[str, Any]:
    body: dict[str, Any] = {"model": SERVED_NAME, "max_tokens": tokens, "ignore_eos": True,
                            "return_token_ids": True, "stream": stream}
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": tid}]
    else:
        path, body["prompt"] = "/v1/completions", f"continue {tid}"
    headers = {"x-trajectory-id": tid}
    if not stream:
        r = await http.post(path, json=body, headers=headers)
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        return {"ids": ch["token_ids"], "finish": ch["finish_reason"], "tid": tid}
    ids: list[int] = []
    finishes = []
    async with http.stream("POST", path, json=body, headers=headers) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for ch in chunk["choices"]:
                    ids += ch.get("token_ids") or []
                    if ch.get("finish_reason"):
                        finishes.append(ch["finish_reason"])
                if seen is not None:
                    seen[tid] = len(ids)
    assert len(finishes) == 1
    return {"ids": ids, "finish": finishes[0], "tid": tid}


def _load(http: httpx.AsyncClient, tag: str, seen: dict[str, int] | None = None,
          tokens: int = N) -> list[asyncio.Task[dict[str, Any]]]:
    """Chat and completions, whole and streamed; the streams count in ``seen`` the
    tokens they received so far."""
    kinds = [(True, False), (True, True), (False, False), (False, True)]
    return [asyncio.create_task(_call(http, c, s, f"{tag}-{i}", seen, tokens))
            for i, (c, s) in enumerate(kinds)]


async def test_keep_and_wait_on_real_vllm(
        tp1_server: LaunchedInstance, loop_thread: LoopThread, tmp_path: Any) -> None:
    settings = make_settings(f"sqlite+aiosqlite:///{tmp_path}/t.db", [tp1_server.url],
                             admin_token="tok")
    with app_in_thread(loop_thread, lambda: create_app(settings)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120, headers=ADMIN) as http:
            # keep: frozen, then finished after resume
            calls = _load(http, "keep")
            await asyncio.sleep(0.8)
            paused = (await http.post("/admin/pause", json={"mode": "keep"})).json()
            assert paused["ok"] and paused["engines"][0]["mode"] == "keep"
            print("real vLLM keep: pause -> frozen", paused["idle_s"], "s")
            await asyncio.sleep(0.3)
            await http.post("/admin/resume", json={"weight_version": "1"})
            for res in await asyncio.gather(*calls):
                assert res["finish"] == "length" and len(res["ids"]) == N

            # wait: the pause answers once the engine drained
            calls = _load(http, "wait")
            await asyncio.sleep(0.8)
            paused = (await http.post("/admin/pause", json={"mode": "wait",
                                                           "engine_mode": "wait"})).json()
            assert paused["ok"]
            print("real vLLM wait: pause -> drained", paused["idle_s"], "s")
            await http.post("/admin/resume", json={"weight_version": "2"})
            for res in await asyncio.gather(*calls):
                assert res["finish"] == "length" and len(res["ids"]) == N


async def _abort_and_continue(http: httpx.AsyncClient, engine: str,
                              calls: list[asyncio.Task[dict[str, Any]]], version: str,
                              tokens: int = N) -> list[list[list[Any]] | None]:
    """Pause in abort-and-continue mode, resume with ``version``; every call must end
    with exactly ``tokens`` tokens, recorded as the client saw them. Returns each
    call's ``weight_segments``."""
    paused = (await http.post("/admin/pause", json={"mode": "abort-and-continue"})).json()
    assert paused["ok"], paused
    assert paused["engines"][0]["mode"] == "abort"
    print(f"real vLLM abort (version {version}): pause -> idle", paused["idle_s"], "s")
    assert (await http.get(f"{engine}/is_paused")).json()["is_paused"]
    await asyncio.sleep(0.3)
    for c in calls:  # a call that ended before the pause must have ended well
        if c.done():
            assert c.exception() is None and c.result()["finish"] == "length"
    resumed = (await http.post("/admin/resume", json={"weight_version": version})).json()
    assert resumed["ok"], resumed
    out = []
    for res in await asyncio.gather(*calls):
        assert res["finish"] == "length" and len(res["ids"]) == tokens
        (call,) = (await http.get(f"/trajectories/{res['tid']}")).json()["calls"]
        assert call["completion_ids"] == res["ids"]
        segments = call["weight_segments"]
        if segments is not None and len(segments) == 1:
            # aborted before its first token: all N come from the new weights
            assert segments == [[0, tokens, version]]
        elif segments is not None:
            (_, k, _), (k2, end, v1) = segments
            assert (v1, k2, end) == (version, k, tokens) and 0 < k < tokens
        out.append(segments)
    assert (await http.get(f"{engine}/weight_info")).json() == {"weight_version": version}
    return out


async def test_abort_and_continue_on_real_vllm(
        tp1_server: LaunchedInstance, loop_thread: LoopThread, tmp_path: Any) -> None:
    settings = make_settings(f"sqlite+aiosqlite:///{tmp_path}/t.db", [tp1_server.url],
                             admin_token="tok")
    with app_in_thread(loop_thread, lambda: create_app(settings)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120, headers=ADMIN) as http:
            # as a trainer would: pause while the engine runs, whatever it is doing
            calls = _load(http, "ac")
            await asyncio.sleep(0.5)
            await _abort_and_continue(http, tp1_server.url, calls, "3")

            # mid-generation, for certain: the engine runs the calls in short slices
            # between keep pauses sent straight to it until it made their first tokens
            # (its own counter: a stream's tokens can reach the client seconds after the
            # engine made them on two busy cores, and 600 tokens take it under a second)
            await _engine(http, tp1_server.url, "/pause?mode=keep")
            seen: dict[str, int] = {}
            calls = _load(http, "mid", seen, tokens=LONG)
            await _queued(http, len(calls))
            made = await _generated(http, tp1_server.url)
            for _ in range(60):  # as short as two control calls: on two busy cores a
                # pause can take long to land, and 50 ms slices let whole calls through
                await _engine(http, tp1_server.url, "/resume")
                await _engine(http, tp1_server.url, "/pause?mode=keep")
                if await _generated(http, tp1_server.url) > made:
                    break
            else:
                raise AssertionError("the engine produced no token in 60 slices")
            await asyncio.sleep(0.5)  # what it made reaches the clients
            done = {c.get_name(): c.result() if c.done() and not c.exception() else c
                    for c in calls if c.done()}
            assert not done, done
            before = dict(seen)
            segments = await _abort_and_continue(http, tp1_server.url, calls, "4", LONG)
            assert any(s is not None and len(s) == 2 for s in segments), segments
            for i in (1, 3):  # the streams: split at or after what their clients had
                tid = f"mid-{i}"
                if before.get(tid):
                    (_, k, _), _ = segments[i]
                    assert k >= before[tid], (segments[i], before)
            print("real vLLM mid-generation abort: split at", segments, "seen", before)

            # queued: the calls wait in the engine's queue (frozen there by a keep pause)
            # when the abort comes. vLLM then sends a stream no chunk with tokens or a
            # finish: /v1/completions only [DONE], chat its role chunk and [DONE]; whole
            # calls get finish_reason "abort" and no tokens.
            await _engine(http, tp1_server.url, "/pause?mode=keep")
            calls = _load(http, "queued")
            await _queued(http, len(calls))
            segments = await _abort_and_continue(http, tp1_server.url, calls, "5")
            assert segments == [[[0, N, "5"]]] * len(calls), segments


async def _engine(http: httpx.AsyncClient, engine: str, path: str) -> None:
    """A control call straight to vLLM, behind the gateway's back."""
    assert (await http.post(engine + path)).status_code == 200


async def _generated(http: httpx.AsyncClient, engine: str) -> float:
    """The engine's count of generated tokens (``vllm:generation_tokens_total``)."""
    for line in (await http.get(f"{engine}/metrics")).text.splitlines():
        if line.startswith("vllm:generation_tokens_total{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:generation_tokens_total in /metrics")


async def _queued(http: httpx.AsyncClient, count: int) -> None:
    """Wait until the gateway sent ``count`` calls to the engine, and a second more for
    them to reach its queue."""
    for _ in range(600):
        if (await http.get("/admin/backends")).json()["data"][0]["in_flight"] == count:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)
