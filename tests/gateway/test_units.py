"""Pure pieces of the gateway: tagging, tool outcomes, prefix deltas, capture, SSE."""

from __future__ import annotations

import orjson
import pytest
from starlette.datastructures import Headers

from gateway.errors import BadRequest, InvalidTrajectoryId
from gateway.proxy.capture import Capture, inject
from gateway.proxy.sse import SSEDecoder
from gateway.trajectories.tagging import identify
from gateway.trajectories.tools import parse_outcomes


def _id(path=None, group=None, headers=None, body=None, keys=False):
    raw = headers.items() if isinstance(headers, dict) else headers or []
    return identify(path_trajectory=path, path_group=group,
                    headers=Headers(raw=[(k.lower().encode(), v.encode()) for k, v in raw]),
                    body=body or {}, api_keys_enabled=keys)


def test_identity_precedence():
    assert _id(path="p", headers={"x-trajectory-id": "h"}).trajectory_id == "p"
    assert _id(headers={"x-trajectory-id": "h", "x-session-id": "s"}).trajectory_id == "h"
    assert _id(headers={"x-session-id": "s"}).trajectory_id == "s"
    assert _id(headers={"authorization": "Bearer traj-7"}).trajectory_id == "traj-7"
    assert _id(body={"metadata": {"session_id": "m", "group_id": "g"}}).group_id == "g"
    assert _id(body={"user": "u"}).trajectory_id == "u"
    assert _id(body={"metadata": {"session_id": "m"}, "user": "u"}).trajectory_id == "m"


def test_bearer_placeholders_and_api_keys_do_not_tag():
    for key in ("EMPTY", "sk-abc", "dummy", ""):
        ident = _id(headers={"authorization": f"Bearer {key}"})
        assert ident.generated and ident.trajectory_id.startswith("auto-")
    assert _id(headers={"authorization": "Bearer traj-7"}, keys=True).generated


@pytest.mark.parametrize("name", ["X-Trajectory-Id", "X-Session-ID", "X-Group-Id",
                                  "Authorization", "x-api-key"])
def test_an_id_or_key_header_sent_twice_is_refused(name):
    """A proxy in front may read the other copy (HAProxy reads the last): refused."""
    _id(headers=[(name, "one")])  # once is fine
    with pytest.raises(BadRequest, match=f"2 {name.lower()} headers") as err:
        _id(headers=[(name, "one"), (name, "two")])
    assert err.value.status_code == 400 and err.value.param == name.lower()
    with pytest.raises(BadRequest):  # the same value twice too: one is the rule
        _id(path="t1", headers=[(name, "t1"), (name, "t1")])


@pytest.mark.parametrize("bad", ["has space", "x" * 129, "-lead", "ü", "a/b"])
def test_invalid_ids_are_rejected(bad):
    with pytest.raises(InvalidTrajectoryId):
        _id(headers={"x-trajectory-id": bad})


def test_tool_outcomes_from_new_messages():
    msgs = [
        {"role": "user", "content": "fix the bug"},
        {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "search", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Traceback (most recent call last):"},
        {"role": "tool", "tool_call_id": "c2", "content": "x" * 10_000},
    ]
    out = parse_outcomes(msgs)
    assert [(o.tool, o.outcome, o.size) for o in out] == [
        ("bash", "failure", "small"), ("search", "success", "large")]
    assert parse_outcomes(msgs[:1]) == []
    timeout = [*msgs[:2], {"role": "tool", "tool_call_id": "c1", "content": "command timed out"}]
    assert parse_outcomes(timeout)[0].outcome == "timeout"


def test_inject_respects_what_client_asked():
    body = {"logprobs": True, "top_logprobs": 3}
    asked = inject(body, chat=True)
    assert asked.logprobs and not asked.token_ids and body["top_logprobs"] == 3
    body = {}
    asked = inject(body, chat=False)
    assert body == {"logprobs": 0, "return_token_ids": True} and not asked.logprobs
    body = {"logprobs": True}
    assert inject(body, chat=False).logprobs and body["logprobs"] is True


def _chunk(**kw):
    return b"data: " + orjson.dumps(kw) + b"\n\n"


def test_sse_decoder_captures_across_split_chunks_and_strips():
    cap = Capture(chat=True, asked=inject({}, chat=True))
    dec = SSEDecoder(cap)
    stream = (_chunk(choices=[{"index": 0, "delta": {"role": "assistant"}}],
                     prompt_token_ids=[1, 2])
              + _chunk(choices=[{"index": 0, "delta": {"content": "a"}, "token_ids": [5],
                                 "logprobs": {"content": [{"logprob": -1.0}]}}])
              + b"data: [DONE]\n\n")
    out = b"".join(dec.feed(stream[i:i + 7]) for i in range(0, len(stream), 7)) + dec.flush()
    assert cap.prompt_ids == [1, 2]
    assert cap.completion(0).token_ids == [5] and cap.completion(0).logprobs == [-1.0]
    assert b"token_ids" not in out and b"prompt_token_ids" not in out
    assert out.endswith(b"data: [DONE]\n\n") and out.count(b"\n\n") == 3


def test_capture_keeps_fields_the_client_asked_for():
    cap = Capture(chat=True, asked=inject({"return_token_ids": True, "logprobs": True},
                                          chat=True))
    payload = {"choices": [{"index": 0, "token_ids": [3], "logprobs": {"content": [
        {"logprob": -0.1}]}, "message": {"content": "x"}}], "prompt_token_ids": [1]}
    assert cap.feed(payload, stream=False) is False
    assert payload["prompt_token_ids"] == [1] and payload["choices"][0]["token_ids"] == [3]


def test_tracker_keeps_only_recent_retired_trajectories():
    from gateway.trajectories.tracker import Tracker

    tracker = Tracker(retain_retired=3)
    for i in range(10):
        st = tracker.touch(f"t{i}", "g", float(i))
        tracker.call_arrived(st, [], float(i))
        tracker.call_dispatched(st, "b0", 0.0)
        tracker.call_finished(st, now=i + 0.5, llm_s=0.5, prompt=[1, 2], completion=[3], ok=True)
        tracker.finish(f"t{i}", 1.0, i + 1.0)
    assert len(tracker) == 3 and tracker.get("t9") is not None and tracker.get("t0") is None
    assert tracker.finished_count == 10 and not tracker.live
    assert tracker.groups["g"].finished_lengths == [1] * 10
    assert tracker.groups["g"].members == ["t7", "t8", "t9"]


def test_a_one_call_trajectory_lets_go_of_its_tree_once_recorded():
    """An untagged call's trajectory is never continued: once its call is placed (the
    record keeps its tokens) the tracker keeps its counters, not its token tree."""
    from gateway.trajectories.tracker import Tracker

    tracker = Tracker()
    st = tracker.touch("auto-1", None, 0.0)
    st.auto = True
    tracker.call_arrived(st, [], 0.0)
    tracker.call_dispatched(st, "b0", 0.0)
    placed = tracker.call_finished(st, now=0.5, llm_s=0.5, prompt=[1, 2, 3], completion=[4, 5],
                                   ok=True)
    assert placed is not None and placed.offset == 0 and placed.delta == [1, 2, 3]
    assert st.final_context == 5 and len(st.sequence) == 0
    assert st.completion_tokens == 2 and not tracker.live


@pytest.mark.parametrize(("method", "path", "expected"), [
    ("POST", "/v1/chat/completions", ("chat", None, None)),
    ("POST", "/v1/completions", ("completions", None, None)),
    ("POST", "/t/traj-1/v1/chat/completions", ("chat", "traj-1", None)),
    ("POST", "/g/grp.2/t/a:b@c/v1/completions", ("completions", "a:b@c", "grp.2")),
    # everything else goes on to FastAPI, which answers it as the routes declare
    ("POST", "/t/bad id!/v1/chat/completions", None),
    ("POST", "/t/" + "x" * 129 + "/v1/chat/completions", None),
    ("POST", "/v1/chat/completions/", None),
    ("POST", "/v1/responses", None),
    ("POST", "/v1/messages", None),
    ("GET", "/v1/chat/completions", None),
])
def test_raw_route_takes_only_the_completion_routes(method, path, expected):
    from gateway.api.openai import raw_route
    route = raw_route({"type": "http", "method": method, "path": path, "root_path": ""})
    got = None if route is None else (route[0].name, route[1], route[2])
    assert got == expected
