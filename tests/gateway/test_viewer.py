"""The trajectory viewer's data (``/trajectories/{id}/view``, ``/routes``, ``/groups/{id}/view``
and the search of ``GET /trajectories``) through a real gateway over simulated engines.

What it must get right is what a person debugging a rollout reads off it: the tokens as
the trainer gets them (same ids, same loss mask) and as the engine's tokenizer reads them
(each id's piece, decoded by the engine), the branch a side call opened and why, the
tool gaps the harness spent, the routed experts of a position, a group's advantages as
the TRL adapter computes them; and none of it for a credential that may not read it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from backends.sim.routes import MOE_SHAPES
from backends.sim.tokenizer import get_tokenizer
from gateway.client.advantages import group_advantages
from gateway.client.routing import routes_of
from gateway.client.types import sample_from_json
from tests.gateway.conftest import GatewayFactory
from tests.servers import LoopThread

MODEL = "qwen3-14b"
SYSTEM = "You are a coding agent. Work in the repository, run its tests and fix what fails."
TOOL_S = 0.25
ADMIN, TRAINER, HARNESS = "adm-token", "trn-token", "hrn-key"


@pytest.fixture(scope="module")
def moe_engine(loop_thread: LoopThread) -> Iterator[list[str]]:
    """One simulated engine that returns routed experts (the Qwen3-30B-A3B router)."""
    from backends.sim.runner import start_sim_servers
    from backends.sim.state import SimServerConfig

    cm = start_sim_servers([SimServerConfig(
        model=MODEL, speed=50, seed=3, output_len_median=24,
        enable_return_routed_experts=True, moe=MOE_SHAPES["qwen3-30b-a3b"])])
    urls = loop_thread.run(cm.__aenter__())
    yield urls
    loop_thread.run(cm.__aexit__(None, None, None))


def _chat(http: httpx.Client, path: str, messages: list[dict[str, Any]], tokens: int,
          **extra: Any) -> str:
    r = http.post(f"{path}/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "max_tokens": tokens, **extra})
    r.raise_for_status()
    if not extra.get("stream"):
        return str(r.json()["choices"][0]["message"]["content"])
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if c["choices"])


def _conversation(http: httpx.Client, traj: str, group: str, turns: int = 3,
                  side_call: bool = True, tokens: int = 30) -> None:
    """An agent's turns with tool gaps, a title side call after its first turn."""
    path = f"/g/{group}/t/{traj}"
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": "fix the failing test"}]
    for turn in range(turns):
        reply = _chat(http, path, messages, tokens, stream=turn == 1)
        messages += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": f"tool output {turn}: ok ok"}]
        if turn == 0 and side_call:
            _chat(http, path, [{"role": "system", "content": "Write a title."},
                               {"role": "user", "content": "fix the failing test"}], 6)
        time.sleep(TOOL_S)


def test_the_view_is_the_sample_read_by_the_engines_tokenizer(
        gateway_at: GatewayFactory, sqlite_url: str, moe_engine: list[str]) -> None:
    traj, group = f"view-{uuid.uuid4().hex[:6]}", f"g-{uuid.uuid4().hex[:6]}"
    with gateway_at(sqlite_url, moe_engine) as gw, httpx.Client(base_url=gw, timeout=30) as http:
        _conversation(http, traj, group)
        http.post(f"/trajectories/{traj}/finish", json={"reward": 1.0}).raise_for_status()
        view = http.get(f"/trajectories/{traj}/view").json()
        sample = http.get(f"/trajectories/{traj}/sample").json()
        detail = http.get(f"/trajectories/{traj}", params={"include_text": True}).json()
        side = next(b for b in view["branches"] if not b["main"])
        side_view = http.get(f"/trajectories/{traj}/view",
                             params={"branch": side["branch"]}).json()
        window = http.get(f"/trajectories/{traj}/routes", params={"start": 8}).json()
        missing = http.get(f"/trajectories/{traj}/view", params={"branch": 99})

    # the tokens are the trainer's sample, each id's piece the engine's decoding of it
    tk = view["tokens"]
    assert tk["main"] and tk["token_ids"] == sample["token_ids"]
    assert tk["loss_mask"] == sample["loss_mask"]
    assert view["text"] is True and tk["pieces_note"] is None
    tok = get_tokenizer()
    pieces = {int(k): v for k, v in tk["pieces"].items()}
    assert set(pieces) == set(tk["token_ids"])
    assert all(pieces[i] == tok.decode([i]) for i in pieces)
    assert "".join(pieces[i] for i in tk["token_ids"]) == tok.decode(tk["token_ids"])
    # each call's generated span reads as the text the harness received
    texts = {c["seq"]: c["completion_text"] for c in detail["calls"]}
    for seq, _, start, end in tk["calls"]:
        assert "".join(pieces[i] for i in tk["token_ids"][start:end]).startswith(texts[seq])
        assert all(lp is not None for lp in tk["logprobs"][start:end])
        assert [round(x, 4) for x in sample["logprobs"][start:end]] == tk["logprobs"][start:end]
    assert sum(tk["loss_mask"]) == sum(e - s for _, _, s, e in tk["calls"])
    assert tk["versions"] == [[s, e, "0"] for _, _, s, e in tk["calls"]]

    # the title call is a side call of its own conversation, opened by call #1
    assert [b["kind"] for b in view["branches"]] == ["first call", "side call"]
    assert side["opened_by"] == 1 and side["fork_position"] <= 16
    assert "another system prompt" in side["reason"]
    assert side_view["tokens"]["branch"] == side["branch"] and not side_view["tokens"]["main"]
    assert missing.status_code == 404 and "no branch 99" in missing.json()["detail"]

    # where the time went: the tool gaps the agent slept, the first call has none
    calls = view["calls"]
    assert [c["seq"] for c in calls] == list(range(4))
    assert calls[0]["tool_gap_ms"] is None
    assert calls[2]["tool_gap_ms"] >= TOOL_S * 1000 * 0.9  # the turn after the first sleep
    assert all(abs(c["llm_ms"] + c["queued_ms"] - c["total_ms"]) < 1e-6 for c in calls)
    assert calls[0]["messages"][0] == {"role": "system", "content": SYSTEM}

    # routed experts: the window is the sample's own rows from the position asked
    assert tk["has_routes"]
    routes = routes_of(sample_from_json(sample))
    assert routes is not None
    assert window["start"] == 8 and window["end"] == len(sample["token_ids"])
    assert np.array_equal(np.asarray(window["rows"]), routes[8:])
    assert (window["layers"], window["top_k"]) == routes.shape[1:]


def test_each_credential_reads_what_it_may(gateway_at: GatewayFactory, sqlite_url: str,
                                           moe_engine: list[str]) -> None:
    traj = f"roles-{uuid.uuid4().hex[:6]}"
    as_ = {name: {"Authorization": f"Bearer {key}"}
           for name, key in (("admin", ADMIN), ("trainer", TRAINER), ("harness", HARNESS))}
    with gateway_at(sqlite_url, moe_engine, admin_token=ADMIN, trainer_token=TRAINER,
                    api_keys=[HARNESS]) as gw, httpx.Client(base_url=gw, timeout=30) as http:
        with httpx.Client(base_url=gw, timeout=30, headers=as_["harness"]) as harness:
            _conversation(harness, traj, "g-roles", turns=1, side_call=False)
        paths = [f"/trajectories/{traj}/view", f"/trajectories/{traj}/routes",
                 "/groups/g-roles/view", "/trajectories?q=roles"]
        refused = {(who, p): http.get(p, headers=h).status_code
                   for who, h in (("none", {}), ("harness", as_["harness"])) for p in paths}
        trainer = http.get(paths[0], headers=as_["trainer"]).json()
        admin = http.get(paths[0], headers=as_["admin"]).json()
        page = http.get(f"/view/trajectories/{traj}")

    assert {k: v for k, v in refused.items() if k[0] == "none"} == \
        {("none", p): 401 for p in paths}
    assert {k: v for k, v in refused.items() if k[0] == "harness"} == \
        {("harness", p): 403 for p in paths}
    # the trainer reads tokens, never text: no pieces, no messages, no completion text
    assert trainer["text"] is False and trainer["tokens"]["pieces"] is None
    assert all("messages" not in c or c["messages"] is None for c in trainer["calls"])
    assert all(c.get("completion_text") is None for c in trainer["calls"])
    assert trainer["tokens"]["token_ids"] == admin["tokens"]["token_ids"]
    assert admin["text"] is True and admin["tokens"]["pieces"]
    # the page itself is static and public: it holds no data until a credential reads it
    assert page.status_code == 200 and traj not in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]


def test_the_search_finds_by_each_field(gateway_at: GatewayFactory, db_url: str,
                                        moe_engine: list[str]) -> None:
    tag = uuid.uuid4().hex[:6]
    with gateway_at(db_url, moe_engine) as gw, httpx.Client(base_url=gw, timeout=30) as http:
        made = {}
        for i, (reward, tokens, version) in enumerate([(0.0, 8, "0"), (1.0, 40, "0"),
                                                       (0.5, 20, "7"), (None, 12, "7")]):
            if version != "0":
                http.put("/admin/weight-version", json={"version": version}).raise_for_status()
            traj = f"Find_{tag}-{i}"
            _chat(http, f"/t/{traj}", [{"role": "user", "content": "hi"}], tokens,
                  ignore_eos=True)
            if reward is not None:
                http.post(f"/trajectories/{traj}/finish", json={"reward": reward})
            made[traj] = reward
        # "_" is a wildcard of LIKE: a search for "find_<tag>" must not find this one
        _chat(http, f"/t/FindX{tag}-9", [{"role": "user", "content": "hi"}], 4)

        def ids(**q: Any) -> list[str]:
            r = http.get("/trajectories", params={"q": f"find_{tag}", **q})
            r.raise_for_status()
            return [t["id"] for t in r.json()["data"]]

        every = ids()
        by_reward = ids(order="-reward")
        assert ids(min_reward=0.5) == [f"Find_{tag}-1", f"Find_{tag}-2"]
        assert ids(max_reward=0.5, finished=True) == [f"Find_{tag}-0", f"Find_{tag}-2"]
        assert ids(finished=False) == [f"Find_{tag}-3"]
        assert ids(min_tokens=15, max_tokens=30) == [f"Find_{tag}-2"]
        assert ids(weight_version="7") == [f"Find_{tag}-2", f"Find_{tag}-3"]
        assert ids(model=MODEL) == every and ids(model="other") == []
        assert ids(order="-tokens")[0] == f"Find_{tag}-1"
        assert ids(q="no-such-id") == []
        assert http.get("/trajectories", params={"q": "%"}).json()["data"] == []  # literal %
        assert http.get("/trajectories", params={"order": "sideways"}).status_code == 422
        for bad in ({"min_tokens": 10**30}, {"max_tokens": -1}, {"min_reward": "nan"},
                    {"max_reward": "inf"}):  # a clear 422, never a database error
            assert http.get("/trajectories", params=bad).status_code == 422, bad
    assert every == list(made)  # oldest first, case-insensitive substring
    assert by_reward == [f"Find_{tag}-1", f"Find_{tag}-2", f"Find_{tag}-0", f"Find_{tag}-3"]


def test_a_group_side_by_side(gateway_at: GatewayFactory, sqlite_url: str,
                              moe_engine: list[str]) -> None:
    """Rewards 1, 0 and 0.25 (the first with a side call: two branches), one finished
    without a reward and one running: each member's advantage is what the client's
    ``group_advantages`` gives the group's samples (one reward per trajectory, whatever
    its branches), the others have none."""
    group = f"grp-{uuid.uuid4().hex[:6]}"
    rewards = [1.0, 0.0, 0.25, None, "running"]
    with gateway_at(sqlite_url, moe_engine) as gw, httpx.Client(base_url=gw, timeout=30) as http:
        for i, reward in enumerate(rewards):
            _conversation(http, f"{group}-{i}", group, turns=2, side_call=i == 0,
                          tokens=10 + 10 * i)
            if reward != "running":
                http.post(f"/trajectories/{group}-{i}/finish", json={"reward": reward})
        view = http.get(f"/groups/{group}/view").json()
        mains = [http.get(f"/trajectories/{group}-{i}/sample").json() for i in range(5)]
        every = http.get(f"/groups/{group}/samples").json()["data"]  # branches=all
        unknown = http.get("/groups/no-such-group/view")
        other = http.get(f"/groups/{group}/view", params={"model": "no-such-policy"})

    members = view["members"]
    assert [m["id"] for m in members] == [f"{group}-{i}" for i in range(5)]
    samples = [sample_from_json(s) for s in every]
    assert len(samples) == 5  # the four finished, the first with two branches
    by_id = dict(zip((s.trajectory_id for s in samples), group_advantages(samples),
                     strict=True))
    assert [m["advantage"] for m in members[:3]] == pytest.approx(
        [by_id[f"{group}-{i}"] for i in range(3)])
    assert members[3]["advantage"] is None and members[3]["finished"]  # no reward
    assert members[4]["advantage"] is None and not members[4]["finished"]
    mean = (1.0 + 0.0 + 0.25) / 3
    assert view["reward_mean"] == pytest.approx(mean)
    assert [m["advantage_unscaled"] for m in members[:3]] == \
        pytest.approx([1.0 - mean, -mean, 0.25 - mean])
    assert [m["length"] for m in members] == [len(s["token_ids"]) for s in mains]
    assert [m["trained"] for m in members] == [sum(s["loss_mask"]) for s in mains]
    assert members[0]["branches"] == 2 and members[1]["branches"] == 1
    assert members[0]["generated"] > members[0]["trained"]  # the title call's tokens
    assert all(m["max_staleness"] == 0 and m["versions"] == ["0"] for m in members)
    assert unknown.status_code == 404 and other.status_code == 404


def test_a_trajectory_whose_calls_all_failed_is_shown_without_a_sample(
        gateway_at: GatewayFactory, sqlite_url: str, scripted: Any) -> None:
    from tests.scripted_upstream import Script

    url, _ = scripted(Script(mode="error400"))  # an engine that refuses every call
    traj = f"failed-{uuid.uuid4().hex[:6]}"
    with gateway_at(sqlite_url, [url]) as gw, httpx.Client(base_url=gw, timeout=30) as http:
        r = http.post(f"/t/{traj}/v1/chat/completions", json={
            "model": "scripted", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 400, r.text
        view = http.get(f"/trajectories/{traj}/view")
        routes = http.get(f"/trajectories/{traj}/routes")
    assert view.status_code == 200, view.text
    body = view.json()
    assert body["tokens"] is None and body["branches"] == []
    assert [c["status"] for c in body["calls"]] == ["error"]
    assert routes.status_code == 404
