"""The tree of branches a trajectory's calls form, and what a new request continues."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from gateway.trajectories.branches import Tree, digest_messages, echoed_words, words


def test_calls_that_extend_each_other_stay_on_one_branch():
    tree = Tree()
    first = tree.place([1, 2, 3], [4, 5])
    assert (first.branch, first.parent, first.offset, first.delta) == (0, None, 0, [1, 2, 3])
    second = tree.place([1, 2, 3, 4, 5, 6], [7])
    assert (second.branch, second.offset, second.delta, second.mismatch_pos) == (0, 5, [6], None)
    assert list(tree.sequence) == [1, 2, 3, 4, 5, 6, 7]


def test_a_side_call_is_a_branch_and_never_overwrites_the_conversation():
    tree = Tree()
    tree.place([1, 2, 3], [4, 5])
    side = tree.place([1, 9, 9], [8])  # another system prompt after the shared BOS
    assert (side.branch, side.parent, side.offset, side.delta) == (1, 0, 1, [9, 9])
    assert side.mismatch_pos is None  # a side call is not drift
    back = tree.place([1, 2, 3, 4, 5, 6], [7])  # the conversation goes on where it was
    assert (back.branch, back.offset) == (0, 5)
    assert tree.main == 0 and list(tree.sequence) == [1, 2, 3, 4, 5, 6, 7]


def test_nothing_shared_is_a_root_and_a_regenerated_turn_is_a_sibling():
    tree = Tree()
    tree.place([1, 2], [3])
    root = tree.place([7, 8], [9])
    assert (root.branch, root.parent, root.offset) == (1, None, 0)
    again = tree.place([1, 2], [4])  # the same prompt sampled again
    assert (again.branch, again.parent, again.offset, again.delta) == (2, 0, 2, [])


def test_divergence_from_the_branch_the_messages_continued_is_a_mismatch():
    tree = Tree()
    tree.place([1, 2, 3], [4, 5])
    drift = tree.place([1, 2, 3, 4, 6, 7], [8], expected=0)
    assert (drift.branch, drift.parent, drift.offset, drift.mismatch_pos) == (1, 0, 4, 4)


def test_the_longest_extended_branch_wins():
    tree = Tree()
    tree.place([1], [2])
    tree.place([1, 5], [6])  # branch 1, forked at 1
    placed = tree.place([1, 2, 3], [4])
    assert (placed.branch, placed.offset) == (0, 2)
    placed = tree.place([1, 5, 6, 7], [8])
    assert (placed.branch, placed.offset) == (1, 3)


MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?"}]
TURN = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "sunny"}


def _tree_after_first_turn() -> Tree:
    tree = Tree()
    said = words("", [("get_weather", '{"city": "Paris"}')])
    tree.place([1, 2, 3], [4, 5, 6], digests=digest_messages(MSGS), said=said)
    return tree


def test_a_request_continues_a_branch_when_it_resends_its_history_and_echoes_the_turn():
    tree = _tree_after_first_turn()
    resent = [*MSGS, {**TURN, "tool_calls": [{"id": "other", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city":"Paris"}'}}]}, RESULT]  # re-serialized
    cont = tree.continuation(digest_messages(resent), resent)
    assert cont is not None
    assert (cont.branch, cont.turn_start, cont.turn_end, cont.echo_complete) == (0, 2, 3, True)
    other_tools = digest_messages(resent, context=[{"type": "function"}])
    assert tree.continuation(other_tools, resent) is None  # another system block
    assert list(cont.sequence) == [1, 2, 3, 4, 5, 6]


def test_a_turn_echoed_as_text_still_continues_but_a_truncated_one_does_not():
    tree = _tree_after_first_turn()
    as_text = [*MSGS, {"role": "assistant", "content": "Calling tools:\n[{'id': 'c1', "
                       "'function': {'name': 'get_weather', 'arguments': {'city': 'Paris'}}}]"},
               {"role": "user", "content": "Observation: sunny"}]
    cont = tree.continuation(digest_messages(as_text), as_text)
    assert cont is not None and cont.echo_complete
    cut = [*MSGS, {"role": "assistant", "content": "get_weather(...)"}, RESULT]
    cont = tree.continuation(digest_messages(cut), cut)
    assert cont is not None and not cont.echo_complete


def test_other_history_continues_nothing():
    tree = _tree_after_first_turn()
    other = [{"role": "system", "content": "write a title"}, MSGS[1], TURN, RESULT]
    assert tree.continuation(digest_messages(other), other) is None
    assert tree.continuation(digest_messages(MSGS), MSGS) is None  # the same request again


def test_digests_see_meaning_not_serialization():
    a = digest_messages([TURN])
    b = digest_messages([{**TURN, "tool_calls": [{"id": "x", "type": "function", "function": {
        "name": "get_weather", "arguments": '{ "city" : "Paris" }'}}]}])
    assert a == b and len(a) == 2  # the context's digest, then the message's
    assert digest_messages([{"role": "developer", "content": "x"}]) == \
        digest_messages([{"role": "system", "content": [{"type": "text", "text": "x"}]}])
    assert digest_messages([MSGS[1]]) != digest_messages([{**MSGS[1], "content": "weather!"}])


def test_echoed_words_count_every_word_of_the_rendering():
    assert echoed_words([TURN]) == Counter({"get_weather": 1, "city": 1, "Paris": 1})
    assert not (words("It is sunny.") - echoed_words([{"role": "assistant",
                                                       "content": " It is sunny. "}]))


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 6),
                          st.lists(st.integers(1, 3), min_size=0, max_size=4),
                          st.lists(st.integers(1, 3), min_size=1, max_size=3)),
                min_size=1, max_size=30))
def test_replaying_the_placements_rebuilds_every_prompt(calls):
    """Whatever the calls, the stored form (branch, parent, offset, delta) rebuilds each
    call's prompt token for token, as build_samples replays it."""
    tree = Tree()
    stored: dict[int, list[int]] = {}  # what replaying the records gives per branch
    lines: list[list[int]] = []  # prompt + completion of each call so far
    for pick, cut, extra, completion in calls:
        base = lines[pick % len(lines)] if lines else []
        prompt = base[:max(0, len(base) - cut)] + extra or [1]  # continue, cut or fork
        placed = tree.place(prompt, completion)
        if placed.branch not in stored:
            parent = stored[placed.parent] if placed.parent is not None else []
            stored[placed.branch] = parent[:placed.offset]
            assert len(stored[placed.branch]) == placed.offset
        seq = stored[placed.branch]
        assert len(seq) == placed.offset
        seq += placed.delta
        assert seq == prompt
        seq += completion
        lines.append(prompt + completion)
    assert tree.count == len(stored)
