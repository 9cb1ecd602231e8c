"""The generated HAProxy configuration routes as documented, checked against real HAProxy
with two stand-in shards and a stand-in front that answer their own names: a call goes by
its group wherever it carries it (path, header, scoped key), else by its trajectory, and
everything that is not a model call goes to the front."""

from __future__ import annotations

import base64
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI, Request
from starlette.responses import PlainTextResponse

from gateway.dispatch.poolspec import parse_pool_spec
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


def where(url: str, path: str, headers: dict[str, str] | None = None) -> tuple[str, str]:
    r = httpx.post(f"{url}{path}", headers=headers or {}, json={}, timeout=10)
    return r.text, r.headers.get("x-shard-key", "")


def test_a_group_routes_alike_wherever_the_call_carries_it(proxy: str) -> None:
    for g in (f"grp-{k}" for k in range(12)):
        ways = [
            where(proxy, f"/g/{g}/t/traj-a/v1/chat/completions"),
            where(proxy, "/v1/chat/completions", {"x-group-id": g, "x-trajectory-id": "b"}),
            where(proxy, "/t/traj-c/v1/chat/completions", {"x-group-id": g}),
            where(proxy, "/v1/chat/completions",
                  {"authorization": f"Bearer rgk-{b64('traj-d')}.{b64(g)}.{b64('mac')}"}),
            where(proxy, "/v1/messages", {"x-api-key": f"rgk-{b64('e')}.{b64(g)}.{b64('m')}"}),
        ]
        assert {key for _, key in ways} == {g}, ways
        assert len({shard for shard, _ in ways}) == 1, ways


def test_without_a_group_the_trajectory_routes(proxy: str) -> None:
    t = "traj-77"
    ways = [where(proxy, f"/t/{t}/v1/completions"),
            where(proxy, "/v1/chat/completions", {"x-trajectory-id": t}),
            where(proxy, "/v1/chat/completions", {"x-session-id": t}),
            where(proxy, "/v1/chat/completions", {"authorization": f"Bearer {t}"}),
            where(proxy, "/v1/chat/completions",
                  {"authorization": f"Bearer rgk-{b64(t)}..{b64('mac')}"})]
    assert {key for _, key in ways} == {t} and len({s for s, _ in ways}) == 1, ways
    for placeholder in ("EMPTY", "sk-proj-123", "dummy"):  # never a routing key
        assert where(proxy, "/v1/chat/completions",
                     {"authorization": f"Bearer {placeholder}"})[1] == ""


def test_groups_spread_over_the_shards(proxy: str) -> None:
    shards = [where(proxy, f"/g/grp-{k}/t/x/v1/chat/completions")[0] for k in range(60)]
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
