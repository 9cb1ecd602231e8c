"""Routed experts recorded through the gateway (MoE routing replay, issue 47).

A simulated engine started with routes on (``--enable-return-routed-experts``, the
Qwen3-30B-A3B router) answers every non-streamed call with the experts of the positions
asked for. Over a four-turn trajectory (non-streamed, streamed, non-streamed, and a turn
that re-renders history so it cannot be joined), the gateway must:

- ask each turn only from the first position its branch does not hold
  (``routed_experts_prompt_start``), and leave the field out when it holds none;
- for the streamed turn (vLLM streams carry no routes), ask the same engine before the
  stream ends with one prefill-only request from the same start;
- strip the routes from what the harness sees (it never asked for them);
- give the sample one route row per position that equals what the engine routes that
  context to, -1 only where nothing reported one (the last token);
- store each call's routes as bytes, one byte per expert id.

The same trajectory through an engine with routes off sends the field never, is asked
for the stream's routes once (its answer has none, so it is not asked again) and has no
routes in its sample.
"""

from __future__ import annotations

import base64
import io
import sqlite3
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from backends.sim.routes import MOE_SHAPES, routed_experts
from gateway.client.routing import UNKNOWN, batch_routes, routes_of
from gateway.client.types import sample_from_json
from tests.gateway.conftest import GatewayFactory
from tests.servers import LoopThread

MODEL = "qwen3-14b"
ROUTER = MOE_SHAPES["qwen3-30b-a3b"]


@pytest.fixture(scope="module")
def engines(loop_thread: LoopThread) -> Iterator[list[str]]:
    """One engine with routes on, one without."""
    from backends.sim.runner import start_sim_servers
    from backends.sim.state import SimServerConfig

    cm = start_sim_servers([
        SimServerConfig(model=MODEL, speed=50, seed=0, output_len_median=20,
                        enable_return_routed_experts=True, moe=ROUTER),
        SimServerConfig(model=MODEL, speed=50, seed=0, output_len_median=20)])
    urls = loop_thread.run(cm.__aenter__())
    yield urls
    loop_thread.run(cm.__aexit__(None, None, None))


def _turns(http: httpx.Client, tid: str) -> list[dict[str, Any]]:
    """Four turns of one trajectory; each answer as the harness saw it."""
    headers = {"x-trajectory-id": tid}
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "list the files"}]
    seen = []
    for turn, stream in enumerate((False, True, False, False)):
        body = {"model": MODEL, "messages": messages, "max_tokens": 16, "stream": stream}
        if stream:
            text = []
            with http.stream("POST", "/v1/chat/completions", json=body,
                             headers=headers) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        assert "routed_experts" not in line
                        chunk = httpx.Response(200, content=line[6:]).json()
                        text += [c["delta"].get("content") or "" for c in chunk["choices"]]
            content = "".join(text)
            seen.append({"stream": True})
        else:
            r = http.post("/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text
            answer = r.json()
            seen.append(answer)
            content = answer["choices"][0]["message"]["content"]
        if turn == 2:  # the harness rewrites its history: a new branch, nothing held
            messages = [{"role": "system", "content": "Be brief, please."},
                        *messages[1:]]
        messages += [{"role": "assistant", "content": content},
                     {"role": "user", "content": f"and now step {turn + 2}"}]
    return seen


def _engine_requests(http: httpx.Client, url: str, ids: list[str]) -> list[dict[str, Any]]:
    """The engine's requests for the calls ``ids``: each call's, then its routes' (if any)."""
    seen = {s["id"]: s for s in http.get(f"{url}/sim/stats").json()["requests_seen"]}
    return [seen[k] for i in ids for k in (f"chatcmpl-{i}", f"cmpl-{i}-routes") if k in seen]


def _decode(field: str) -> np.ndarray:
    arr: np.ndarray = np.load(io.BytesIO(base64.b64decode(field)), allow_pickle=False)
    return arr


def test_routes_are_asked_from_the_first_unknown_position_and_aligned_in_the_sample(
        gateway_at: GatewayFactory, engines: list[str], tmp_path: Path) -> None:
    db = tmp_path / "traces.db"
    tid = f"moe-{uuid.uuid4().hex[:8]}"
    with gateway_at(f"sqlite+aiosqlite:///{db}", engines[:1]) as gw, \
            httpx.Client(base_url=gw, timeout=30) as http:
        answers = _turns(http, tid)
        for a in answers:
            if not a.get("stream"):
                assert "routed_experts" not in a["choices"][0]  # the harness never asked
        http.post(f"/trajectories/{tid}/finish", json={"reward": 1.0})
        calls = http.get(f"/trajectories/{tid}", params={"include_text": False}).json()["calls"]
        samples = http.get(f"/trajectories/{tid}/samples").json()["data"]
        tree = http.get(f"/trajectories/{tid}/tree").json()
        asked = _engine_requests(http, engines[0], [c["id"] for c in calls])

    # the tree export: each node's route, on every branch's path, is the engine's
    nodes = _decode(tree["routed_experts"])
    assert len(nodes) == len(tree["token_ids"])
    for b in tree["branches"]:
        path, leaf = [], b["leaf"]
        while leaf >= 0:
            path.append(leaf)
            leaf = tree["parents"][leaf]
        path.reverse()
        tokens = [tree["token_ids"][i] for i in path]
        assert np.array_equal(nodes[path[:-1]], routed_experts(tokens, 0, ROUTER, "default|"))

    assert len(calls) == 4 and len(asked) == 5
    assert asked[2]["id"] == f"cmpl-{calls[1]['id']}-routes" and asked[2]["max_tokens"] == 1
    lengths = [c["prompt_len"] + len(c["completion_ids"]) for c in calls]
    starts = [a["routed_experts_prompt_start"] for a in asked]  # None: not sent
    # turn 1 holds nothing; turn 2 asks from where turn 1's routes end (its last token was
    # never forwarded), and so does its routes' request (the stream carried none), which
    # covers turn 2 but its last token, as a non-streamed answer would; turn 3 asks from
    # there; turn 4 opened a branch of its own and holds nothing
    l1, l2 = lengths[0], lengths[1]
    assert starts == [None, l1 - 1, l1 - 1, l2 - 1, None], (starts, lengths)
    assert asked[2]["prompt_tokens"] == l2 - 1  # the sequence but its last token

    assert calls[3]["branch"] != calls[2]["branch"] and len(samples) == 2
    for s in samples:
        assert _decode(s["routed_experts"]).dtype == np.int16
        routes = routes_of(sample_from_json(s))  # as the trainer's client reads them
        ids = s["token_ids"]
        assert routes is not None
        assert routes.shape == (len(ids), ROUTER.num_layers, ROUTER.top_k)
        truth = routed_experts(ids, 0, ROUTER, "default|")
        assert np.array_equal(routes[:-1], truth), "a route differs from the engine's"
        assert (routes[-1] == UNKNOWN).all()  # the last token was never forwarded
    batch = batch_routes([sample_from_json(s) for s in samples])
    longest = max(len(s["token_ids"]) for s in samples)
    assert batch.shape == (2, longest, ROUTER.num_layers, ROUTER.top_k)

    # stored in segment files beside the database (the rows hold where), not in the rows
    with sqlite3.connect(db) as conn:
        stored = {r[0]: r[1:] for r in conn.execute(
            "SELECT id, routes, routes_file, routes_offset, routes_length FROM calls")}
    segments = list((tmp_path / "traces.db.routes").iterdir())
    row_bytes = ROUTER.num_layers * ROUTER.top_k  # one byte per expert id (128 experts)
    positions = [l1 - 1, l2 - l1, lengths[2] - l2, lengths[3] - 1]
    for c, n in zip(calls, positions, strict=True):  # the .npy header (128 bytes), the ids
        blob, segment, offset, length = stored[c["id"]]
        assert blob is None and segment in {p.name for p in segments}
        assert length == 128 + n * row_bytes
        data = (tmp_path / "traces.db.routes" / segment).read_bytes()[offset:offset + length]
        assert np.load(io.BytesIO(data)).shape == (n, ROUTER.num_layers, ROUTER.top_k)
    assert sum(p.stat().st_size for p in segments) == sum(r[3] for r in stored.values())


def test_a_dense_engine_is_never_asked_and_its_samples_have_no_routes(
        gateway_at: GatewayFactory, engines: list[str], tmp_path: Path) -> None:
    tid = f"dense-{uuid.uuid4().hex[:8]}"
    with gateway_at(f"sqlite+aiosqlite:///{tmp_path / 'traces.db'}", engines[1:]) as gw, \
            httpx.Client(base_url=gw, timeout=30) as http:
        _turns(http, tid)
        calls = http.get(f"/trajectories/{tid}").json()["calls"]
        samples = http.get(f"/trajectories/{tid}/samples").json()["data"]
        asked = _engine_requests(http, engines[1], [c["id"] for c in calls])
        _turns(http, f"{tid}-again")  # its engine is known not to route: not asked
        again = http.get(f"/trajectories/{tid}-again").json()["calls"]
        asked_again = _engine_requests(http, engines[1], [c["id"] for c in again])
    assert [a["routed_experts_prompt_start"] for a in asked] == [None] * 5  # never sent
    assert asked[2]["id"] == f"cmpl-{calls[1]['id']}-routes"  # the one probe
    assert len(asked_again) == 4
    assert all(s["routed_experts"] is None for s in samples)


@pytest.fixture(scope="module")
def slow_routed(loop_thread: LoopThread) -> Iterator[str]:
    """One engine with routes on, slow enough (5x) that an answer spans a pause."""
    from backends.sim.runner import start_sim_servers
    from backends.sim.state import SimServerConfig

    cm = start_sim_servers([SimServerConfig(speed=5, seed=0, tick_real_s=0.005,
                                            enable_return_routed_experts=True, moe=ROUTER)])
    (url,) = loop_thread.run(cm.__aenter__())
    yield url
    loop_thread.run(cm.__aexit__(None, None, None))


async def test_a_call_continued_across_a_weight_update_keeps_each_routes_weights(
        gateway_at: GatewayFactory, slow_routed: str, sqlite_url: str) -> None:
    """A non-streamed call aborted by a weight update and continued token in: its routes
    are the first request's (old weights) up to where it stopped, then the
    continuation's (new weights), asked from where the first ended; the sample holds
    both, as the engine routed each position under the weights of the time."""
    import asyncio

    from tests.gateway.slow_engines import ADMIN, HARNESS, KEY, N, generating

    with gateway_at(sqlite_url, [slow_routed], admin_token="tok", api_keys=[KEY]) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=ADMIN) as admin, \
                httpx.AsyncClient(base_url=url, timeout=60, headers=HARNESS) as http:
            await admin.put("/admin/weight-version", json={"version": "0"})
            body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}],
                    "max_tokens": N, "ignore_eos": True}
            task = asyncio.create_task(http.post("/v1/chat/completions", json=body,
                                                 headers={"x-trajectory-id": "spans"}))
            await generating([slow_routed], 1)
            r = (await admin.post("/admin/pause", json={"mode": "abort-and-continue"})).json()
            assert r["ok"], r
            await asyncio.sleep(0.2)
            assert (await admin.post("/admin/resume", json={"weight_version": "t1"})).json()["ok"]
            answer = await task
            assert answer.status_code == 200 and "routed_experts" not in answer.text
            (call,) = (await admin.get("/trajectories/spans")).json()["calls"]
            sample = (await admin.get("/trajectories/spans/sample")).json()
            seen = (await http.get(f"{slow_routed}/sim/stats")).json()["requests_seen"]
    first, later = [s for s in seen if s["id"] in (f"chatcmpl-{call['id']}",
                                                   f"cmpl-{call['id']}")]
    (_, n, old), = first["weight_spans"]
    (_, _, new), = later["weight_spans"]
    assert old != new and 0 < n < N
    prompt = call["prompt_len"]
    assert later["routed_experts_prompt_start"] == prompt + n - 1  # where the first ended
    ids = sample["token_ids"]
    routes = _decode(sample["routed_experts"])
    cut = prompt + n - 1
    assert np.array_equal(routes[:cut], routed_experts(ids, 0, ROUTER, f"{old}|")[:cut])
    assert np.array_equal(routes[cut:-1], routed_experts(ids, 0, ROUTER, f"{new}|")[cut:])
    assert not np.array_equal(routes[cut:-1], routed_experts(ids, 0, ROUTER, f"{old}|")[cut:])


def test_a_gateway_clears_routes_past_their_retention(
        gateway_at: GatewayFactory, engines: list[str], tmp_path: Path) -> None:
    """``traces.routes_retention_s`` through a running gateway: a second after its calls a
    trajectory's sample has no routes left, its tokens whole; /status and /metrics count
    what was cleared."""
    from gateway.config import TraceSettings

    tid = f"ret-{uuid.uuid4().hex[:8]}"
    traces = TraceSettings(flush_interval_s=0.05, routes_retention_s=1.0)
    with gateway_at(f"sqlite+aiosqlite:///{tmp_path / 'traces.db'}", engines[:1],
                    traces=traces) as gw, httpx.Client(base_url=gw, timeout=30) as http:
        _turns(http, tid)
        fresh = http.get(f"/trajectories/{tid}/sample").json()
        assert fresh["routed_experts"] is not None
        deadline = time.monotonic() + 15
        while http.get("/status").json()["trace_writer"]["routes_cleared"] < 4:
            assert time.monotonic() < deadline, "no routes cleared in 15 s"
            time.sleep(0.2)
        aged = http.get(f"/trajectories/{tid}/sample").json()
        metrics = http.get("/metrics").text
    assert aged["routed_experts"] is None
    assert aged["token_ids"] == fresh["token_ids"] and aged["loss_mask"] == fresh["loss_mask"]
    assert "rollout_gateway_trace_routes_cleared_total 4.0" in metrics
    assert list((tmp_path / "traces.db.routes").iterdir()) == []  # the segments deleted
