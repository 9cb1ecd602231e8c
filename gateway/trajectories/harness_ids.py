"""The session ids harnesses send on their own: they tag a call that names no trajectory.

With a plain ``/v1`` base URL every call of a harness would otherwise be a trajectory of
its own (``auto-...``). Most coding agents already send the id of their session, the same
on every call of one run (its side calls too). What each sends (seen on
the wire from Codex CLI 0.169, Claude Code 2.1.331, opencode 1.18, Gemini CLI 0.61 and
Qwen Code 0.24 as shipped; read in the source of the OpenHands SDK 1.58 and the Python
agent SDKs; docs/integrations.md):

================  =====================================  =================================
harness           sends                                  becomes
================  =====================================  =================================
Codex CLI         header ``session-id: <uuid>`` (and     the trajectory (``session-id``)
                  ``thread-id``, the same on the main
                  thread)
Claude Code       header ``x-claude-code-session-id``;   the trajectory (the header, else
                  body ``metadata.user_id``: a JSON      the body's ``session_id``; the
                  string ``{"device_id": ...,            older ``user_<hash>_account_..._
                  "session_id": "<uuid>"}``              session_<uuid>`` form too)
OpenHands SDK     header ``x-litellm-session-id``        the trajectory
                  (its conversation id)
opencode          header ``X-Session-Id: ses_...``       already an explicit id
                                                         (``X-Session-ID``, step 2)
Gemini CLI        ``x-gemini-api-privileged-user-id``    nothing: it is the installation's
                                                         id (``~/.gemini/installation_id``),
                                                         the same for every run in a HOME
Qwen Code, mini-  nothing per session                    nothing: give the trajectory in
swe-agent, the                                           the base URL (``/t/{id}/v1``)
agent SDKs
================  =====================================  =================================

They come after every explicit id (:mod:`gateway.trajectories.tagging` has the order) and
before ``user``. An id that is not a valid trajectory id (other characters, longer than
128) is mapped, not refused: ``h-`` and its 128-bit BLAKE2b hash in hex, the same for
every call that carries it. A sharded gateway's HAProxy reads the headers in the
same place (:mod:`gateway.shards.haproxy`); the body's id it cannot read, but Claude Code
sends the same id in its header.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import orjson

from gateway.schema.ids import ID_PATTERN

#: headers that carry a harness's own session id, in the order they are read
HARNESS_HEADERS = ("x-claude-code-session-id", "session-id", "x-litellm-session-id")
_LEGACY_MARK = "_session_"  # Claude Code's user_id before it became JSON


def harness_session(headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
    """The trajectory id a harness's own session id gives the call, or None.

    ``headers``: the call's single-valued headers, names lowercased."""
    for name in HARNESS_HEADERS:
        if (value := headers.get(name, "").strip()):
            return as_trajectory_id(value)
    found = claude_session(body)
    return as_trajectory_id(found) if found else None


def claude_session(body: Mapping[str, Any]) -> str | None:
    """The ``session_id`` inside Claude Code's ``metadata.user_id`` (a JSON string, an
    object, or the older ``..._session_<uuid>`` string), or None."""
    meta = body.get("metadata")
    user = meta.get("user_id") if isinstance(meta, Mapping) else None
    if isinstance(user, str) and user.startswith("{"):
        try:
            user = orjson.loads(user)
        except orjson.JSONDecodeError:
            return None
    if isinstance(user, Mapping):
        sid = user.get("session_id")
        return (sid.strip() or None) if isinstance(sid, str) else None
    if isinstance(user, str) and _LEGACY_MARK in user:
        return user[user.rfind(_LEGACY_MARK) + len(_LEGACY_MARK):].strip() or None
    return None


def as_trajectory_id(value: str) -> str:
    """``value`` if it is a valid trajectory id, else its deterministic stand-in."""
    if ID_PATTERN.fullmatch(value):
        return value
    return "h-" + hashlib.blake2b(value.encode(errors="surrogatepass"),
                                  digest_size=16).hexdigest()
