"""Schemathesis against the gateway's own OpenAPI document, in process (ASGI).

At least 2000 generated requests over every operation (admin ones with the admin token,
so their validation is exercised too), against a gateway whose backend is a fast
scripted upstream. No answer may be a 5xx that is not an upstream failure, and every
4xx must come in its route's wire shape: ``{"error": {...}}`` under ``/v1`` (Google's
``{"error": {code, message, status}}`` on the Gemini routes), ``{"detail": ...}``
elsewhere.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import orjson
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from gateway.app import create_app
from gateway.config import (
    DispatchSettings,
    ServerSettings,
    Settings,
    TraceSettings,
    UpstreamSettings,
)
from tests.scripted_upstream import Script

ADMIN = "fuzz-admin-token"
MIN_CASES = 2000
PER_OPERATION = 60  # per operation and generation mode (valid, then invalid data)
# an endless event stream; a long poll (each case could wait its timeout_s, up to minutes)
SKIP = {"/status/stream", "/groups/{group_id}/samples", "/groups/{group_id}/trees"}  # long polls
UPSTREAM_CODES = {"upstream_error", "upstream_timeout", "no_backend", "overloaded"}
GEMINI_METHODS = (":generateContent", ":streamGenerateContent", ":countTokens")


def _check(path: str, status: int, body: bytes) -> None:
    openai = "/v1/" in path or path.endswith("/v1")
    if status < 400 or path == "/metrics":
        return
    doc = orjson.loads(body)
    if path.endswith(GEMINI_METHODS):  # Google's envelope
        err = doc["error"]
        assert err["code"] == status and isinstance(err["message"], str), doc
        assert isinstance(err["status"], str), doc
        assert status < 500 or status in (502, 503, 504), (status, doc)
    elif openai:
        err = doc["error"]
        assert isinstance(err["message"], str) and isinstance(err["type"], str), doc
        if status >= 500:
            assert err["code"] in UPSTREAM_CODES, (status, doc)
    else:
        assert "detail" in doc, doc
        assert status < 500 or status == 503, (status, doc)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_openapi_fuzz_no_server_errors(scripted, tmp_path: Path):
    upstream, _ = scripted(Script(tokens=3, model="scripted"))
    app = create_app(Settings(
        database_url=f"sqlite+aiosqlite:///{tmp_path / 'fuzz.db'}", backends=[upstream],
        admin_token=ADMIN, policy="slime",
        upstream=UpstreamSettings(health_interval_s=0.5, first_byte_timeout_s=5),
        traces=TraceSettings(flush_interval_s=0.05, spool_path=tmp_path / "spool.jsonl"),
        dispatch=DispatchSettings(pause_mode="reject", backend_wait_s=0),
        server=ServerSettings(allowed_hosts=["testserver"])))  # the ASGI client's Host
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    total, by_status = 0, dict[int, int]()
    started = time.monotonic()
    operations = [r.ok() for r in schema.get_all_operations()]
    for op, mode in itertools.product(operations, GenerationMode):
        if op.path in SKIP:
            continue

        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=PER_OPERATION, deadline=None, database=None,
                  phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        def run(case: schemathesis.Case) -> None:
            nonlocal total
            response = case.call(headers={"Authorization": f"Bearer {ADMIN}"})
            total += 1
            by_status[response.status_code] = by_status.get(response.status_code, 0) + 1
            _check(case.formatted_path, response.status_code, response.content)

        try:
            run()
        except Unsatisfiable:  # nothing invalid to send (an operation without inputs)
            assert mode is GenerationMode.NEGATIVE, op.path
    took = time.monotonic() - started
    print(f"\nschemathesis: {total} cases in {took:.0f}s; statuses {sorted(by_status.items())}")
    assert total >= MIN_CASES
    assert 500 not in by_status
