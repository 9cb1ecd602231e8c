"""Options the simulator benchmarks share (``bench sim``, ``bench steps``, ``bench tail``)."""

from __future__ import annotations

import contextlib
from typing import Annotated

import typer

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
