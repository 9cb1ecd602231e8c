"""HAProxy's configuration for a sharded gateway: model calls by trajectory hash, the rest
to the front.

Why HAProxy (both it and nginx are in Debian): it can route on a value pieced together
from the path, headers and the bearer key in its own configuration language (sample
fetches and converters: ``field``, ``regsub``, ``ub64dec`` for the scoped keys), hash on it
with a consistent ring (``balance hash <expr>``, ``hash-type consistent``), health-check
the shards and expose per-shard counters, with no script module; nginx needs njs or Lua
for the key parsing. HAProxy 2.6 or newer (Debian 12 ships 2.6).

A trajectory must live on one shard (its tracker holds its ``seq`` and token state; a
second shard would restore it from the store and number its calls again), so the routing
key is the one id every call of a trajectory carries alike: its trajectory id, read as
the gateway reads it (gateway/trajectories/tagging.py), first found wins:

1. the path: ``/t/{trajectory}/...``, with or without a ``/g/{group}`` before it (the
   group is *not* the key: a harness may send some calls with it and some without);
2. ``X-Trajectory-Id``, then ``X-Session-ID``;
3. a scoped harness key's trajectory (``rgk-<trajectory>.<group>.<mac>``, base64url
   fields; the gateway refuses a call of the key that names another one), else a bearer
   key that is not a placeholder (``EMPTY``, ``sk-...``: a per-trajectory session key
   when API keys are off);
4. the session id a harness sends on its own in a header (Codex's ``session-id``, Claude
   Code's ``x-claude-code-session-id``, the OpenHands SDK's ``x-litellm-session-id``:
   :data:`gateway.trajectories.harness_ids.HARNESS_HEADERS`, in that order);
5. only when none of these is there: the ``X-Group-Id`` header.

A request carrying one of those headers (or ``Authorization``, ``x-api-key``) twice is
answered 400 here, as the gateway answers it: HAProxy reads the last copy, the gateway
would read the first. Ids carried only in the JSON body (``metadata.session_id``,
Claude Code's ``metadata.user_id``, ``user``) are not used: the proxy would have to
buffer every request body to read them. Such a call goes by its harness header if it has
one (Claude Code sends its session in both, alike; a trajectory named in
``metadata.session_id`` stays on one shard as long as its calls carry one harness
session), else by its ``X-Group-Id``, else to any shard, which is right only for a
one-call (untagged) trajectory; a sharded gateway needs the trajectory in the path, a
header or the key (``RolloutClient.base_url_for`` puts it in the path). A harness id the
gateway maps into the id's characters routes by its raw value, the same on every call.
A GRPO group's trajectories spread over the shards like any others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import orjson

from gateway.trajectories.harness_ids import HARNESS_HEADERS
from gateway.trajectories.tagging import SINGLE_HEADERS

#: the gateway's own placeholder list (gateway/trajectories/tagging.py), lowercased
PLACEHOLDERS = ("empty", "none", "null", "dummy", "fake", "x", "token-abc123")
MODEL_PATHS = ("/v1/", "/t/", "/g/")


@dataclass(frozen=True, slots=True)
class ProxyPlan:
    bind: str  # "0.0.0.0:8000"
    shards: Sequence[str]  # "127.0.0.1:8101", one per shard, in shard order
    front: str  # "127.0.0.1:8100"
    stream_timeout_s: int = 3600  # an agent's call may stream for a long time


_UNSET = "!{ var(txn.rk) -m found }"
_KEY = "var(txn.key)"
_SCOPED = '{ var(txn.key) -m beg rgk- }'
#: OpenAI's error envelope, as the gateway answers the same request
_TWICE = orjson.dumps({"error": {
    "message": f"one of the headers {', '.join(SINGLE_HEADERS)} is sent more than once: "
               "send one", "type": "invalid_request_error", "param": None, "code": None}})


def _set(var: str, fetch: str, *conds: str) -> str:
    return f"    http-request set-var({var}) {fetch}" + (f" if {' '.join(conds)}" if conds else "")


def _twice_rules() -> list[str]:
    """A call carrying an id or key header twice: 400, as the gateway answers it."""
    quoted = _TWICE.decode().replace("\\", "\\\\").replace('"', '\\"')
    return [*(f"    acl twice req.fhdr_cnt({h}) gt 1" for h in SINGLE_HEADERS),
            f'    http-request return status 400 content-type application/json string '
            f'"{quoted}" if model_call twice']


def _key_rules() -> list[str]:
    """``txn.rk``, the routing key: the trajectory, else the group (module docstring).
    Headers are read whole (``fhdr``: no splitting at commas), as the gateway reads them;
    path segments are percent-decoded, as the gateway's router decodes them."""
    has = "{{ req.fhdr({0}) -m found }}".format
    plain = ("{ var(txn.key) -m found }", "!{ var(txn.key) -m beg sk- }",
             f"!{{ var(txn.key),lower -m str {' '.join(PLACEHOLDERS)} }}")
    return [
        "    # the presented key: a bearer or x-api-key",
        _set("txn.key", 'req.fhdr(authorization),word(2," ")',
             '{ req.fhdr(authorization),lower -m beg "bearer " }'),
        _set("txn.key", "req.fhdr(x-api-key)", "!{ var(txn.key) -m found }", has("x-api-key")),
        "    # 1. the trajectory: /t/{id}/ in the path, after /g/{group}/ or not",
        _set("txn.rk", "path,field(3,/),url_dec", "{ path_beg /t/ }"),
        _set("txn.rk", "path,field(5,/),url_dec", _UNSET, "{ path_reg ^/g/[^/]*/t/ }"),
        "    # 2. its headers, 3. a scoped key's trajectory, a session key",
        _set("txn.rk", "req.fhdr(x-trajectory-id)", _UNSET, has("x-trajectory-id")),
        _set("txn.rk", "req.fhdr(x-session-id)", _UNSET, has("x-session-id")),
        _set("txn.rk", f'{_KEY},regsub("^rgk-",""),field(1,.),ub64dec', _UNSET, _SCOPED),
        _set("txn.rk", _KEY, _UNSET, *plain),
        "    # 4. the session id the harness sends on its own",
        *(_set("txn.rk", f"req.fhdr({h})", _UNSET, has(h)) for h in HARNESS_HEADERS),
        "    # 5. no trajectory this proxy can see (it is in the body, or none): the group",
        _set("txn.rk", "req.fhdr(x-group-id)", _UNSET, has("x-group-id")),
        "    # the key it went by, for logs and tests",
        "    http-response set-header x-shard-key %[var(txn.rk)] if { var(txn.rk) -m found }",
    ]


def haproxy_config(plan: ProxyPlan) -> str:
    """The whole ``haproxy.cfg`` for ``plan``."""
    if not plan.shards:
        raise ValueError("a sharded gateway needs at least one shard")
    timeout = f"{plan.stream_timeout_s}s"
    # no health check on the shards, on purpose: a check would take a dead shard off the
    # ring and send its trajectories to another shard mid-flight, which would restore them
    # from a store that may lack the dead shard's last unwritten records. A trajectory's
    # calls fail (503) while its shard is down and go on when it is back.
    servers = "\n".join(f"    server s{i} {addr}" for i, addr in enumerate(plan.shards))
    rules = "\n".join([*_twice_rules(), *_key_rules()])
    paths = " ".join(MODEL_PATHS)
    return f"""# generated by rollout-gateway (gateway/shards/haproxy.py): do not edit by hand
global
    maxconn 8000
    log stdout format raw local0 warning

defaults
    mode http
    log global
    option dontlognull
    timeout connect 5s
    timeout client {timeout}
    timeout server {timeout}
    timeout http-request 60s
    retries 0

frontend gateway
    bind {plan.bind}
    acl model_call path_beg {paths}
{rules}
    use_backend shards if model_call
    default_backend front

backend shards
    balance hash var(txn.rk)
    hash-type consistent
    # the shard that answered, for logs and tests
    http-response set-header x-shard %[srv_name]
{servers}

backend front
    server front {plan.front}
"""
