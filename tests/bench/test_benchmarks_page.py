"""BENCHMARKS.md: its tables are what ``bench page`` makes of the JSON in the repo, and
every command it lists is one the CLI accepts."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

from bench.reports.page import PAGE, ROOT, render
from bench.reports.page import command as merged_command
from gateway.policies.registry import ALL_NAMES
from rollout_gateway.cli import app


def page_commands(text: str) -> list[str]:
    """``rollout-gateway ...`` lines of fenced blocks and inline code spans."""
    fenced = [line.strip() for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
              for line in block.splitlines()]
    inline = re.findall(r"`(rollout-gateway [^`]+)`", text)
    return [c for c in fenced + inline if c.startswith("rollout-gateway ")]


def check_command(command: str) -> None:
    """Parse ``command`` as the CLI would (subcommands, options, types) without running
    it; policy and layout names must be current ones, input files must exist. Raises
    ``ValueError`` saying what is wrong."""
    args = shlex.split(command)[1:]
    cmd = typer.main.get_command(app)
    path = ["rollout-gateway"]
    while hasattr(cmd, "list_commands"):  # a group (typer vendors click: duck-typed)
        sub = cmd.get_command(cmd.context_class(cmd), args[0]) if args else None
        if sub is None:
            raise ValueError(f"no command {' '.join(path + args[:1])!r}")
        path.append(args.pop(0))
        cmd = sub
    try:
        params = cmd.make_context(" ".join(path), args).params
    except Exception as exc:  # typer's UsageError and its kin: what the CLI would refuse
        raise ValueError(f"{command}: {exc}") from exc
    given = [params.get(opt) or [] for opt in ("policy", "layout")]  # one name or a list
    bad = [n for v in given for n in ([v] if isinstance(v, str) else v) if n not in ALL_NAMES]
    if bad:
        raise ValueError(f"{command}: not a current policy name: {bad}")
    missing = [p for p in params.get("against") or [] if not (ROOT / p).exists()]
    if missing:
        raise ValueError(f"{command}: no such input: {missing}")


def test_the_page_is_what_its_json_makes() -> None:
    text = PAGE.read_text()
    assert render(text) == text, "BENCHMARKS.md is stale: run rollout-gateway bench page"


def test_the_page_lists_commands_and_every_one_is_accepted() -> None:
    commands = page_commands(PAGE.read_text())
    assert len(commands) >= 10  # steps x3, tail x3, weights, live, the other benchmarks
    for command in commands:
        check_command(command)


@pytest.mark.parametrize("command", [
    "rollout-gateway bench sim --workload swe --policy oracle",  # a name that is gone
    "rollout-gateway bench steps --policy ours-lane",  # an old name: accepted, not on the page
    "rollout-gateway bench steps --no-such-option 1",
    "rollout-gateway bench stepz --gpus 8",
    "rollout-gateway bench tail --against docs/steps-search-64gpu.json",  # moved
])
def test_the_check_refuses_what_would_fail_or_is_out_of_date(command: str) -> None:
    with pytest.raises(ValueError, match="bench"):
        check_command(command)


def test_a_number_changed_in_the_json_changes_the_page(tmp_path: Path) -> None:
    import shutil

    shutil.copytree(ROOT / "docs" / "benchmarks", tmp_path / "docs" / "benchmarks")
    live = tmp_path / "docs" / "benchmarks" / "live-16gpu" / "3x" / "heddle-libra.json"
    live.write_text(live.read_text().replace('"makespan_s": 645.', '"makespan_s": 745.', 1))
    text = PAGE.read_text()
    assert "| `heddle` | 1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1 | 646 |" in text
    assert "| `heddle` | 1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1 | 746 |" in render(text, tmp_path)


def test_runs_merge_into_one_command_only_when_they_differ_in_policies_alone() -> None:
    runs = [{"command": "rollout-gateway bench steps --gpus 8 --policy ours-lane "
                        "--json docs/steps-a.json"},
            {"command": "rollout-gateway bench steps --gpus 8 --policy heddle --json /tmp/b"}]
    assert merged_command(runs, "--json", "x.json") == (
        "rollout-gateway bench steps --gpus 8 --policy straggler-lane --policy heddle "
        "--json x.json")
    runs[1]["command"] = runs[1]["command"].replace("--gpus 8", "--gpus 16")
    with pytest.raises(ValueError, match="differ"):
        merged_command(runs)


def test_the_split_and_loop_tables_follow_their_json(tmp_path: Path) -> None:
    import json
    import shutil

    from bench.reports.loop_table import loop_table, split_table

    bench = tmp_path / "docs" / "benchmarks"
    shutil.copytree(ROOT / "docs" / "benchmarks", bench)
    split = bench / "shards" / "split.json"
    doc = json.loads(split.read_text())
    doc["results"]["tau"]["ratio_geomean"] = 1.5
    split.write_text(json.dumps(doc))
    assert "| tau |" in split_table(tmp_path) and "1.500x" in split_table(tmp_path)
    split.unlink()
    assert split_table(tmp_path) == "(not run)"

    loop = bench / "loop" / "qwen3-14b-h100-64gpu-math-code.json"
    doc = json.loads(loop.read_text())
    assert "4/GPU" not in loop_table(tmp_path).split("search")[0]
    doc["command"] = doc["command"].replace("--per-gpu 8", "--per-gpu 4")
    loop.write_text(json.dumps(doc))
    assert "| math-code | low, 4/GPU, trainer" in loop_table(tmp_path)


def test_replay_is_set_against_the_same_mode_pinned_seed_by_seed() -> None:
    from bench.reports.loop_table import _policy_vs_pinned

    def row(*tokens: float) -> dict[str, object]:
        return {"tokens_per_seed": {str(s): t for s, t in enumerate(tokens, 1)}}

    rows = {"async@verl-tp2": row(100, 200, 300), "async@replay": row(110, 220, 330),
            "sync@verl-tp2": row(100, 100, 100), "sync@replay": row(90, 90, 90),
            "tail-batching@replay": row(1, 2, 3)}  # no pinned row: left out
    assert _policy_vs_pinned(rows, "verl-tp2") == [
        "`async` 1.100x (1.100-1.100)", "`sync` 0.900x (0.900-0.900)"]


def test_the_reach_table_says_what_the_tail_estimate_rules_out(tmp_path: Path) -> None:
    """A cell is "out of reach" only while 1.15x over its best static layout needs less
    than the tail estimate; the best static is the one its steps runs name, the one
    that need was computed against."""
    import json
    import shutil

    from bench.reports.page import reach_table

    bench = tmp_path / "docs" / "benchmarks"
    shutil.copytree(ROOT / "docs" / "benchmarks", bench)
    tail = bench / "reach" / "tau-16gpu-16pg-high-tail.json"
    row = next(r for r in reach_table(tmp_path).splitlines() if r.startswith("| tau | H100 | 16 | high"))
    assert "out of reach" in row and "`verl-tp4`" in row
    doc = json.loads(tail.read_text())
    doc["target"]["needs_x_estimate"] = 1.07
    doc["against"]["verl-tp8"]["geomean"] = 1.01
    tail.write_text(json.dumps(doc))
    steps = bench / "reach" / "tau-16gpu-16pg-high-steps.json"
    runs = json.loads(steps.read_text())
    runs["best_static"] = "verl-tp8"
    steps.write_text(json.dumps(runs))
    row = next(r for r in reach_table(tmp_path).splitlines() if r.startswith("| tau | H100 | 16 | high"))
    assert "1.07x the estimate | not ruled out" in row and "`verl-tp8` 1.01x" in row
