"""mini-swe-agent (PyPI, its ``mini`` CLI, as shipped: base URL, key and model set, nothing
else but a step limit) on a tiny task, against a gateway over the simulated pool.

The simulated model answers with a tool call most turns (a command of nonsense words: it
fails and the agent goes on) and with text otherwise. mini-swe-agent rejects a reply with
no tool call (a format error): it drops the reply from its history and sends an error
message instead, so the next call forks a branch beside the rejected reply. The run ends
at the step limit (the simulated model never submits).

What is asserted: every call answered with no token mismatch; every generated token under
loss mask 1 in exactly one ``branches=all`` sample; the main sample trains the whole
conversation mini-swe-agent kept (every completion token of every call on main's line)
and none of the replies it rejected; the prefix tree holds each generated token once.
``pytest -s`` prints the figures docs/integrations.md tabulates.
"""

from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harnesses.mini import rejected_replies, run_mini
from tests.harnesses.trace import assert_every_token_kept, harness_report, lineage

# found, not imported: importing it would write its global config under this HOME
if importlib.util.find_spec("minisweagent") is None:
    pytest.skip("mini-swe-agent is not installed (the dev extra of pyproject.toml brings it: "
                "pip install -e '.[dev]')", allow_module_level=True)

STEPS = 16


def test_mini_swe_agent_run_is_kept_whole(sim_pool: list[str], gateway_at: Any,
                                          sqlite_url: str, tmp_path: Path) -> None:
    traj = "mini-" + uuid.uuid4().hex[:8]
    with gateway_at(sqlite_url, sim_pool) as gw:
        saved, wall = run_mini(f"{gw}/t/{traj}/v1", tmp_path, steps=STEPS)
        calls = httpx.get(f"{gw}/trajectories/{traj}", timeout=10).json()["calls"]
        kept = assert_every_token_kept(gw, traj)
        report = harness_report(gw, traj)
        main = httpx.get(f"{gw}/trajectories/{traj}/sample", timeout=10).json()
        all_samples = httpx.get(f"{gw}/trajectories/{traj}/samples",
                                params={"branches": "all"}, timeout=10).json()["data"]
    print(f"\nmini-swe-agent {saved['info']['mini_version']}: {wall:.1f} s")
    print(kept.line("mini-swe-agent (sim pool)"))
    print(report.line("mini-swe-agent (sim pool)"))

    # the run: every step one call, each answered, and mini-swe-agent stopped at its limit
    info = saved["info"]
    assert info["exit_status"] == "LimitsExceeded", info
    assert info["model_stats"]["api_calls"] == STEPS
    assert [c["seq"] for c in calls] == list(range(STEPS))
    assert all(c["status"] == "ok" for c in calls), [c["error"] for c in calls]
    rejected = rejected_replies(saved["messages"])
    assert len(rejected) == STEPS

    # no token mismatch anywhere: each call's prompt continues its branch's record
    assert [c["mismatch_pos"] for c in calls] == [None] * STEPS
    assert all(s["mismatches"] == [] for s in all_samples)
    assert report.mismatches == 0

    # every generated token under loss mask 1 in exactly one branches=all sample
    generated = sum(len(c["completion_ids"]) for c in calls)
    assert kept.calls == report.calls == STEPS
    assert kept.kept == kept.generated == report.generated == generated > 0
    assert sum(sum(s["loss_mask"]) for s in all_samples) == generated

    # the simulated model answered in text at least once: each reply mini-swe-agent
    # rejected is off main (its next call forked a branch beside it), every other call
    # is main's, and main trains each of their completion tokens in its own sequence
    assert any(rejected) and report.branches == kept.branches == sum(rejected) + 1 > 1
    assert main["main"] and main["mismatches"] == []
    line = lineage(calls, main["branch"])
    on_main = {c["seq"] for c, a, b in line if b > a}
    assert on_main == {seq for seq, r in enumerate(rejected) if not r}
    # (main's own calls are its spans; those it inherited sit where their branch had them)
    spans = {s["seq"]: s["completion_start"] for s in main["calls"]}
    assert set(spans) <= on_main
    for c, a, b in (part for part in line if part[0]["seq"] in on_main):
        assert (a, b) == (0, len(c["completion_ids"])), c["seq"]
        start, end = c["prompt_len"], c["prompt_len"] + b
        assert spans.get(c["seq"], start) == start
        assert main["token_ids"][start:end] == c["completion_ids"]
        assert main["loss_mask"][start:end] == [1] * (b - a)
        assert main["logprobs"][start:end] == c["completion_logprobs"]
    trained = sum(len(c["completion_ids"]) for c in calls if not rejected[c["seq"]])
    assert report.main_trained == sum(main["loss_mask"]) == trained
    assert report.main_trained < generated  # the rejected replies are trained elsewhere

    # branches=all repeats the shared prefixes; the tree holds each token once
    assert report.tree_trained == generated
    assert report.tree_nodes < report.all_tokens
    assert report.all_tokens == sum(len(s["token_ids"]) for s in all_samples)
