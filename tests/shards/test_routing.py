"""The generated HAProxy configuration routes as documented, checked against real HAProxy
with three stand-in shards and a stand-in front that answer their own names: a call goes
by its trajectory wherever it carries it (path with or without a group, header, scoped
key, the session id a harness sends on its own), else by its group header; an id header sent twice is refused; everything that is
not a model call goes to the front."""

from __future__ import annotations

import base64
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from starlette.responses import PlainTextResponse

from gateway.pool.spec import parse_pool_spec
from gateway.shards.haproxy import ProxyPlan, haproxy_config
from gateway.shards.launch import split_backends, split_pool
from tests.servers import LoopThread, app_in_thread, free_port
from tests.shards.conftest import haproxy_or_fail


def named(name: str) -> FastAPI:
    app = FastAPI()

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def any_path(request: Request, path: str) -> PlainTextResponse:
        return PlainTextResponse(name)

    return app


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = haproxy_or_fail()
    lt = LoopThread()
    with app_in_thread(lt, lambda: named("s0")) as s0, \
            app_in_thread(lt, lambda: named("s1")) as s1, \
            app_in_thread(lt, lambda: named("s2")) as s2, \
            app_in_thread(lt, lambda: named("front")) as front:
        port = free_port()
        cfg = tmp_path_factory.mktemp("haproxy") / "haproxy.cfg"
        cfg.write_text(haproxy_config(ProxyPlan(
            f"127.0.0.1:{port}", [u.removeprefix("http://") for u in (s0, s1, s2)],
            front.removeprefix("http://"))))
        checked = subprocess.run([binary, "-c", "-f", str(cfg)], capture_output=True,
                                 text=True)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        proc = subprocess.Popen([binary, "-f", str(cfg), "-db"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                httpx.get(f"{url}/status", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield url
        proc.terminate()
        proc.wait(10)
    lt.stop()


def b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def where(url: str, path: str, headers: dict[str, str] | list[tuple[str, str]] | None = None
          ) -> tuple[str, str]:
    r = httpx.post(f"{url}{path}", headers=headers or {}, json={}, timeout=10)
    assert r.headers.get("x-shard", r.text) == r.text  # the shard that answered, named
    return r.text, r.headers.get("x-shard-key", "")


def test_a_trajectory_routes_alike_wherever_the_call_carries_it(proxy: str) -> None:
    """A harness may mix the forms call by call (with and without its group, a header, a
    key): every call of the trajectory must reach the one shard that holds it."""
    for t in (f"traj-{k}" for k in range(12)):
        ways = [
            where(proxy, f"/g/grp-a/t/{t}/v1/chat/completions"),
            where(proxy, f"/g/grp-b/t/{t}/v1/responses", {"x-group-id": "grp-c"}),
            where(proxy, f"/t/{t}/v1/chat/completions"),
            where(proxy, f"/t/{t}/v1/messages", {"x-group-id": "grp-a"}),
            where(proxy, f"/t/{t.replace('-', '%2D')}/v1/completions"),  # as Starlette decodes
            where(proxy, "/v1/chat/completions", {"x-trajectory-id": t, "x-group-id": "g"}),
            where(proxy, "/v1/chat/completions", {"x-session-id": t}),
            where(proxy, "/v1/chat/completions", {"authorization": f"Bearer {t}"}),
            where(proxy, "/v1/chat/completions",
                  {"authorization": f"Bearer rgk-{b64(t)}.{b64('grp-a')}.{b64('mac')}"}),
            where(proxy, "/v1/messages", {"x-api-key": f"rgk-{b64(t)}..{b64('m')}"}),
        ]
        assert {key for _, key in ways} == {t}, ways
        assert len({shard for shard, _ in ways}) == 1, ways
    for placeholder in ("EMPTY", "sk-proj-123", "dummy"):  # never a routing key
        assert where(proxy, "/v1/chat/completions",
                     {"authorization": f"Bearer {placeholder}"})[1] == ""


def test_without_a_trajectory_the_group_header_routes(proxy: str) -> None:
    """A trajectory tagged only in the body: the proxy sees its group header alone."""
    assert where(proxy, "/v1/chat/completions", {"x-group-id": "grp-9"})[1] == "grp-9"
    assert where(proxy, "/v1/chat/completions",
                 {"x-group-id": "grp-9", "authorization": "Bearer EMPTY"})[1] == "grp-9"


def test_an_id_or_key_header_sent_twice_is_refused_at_the_proxy(proxy: str) -> None:
    """HAProxy would route on the last copy and the gateway read the first: a 400 in
    OpenAI's envelope, as the gateway answers, and no shard sees the call."""
    for name in ("x-trajectory-id", "X-Session-ID", "x-group-id", "authorization",
                 "x-api-key"):
        r = httpx.post(f"{proxy}/v1/chat/completions", json={}, timeout=10,
                       headers=[(name, "Bearer t-a"), (name, "Bearer t-b")])
        assert r.status_code == 400, (name, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    # one of each is fine, and the comma is no separator: the whole value is the id
    assert where(proxy, "/v1/chat/completions", [("x-trajectory-id", "a,b")])[1] == "a,b"


def test_a_harness_session_header_routes_like_the_gateway_reads_it(proxy: str) -> None:
    """Codex's ``session-id``, Claude Code's ``x-claude-code-session-id``, the OpenHands
    SDK's ``x-litellm-session-id``: every call of a session reaches one shard (with a
    placeholder key, a group, on any door), after the explicit ids, before the group."""
    sessions = [f"01a2207b-9cbc-7822-a47f-{k:012d}" for k in range(12)]
    for sid in sessions:
        for header in ("session-id", "x-claude-code-session-id", "x-litellm-session-id"):
            ways = [
                where(proxy, "/v1/responses", {header: sid, "authorization": "Bearer EMPTY"}),
                where(proxy, "/v1/messages", {header: sid, "x-api-key": "sk-none"}),
                where(proxy, "/v1/chat/completions", {header: sid, "x-group-id": "grp-a"}),
                where(proxy, "/v1/chat/completions", {header: sid}),
            ]
            assert {key for _, key in ways} == {sid}, ways
            assert len({shard for shard, _ in ways}) == 1, ways
    assert len({where(proxy, "/v1/responses", {"session-id": s})[0] for s in sessions}) > 1
    both = {"session-id": "codex-s", "x-claude-code-session-id": "claude-s",
            "x-litellm-session-id": "lite-s"}
    assert where(proxy, "/v1/chat/completions", both)[1] == "claude-s"  # the gateway's order
    assert where(proxy, "/v1/chat/completions",
                 {"session-id": "codex-s", "x-litellm-session-id": "l"})[1] == "codex-s"
    for explicit, key in (({"x-trajectory-id": "t"}, "t"), ({"x-session-id": "s"}, "s"),
                          ({"authorization": "Bearer traj-9"}, "traj-9")):
        assert where(proxy, "/v1/chat/completions", {**both, **explicit})[1] == key
    assert where(proxy, "/t/path-t/v1/responses", both)[1] == "path-t"
    for name in both:  # sent twice: refused, as the gateway refuses it
        r = httpx.post(f"{proxy}/v1/chat/completions", json={}, timeout=10,
                       headers=[(name, "a"), (name, "b")])
        assert r.status_code == 400, (name, r.text)


def test_trajectories_spread_over_the_shards(proxy: str) -> None:
    shards = [where(proxy, f"/g/grp-1/t/traj-{k}/v1/chat/completions")[0] for k in range(60)]
    assert {"s0", "s1", "s2"} == set(shards)
    assert min(shards.count(s) for s in ("s0", "s1", "s2")) >= 8, shards


def test_everything_else_goes_to_the_front(proxy: str) -> None:
    for path in ("/status", "/admin/pause", "/trajectories/t/finish", "/groups/g/samples",
                 "/metrics", "/"):
        assert where(proxy, path)[0] == "front", path


def test_a_pool_splits_into_gpu_blocks_and_backends_round_robin() -> None:
    spec = parse_pool_spec({"model": "m", "inventory": {"gpus": 8},
                            "launcher": {"kind": "sim"},
                            "layout": [{"tp": 1, "count": 4}, {"tp": 4}]})
    parts = split_pool(spec, 2)
    assert [p["inventory"]["nodes"][0]["gpus"] for p in parts] == [[0, 1, 2, 3],
                                                                    [4, 5, 6, 7]]
    assert [[e["tp"] for e in p["layout"]] for p in parts] == [[1, 1, 1, 1], [4]]
    for p in parts:
        parse_pool_spec(p)  # each part is a valid pool of its own
    with pytest.raises(ValueError, match="fits in no shard"):
        split_pool(parse_pool_spec({"model": "m", "inventory": {"gpus": 8},
                                    "launcher": {"kind": "sim"}, "layout": [{"tp": 8}]}), 2)
    assert split_backends(["a", "b", "c", "d", "e"], 2) == [["a", "c", "e"], ["b", "d"]]
    probe = split_pool(parse_pool_spec({"model": "m", "inventory": {"gpus": 8},
                                        "launcher": {"kind": "sim"}, "layout": "probe"}), 2)
    # each shard probes every degree its own four GPUs hold
    assert [[r.tp for r in parse_pool_spec(p).requests()] for p in probe] == [[2, 1, 1]] * 2


async def test_one_shard_owns_the_stores_upkeep(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    """The shards share one store: each knows its index and shard 0 alone clears expired
    routes, however the retention was configured; each shard's spool is its own file."""
    from gateway.config import Settings
    from gateway.runtime import open_runtime
    from gateway.shards.launch import SHARD_ENV, SPOOL_ENV, ShardPlan, shard_env

    monkeypatch.setenv("ROLLOUT_GATEWAY_TRACES", '{"routes_retention_s": 3600}')
    monkeypatch.setenv(SPOOL_ENV, "/tmp/spool.jsonl")
    envs = [shard_env(ShardPlan(shards=3, database_url="postgresql://x/y"), i)
            for i in range(3)]
    assert [e[SHARD_ENV] for e in envs] == ["0", "1", "2"]
    assert len({e[SPOOL_ENV] for e in envs}) == 3
    owners = []
    for i in range(3):
        settings = Settings(database_url=f"sqlite+aiosqlite:///{tmp_path / f's{i}.db'}",
                            shard_index=int(envs[i][SHARD_ENV]),
                            traces={"routes_retention_s": 3600,  # type: ignore[arg-type]
                                    "spool_path": tmp_path / f"spool{i}"})
        async with open_runtime(settings) as rt:
            owners.append(rt.routes_retention is not None)
    assert owners == [True, False, False]
