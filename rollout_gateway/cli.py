"""``rollout-gateway``: the one place where every command is registered.

The layers below each define their own commands and know nothing of the layers above:
``gateway.cli`` the gateway's (``serve``, ``migrate``, ``export``, ``sim-backend``),
``bench.cli`` the end-to-end ``demo`` and the ``bench`` group. This module mounts them.
"""

from __future__ import annotations

import typer

from bench.cli import bench_app, demo
from gateway.cli import app as gateway_app


def build_app() -> typer.Typer:
    """The whole command tree, in the order ``--help`` lists it."""
    app = typer.Typer(help="Trajectory-aware gateway for agentic RL rollouts.",
                      no_args_is_help=True, pretty_exceptions_show_locals=False)
    app.add_typer(gateway_app)  # unnamed: its commands sit at the top level
    top = typer.Typer()
    top.command()(demo)
    app.add_typer(top)
    app.add_typer(bench_app, name="bench", help="Benchmarks: simulated and live rollouts.")
    return app


app = build_app()


def main() -> None:
    app()
