"""Harness keys scoped to one trajectory: minted by the trainer, checked without a table.

A key carries its trajectory id (and group, when minted with one) in the clear, and an
HMAC-SHA256 of them under the gateway's key secret::

    rgk-<base64url(trajectory)>.<base64url(group) or empty>.<base64url(mac)>

so the gateway verifies it from the key alone (no store lookup, valid across restarts
while the secret stays the same), and a harness needs nothing but the base URL and the
key: the key names its trajectory. Parsing (:func:`parse_key`) and verifying
(:meth:`KeySigner.verify`) are separate on purpose: what a key *names* may only narrow a
call (tagging binds the call to it), while what it *grants* is decided by the signature.

A key binds its group as it binds its trajectory: minted with a group, its calls are in
that group; minted without one, they are in none. The group decides whose samples a
trainer compares a trajectory's reward with (GRPO), so a harness that could choose it
could put its trajectory beside any other group's (:meth:`ScopedKey.check`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from dataclasses import dataclass

from gateway.errors import Forbidden

PREFIX = "rgk-"
_DOMAIN = b"rollout-gateway trajectory key v1\x00"


@dataclass(frozen=True, slots=True)
class ScopedKey:
    trajectory_id: str
    group_id: str | None

    def check(self, *, trajectory_id: str | None = None, group_id: str | None = None) -> None:
        """403 unless what a call names (None: names nothing) is this key's own trajectory
        and group; a key minted without a group lets a call name none."""
        if trajectory_id is not None and trajectory_id != self.trajectory_id:
            raise Forbidden(f"this key is for trajectory {self.trajectory_id!r}; the call "
                            f"names {trajectory_id!r}", param="trajectory_id")
        if group_id is not None and group_id != self.group_id:
            owned = (f"group {self.group_id!r}" if self.group_id is not None
                     else "no group (it was minted without one)")
            raise Forbidden(f"this key is for {owned}; the call names group {group_id!r}",
                            param="group_id")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def parse_key(key: str) -> tuple[ScopedKey, bytes] | None:
    """The trajectory (and group) a key names, and its MAC; None if it is not a scoped
    key. Nothing is verified here."""
    if not key.startswith(PREFIX):
        return None
    parts = key[len(PREFIX):].split(".")
    if len(parts) != 3 or not parts[0]:
        return None
    try:
        traj = _unb64(parts[0]).decode()
        group = _unb64(parts[1]).decode() if parts[1] else None
        mac = _unb64(parts[2])
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    return ScopedKey(traj, group), mac


def named_by(key: str) -> ScopedKey | None:
    """What a presented key names (unverified): see the module docstring."""
    parsed = parse_key(key)
    return None if parsed is None else parsed[0]


class KeySigner:
    """Mints and verifies scoped keys under one secret."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def _mac(self, scoped: ScopedKey) -> bytes:
        msg = _DOMAIN + scoped.trajectory_id.encode() + b"\x00" + (scoped.group_id or "").encode()
        return hmac.new(self._secret, msg, hashlib.sha256).digest()

    def mint(self, trajectory_id: str, group_id: str | None = None) -> str:
        """A key for ``trajectory_id`` (ids are validated by the caller)."""
        scoped = ScopedKey(trajectory_id, group_id)
        group = _b64(group_id.encode()) if group_id else ""
        return f"{PREFIX}{_b64(trajectory_id.encode())}.{group}.{_b64(self._mac(scoped))}"

    def verify(self, key: str) -> ScopedKey | None:
        """The key's scope if this gateway minted it, else None (constant-time compare)."""
        parsed = parse_key(key)
        if parsed is None:
            return None
        scoped, mac = parsed
        return scoped if hmac.compare_digest(mac, self._mac(scoped)) else None
