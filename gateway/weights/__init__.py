"""Weight updates and the staleness bound: the control plane a trainer drives.

``update`` pauses the engines, swaps their weights and resumes them; ``job`` runs an update
as an admin job; ``aborts`` cuts a trajectory short and enforces the staleness bound at
each version change. The request path never imports this package (the ``relay-apart``
contract): it reads the live-call table (``gateway.live_calls``) and the weight version
through the runtime it is handed.
"""
