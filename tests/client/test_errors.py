"""Both of the gateway's error shapes map to the client's exceptions; URL helpers."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gateway.client import (
    BadRequestError,
    GatewayHTTPError,
    OverloadedError,
    PausedError,
    UpstreamError,
    new_id,
    openai_base_url,
    session_headers,
)
from gateway.client.errors import error_from_response
from gateway.envelopes import openai_error_body
from gateway.errors import Paused, UpstreamTimeout


def _response(status: int, *, json: Any = None, content: bytes | None = None,
              headers: dict[str, str] | None = None) -> httpx.Response:
    request = httpx.Request("POST", "http://gw/admin/pause")
    if json is not None:
        return httpx.Response(status, json=json, headers=headers, request=request)
    return httpx.Response(status, content=content or b"", headers=headers, request=request)


def test_openai_envelope_paused_becomes_paused_error_with_retry_after() -> None:
    exc = Paused("paused for weight sync", retry_after_s=7)
    body = openai_error_body(exc.message, error_type=exc.error_type, code=exc.code)
    err = error_from_response(_response(429, content=body, headers=exc.headers))
    assert isinstance(err, PausedError) and isinstance(err, OverloadedError)
    assert err.retry_after_s == 7 and err.code == "paused_for_weight_sync"
    assert err.message == "paused for weight sync"
    assert str(err) == "POST http://gw/admin/pause -> 429: paused for weight sync"


def test_detail_shapes() -> None:
    err = error_from_response(_response(504, json={"detail": UpstreamTimeout("slow").message}))
    assert type(err) is UpstreamError and err.message == "slow"
    invalid = error_from_response(_response(422, json={"detail": [
        {"loc": ["body", "version"], "msg": "too short", "type": "string_too_short"}]}))
    assert isinstance(invalid, BadRequestError)
    assert invalid.message == "body.version: too short"
    overloaded = error_from_response(_response(503, json={"detail": "no backend"}))
    assert type(overloaded) is OverloadedError and overloaded.retry_after_s is None
    odd = error_from_response(_response(418, content=b"teapot"))
    assert type(odd) is GatewayHTTPError and odd.message == "teapot" and odd.detail is None


def test_url_helpers() -> None:
    assert openai_base_url("http://gw:8000/", "t-1") == "http://gw:8000/t/t-1/v1"
    assert openai_base_url("http://gw:8000", "t-1", "g:1") == "http://gw:8000/g/g:1/t/t-1/v1"
    assert session_headers("t-1", "g") == {"X-Session-ID": "t-1", "X-Group-Id": "g"}
    assert new_id("step3").startswith("step3-") and new_id() != new_id()
    with pytest.raises(ValueError, match="invalid group_id"):
        openai_base_url("http://gw", "t", "a/b")


def test_job_failed_carries_the_job_info_and_still_reads_like_its_json() -> None:
    from gateway.client import JobFailed, JobInfo
    from gateway.pool.jobs import JobStatus

    raw = {"id": "7", "kind": "reconfigure", "status": "failed", "errors": ["a: boom"],
           "phases": [{"name": "start"}]}
    for given in (raw, JobInfo.from_json(raw)):
        exc = JobFailed("job 7 failed: a: boom", job=given)
        assert isinstance(exc.job, JobInfo)
        assert exc.job.status is JobStatus.FAILED and exc.job.errors == ["a: boom"]
        assert exc.job.raw["phases"] == [{"name": "start"}]
        assert exc.job["status"] == "failed" and exc.job.get("missing", 1) == 1
