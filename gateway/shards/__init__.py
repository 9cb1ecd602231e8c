"""Several gateway processes behind one address (docs/scaling.md, docs/deployment.md).

A sharded gateway is N complete gateways (*shards*), each owning a disjoint part of the
pool and the trajectories hashed to it, behind HAProxy, which routes every model call by
its trajectory's group (else its id), wherever the call carries it; and one *front*: a
small process that fans the admin API out to every shard, answers the trajectory API
from the shard that holds each trajectory, and serves one status page, one ``/status``
and one ``/metrics`` over all shards. All shards write one Postgres store.

* :mod:`gateway.shards.haproxy`: the proxy's configuration (generated, never hand-written);
* :mod:`gateway.shards.merge`: one status and one metrics view from the shards' own;
* :mod:`gateway.shards.front`: the front's app (status, metrics, page, trajectory API);
* :mod:`gateway.shards.fanout`: its admin API (fan-out, undo, jobs, moving a backend);
* :mod:`gateway.shards.shardset`: the shards as the front sees them;
* :mod:`gateway.shards.launch`: ``rollout-gateway serve --shards N`` on one machine.
"""
