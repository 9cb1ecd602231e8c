"""What the viewer says of a trajectory's branches, timings and token spans, on calls
built as the store holds them (no database): each reason a branch can open for, told
from where it forks, and the spans the token view marks."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from gateway.store.models import Trajectory
from gateway.store.samples import build_branches
from gateway.store.views import view_branches, view_calls, view_tokens
from tests.store.rows import Calls

T0 = datetime(2026, 12, 1, tzinfo=UTC)


def _traj() -> Trajectory:
    return Trajectory(id="t", group_id=None, created_at=T0, finished_at=None, reward=None,
                      meta=None, attempt=0)


def _branches(calls: Calls) -> dict[int, tuple[str, str, bool]]:
    ordered, main = build_branches(_traj(), calls.rows, routes=False)
    assert main is not None
    return {b.branch: (b.kind, b.reason, b.main) for b in view_branches(ordered, main, "0")}


def test_each_way_a_branch_opens_is_told_apart() -> None:
    c = Calls()
    c.call(0, list(range(40)), 10)                  # #0: prompt 0-40, reply 40-50
    c.call(0, [7, 7, 7], 10)                        # #1: prompt 50-53, reply 53-63
    c.call(1, [8, 8], 10, fork=(0, 53))             # #2: #1's prompt again, its reply dropped
    c.call(2, [9], 5, fork=(1, 60))                 # #3: keeps 5 of #2's 10 tokens
    c.call(3, [4, 4], 5, fork=(1, 20))              # #4: differs inside #0's prompt
    c.call(4, [1, 2, 3], 4, fork=(0, 3))            # #5: its own system prompt (a title)
    c.call(1, [6], 10)                              # #6: the conversation goes on
    c.call(5, [2] * 5, 10, fork=(1, 65))            # #7: #6's reply dropped, an error added
    c.call(5, [6], 10)                              #     (the turn's opening tokens differ)
    told = _branches(c)
    assert {b: k for b, (k, _, _) in told.items()} == {
        0: "first call", 1: "dropped turn", 2: "side call", 3: "side call", 4: "side call",
        5: "dropped turn"}
    assert "call #6's prompt again without its reply" in told[5][1] and told[5][2]
    assert "call #1's prompt again without its reply (10 tokens)" in told[1][1]
    assert "keeps 5 of the 10 tokens call #2 generated" in told[2][1]
    assert "in call #0's prompt" in told[3][1]
    assert "shares only its first 3 tokens" in told[4][1]


def test_a_branch_that_goes_on_is_named_for_its_fork_not_called_a_side_call() -> None:
    c = Calls()
    c.call(0, list(range(40)), 10)
    c.call(0, [7, 7, 7], 10)
    c.call(1, [5] * 30, 10, fork=(0, 25))           # a compaction: history from position 25
    c.call(1, [6], 10)
    c.call(2, [3] * 20, 10, fork=(1, 70))           # edits the last reply, then goes on
    c.call(2, [6], 10)
    told = _branches(c)
    assert told[1][0] == "edited history" and not told[1][2]
    assert told[2][0] == "edited turn" and told[2][2]  # main: the conversation ended there
    # a branch with a system prompt of its own that the harness went on with is the task
    d = Calls()
    d.call(0, [1, 2, 3, 4], 3)                      # a title call first
    d.call(1, [9] * 40, 10, fork=(0, 2))
    d.call(1, [6], 10)
    told = _branches(d)
    assert told[0][0] == "side call" and told[1][:1] == ("changed system prompt",)
    assert told[1][2]


def test_time_gaps_and_token_spans() -> None:
    c = Calls()
    c.call(0, list(range(20)), 8)
    c.call(0, [5, 5], 8)
    c.call(0, [6], 8)
    starts = [T0, T0 + timedelta(seconds=2), T0 + timedelta(seconds=2.5)]
    for row, start, total in zip(c.rows, starts, (500.0, 1000.0, 100.0), strict=True):
        row.started_at, row.total_ms, row.queued_ms = start, total, 50.0
    c.rows[1].weight_segments = [[0, 3, "0"], [3, 8, "1"]]
    c.rows[2].weight_version = "1"
    c.rows[2].kept_len = 38  # ran #1's reply (30-38) from the record
    calls = view_calls(c.rows, text=False)
    assert [x.tool_gap_ms for x in calls] == [None, 1500.0, None]  # #2 overlapped #1
    assert [x.llm_ms for x in calls] == [450.0, 950.0, 50.0]
    assert all(x.messages is None and x.completion_text is None for x in calls)

    ordered, main = build_branches(_traj(), c.rows, routes=False)
    assert main is not None
    tk = view_tokens(main, main, c.rows)
    assert tk.calls == [(0, 0, 20, 28), (1, 28, 30, 38), (2, 38, 39, 47)]
    assert tk.versions == [(20, 28, "0"), (30, 33, "0"), (33, 38, "1"), (39, 47, "1")]
    assert tk.token_in == [(30, 38, 2)]
    assert [lp is None for lp in tk.logprobs[18:22]] == [True, True, False, False]
    assert not tk.has_routes
