"""Who a call belongs to: the trajectory (and GRPO group) of each request.

Sources, first match wins:

1. the path: ``/t/{trajectory}/v1/...`` or ``/g/{group}/t/{trajectory}/v1/...``;
2. headers ``X-Trajectory-Id``, then ``X-Session-ID`` (and ``X-Group-Id``);
3. ``Authorization: Bearer <session id>`` (or ``x-api-key``, as Anthropic clients send
   it, or ``x-goog-api-key``, as Gemini clients do) when API keys are off, unless the key
   is one of the placeholders harnesses send when they have no key (``EMPTY``, ``sk-...``);
4. the body: ``metadata.session_id`` (and ``metadata.group_id``);
5. the session id the harness sends on its own (Codex's ``session-id`` header, Claude
   Code's ``x-claude-code-session-id`` and ``metadata.user_id``, the OpenHands SDK's
   ``x-litellm-session-id``: :mod:`gateway.trajectories.harness_ids`), mapped into the
   id's characters when it has others;
6. the body's ``user``.

A call with none of these gets a fresh id, returned in the ``X-Trajectory-Id`` header.

A harness key scoped to one trajectory (:mod:`gateway.trajectories.keys`) names its
trajectory and its group itself: the call belongs to them, and a path, header or
``metadata`` that names another trajectory or group is a 403 (``user``, a free-form field
many SDKs fill, and the harness's own session id are then ignored). A key minted without a
group gives its calls none, so a call that names one is refused too: the harness does not
choose its GRPO group. The key's signature was checked by the route's credential check
before the call got here; what it names can only narrow a call, never widen it.

Each id header (and each credential header) is read once: a request carrying one twice
is a 400, since a proxy in front (HAProxy in a sharded gateway) may read the other copy
and send the trajectory's calls to two places (:mod:`gateway.shards.haproxy`).
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.errors import BadRequest, InvalidTrajectoryId
from gateway.schema.ids import ID_PATTERN
from gateway.trajectories.harness_ids import HARNESS_HEADERS, harness_session
from gateway.trajectories.keys import ScopedKey, named_by

PLACEHOLDER_KEYS = frozenset({"", "empty", "none", "null", "dummy", "fake", "x", "token-abc123"})
#: headers a request may carry once: the ids (harnesses' own too), and the credentials a
#: scoped key comes in
SINGLE_HEADERS = ("x-trajectory-id", "x-session-id", "x-group-id", "authorization",
                  "x-api-key", "x-goog-api-key", *HARNESS_HEADERS)


class HeaderList(Protocol):
    """Request headers as Starlette's ``Headers`` holds them: every value of a name."""

    def getlist(self, key: str) -> list[str]: ...


@dataclass(frozen=True, slots=True)
class Identity:
    trajectory_id: str
    group_id: str | None
    generated: bool = False


def validate_id(value: str, *, what: str = "trajectory_id") -> str:
    """Return ``value`` if it is a valid id, else raise a 400 that says what is allowed."""
    if not ID_PATTERN.fullmatch(value):
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise InvalidTrajectoryId(
            f"invalid {what} {shown!r}: use 1-128 characters from [A-Za-z0-9._:@+=-], "
            "starting with a letter or digit",
            param=what,
        )
    return value


def single_headers(headers: HeaderList) -> dict[str, str]:
    """The value of each of :data:`SINGLE_HEADERS` the request carries; 400 for one it
    carries twice (see the module docstring)."""
    out = {}
    for name in SINGLE_HEADERS:
        values = headers.getlist(name)
        if len(values) > 1:
            raise BadRequest(f"the request carries {len(values)} {name} headers: send one",
                             param=name)
        if values:
            out[name] = values[0]
    return out


def _presented_key(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    if headers.get("x-api-key"):  # how Anthropic clients send their key
        return headers["x-api-key"].strip()
    if headers.get("x-goog-api-key"):  # how Gemini clients send theirs
        return headers["x-goog-api-key"].strip()
    return None


def _bearer_session(key: str | None, api_keys_enabled: bool) -> str | None:
    if api_keys_enabled or key is None:
        return None
    if key.lower() in PLACEHOLDER_KEYS or key.startswith("sk-"):
        return None
    return key


def _body_ids(body: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """``metadata.session_id`` and ``metadata.group_id``."""
    meta = body.get("metadata")
    traj = group = None
    if isinstance(meta, Mapping):
        sid, gid = meta.get("session_id"), meta.get("group_id")
        traj = sid if isinstance(sid, str) else None
        group = gid if isinstance(gid, str) else None
    return traj, group


def _user(body: Mapping[str, Any]) -> str | None:
    user = body.get("user")
    return user if isinstance(user, str) and user else None


def identify(
    *,
    path_trajectory: str | None,
    path_group: str | None,
    headers: HeaderList,
    body: Mapping[str, Any],
    api_keys_enabled: bool = False,
) -> Identity:
    """Resolve the call's trajectory and group (see the module docstring for the order).

    ``api_keys_enabled``: credentials are configured, so the bearer is a credential and
    never a session id."""
    one = single_headers(headers)
    body_traj, body_group = _body_ids(body)
    key = _presented_key(one)
    scoped = named_by(key) if key else None
    if scoped is not None:
        return _bound(scoped, [path_trajectory, one.get("x-trajectory-id"),
                               one.get("x-session-id"), _metadata_session(body)],
                      [path_group, one.get("x-group-id"), body_group])
    traj = (
        path_trajectory
        or one.get("x-trajectory-id")
        or one.get("x-session-id")
        or _bearer_session(key, api_keys_enabled)
        or body_traj
        or harness_session(one, body)
        or _user(body)
    )
    group = path_group or one.get("x-group-id") or body_group
    if group is not None:
        validate_id(group, what="group_id")
    if traj is None:
        return Identity(f"auto-{uuid.uuid4().hex[:20]}", group, generated=True)
    return Identity(validate_id(traj), group)


def _metadata_session(body: Mapping[str, Any]) -> str | None:
    meta = body.get("metadata")
    sid = meta.get("session_id") if isinstance(meta, Mapping) else None
    return sid if isinstance(sid, str) else None


def _bound(scoped: ScopedKey, trajectories: list[str | None],
           groups: list[str | None]) -> Identity:
    """The identity of a scoped key's call: its own trajectory and group (none for a key
    minted without one), or 403 when the call names another."""
    for named in trajectories:
        scoped.check(trajectory_id=named)
    for named in groups:
        scoped.check(group_id=named)
    if scoped.group_id is not None:
        validate_id(scoped.group_id, what="group_id")
    return Identity(validate_id(scoped.trajectory_id), scoped.group_id)


def prompt_identity(body: Mapping[str, Any]) -> str:
    """A stable id of the task prompt: the conversation up to the first user message.

    Members of one GRPO group (and reruns of the same task in later batches) share it,
    which is what per-prompt statistics and Libra's causal tree key on.
    """
    msgs = body.get("messages")
    if isinstance(msgs, list):
        head = []
        for m in msgs:
            head.append(repr((m.get("role"), m.get("content"))) if isinstance(m, Mapping)
                        else repr(m))
            if isinstance(m, Mapping) and m.get("role") == "user":
                break
        text = "\n".join(head)
    else:
        text = repr(body.get("prompt"))[:4096]
    return "p-" + hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
