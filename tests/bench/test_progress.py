"""The bench commands' progress: a bar on a terminal, a line per tenth of a task in a log."""

from __future__ import annotations

import io

from rich.console import Console

from bench.options import Progress


def _run(terminal: bool) -> str:
    out = io.StringIO()
    console = Console(file=out, width=100, force_terminal=terminal)
    with Progress(console=console, transient=True) as prog:
        runs = prog.add_task("2 cells, 20 runs each", total=40)
        for _ in range(40):
            prog.advance(runs, 1)
        policy = prog.add_task("replay", total=7)
        prog.update(policy, completed=3)  # bench sim reports by update, not advance
        prog.update(policy, completed=7)
    return out.getvalue()


def test_a_log_gets_a_line_at_every_tenth_of_each_task() -> None:
    lines = _run(terminal=False).splitlines()
    said = [ln for ln in lines if ln.startswith("2 cells, 20 runs each: ")]
    assert [ln.split(": ")[1].split(" after")[0] for ln in said] == [
        f"{4 * k}/40 ({10 * k}%)" for k in range(1, 11)]
    assert [ln.split(" after")[0] for ln in lines if ln.startswith("replay: ")] == [
        "replay: 3/7 (40%)", "replay: 7/7 (100%)"]


def test_a_terminal_gets_the_bar_alone() -> None:
    assert ": 4/40 (10%)" not in _run(terminal=True)
