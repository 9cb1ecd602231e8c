"""The role every route needs, as one table.

The routes enforce it with their dependencies (:mod:`gateway.api.deps`);
tests/gateway/test_security.py enumerates the app's routes, fails on a route missing
here, and calls each with every kind of credential to hold the routes to this table;
docs/deployment.md shows :func:`markdown_table`, and a test keeps the two equal.
"""

from __future__ import annotations

from gateway.api.deps import Role

V1_PREFIXES = ("", "/t/{trajectory_id}", "/g/{group_id}/t/{trajectory_id}")
_V1_POST = ("chat/completions", "completions", "responses", "messages",
            "messages/count_tokens")
_GEMINI_POST = ("generateContent", "streamGenerateContent", "countTokens")

ROUTE_ROLES: dict[tuple[str, str], Role] = {
    **{("POST", f"{p}/v1/{s}"): Role.HARNESS for p in V1_PREFIXES for s in _V1_POST},
    **{("GET", f"{p}/v1/models"): Role.HARNESS for p in V1_PREFIXES},
    **{("POST", f"{p}/{v}/models/{{model:path}}:{m}"): Role.HARNESS
       for p in V1_PREFIXES for v in ("v1beta", "v1") for m in _GEMINI_POST},
    ("GET", "/trajectories"): Role.TRAINER,
    ("GET", "/trajectories/{trajectory_id}"): Role.TRAINER,
    ("POST", "/trajectories/{trajectory_id}/finish"): Role.TRAINER,
    ("GET", "/trajectories/{trajectory_id}/sample"): Role.TRAINER,
    ("GET", "/trajectories/{trajectory_id}/samples"): Role.TRAINER,
    ("GET", "/trajectories/{trajectory_id}/tree"): Role.TRAINER,
    ("POST", "/trajectories/{trajectory_id}/key"): Role.TRAINER,
    ("POST", "/trajectories/{trajectory_id}/abort"): Role.TRAINER,
    ("POST", "/trajectories/{trajectory_id}/restart"): Role.TRAINER,
    ("GET", "/trajectories/{trajectory_id}/live"): Role.TRAINER,
    ("GET", "/trajectories/{trajectory_id}/view"): Role.TRAINER,
    ("GET", "/trajectories/{trajectory_id}/routes"): Role.TRAINER,
    ("GET", "/groups/{group_id}/samples"): Role.TRAINER,
    ("GET", "/groups/{group_id}/trees"): Role.TRAINER,
    ("GET", "/groups/{group_id}/view"): Role.TRAINER,
    ("POST", "/training/mismatch"): Role.TRAINER,
    ("GET", "/training/mismatch"): Role.TRAINER,
    ("GET", "/admin/backends"): Role.OPERATOR,
    ("POST", "/admin/backends"): Role.OPERATOR,
    ("DELETE", "/admin/backends/{backend_id}"): Role.OPERATOR,
    ("GET", "/admin/pool"): Role.OPERATOR,
    ("PUT", "/admin/pool"): Role.OPERATOR,
    ("POST", "/admin/pool/release"): Role.OPERATOR,
    ("POST", "/admin/pool/adopt"): Role.OPERATOR,
    ("GET", "/admin/jobs"): Role.OPERATOR,
    ("GET", "/admin/jobs/{job_id}"): Role.OPERATOR,
    ("POST", "/admin/pause"): Role.OPERATOR,
    ("POST", "/admin/resume"): Role.OPERATOR,
    ("POST", "/admin/weight-update"): Role.OPERATOR,
    ("POST", "/admin/weight-update/{job_id}/done"): Role.OPERATOR,
    ("PUT", "/admin/weight-version"): Role.OPERATOR,
    ("GET", "/admin/policy"): Role.OPERATOR,
    ("PUT", "/admin/policy"): Role.OPERATOR,
    ("GET", "/admin/staleness"): Role.OPERATOR,
    ("PUT", "/admin/staleness"): Role.OPERATOR,
    ("POST", "/admin/flush"): Role.OPERATOR,
    ("GET", "/health"): Role.PUBLIC,
    ("GET", "/ready"): Role.PUBLIC,
    ("GET", "/metrics"): Role.PUBLIC,
    ("GET", "/status"): Role.PUBLIC,
    ("GET", "/status/stream"): Role.PUBLIC,
    ("GET", "/"): Role.PUBLIC,
    ("GET", "/static/{name}"): Role.PUBLIC,
    ("GET", "/view"): Role.PUBLIC,
    ("GET", "/view/{path:path}"): Role.PUBLIC,
    ("GET", "/openapi.json"): Role.PUBLIC,
    ("GET", "/docs"): Role.PUBLIC,
    ("GET", "/docs/oauth2-redirect"): Role.PUBLIC,
    ("GET", "/redoc"): Role.PUBLIC,
}

#: who holds each role's credential, and what else works there
WHO = {
    Role.PUBLIC: "anyone who can reach the port",
    Role.HARNESS: "a key of `API_KEYS` (any trajectory) or a scoped key (its trajectory "
                  "only); the trainer and admin tokens work too",
    Role.TRAINER: "`TRAINER_TOKEN`; the admin token works too",
    Role.OPERATOR: "`ADMIN_TOKEN`",
}


def markdown_table() -> str:
    """The table of docs/deployment.md: one row per role, its routes grouped."""
    rows = ["| role | credential | routes |", "|---|---|---|"]
    for role in sorted(Role, reverse=True):
        routes = [f"`{m} {p}`" for (m, p), r in ROUTE_ROLES.items()
                  if r is role and not p.startswith(("/t/", "/g/"))]
        if role is Role.HARNESS:
            routes.append("each also under `/t/{trajectory_id}` and "
                          "`/g/{group_id}/t/{trajectory_id}`")
        rows.append(f"| {role.name.lower()} | {WHO[role]} | {', '.join(routes)} |")
    return "\n".join(rows)
