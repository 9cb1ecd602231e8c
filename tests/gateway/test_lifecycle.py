"""A trajectory's life across RL steps: reused ids open attempts, nothing ever wedges."""

from __future__ import annotations

import httpx

from tests.gateway.conftest import GatewayFactory

MODEL = "qwen3-14b"


def _turn(client: httpx.Client, tid: str, messages: list[dict[str, object]]) -> str:
    r = client.post(f"/t/{tid}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": messages, "max_tokens": 8})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def _episode(client: httpx.Client, tid: str, task: str) -> None:
    msgs: list[dict[str, object]] = [{"role": "user", "content": task}]
    msgs.append({"role": "assistant", "content": _turn(client, tid, msgs)})
    msgs.append({"role": "user", "content": "tool said: ok"})
    _turn(client, tid, msgs)


def test_reused_ids_open_a_new_attempt_each_step(
    gateway_at: GatewayFactory, sim_pool: list[str], db_url: str
) -> None:
    """The wedge this fixes: step 2 reused step 1's ids and every queued call hung."""
    ids = [f"prompt{i}-0" for i in range(3)]
    with gateway_at(db_url, sim_pool) as url, httpx.Client(base_url=url) as c:
        for step in range(3):
            for tid in ids:
                _episode(c, tid, f"task of {tid}")
                r = c.post(f"/trajectories/{tid}/finish", json={"reward": float(step)})
                assert r.status_code == 200 and r.json()["attempt"] == step
        for tid in ids:
            latest = c.get(f"/trajectories/{tid}/sample").json()
            assert latest["attempt"] == 2 and latest["reward"] == 2.0
            assert [s["seq"] for s in latest["calls"]] == [0, 1]
            first = c.get(f"/trajectories/{tid}/sample", params={"attempt": 0}).json()
            assert first["attempt"] == 0 and first["reward"] == 0.0
            assert [s["seq"] for s in first["calls"]] == [0, 1]
            # both start from the same prompt; the attempts are recorded apart
            assert first["token_ids"][:5] == latest["token_ids"][:5]
            calls = c.get(f"/trajectories/{tid}").json()["calls"]
            assert [(k["attempt"], k["seq"]) for k in calls] == [
                (a, s) for a in range(3) for s in range(2)]
            assert c.get(f"/trajectories/{tid}/sample", params={"attempt": 3}).status_code \
                == 404
        status = c.get("/status").json()["scheduler"]
        assert status["faults"] == 0 and status["queued"] == 0


def test_a_call_after_finish_without_reuse_still_gets_answered(
    gateway_at: GatewayFactory, sim_pool: list[str], sqlite_url: str
) -> None:
    with gateway_at(sqlite_url, sim_pool) as url, httpx.Client(base_url=url) as c:
        _turn(c, "solo", [{"role": "user", "content": "hi"}])
        assert c.post("/trajectories/solo/finish", json={"reward": 1}).status_code == 200
        assert c.post("/trajectories/solo/finish", json={"reward": 1}).status_code == 200
        _turn(c, "solo", [{"role": "user", "content": "hi"}])
        live = c.get("/trajectories/solo").json()
        assert live["attempt"] == 1 and live["finished_at"] is None and live["reward"] is None
