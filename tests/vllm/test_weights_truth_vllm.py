"""Every token's recorded weight version is the one that made it, on real vLLM (CPU build,
tiny model), checked by recomputing logprobs.

Two checkpoints of the tiny model with the same tokenizer and different weights (A and B)
take turns: each update reloads the other one. For every completion token the logprob the
engine reported when it sampled the token is compared with the logprob of the same token
recomputed under A and under B (``prompt_logprobs`` of the whole sequence): the closer
one made it. That must be the checkpoint of the version the gateway stamped on the token.
Calls mix chat and completions, whole and streamed, with and without ``tools`` (which
cannot be continued token-in: in abort-and-continue their engine is paused with keep).

The pool test starts a managed pool on A, updates it to B, checks that a bad update
pauses nothing and kills nothing, and that an engine added afterwards comes up on B.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.base import LaunchedInstance
from gateway.app import create_app
from gateway.config import Settings, TraceSettings, UpstreamSettings
from tests.gateway.conftest import make_settings
from tests.servers import LoopThread, app_in_thread
from tests.vllm.conftest import SERVED_NAME
from tests.vllm.truth import recompute, reload_weights

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]
ADMIN = {"authorization": "Bearer tok"}
KEY = "harness-key"
HARNESS = {"authorization": f"Bearer {KEY}"}
TOOLS = [{"type": "function", "function": {"name": "search", "description": "search",
                                           "parameters": {"type": "object", "properties": {
                                               "query": {"type": "string"}}}}}]
LONG = 1400  # the tiny model's context is 2048
TIE = 0.05  # logprobs closer than this under A and B do not tell which made the token

@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.stop()


def _bodies(tag: str, tokens: int) -> dict[str, dict[str, Any]]:
    chat = {"messages": [{"role": "user", "content": f"tell me about {tag}"}],
            "max_tokens": tokens, "ignore_eos": True, "temperature": 1.0}
    text = {"prompt": f"continue {tag}", "max_tokens": tokens, "ignore_eos": True,
            "temperature": 1.0}
    kinds = {"chat": chat, "text": text, "tools": {**chat, "tools": TOOLS}}
    return {f"{tag}-{name}-{'s' if stream else 'w'}-{i}": {**body, "stream": stream}
            for name, body in kinds.items() for stream in (False, True) for i in range(2)}


async def _call(http: httpx.AsyncClient, tid: str, body: dict[str, Any]) -> str:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    body = {"model": SERVED_NAME, **body}
    headers = {"x-trajectory-id": tid}
    if not body["stream"]:
        r = await http.post(path, json=body, headers=headers)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["finish_reason"])
    finishes = []
    async with http.stream("POST", path, json=body, headers=headers) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                finishes += [c["finish_reason"] for c in chunk["choices"]
                             if c.get("finish_reason")]
    assert len(finishes) == 1, finishes
    return str(finishes[0])


async def _metric(engine: str, name: str) -> float:
    async with httpx.AsyncClient(timeout=30) as http:
        for line in (await http.get(f"{engine}/metrics")).text.splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name}")


async def _engine_idle(engine: str, timeout_s: float = 180) -> None:
    """Wait until the engine runs and queues nothing: requests an earlier test left on
    this shared engine would otherwise make the token count below move before any of
    this test's calls generate, and the update would land before them."""
    deadline = time.monotonic() + timeout_s
    while (await _metric(engine, "vllm:num_requests_running")
           + await _metric(engine, "vllm:num_requests_waiting")) > 0:
        assert time.monotonic() < deadline, "the engine never went idle"
        await asyncio.sleep(0.2)


async def _ctl(engine: str, path: str) -> None:
    """A control call straight to vLLM, behind the gateway's back."""
    async with httpx.AsyncClient(timeout=30) as http:
        assert (await http.post(engine + path)).status_code == 200


async def _dispatched(admin: httpx.AsyncClient, count: int,
                      calls: list[asyncio.Task[str]]) -> None:
    """Wait until the gateway has sent ``count`` calls to its engine (its own counter, not
    the status page's periodic snapshot), and a second more for them to reach its queue;
    at once if every call is over (how it ended is for the caller to see)."""
    deadline = time.monotonic() + 300
    while (await admin.get("/admin/backends")).json()["data"][0]["in_flight"] < count:
        if all(c.done() for c in calls):
            return
        if time.monotonic() > deadline:
            status = (await admin.get("/status")).json()
            raise AssertionError(f"the gateway never dispatched {count} calls: "
                                 f"{(await admin.get('/admin/backends')).json()} "
                                 f"queued {status.get('queue')} paused {status.get('paused')}")
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)


async def _mid_generation(admin: httpx.AsyncClient, engine: str,
                          calls: list[asyncio.Task[str]]) -> None:
    """Hold ``calls`` mid-generation: the engine was paused (keep) before they were sent,
    so they wait in its queue; it then runs in short slices between keep pauses until it
    made tokens, and stays paused for the update to find them there. (Waiting on the
    status page and token counters instead raced the calls: the tiny model makes 1400
    tokens in a few seconds, less than the status page's lag on two busy cores, and the
    update then came after every call had ended: 0 calls spanned two weights.)"""
    count = len(calls)
    await _dispatched(admin, count, calls)
    made = await _metric(engine, "vllm:generation_tokens_total")
    for _ in range(200):  # slices as short as two control calls
        await _ctl(engine, "/resume")
        await _ctl(engine, "/pause?mode=keep")
        if await _metric(engine, "vllm:generation_tokens_total") > made:
            return
    raise AssertionError("the engine made no tokens in 200 slices")


async def _job(admin: httpx.AsyncClient, body: dict[str, Any], timeout_s: float = 300
               ) -> dict[str, Any]:
    r = await admin.post("/admin/weight-update", json=body)
    assert r.status_code == 202, r.text
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job: dict[str, Any] = (await admin.get(f"/admin/jobs/{r.json()['job']}")).json()
        if job["status"] not in ("pending", "running"):
            return job
        await asyncio.sleep(0.2)
    raise AssertionError(f"job not done in {timeout_s} s")


async def _samples(admin: httpx.AsyncClient, tids: dict[str, str]
                   ) -> dict[str, dict[str, Any]]:
    """Each trajectory's sample and call, with the mode it ran under."""
    out = {}
    for tid, mode in tids.items():
        sample = (await admin.get(f"/trajectories/{tid}/sample")).json()
        (call,) = (await admin.get(f"/trajectories/{tid}")).json()["calls"]
        out[tid] = {**sample, "call": call, "mode": mode}
    return out


def _runs(labels: list[str]) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for x in labels:
        if out and out[-1][0] == x:
            out[-1] = (x, out[-1][1] + 1)
        else:
            out.append((x, 1))
    return out


async def _judge(engine: str, samples: dict[str, dict[str, Any]], path_of: dict[str, str],
                 checkpoints: dict[str, str]) -> dict[str, tuple[int, int, int, int]]:
    """Per mode and kind of call: (tokens, stamped with the weights that made them, of
    which ties, calls whose tokens span two weights), by recomputed logprobs under A and
    under B. A tie (a token whose logprob is about the same under both, closer than
    ``TIE``) counts for either."""
    ids = {tid: s["token_ids"] for tid, s in samples.items()}
    recomputed: dict[str, dict[str, list[float]]] = {name: {} for name in checkpoints}
    for name, path in checkpoints.items():
        await reload_weights(engine, path)
        for tid, seq in ids.items():
            recomputed[name][tid] = await recompute(engine, seq)
    out: dict[str, tuple[int, int, int, int]] = {}
    for tid, s in samples.items():
        n = len(s["call"]["completion_ids"])
        start = len(s["token_ids"]) - n
        made = []
        for i in range(start, len(s["token_ids"])):
            rec = s["logprobs"][i]
            dist = {c: abs(recomputed[c][tid][i - 1] - rec) for c in checkpoints}
            best = min(dist, key=lambda c, d=dist: d[c])
            tie = max(dist.values()) - dist[best] < TIE
            made.append("?" if tie else best)
        stamped = [path_of[v] for v in s["weight_versions"][start:]]
        names = {path: name for name, path in checkpoints.items()}
        right = sum(m in ("?", names[p]) for p, m in zip(stamped, made, strict=True))
        kind, stream = tid.split("-")[-3:-1]
        key = f"{s['mode']}/{kind}/{'stream' if stream == 's' else 'whole'}"
        total, ok, ties, spans = out.get(key, (0, 0, 0, 0))
        out[key] = (total + n, ok + right, ties + made.count("?"),
                    spans + (len({m for m in made if m != "?"}) > 1))
        if right != n:
            print("MISMATCH", tid, "segments", s["call"]["weight_segments"],
                  "version", s["call"]["weight_version"], "made", _runs(made))
    return out


@pytest.mark.timeout(1800)
async def test_every_token_version_is_true_on_real_vllm(
        tp1_server: LaunchedInstance, loop_thread: LoopThread, checkpoints: dict[str, str],
        tmp_path: Path) -> None:
    engine = tp1_server.url
    settings = make_settings(f"sqlite+aiosqlite:///{tmp_path}/t.db", [engine],
                             admin_token="tok", api_keys=[KEY])
    path_of = {"v0": checkpoints["A"]}
    tids: dict[str, str] = {}
    with app_in_thread(loop_thread, lambda: create_app(settings)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=600, headers=ADMIN) as admin, \
                httpx.AsyncClient(base_url=url, timeout=600, headers=HARNESS) as http:
            await reload_weights(engine, checkpoints["A"])
            await admin.put("/admin/weight-version", json={"version": "v0"})
            for n, mode in enumerate(("keep", "abort-and-continue", "wait"), start=1):
                version, target = f"v{n}", checkpoints["B" if n % 2 else "A"]
                path_of[version] = target
                tokens = LONG if mode != "wait" else LONG // 3  # wait drains them all
                await _engine_idle(engine)
                if mode != "wait":  # (a paused engine would never drain for wait)
                    await _ctl(engine, "/pause?mode=keep")
                calls = {tid: asyncio.create_task(_call(http, f"{mode}-{tid}", body))
                         for tid, body in _bodies(f"{mode}{n}", tokens).items()}
                tids.update({f"{mode}-{tid}": mode for tid in calls})
                if mode != "wait":
                    await _mid_generation(admin, engine, list(calls.values()))
                else:  # the update drains them: mid-generation or not, nothing spans
                    await _dispatched(admin, 1, list(calls.values()))
                t0 = time.monotonic()
                job = await _job(admin, {"version": version, "mode": mode,
                                         "method": "reload", "weights_path": target})
                assert job["status"] == "succeeded", job
                print(f"real vLLM {mode}: job {time.monotonic() - t0:.1f} s, "
                      f"{[(p['name'], p['duration_s']) for p in job['phases']]}, "
                      f"engines {job['phases'][1]['engines']}")
                assert set(await asyncio.gather(*calls.values())) <= {"length", "tool_calls"}
            samples = await _samples(admin, tids)
    shares = await _judge(engine, samples, path_of, checkpoints)
    for kind, (total, right, ties, spans) in sorted(shares.items()):
        print(f"real vLLM {kind}: {right}/{total} tokens stamped with the weights that "
              f"made them ({100 * right / total:.1f}%; {ties} ties), {spans} calls span "
              "two weights")
    assert all(right == total for total, right, _, _ in shares.values()), shares
    assert sum(spans for kind, (_, _, _, spans) in shares.items()
               if not kind.startswith("wait")) > 0


def _pool_settings(tmp_path: Path, vllm_python: str, model_dir: str) -> Settings:
    spec = {"model": SERVED_NAME, "inventory": {"gpus": 2},
            "launcher": {"kind": "vllm", "python": vllm_python, "model_path": model_dir,
                         "device": "cpu", "log_dir": str(tmp_path / "logs"),
                         "state_dir": str(tmp_path / "state"), "start_timeout_s": 300,
                         "extra_args": ["--dtype", "bfloat16", "--max-model-len", "2048",
                                        "--enforce-eager"]},
            "layout": [{"tp": 1, "gpus": [0]}], "check_interval_s": 0.5,
            "restart": {"max_restarts": 1, "backoff_s": 0.5}}
    path = tmp_path / "pool.json"
    path.write_text(json.dumps(spec))
    return Settings(database_url=f"sqlite+aiosqlite:///{tmp_path}/p.db", pool=path,
                    admin_token="tok", api_keys=[KEY],
                    upstream=UpstreamSettings(health_interval_s=0.5),
                    traces=TraceSettings(flush_interval_s=0.05))


async def _wait_job(admin: httpx.AsyncClient, job_id: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job: dict[str, Any] = (await admin.get(f"/admin/jobs/{job_id}")).json()
        if job["status"] not in ("pending", "running"):
            return job
        await asyncio.sleep(0.5)
    raise AssertionError(f"job {job_id} not done in {timeout_s} s")


async def _greedy(url: str) -> list[int]:
    async with httpx.AsyncClient(timeout=120) as http:
        r = await http.post(f"{url}/v1/completions", json={
            "model": SERVED_NAME, "prompt": "the same prompt", "max_tokens": 24,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        ids: list[int] = r.json()["choices"][0]["token_ids"]
        return ids


@pytest.mark.timeout(1800)
async def test_pool_engines_come_up_on_the_current_weights_on_real_vllm(
        vllm_python: str, checkpoints: dict[str, str], loop_thread: LoopThread,
        tmp_path: Path) -> None:
    settings = _pool_settings(tmp_path, vllm_python, checkpoints["A"])
    with app_in_thread(loop_thread, lambda: create_app(settings)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=600, headers=ADMIN) as admin, \
                httpx.AsyncClient(base_url=url, timeout=600, headers=HARNESS) as http:
            assert (await _wait_job(admin, "1", 400))["status"] == "succeeded"
            first = (await admin.get("/admin/pool")).json()["instances"][0]["url"]
            on_a = await _greedy(first)
            bad = await _job(admin, {"version": "9", "method": "reload",
                                     "weights_path": str(tmp_path / "nope")})
            alive = await http.post("/v1/chat/completions", json={
                "model": SERVED_NAME, "max_tokens": 4,
                "messages": [{"role": "user", "content": "still there?"}]})
            calls = [asyncio.create_task(_call(http, f"pool-{tid}", body))
                     for tid, body in _bodies("pool", 600).items()]
            await asyncio.sleep(1.0)
            job = await _job(admin, {"version": "1", "method": "reload",
                                     "weights_path": checkpoints["B"]})
            await asyncio.gather(*calls)
            r = await admin.post("/admin/backends", json={"tp": 1})
            added = await _wait_job(admin, r.json()["job"], 400)
            pool = (await admin.get("/admin/pool")).json()
            urls = [i["url"] for i in pool["instances"]]
            roots = [(await http.get(f"{u}/v1/models")).json()["data"][0]["root"]
                     for u in urls]
            labels = [(await http.get(f"{u}/weight_info")).json() for u in urls]
            outputs = [await _greedy(u) for u in urls]
    print("real vLLM pool: bad update", bad["errors"], "; update", job["phases"][-1])
    assert bad["status"] == "failed" and [p["name"] for p in bad["phases"]] == ["check"]
    assert "does not exist" in bad["errors"][0] and alive.status_code == 200
    assert job["status"] == "succeeded", job
    assert added["status"] == "succeeded", added
    assert pool["weights"] == {"version": "1", "path": checkpoints["B"], "pushed": False}
    assert labels == [{"weight_version": "1"}] * 2
    assert roots[1] == checkpoints["B"]  # the new engine started on B itself
    assert outputs[0] == outputs[1] != on_a  # both serve B, not A


@pytest.mark.timeout(1800)
async def test_engines_that_group_tokens_finish_the_streams_keep_would_freeze(
        vllm_python: str, checkpoints: dict[str, str], loop_thread: LoopThread,
        tmp_path: Path) -> None:
    """A pool of vLLM engines started with ``--stream-interval 8``: vLLM holds up to 7
    tokens it made unsent across a pause, so a stream frozen by ``keep`` would get a
    boundary off by those tokens (the test above, run with the flag, found 2 of 2800
    tokens stamped with the wrong weights). The update therefore aborts the calls it can
    continue and lets the engine finish the streams (``wait``): every token is stamped
    with the weights that made it, judged by recomputed logprobs."""
    settings = _pool_settings(tmp_path, vllm_python, checkpoints["A"])
    spec = json.loads(Path(str(settings.pool)).read_text())
    spec["launcher"]["stream_interval"] = 8
    Path(str(settings.pool)).write_text(json.dumps(spec))
    tids: dict[str, str] = {}
    with app_in_thread(loop_thread, lambda: create_app(settings)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=600, headers=ADMIN) as admin, \
                httpx.AsyncClient(base_url=url, timeout=600, headers=HARNESS) as http:
            assert (await _wait_job(admin, "1", 400))["status"] == "succeeded"
            engine = (await admin.get("/admin/pool")).json()["instances"][0]["url"]
            await admin.put("/admin/weight-version", json={"version": "v0"})
            calls = {tid: asyncio.create_task(_call(http, f"keep-{tid}", body))
                     for tid, body in _bodies("grouped", LONG).items()}
            tids.update({f"keep-{tid}": "keep" for tid in calls})
            await _dispatched(admin, len(calls), list(calls.values()))
            job = await _job(admin, {"version": "v1", "mode": "keep", "method": "reload",
                                     "weights_path": checkpoints["B"]})
            finishes = await asyncio.gather(*calls.values())
            samples = await _samples(admin, tids)
            shares = await _judge(engine, samples,  # on the pool's engine, still up
                                  {"v0": checkpoints["A"], "v1": checkpoints["B"]},
                                  checkpoints)
    assert job["status"] == "succeeded", job
    (paused,) = job["phases"][1]["engines"]
    assert paused["mode"] == "wait", paused  # not keep: its streams finish first
    assert set(finishes) <= {"length", "tool_calls"}
    for kind, (total, right, ties, spans) in sorted(shares.items()):
        print(f"real vLLM, 8 tokens an event, {kind}: {right}/{total} tokens stamped with "
              f"the weights that made them ({ties} ties), {spans} calls span two weights")
    assert all(right == total for total, right, _, _ in shares.values()), shares
    print("versions per call:", {tid: sorted({v for v in s["weight_versions"] if v})
                                  for tid, s in samples.items()})
