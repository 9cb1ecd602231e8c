"""Options the simulator benchmarks share (``bench sim``, ``bench steps``, ``bench tail``),
and their progress display."""

from __future__ import annotations

import contextlib
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import Progress as RichProgress
from rich.progress import TaskID

TP_EFFICIENCY_HELP = ("how well TP scales in the cost model: low | mid | high (the band of "
                      "published measurements), calibrated (the shipped fit, default) or a "
                      "TP8/TP1 decode-throughput ratio of one instance, e.g. 1.8 "
                      "(docs/tp-efficiency.md)")
TpEfficiency = Annotated[str, typer.Option("--tp-efficiency", help=TP_EFFICIENCY_HELP)]
Model = Annotated[str, typer.Option(help="latency profile's model, e.g. qwen3-8b, qwen3-32b")]
Gpu = Annotated[str, typer.Option(help="latency profile's GPU: H100 | A100")]


def band_point(text: str, model: str, gpu: str) -> str | float:
    """``--tp-efficiency`` parsed and checked against the (model, GPU) profiles: a band
    name or a ratio; a bad value is a usage error naming what is accepted."""
    from backends.sim.profiles import penalty_for

    where: str | float = text
    with contextlib.suppress(ValueError):  # a number is a ratio, anything else a name
        where = float(text)
    try:
        penalty_for(model, gpu, where)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    return where


def log_console(width: int) -> Console:
    """A console for a bench command's output: the terminal's own, or, in a log (no
    terminal), one ``width`` columns wide so that report lines are not wrapped at 80."""
    console = Console()
    return console if console.is_terminal else Console(width=width)


class Progress(RichProgress):
    """rich's progress bar; where the output is no terminal (a log file, ``nohup``, CI),
    where rich would print the bar only at the end, a line at every tenth of a task
    instead, with the time so far, so that an hour-long run still says how far it is. Its
    own console, in a log, is 220 columns wide: the bench reports' lines unwrapped."""

    def __init__(self, *columns: Any, **kwargs: Any) -> None:
        if kwargs.get("console") is None:
            kwargs["console"] = log_console(220)
        super().__init__(*columns, **kwargs)
        self._tenths: dict[TaskID, int] = {}

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._say(task_id)

    def update(self, task_id: TaskID, **kwargs: Any) -> None:
        super().update(task_id, **kwargs)
        self._say(task_id)

    def _say(self, task_id: TaskID) -> None:
        task = self._tasks[task_id]
        if self.console.is_terminal or not task.total:
            return
        tenth = int(10 * task.completed / task.total)
        if tenth > self._tenths.get(task_id, 0):
            self._tenths[task_id] = tenth
            self.console.print(f"{task.description}: {task.completed:g}/{task.total:g} "
                               f"({tenth * 10}%) after {task.elapsed or 0:.0f} s")
