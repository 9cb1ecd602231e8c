"""``python -m gateway``: kept as an alias of ``python -m rollout_gateway`` (the whole CLI).

An entry point, not part of the gateway library: the one module in ``gateway`` allowed to
import the composition root above it (see the import contracts in ``pyproject.toml``).
"""

from rollout_gateway.cli import main

main()
