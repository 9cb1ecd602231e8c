"""The session ids harnesses send on their own tag a call that names no trajectory
(gateway/trajectories/harness_ids.py): each source, their order after the explicit ids
and before ``user``, the mapping of ids the gateway would refuse, and a Codex-like run
with a plain ``/v1`` base URL landing on one trajectory."""

from __future__ import annotations

import time

import httpx
import orjson
import pytest
from starlette.datastructures import Headers

from gateway.errors import BadRequest
from gateway.trajectories.harness_ids import as_trajectory_id, claude_session
from gateway.trajectories.keys import KeySigner
from gateway.trajectories.tagging import identify

SID = "01a2207b-9cbc-7822-a47f-52aa3e670b31"  # as Codex 0.169 sends it
#: Claude Code 2.1.331's metadata.user_id, as sent
USER_ID = orjson.dumps({"device_id": "36764aea5f5e04cd", "account_uuid": "",
                        "session_id": "b74e284c-8cf6-4e4f-bb53-c416a6dab0b6"}).decode()


def _id(path=None, headers=None, body=None, keys=False):
    raw = headers.items() if isinstance(headers, dict) else headers or []
    return identify(path_trajectory=path, path_group=None,
                    headers=Headers(raw=[(k.lower().encode(), v.encode()) for k, v in raw]),
                    body=body or {}, api_keys_enabled=keys)


@pytest.mark.parametrize(("headers", "body", "expected"), [
    ({"session-id": SID, "authorization": "Bearer EMPTY"}, {}, SID),  # Codex CLI
    ({"Session-Id": SID}, {}, SID),  # header names are case-insensitive
    ({"X-Claude-Code-Session-Id": "b74e", "x-api-key": "sk-none"}, {}, "b74e"),
    ({}, {"metadata": {"user_id": USER_ID}}, "b74e284c-8cf6-4e4f-bb53-c416a6dab0b6"),
    ({"x-litellm-session-id": "conv-1"}, {}, "conv-1"),  # the OpenHands SDK
])
def test_each_harness_session_id_tags_the_call(headers, body, expected):
    ident = _id(headers=headers, body=body)
    assert ident.trajectory_id == expected and not ident.generated


def test_claude_user_id_forms():
    assert claude_session({"metadata": {"user_id": USER_ID}}) == \
        "b74e284c-8cf6-4e4f-bb53-c416a6dab0b6"
    legacy = "user_9f3a_account_5d1e-77_session_0c0e1d2f-aaaa-4bbb-8ccc-123456789abc"
    assert claude_session({"metadata": {"user_id": legacy}}) == \
        "0c0e1d2f-aaaa-4bbb-8ccc-123456789abc"
    assert claude_session({"metadata": {"user_id": {"session_id": "s-1"}}}) == "s-1"
    for user_id in ("{not json", "plain-user", '{"device_id": "d"}', 7, None, ""):
        assert claude_session({"metadata": {"user_id": user_id}}) is None
    assert claude_session({"metadata": "x"}) is None and claude_session({}) is None


def test_explicit_ids_win_and_user_comes_last():
    harness = {"session-id": "codex-s", "x-claude-code-session-id": "claude-s",
               "x-litellm-session-id": "lite-s"}
    assert _id(path="p", headers=harness).trajectory_id == "p"
    assert _id(headers={**harness, "x-trajectory-id": "h"}).trajectory_id == "h"
    assert _id(headers={**harness, "x-session-id": "s"}).trajectory_id == "s"
    assert _id(headers={**harness, "authorization": "Bearer traj-7"}).trajectory_id == "traj-7"
    assert _id(headers=harness, body={"metadata": {"session_id": "m"}}).trajectory_id == "m"
    # among the harness ids: Claude Code's header, Codex's, LiteLLM's, then the body's
    assert _id(headers=harness).trajectory_id == "claude-s"
    assert _id(headers={"session-id": "codex-s", "x-litellm-session-id": "l"}
               ).trajectory_id == "codex-s"
    assert _id(headers={"x-litellm-session-id": "l"},
               body={"metadata": {"user_id": USER_ID}}).trajectory_id == "l"
    # before ``user``, after it when absent
    assert _id(headers={"session-id": "codex-s"}, body={"user": "u"}).trajectory_id == "codex-s"
    assert _id(body={"metadata": {"user_id": "nothing"}, "user": "u"}).trajectory_id == "u"
    # with API keys on, the bearer is a credential: the harness id still tags
    assert _id(headers={"authorization": "Bearer k", "session-id": "c"}, keys=True
               ).trajectory_id == "c"
    # an empty header is no id
    assert _id(headers={"session-id": " "}).generated


def test_a_scoped_key_ignores_the_harness_session():
    """The key names the call's trajectory; the harness's own id is no conflict."""
    key = KeySigner(b"k" * 32).mint("mine")
    ident = _id(headers={"authorization": f"Bearer {key}", "session-id": "other",
                         "x-claude-code-session-id": "other2"}, keys=True)
    assert ident.trajectory_id == "mine"


@pytest.mark.parametrize("raw", ["has space", "x" * 129, "-lead", "ü", "a/b"])
def test_a_harness_id_outside_the_charset_is_mapped_not_refused(raw):
    mapped = _id(headers={"session-id": raw}).trajectory_id
    seen = raw.encode().decode("latin-1")  # how a header's bytes read in Starlette
    assert mapped == as_trajectory_id(seen) == _id(headers={"x-litellm-session-id": raw}
                                                   ).trajectory_id
    assert mapped.startswith("h-") and len(mapped) == 34
    assert as_trajectory_id(seen + "!") != mapped  # another id, another trajectory


@pytest.mark.parametrize("name", ["session-id", "x-claude-code-session-id",
                                  "x-litellm-session-id"])
def test_a_harness_header_sent_twice_is_refused(name):
    with pytest.raises(BadRequest, match=f"2 {name} headers"):
        _id(headers=[(name, "a"), (name, "b")])


def test_a_codex_like_run_on_a_plain_base_url_is_one_trajectory(sim_pool, gateway_at,
                                                                 sqlite_url):
    """Codex 0.169 with ``base_url = GW/v1``: a ``session-id`` header, a placeholder key,
    the Responses API; three calls, one trajectory (the issue saw three ``auto-`` ones)."""
    headers = {"session-id": SID, "thread-id": SID, "authorization": "Bearer EMPTY",
               "originator": "codex_exec"}
    with gateway_at(sqlite_url, sim_pool) as gw:
        items: list[dict] = [{"type": "message", "role": "user",
                              "content": [{"type": "input_text", "text": "list the files"}]}]
        for _ in range(3):
            r = httpx.post(f"{gw}/v1/responses", headers=headers, timeout=30, json={
                "model": "qwen3-14b", "input": items, "store": False, "max_output_tokens": 20})
            assert r.status_code == 200, r.text
            assert r.headers["x-trajectory-id"] == SID
            items += [*r.json()["output"],
                      {"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": "go on"}]}]
        calls = _calls(gw, SID, 3)
        assert [c["seq"] for c in calls] == [0, 1, 2]
        listed = httpx.get(f"{gw}/trajectories").json()["data"]
        assert [t["id"] for t in listed] == [SID]


def _calls(gw: str, traj: str, n: int) -> list[dict]:
    for _ in range(100):  # the writer flushes every 50 ms
        got = httpx.get(f"{gw}/trajectories/{traj}").json().get("calls", [])
        if len(got) >= n:
            return got
        time.sleep(0.05)
    raise AssertionError(f"{traj} has fewer than {n} calls")
