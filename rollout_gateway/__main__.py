"""``python -m rollout_gateway``: the same as the installed ``rollout-gateway``."""

from rollout_gateway.cli import main

main()
