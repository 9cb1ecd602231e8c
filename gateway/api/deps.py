"""Request-scoped access to the runtime, and who may call what: the roles.

Each role includes the ones below it:

- **operator** (``ADMIN_TOKEN``): everything, the admin API and ``include_text`` included;
- **trainer** (``TRAINER_TOKEN``): the trajectory API (list, read, finish with a reward,
  samples, scoped keys) and model calls;
- **harness**: model calls (``/v1``) only, with a key of ``API_KEYS`` (any trajectory) or
  a key scoped to one trajectory (:mod:`gateway.trajectories.keys`), whose calls can
  name no other trajectory and no group but the key's own;
- **public**: health, status, metrics, the status page, the OpenAPI document.

With no credential configured (``Settings.auth_enabled`` false; only loopback allows it)
every caller is the operator, so the demo needs no setup. As soon as one is configured,
every route needs its role's credential: none is 401, one of a lower role is 403.
``gateway.api.access`` lists the role of every route; the table test holds them to it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from enum import IntEnum

from fastapi import Request

from gateway.config import Settings
from gateway.errors import Forbidden, Unauthorized
from gateway.proxy.relay import Proxy
from gateway.runtime import Runtime
from gateway.trajectories.keys import KeySigner, ScopedKey


class Role(IntEnum):
    PUBLIC = 0
    HARNESS = 1
    TRAINER = 2
    OPERATOR = 3


@dataclass(frozen=True, slots=True)
class Principal:
    role: Role
    scope: ScopedKey | None = None  # a harness key for one trajectory


def _key_secret(settings: Settings) -> bytes:
    if settings.key_secret:
        return settings.key_secret.encode()
    base = settings.admin_token or settings.trainer_token
    if base:  # stable across restarts while the token is
        return hmac.new(base.encode(), b"rollout-gateway key secret", hashlib.sha256).digest()
    return secrets.token_bytes(32)


class Access:
    """One gateway's credentials: who a presented key is, and the scoped-key signer."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.signer = KeySigner(_key_secret(settings))

    def who(self, presented: str | None) -> Principal | None:
        """The presented credential's principal; None when it is missing or unknown."""
        s = self.settings
        if not s.auth_enabled:
            return Principal(Role.OPERATOR)
        if presented is None:
            return None
        if s.admin_token and token_matches(presented, s.admin_token):
            return Principal(Role.OPERATOR)
        if s.trainer_token and token_matches(presented, s.trainer_token):
            return Principal(Role.TRAINER)
        if any(token_matches(presented, k) for k in s.api_keys):
            return Principal(Role.HARNESS)
        scope = self.signer.verify(presented)
        return None if scope is None else Principal(Role.HARNESS, scope)


def get_rt(request: Request) -> Runtime:
    rt: Runtime = request.state.rt
    return rt


def get_proxy(request: Request) -> Proxy:
    proxy: Proxy = request.state.proxy
    return proxy


def get_access(request: Request) -> Access:
    access: Access = request.state.access
    return access


def presented_key(request: Request) -> str | None:
    """The bearer token, or ``x-api-key`` as Anthropic clients send it, or
    ``x-goog-api-key`` as Gemini clients do."""
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip() or None
    return (request.headers.get("x-api-key", "").strip()
            or request.headers.get("x-goog-api-key", "").strip() or None)


def token_matches(presented: str | None, expected: str) -> bool:
    """Constant-time comparison, so the token cannot be guessed byte by byte."""
    return presented is not None and hmac.compare_digest(presented.encode(), expected.encode())


_NEEDS = {
    Role.HARNESS: ("a harness key (ROLLOUT_GATEWAY_API_KEYS, or one minted by POST "
                   "/trajectories/{id}/key), the trainer token or the admin token"),
    Role.TRAINER: "the trainer token (ROLLOUT_GATEWAY_TRAINER_TOKEN) or the admin token",
    Role.OPERATOR: "the admin token (ROLLOUT_GATEWAY_ADMIN_TOKEN)",
}


def _unconfigured(settings: Settings, role: Role) -> str:
    """A note when no credential of ``role`` (or above) exists on this gateway at all."""
    have = {Role.OPERATOR: bool(settings.admin_token),
            Role.TRAINER: bool(settings.admin_token or settings.trainer_token)}
    if have.get(role, True):
        return ""
    return "; none is configured on this gateway"


def authorize(request: Request, role: Role) -> Principal:
    """The caller's principal if it may use a route of ``role``, else 401 or 403."""
    access = get_access(request)
    presented = presented_key(request)
    principal = access.who(presented)
    needs = _NEEDS.get(role, "")
    if principal is None:
        what = "missing" if presented is None else "invalid"
        raise Unauthorized(f"{what} credential: this route needs {needs}"
                           f"{_unconfigured(access.settings, role)}")
    if principal.role < role:
        raise Forbidden(f"a {principal.role.name.lower()} credential cannot use this route: "
                        f"it needs {needs}{_unconfigured(access.settings, role)}")
    if principal.scope is not None:
        check_scope(principal.scope, request.path_params.get("trajectory_id"),
                    request.path_params.get("group_id"))
    return principal


def check_scope(scope: ScopedKey, trajectory_id: str | None, group_id: str | None) -> None:
    """403 when a call of a scoped key names another trajectory or group in its URL (any
    group, for a key minted without one): before its body is read."""
    scope.check(trajectory_id=trajectory_id, group_id=group_id)


def is_admin(request: Request) -> bool:
    """True with the admin token (or when no credential is configured: loopback only)."""
    principal = get_access(request).who(presented_key(request))
    return principal is not None and principal.role >= Role.OPERATOR


# ``async`` although they never await: FastAPI runs a plain ``def`` dependency in its
# thread pool, a thread hop on every call.

async def require_api_key(request: Request) -> None:
    """Harness role: model calls."""
    authorize(request, Role.HARNESS)


async def require_trainer(request: Request) -> None:
    """Trainer role: the trajectory API."""
    authorize(request, Role.TRAINER)


async def require_admin(request: Request) -> None:
    """Operator role: the admin API."""
    authorize(request, Role.OPERATOR)
