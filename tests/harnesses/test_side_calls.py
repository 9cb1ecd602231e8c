"""Side calls, compaction and subagents on one trajectory id are branches, never
overwrites: the conversation's sample survives them whole, and every generated token is
in some branch's sample under loss mask 1.

Before trajectories were trees, one unrelated call after a three-turn conversation left
``/sample`` at 29 tokens instead of 1,517.
"""

from __future__ import annotations

import uuid

import anthropic
import httpx
import openai

from tests.harnesses.conftest import MODEL
from tests.harnesses.trace import assert_every_token_kept

ANT_TOOL = {"name": "bash", "description": "run a shell command",
            "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}},
                             "required": ["cmd"]}}
# an agent's system prompt is long; a short one must still outlast the few tokens a side
# call's own system prompt shares with it (gateway/store/samples.py, 16 tokens)
AGENT = "You are a coding agent. Work in the repository, run its tests and fix what fails."


def _samples(gw: str, traj: str) -> list[dict]:
    return httpx.get(f"{gw}/trajectories/{traj}/samples", timeout=10).json()["data"]


def test_a_title_call_between_turns_is_its_own_branch(scripted_gateway, closing):
    """The Messages API as a coding agent uses it, with a title-generation side call
    (another system prompt, no tools) between its turns, as Claude Code sends one."""
    traj = f"title-{uuid.uuid4().hex[:8]}"
    client = closing(anthropic.Anthropic(base_url=f"{scripted_gateway}/t/{traj}",
                                         api_key="sk-none"))
    messages: list[dict] = [{"role": "user", "content": "list the files"}]
    first = client.messages.create(model=MODEL, max_tokens=200, system=AGENT,
                                   tools=[ANT_TOOL], messages=messages)
    use = next(b for b in first.content if b.type == "tool_use")
    title = client.messages.create(model=MODEL, max_tokens=20, messages=[
        {"role": "user", "content": "list the files"}],
        system="Write a 3-word title for this conversation.")
    assert title.content[0].text
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": "a.py b.py"}]}]
    second = client.messages.create(model=MODEL, max_tokens=200, system=AGENT,
                                    tools=[ANT_TOOL], messages=messages)
    messages += [{"role": "assistant", "content": [b.model_dump() for b in second.content]},
                 {"role": "user", "content": "thanks"}]
    client.messages.create(model=MODEL, max_tokens=200, system=AGENT, tools=[ANT_TOOL],
                           messages=messages)

    calls = httpx.get(f"{scripted_gateway}/trajectories/{traj}").json()["calls"]
    assert [c["branch"] for c in calls] == [0, 1, 0, 0]
    assert calls[1]["parent_branch"] == 0 and calls[1]["mismatch_pos"] is None
    kept = assert_every_token_kept(scripted_gateway, traj)
    assert kept.branches == 2 and kept.calls == 4
    main = httpx.get(f"{scripted_gateway}/trajectories/{traj}/sample").json()
    assert main["branch"] == 0 and main["main"]  # the conversation, whole
    assert len(main["token_ids"]) == calls[3]["prompt_len"] + len(calls[3]["completion_ids"])
    assert [s["call_id"] for s in main["calls"]] == [calls[i]["id"] for i in (0, 2, 3)]
    print(kept.line("messages API with a title side call (sim)"))


def test_compaction_and_a_subagent_are_branches_and_the_conversation_goes_on(
        scripted_gateway, closing):
    """A chat agent summarizes its history (that call extends the conversation), restarts
    from the summary (a branch forked at the shared system prompt), and starts a subagent
    with its own system prompt (a branch) while the main line goes on."""
    traj = f"compact-{uuid.uuid4().hex[:8]}"
    client = closing(openai.OpenAI(base_url=f"{scripted_gateway}/t/{traj}/v1",
                                   api_key="EMPTY", max_retries=0))

    def say(messages: list[dict]) -> str:
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30)
        return out.choices[0].message.content or ""

    history = [{"role": "system", "content": AGENT},
               {"role": "user", "content": "fix the failing test"}]
    history.append({"role": "assistant", "content": say(history)})
    history.append({"role": "user", "content": "go on"})
    history.append({"role": "assistant", "content": say(history)})
    summary = say([*history, {"role": "user", "content": "Summarize the conversation."}])
    fresh = [{"role": "system", "content": AGENT},
             {"role": "user", "content": f"Summary so far: {summary}"}]
    fresh.append({"role": "assistant", "content": say(fresh)})
    say([{"role": "system", "content": "You are a subagent that reads files."},
         {"role": "user", "content": "read a.py"}])
    fresh.append({"role": "user", "content": "and now?"})
    say(fresh)

    calls = httpx.get(f"{scripted_gateway}/trajectories/{traj}").json()["calls"]
    assert [c["branch"] for c in calls] == [0, 0, 0, 1, 2, 1]
    # forks from the branch sharing the longest prefix; on a tie (the subagent shares only
    # the system role's header with either), from the main one
    assert [c["parent_branch"] for c in calls] == [None, None, None, 0, 1, None]
    kept = assert_every_token_kept(scripted_gateway, traj)
    samples = _samples(scripted_gateway, traj)
    assert [(s["branch"], s["main"]) for s in samples] == [(0, False), (1, True), (2, False)]
    assert len(samples[0]["calls"]) == 3  # the whole history before the compaction
    assert all(c["mismatch_pos"] is None for c in calls)
    longest = httpx.get(f"{scripted_gateway}/trajectories/{traj}/samples",
                        params={"branches": "longest"}).json()["data"]
    assert [s["branch"] for s in longest] == [max(
        samples, key=lambda s: sum(s["loss_mask"]))["branch"]]
    print(kept.line("chat agent with compaction and a subagent (sim)"))
