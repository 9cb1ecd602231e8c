"""``rollout-gateway bench``: benchmark commands (each module adds its own)."""

from __future__ import annotations

import typer

bench_app = typer.Typer(no_args_is_help=True)
