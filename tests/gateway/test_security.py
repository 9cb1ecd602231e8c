"""Trust boundaries: every route against every kind of credential, keys scoped to one
trajectory, the browser-side attacks, and out-of-domain values.

In RL the agent is the adversary: the harness's credential (or none at all) must not set a
reward, read a sample, list trajectories, write into another trajectory or steer the pool;
a web page in the operator's browser must not change anything, even on loopback.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import openai
import pytest
from fastapi.routing import iter_route_contexts

from gateway.api.access import ROUTE_ROLES, markdown_table
from gateway.api.browser import host_name, served_hosts
from gateway.api.deps import Role
from gateway.app import create_app
from gateway.config import ServerSettings, Settings
from gateway.trajectories.keys import KeySigner, named_by
from tests.scripted_upstream import Script

ROOT = Path(__file__).resolve().parents[2]
ADMIN, TRAINER, HARNESS = "op-Secret-a1", "tr-Secret-b2", "hk-Secret-c3"
CHAT = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}
BODIES = {  # a valid request per route, so that a refusal can only come from the checks
    "chat/completions": CHAT,
    "completions": {"model": "scripted", "prompt": "hi"},
    "responses": {"model": "scripted", "input": "hi"},
    "messages": {**CHAT, "max_tokens": 5},
    "messages/count_tokens": CHAT,
    "/finish": {"reward": 1.0},
    "/key": None,
}
PATH_VALUES = {"trajectory_id": "victim", "group_id": "g1", "backend_id": "no-such",
               "job_id": "no-such", "name": "app.js"}


def _auth(token: str | None) -> dict[str, str]:
    return {} if token is None else {"Authorization": f"Bearer {token}"}


def _app_routes(settings: Settings) -> set[tuple[str, str]]:
    app = create_app(settings)
    return {(m, r.path) for r in iter_route_contexts(app.routes)
            for m in (getattr(r, "methods", None) or ()) if m != "HEAD"}


def test_every_route_has_a_role():
    """A new route fails here until gateway/api/access.py says who may call it."""
    routes = _app_routes(Settings())
    missing = sorted(routes - set(ROUTE_ROLES))
    assert not missing, f"routes without a role in gateway/api/access.py: {missing}"
    stale = sorted(set(ROUTE_ROLES) - routes)
    assert not stale, f"roles for routes the app does not have: {stale}"


def test_the_deployment_doc_shows_the_table():
    assert markdown_table() in (ROOT / "docs/deployment.md").read_text(), \
        "docs/deployment.md: paste gateway.api.access.markdown_table()"


def _concrete(path: str) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: PATH_VALUES[m[1]], path)


def _body(path: str) -> object:
    for suffix, body in BODIES.items():
        if path.endswith(suffix):
            return body
    return {}


def _expect(role: Role, path: str, who: str) -> int | None:
    """401/403 where ``who`` may not use a route of ``role``; None where it may."""
    if role is Role.PUBLIC or who == "operator":
        return None
    if who in ("none", "invalid"):
        return 401
    rank = {"harness": Role.HARNESS, "scoped-other": Role.HARNESS, "trainer": Role.TRAINER}
    if rank[who] < role:
        return 403
    if who == "scoped-other" and "{trajectory_id}" in path:
        return 403  # names the victim's trajectory
    return None


def _admin_last(item: tuple[tuple[str, str], Role]) -> bool:
    return item[0][1].startswith("/admin")


def test_each_route_answers_each_credential_as_its_role_says(gateway_at, scripted, sqlite_url):
    upstream, seen = scripted(Script())
    with gateway_at(sqlite_url, [upstream], admin_token=ADMIN, trainer_token=TRAINER,
                    api_keys=[HARNESS]) as url, httpx.Client(base_url=url, timeout=30) as http:
        scoped = http.post("/trajectories/attacker/key", headers=_auth(TRAINER)).json()["key"]
        creds = {"none": None, "invalid": "not-a-key", "harness": HARNESS,
                 "scoped-other": scoped, "trainer": TRAINER, "operator": ADMIN}
        failures = []
        # pause/resume run last and in that order, so model calls are never held
        for (method, path), role in sorted(ROUTE_ROLES.items(), key=_admin_last):
            if path == "/status/stream":
                continue  # an endless stream; its role (public) is that of /status
            for who, token in creds.items():
                r = http.request(method, _concrete(path), json=_body(path),
                                 headers=_auth(token))
                want = _expect(role, path, who)
                if want is None and r.status_code in (401, 403):
                    failures.append(f"{method} {path} as {who}: {r.status_code} {r.text[:120]}")
                elif want is not None and r.status_code != want:
                    failures.append(f"{method} {path} as {who}: {r.status_code}, want {want}")
        assert not failures, "\n".join(failures)
        assert http.get("/admin/pool", headers=_auth(ADMIN)).json()["paused"] is False
        assert all(b["messages"][-1]["content"] == "hi" for b in seen.bodies)


def test_loopback_without_credentials_is_open(gateway_at, scripted, sqlite_url):
    """Zero setup for the demo: nothing configured, every route answers without a key."""
    upstream, _ = scripted(Script())
    with gateway_at(sqlite_url, [upstream]) as url, httpx.Client(base_url=url) as http:
        for (method, path), _role in sorted(ROUTE_ROLES.items(), key=_admin_last):
            if path == "/status/stream":
                continue
            r = http.request(method, _concrete(path), json=_body(path))
            assert r.status_code not in (401, 403), (method, path, r.text)


def test_the_issue_attacks_with_keys_configured(gateway_at, scripted, sqlite_url):
    """Issue 28 as reported: ADMIN_TOKEN and API_KEYS set, a sandbox with (or without)
    the harness key lists, reads samples of and rewards trajectories."""
    upstream, _ = scripted(Script())
    with gateway_at(sqlite_url, [upstream], admin_token=ADMIN, api_keys=[HARNESS]) as url, \
            httpx.Client(base_url=url) as http:
        assert http.post("/t/t1/v1/chat/completions", json=CHAT,
                         headers=_auth(HARNESS)).status_code == 200
        for token, code in ((None, 401), (HARNESS, 403)):
            assert http.get("/trajectories", headers=_auth(token)).status_code == code
            assert http.get("/trajectories/t1/sample", headers=_auth(token)).status_code == code
            assert http.get("/trajectories/t1/samples", headers=_auth(token)).status_code == code
            r = http.post("/trajectories/t1/finish", json={"reward": 1.0}, headers=_auth(token))
            assert r.status_code == code
            assert http.post("/admin/pause", headers=_auth(token)).status_code == code
        assert http.get("/trajectories/t1", headers=_auth(ADMIN)).json()["reward"] is None
        # no trainer token is configured: the admin token does the trainer's work
        r = http.post("/trajectories/t1/finish", json={"reward": 0.5}, headers=_auth(ADMIN))
        assert r.status_code == 200 and r.json()["reward"] == 0.5


def test_a_key_for_one_trajectory(gateway_at, scripted, sqlite_url):
    upstream, seen = scripted(Script())
    with gateway_at(sqlite_url, [upstream], trainer_token=TRAINER) as url, \
            httpx.Client(base_url=url) as http:
        minted = http.post("/trajectories/run-7/key", json={"group_id": "grp-1"},
                           headers=_auth(TRAINER))
        assert minted.status_code == 200
        key = minted.json()["key"]
        assert named_by(key) is not None and named_by(key).trajectory_id == "run-7"
        # base URL + key is all a harness needs: the key names the trajectory and group
        with openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client:
            raw = client.chat.completions.with_raw_response.create(**CHAT)
        assert raw.headers["x-trajectory-id"] == "run-7"
        got = http.get("/trajectories/run-7", headers=_auth(TRAINER)).json()
        assert got["group_id"] == "grp-1" and len(got["calls"]) == 1
        # naming another trajectory or group anywhere is refused, before anything runs
        sent = len(seen.bodies)
        for path, headers, body in [
            ("/t/other/v1/chat/completions", {}, CHAT),
            ("/g/grp-1/t/other/v1/chat/completions", {}, CHAT),
            ("/g/grp-2/t/run-7/v1/chat/completions", {}, CHAT),
            ("/t/other/v1/messages", {}, {**CHAT, "max_tokens": 5}),
            ("/t/other/v1/models", {}, None),
            ("/v1/chat/completions", {"X-Trajectory-Id": "other"}, CHAT),
            ("/v1/chat/completions", {"X-Session-ID": "other"}, CHAT),
            ("/v1/chat/completions", {"X-Group-Id": "grp-2"}, CHAT),
            ("/v1/chat/completions", {}, {**CHAT, "metadata": {"session_id": "other"}}),
        ]:
            method = "GET" if path.endswith("/models") else "POST"
            r = http.request(method, path, json=body, headers={**_auth(key), **headers})
            assert r.status_code == 403, (path, headers, body, r.text)
            assert r.json()["error"]["type"] == "permission_error"
        assert len(seen.bodies) == sent
        # ``user`` is free-form (SDKs fill it): ignored under a key, the call stays its own
        r = http.post("/v1/chat/completions", json={**CHAT, "user": "other"}, headers=_auth(key))
        assert r.status_code == 200 and r.headers["x-trajectory-id"] == "run-7"
        # the key is a harness credential: not its own reward, not its own sample
        assert http.post("/trajectories/run-7/finish", json={"reward": 1.0},
                         headers=_auth(key)).status_code == 403
        assert http.get("/trajectories/run-7/sample", headers=_auth(key)).status_code == 403
        assert http.post("/trajectories/run-8/key", headers=_auth(key)).status_code == 403
        # a key edited to name another trajectory, or signed elsewhere, is no key
        forged = "rgk-" + "b3RoZXI" + key[key.index("."):]  # base64url("other")
        assert http.post("/v1/chat/completions", json=CHAT,
                         headers=_auth(forged)).status_code == 401
        foreign = KeySigner(b"another gateway").mint("run-7", "grp-1")
        assert http.post("/v1/chat/completions", json=CHAT,
                         headers=_auth(foreign)).status_code == 401
    # stateless: a restarted gateway with the same token takes the same key
    with gateway_at(sqlite_url, [upstream], trainer_token=TRAINER) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=_auth(key))
        assert r.status_code == 200 and r.headers["x-trajectory-id"] == "run-7"
    with gateway_at(sqlite_url, [upstream], trainer_token="rotated") as url:
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=_auth(key))
        assert r.status_code == 401


def test_a_key_minted_without_a_group_puts_its_calls_in_none(gateway_at, scripted,
                                                              sqlite_url):
    """A harness does not choose its GRPO group: a key minted without one gives its calls
    none, and a call that names one anywhere is refused before anything runs."""
    upstream, seen = scripted(Script())
    with gateway_at(sqlite_url, [upstream], trainer_token=TRAINER) as url, \
            httpx.Client(base_url=url) as http:
        victim = http.post("/trajectories/victim/key", json={"group_id": "vg"},
                           headers=_auth(TRAINER)).json()["key"]
        attacker = http.post("/trajectories/attacker/key", headers=_auth(TRAINER)).json()["key"]
        assert http.post("/v1/chat/completions", json=CHAT,
                         headers=_auth(victim)).status_code == 200
        sent = len(seen.bodies)
        for path, headers, body in [
            ("/g/vg/t/attacker/v1/chat/completions", {}, CHAT),  # the raw route
            ("/g/vg/t/attacker/v1/responses", {}, BODIES["responses"]),
            ("/g/vg/t/attacker/v1/models", {}, None),
            ("/v1/chat/completions", {"X-Group-Id": "vg"}, CHAT),
            ("/v1/messages", {"X-Group-Id": "vg"}, BODIES["messages"]),
            ("/v1/chat/completions", {}, {**CHAT, "metadata": {"group_id": "vg"}}),
        ]:
            method = "GET" if path.endswith("/models") else "POST"
            r = http.request(method, path, json=body, headers={**_auth(attacker), **headers})
            assert r.status_code == 403, (path, headers, body, r.text)
            err = r.json()["error"]  # (Anthropic's envelope, on /messages, has no param)
            assert err.get("param", "group_id") == "group_id" and "'vg'" in err["message"]
        assert len(seen.bodies) == sent
        r = http.post("/v1/chat/completions", json=CHAT, headers=_auth(attacker))
        assert r.status_code == 200 and r.headers["x-trajectory-id"] == "attacker"
        for tid in ("victim", "attacker"):
            assert http.post(f"/trajectories/{tid}/finish", json={"reward": 1.0},
                             headers=_auth(TRAINER)).status_code == 200
        group = http.get("/groups/vg/samples", headers=_auth(TRAINER)).json()
        assert group["trajectory_ids"] == ["victim"], group["trajectory_ids"]
        got = http.get("/trajectories/attacker", headers=_auth(TRAINER)).json()
        assert got["group_id"] is None


def test_an_id_header_sent_twice_is_refused(gateway_at, scripted, sqlite_url):
    """Two copies of an id header: a proxy in front may route on the other one (HAProxy
    reads the last), so the call is refused before it is tagged or run."""
    upstream, seen = scripted(Script())
    with gateway_at(sqlite_url, [upstream]) as url, httpx.Client(base_url=url) as http:
        for name in ("X-Trajectory-Id", "X-Session-ID", "X-Group-Id"):
            for path in ("/v1/chat/completions", "/v1/responses"):
                body = BODIES[path.removeprefix("/v1/")]
                r = http.post(path, json=body, headers=[(name, "t-a"), (name, "t-b")])
                assert r.status_code == 400, (name, path, r.text)
                assert r.json()["error"]["param"] == name.lower()
        assert seen.bodies == []
        assert http.get("/trajectories", params={"limit": 10}).json()["data"] == []
        r = http.post("/v1/chat/completions", json=CHAT, headers=[("X-Trajectory-Id", "t-a")])
        assert r.status_code == 200 and r.headers["x-trajectory-id"] == "t-a"


def test_the_bearer_is_never_a_session_id_once_credentials_exist(gateway_at, scripted,
                                                                  sqlite_url):
    upstream, _ = scripted(Script())
    with gateway_at(sqlite_url, [upstream], admin_token=ADMIN) as url:
        r = httpx.post(f"{url}/t/t9/v1/chat/completions", json=CHAT, headers=_auth(ADMIN))
        assert r.status_code == 200 and r.headers["x-trajectory-id"] == "t9"
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=_auth(ADMIN))
        assert r.headers["x-trajectory-id"].startswith("auto-")  # not the admin token
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=_auth("traj-7"))
        assert r.status_code == 401


def test_settings_refuse_a_harness_key_that_is_also_a_token():
    with pytest.raises(ValueError, match="TRAINER_TOKEN is also one of the harness"):
        Settings(trainer_token="same", api_keys=["same"])
    with pytest.raises(ValueError, match="ADMIN_TOKEN is also one of the harness"):
        Settings(admin_token="same", api_keys=["x", "same"])


# -- browser-side attacks ----------------------------------------------------------------

def test_cross_site_requests_cannot_change_state_on_an_open_loopback_gateway(
        gateway_at, scripted, sqlite_url):
    upstream, seen = scripted(Script())
    with gateway_at(sqlite_url, [upstream], server=ServerSettings(
            cors_origins=["https://dash.example"])) as url, httpx.Client(base_url=url) as http:
        own = url  # http://127.0.0.1:<port>
        evil = {"Origin": "https://evil.example", "Content-Type": "text/plain"}
        for method, path, body in [("POST", "/admin/pause", "{}"),
                                   ("PUT", "/admin/weight-version", '{"version": "x"}'),
                                   ("POST", "/trajectories/t1/finish", '{"reward": 1}'),
                                   ("POST", "/v1/chat/completions", '{"model": "scripted"}'),
                                   ("POST", "/t/t1/v1/messages", "{}"),
                                   ("DELETE", "/admin/backends/b0", None)]:
            r = http.request(method, path, content=body, headers=evil)
            assert r.status_code == 403, (method, path, r.text)
            assert "cross-origin" in r.text
        r = http.post("/admin/pause", headers={"Origin": "null"})
        assert r.status_code == 403
        assert http.get("/status").json()["paused"] is False
        assert seen.bodies == []
        assert http.get("/status", headers=evil).status_code == 200  # reads are not refused
        # the gateway's own pages, configured origins, and clients that send no Origin
        assert http.post("/admin/pause", headers={"Origin": own}).status_code == 200
        assert http.post("/admin/resume", headers={"Origin": "https://dash.example"}
                         ).status_code == 200
        assert http.post("/admin/pause").status_code == 200
        assert http.post("/admin/resume").status_code == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example",
                                  "localhost.evil.example", "[::2]", ""])
def test_a_foreign_host_is_not_served(gateway_at, scripted, sqlite_url, host):
    """DNS rebinding: a page whose own name resolves to 127.0.0.1 sends its own Host."""
    upstream, seen = scripted(Script())
    with gateway_at(sqlite_url, [upstream]) as url, httpx.Client(base_url=url) as http:
        for method, path in [("GET", "/status"), ("GET", "/trajectories"), ("GET", "/"),
                             ("POST", "/v1/chat/completions"), ("POST", "/admin/pause")]:
            r = http.request(method, path, json=CHAT, headers={"Host": host})
            assert r.status_code == 400, (host, path, r.text)
            assert "DNS rebinding" in r.text
        assert seen.bodies == [] and http.get("/status").json()["paused"] is False
        port = url.rsplit(":", 1)[1]
        for ok in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
            assert http.get("/status", headers={"Host": ok}).status_code == 200, ok


def test_allowed_hosts_extend_what_is_served(gateway_at, scripted, sqlite_url):
    upstream, _ = scripted(Script())
    server = ServerSettings(allowed_hosts=["gw.internal", "*.lab.example"])
    with gateway_at(sqlite_url, [upstream], server=server) as url:
        for host, code in [("gw.internal:8000", 200), ("a.lab.example", 200),
                           ("lab.example", 400), ("evil.example", 400)]:
            assert httpx.get(f"{url}/status", headers={"Host": host}).status_code == code, host


def test_served_hosts_per_bind():
    assert served_hosts(ServerSettings()) == ["127.0.0.1", "localhost", "[::1]"]
    assert served_hosts(ServerSettings(host="::1")) == ["[::1]", "localhost", "127.0.0.1"]
    assert served_hosts(ServerSettings(host="0.0.0.0")) == ["*"]
    assert "gw" in served_hosts(ServerSettings(host="0.0.0.0", allowed_hosts=["gw"]))
    assert served_hosts(ServerSettings(host="10.0.0.5")) == ["10.0.0.5"]
    assert host_name("[::1]:8000") == "[::1]" and host_name("Example.COM:80") == "example.com"


# -- out-of-domain values ------------------------------------------------------------------

@pytest.mark.parametrize("raw", ["NaN", "Infinity", "-Infinity", "1e400", "-1e999"])
def test_non_finite_rewards_are_refused(gateway_at, scripted, sqlite_url, raw):
    upstream, _ = scripted(Script())
    with gateway_at(sqlite_url, [upstream]) as url, httpx.Client(base_url=url) as http:
        assert http.post("/t/t1/v1/chat/completions", json=CHAT).status_code == 200
        for body in (f'{{"reward": {raw}}}',
                     f'{{"reward": 1, "metadata": {{"score": [1, {{"x": {raw}}}]}}}}'):
            r = http.post("/trajectories/t1/finish", content=body,
                          headers={"Content-Type": "application/json"})
            assert r.status_code == 422, (body, r.text)
            assert "finite" in r.text
        got = http.get("/trajectories/t1").json()
        assert got["reward"] is None and got["finished_at"] is None


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/admin/pause", '{"timeout_s": NaN}'),
    ("POST", "/admin/pause", '{"timeout_s": 1e400}'),
    ("POST", "/admin/resume", '{"timeout_s": -Infinity}'),
    ("POST", "/admin/weight-update", '{"version": "v", "timeout_s": Infinity}'),
    ("PUT", "/admin/pool", '{"gpus": 1000000000000}'),
    ("PUT", "/admin/pool", '{"gpus": -1}'),
    ("PUT", "/admin/pool", '{"gpus": [0, 99999999999]}'),
    ("PUT", "/admin/pool", '{"layout": [{"tp": 1, "count": 1000000000}]}'),
    ("PUT", "/admin/pool", '{"tp": 1e400}'),
    ("POST", "/admin/backends", '{"gpus": [1e400]}'),
    ("POST", "/admin/backends", '{"tp": NaN}'),
    ("GET", "/status/stream?interval=nan", None),
    ("GET", "/trajectories?limit=1e400", None),
    ("GET", "/trajectories/t1/sample?attempt=99999999999999999999", None),
    ("GET", "/trajectories/t1/samples?max_staleness=-1", None),
])
def test_out_of_domain_numbers_are_4xx(gateway_at, scripted, sqlite_url, method, path, body):
    upstream, _ = scripted(Script())
    with gateway_at(sqlite_url, [upstream]) as url:
        r = httpx.request(method, url + path, content=body,
                          headers={"Content-Type": "application/json"})
        assert r.status_code in (400, 422), r.text
        assert httpx.get(f"{url}/status").json()["paused"] is False
