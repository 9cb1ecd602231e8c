"""Which branch is the task and what each sample trains (issue 42, item 1).

The shapes are the ones harnesses make (docs/integrations.md): a reply the harness drops
(mini-swe-agent's format errors), a side call after the task (Qwen Code's memory
subagent, smolagents' final-answer fallback), a title call before it (Claude Code,
opencode). In each, the main sample is the task's conversation and trains every
generated token in its sequence, and over all samples each generated token is trained
exactly once. Rows are built in memory as the store holds them (no database needed).
"""

from __future__ import annotations

import pytest

from gateway.store.codec import unpack_ids
from gateway.store.models import Trajectory
from gateway.store.samples import build_sample, build_samples
from tests.store.rows import Calls


def _trained(sample) -> list[int]:
    return [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m]


def _check_once(calls: Calls) -> None:
    samples = build_samples(Trajectory(id="t", attempt=0), calls.rows)
    trained = [t for s in samples for t in _trained(s)]
    generated = [t for c in calls.rows for t in unpack_ids(c.completion_ids)]
    assert sorted(trained) == sorted(generated)  # every generated token exactly once


def test_a_dropped_reply_leaves_the_final_conversation_whole():
    """Tool call, a text reply the harness drops, a format-error turn, a tool call, an
    answer: the main sample trains the first tool call too (it was masked 0 before)."""
    c = Calls()
    tool1 = c.call(0, [1, 2, 3], 4)
    dropped = c.call(0, [5], 3)  # the harness will not keep this reply
    fork = 3 + 4 + 1  # the format-error turn follows the tool result, not the reply
    error_turn = c.call(1, [6], 2, fork=(0, fork))
    tool2 = c.call(1, [7], 3)
    answer = c.call(1, [8], 5)
    main = build_sample(Trajectory(id="t", attempt=0), c.rows)
    assert main.branch == 1 and main.main
    assert _trained(main) == tool1 + error_turn + tool2 + answer
    [other] = [s for s in build_samples(Trajectory(id="t", attempt=0), c.rows)
               if not s.main]
    assert _trained(other) == dropped
    _check_once(c)


@pytest.mark.parametrize("side_len", [3, 400])
def test_a_side_call_after_the_task_is_not_main(side_len: int):
    """A memory subagent (or a fallback answer) after the task, with its own system
    prompt: however long its answer, the task's conversation stays main."""
    c = Calls()
    task = c.call(0, [1, 2, 3], 20) + c.call(0, [4], 30) + c.call(0, [5], 10)
    side = c.call(1, [9, 9], side_len, fork=(0, 1))  # shares the first token only
    samples = build_samples(Trajectory(id="t", attempt=0), c.rows)
    [main] = [s for s in samples if s.main]
    assert main.branch == 0 and _trained(main) == task
    assert [_trained(s) for s in samples if not s.main] == [side]
    assert build_samples(Trajectory(id="t", attempt=0), c.rows, branches="main") == [main]
    _check_once(c)


def test_a_title_call_before_the_task_is_not_main():
    c = Calls()
    title = c.call(0, [1, 2], 6)
    task = c.call(1, [3, 4], 10, fork=(0, 0)) + c.call(1, [5], 10)
    samples = build_samples(Trajectory(id="t", attempt=0), c.rows)
    [main] = [s for s in samples if s.main]
    assert main.branch == 1 and _trained(main) == task
    assert [_trained(s) for s in samples if not s.main] == [title]
    _check_once(c)


def test_a_subagent_forked_late_trains_its_own_tail_and_main_keeps_the_shared_turns():
    """A branch forked after two turns of the task: the shared turns are main's to train;
    the branch trains only what it generated after the fork."""
    c = Calls()
    shared = c.call(0, [1], 5) + c.call(0, [2], 5)
    later = c.call(0, [3], 5) + c.call(0, [4], 5)
    fork = 1 + 5 + 1 + 5
    side = c.call(1, [9], 7, fork=(0, fork))
    samples = build_samples(Trajectory(id="t", attempt=0), c.rows)
    by = {s.branch: s for s in samples}
    assert by[0].main and _trained(by[0]) == shared + later
    assert _trained(by[1]) == side
    assert by[1].loss_mask[:fork] == [0] * fork  # context there, trained in main
    _check_once(c)


def test_after_a_compaction_main_is_where_the_harness_went_on():
    """History (3 calls, the last one the summary), a restart from the summary under the
    same system prompt (2 calls), a subagent with its own system prompt (1 call): main is
    the restarted conversation; the history trains its own turns; so does the subagent."""
    c = Calls()
    system = list(range(1, 31))  # a system prompt of 30 tokens
    history = c.call(0, [*system, 40], 8) + c.call(0, [41], 8) + c.call(0, [42], 9)
    restarted = c.call(1, [43, 44], 6, fork=(0, 30)) + c.call(1, [45], 6)
    subagent = c.call(2, [99, 98], 5, fork=(0, 2))
    samples = build_samples(Trajectory(id="t", attempt=0), c.rows)
    by = {s.branch: s for s in samples}
    assert by[1].main and _trained(by[1]) == restarted
    assert _trained(by[0]) == history and _trained(by[2]) == subagent
    _check_once(c)
