"""Engine-level pauses through the gateway against real vLLM (CPU build, tiny model).

vLLM 0.32 on CPU supports every pause mode (``/pause?mode=abort|wait|keep``, needs
``VLLM_SERVER_DEV_MODE=1``), ``/update_weight_version`` and ``/weight_info``. The
abort-and-continue check is on token ids: each call ends with exactly ``max_tokens``
tokens, split by the trace into the version before and after the update.
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
ADMIN = {"authorization": "Bearer tok"}


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.stop()


async def _call(http: httpx.AsyncClient, chat: bool, stream: bool, tid: str
                ) -> dict[str, Any]:
    body: dict[str, Any] = {"model": SERVED_NAME, "max_tokens": N, "ignore_eos": True,
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
    assert len(finishes) == 1
    return {"ids": ids, "finish": finishes[0], "tid": tid}


def _load(http: httpx.AsyncClient, tag: str) -> list[asyncio.Task[dict[str, Any]]]:
    kinds = [(True, False), (True, True), (False, False), (False, True)]
    return [asyncio.create_task(_call(http, c, s, f"{tag}-{i}"))
            for i, (c, s) in enumerate(kinds)]


async def test_every_pause_mode_on_real_vllm(
        tp1_server: LaunchedInstance, loop_thread: LoopThread, tmp_path: Any) -> None:
    settings = make_settings(f"sqlite+aiosqlite:///{tmp_path}/t.db", [tp1_server.url],
                             admin_token="tok")
    with app_in_thread(loop_thread, lambda: create_app(settings)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120, headers=ADMIN) as http:
            # abort-and-continue
            calls = _load(http, "ac")
            await asyncio.sleep(0.8)
            paused = (await http.post("/admin/pause",
                                      json={"mode": "abort-and-continue"})).json()
            assert paused["ok"], paused
            assert paused["engines"][0]["mode"] == "abort"
            print("real vLLM abort: pause -> idle", paused["idle_s"], "s")
            assert (await http.get(f"{tp1_server.url}/is_paused")).json()["is_paused"]
            await asyncio.sleep(0.3)
            for c in calls:  # a call that ended before the pause must have ended well
                if c.done():
                    assert c.exception() is None and c.result()["finish"] == "length"
            resumed = (await http.post("/admin/resume", json={"weight_version": "1"})).json()
            assert resumed["ok"], resumed
            split = 0
            for res in await asyncio.gather(*calls):
                assert res["finish"] == "length" and len(res["ids"]) == N
                (call,) = (await http.get(f"/trajectories/{res['tid']}")).json()["calls"]
                assert call["completion_ids"] == res["ids"]
                if call["weight_segments"]:
                    (_, k, v0), (k2, end, v1) = call["weight_segments"]
                    assert (v0, v1, k2, end) == ("0", "1", k, N)
                    split += 1
            assert split >= 1  # at least one call was generating when the pause came
            info = (await http.get(f"{tp1_server.url}/weight_info")).json()
            assert info == {"weight_version": "1"}

            # keep: frozen, then finished after resume
            calls = _load(http, "keep")
            await asyncio.sleep(0.8)
            paused = (await http.post("/admin/pause", json={"mode": "keep"})).json()
            assert paused["ok"] and paused["engines"][0]["mode"] == "keep"
            print("real vLLM keep: pause -> frozen", paused["idle_s"], "s")
            await asyncio.sleep(0.3)
            await http.post("/admin/resume", json={"weight_version": "2"})
            for res in await asyncio.gather(*calls):
                assert res["finish"] == "length" and len(res["ids"]) == N

            # wait: the pause answers once the engine drained
            calls = _load(http, "wait")
            await asyncio.sleep(0.8)
            paused = (await http.post("/admin/pause", json={"mode": "wait",
                                                           "engine_mode": "wait"})).json()
            assert paused["ok"]
            print("real vLLM wait: pause -> drained", paused["idle_s"], "s")
            await http.post("/admin/resume", json={"weight_version": "3"})
            for res in await asyncio.gather(*calls):
                assert res["finish"] == "length" and len(res["ids"]) == N
