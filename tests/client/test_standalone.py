"""The trainer client stands alone: importing it loads none of the server, and the routes
it reads declare the models it parses them with (so the OpenAPI document is typed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gateway.app import create_app
from gateway.client import CallSpan, Mismatch, Sample
from gateway.store import samples as store_samples
from tests.gateway.conftest import make_settings

ROOT = Path(__file__).resolve().parents[2]
SERVER_MODULES = ("sqlalchemy", "fastapi", "starlette", "gateway.store", "gateway.api",
                  "gateway.dispatch", "gateway.trajectories", "gateway.errors")


def test_importing_the_client_loads_no_server_module() -> None:
    code = ("import json, sys\n"
            "import gateway.client, gateway.client.types, gateway.schema\n"
            f"print(json.dumps([m for m in {SERVER_MODULES!r} if m in sys.modules]))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True, timeout=120)
    assert json.loads(out.stdout) == []


def test_the_store_builds_the_clients_sample_type() -> None:
    assert (store_samples.Sample, store_samples.CallSpan, store_samples.Mismatch) == (
        Sample, CallSpan, Mismatch)


def _ok_schema(doc: dict[str, object], path: str, method: str = "get") -> str:
    op = doc["paths"][path][method]  # type: ignore[index]
    return str(op["responses"]["200"]["content"]["application/json"]["schema"])


def test_trainer_routes_declare_their_response_models() -> None:
    app = create_app(make_settings("sqlite+aiosqlite:///:memory:", ["http://127.0.0.1:9"]))
    doc = app.openapi()
    expected = {
        ("/trajectories", "get"): "TrajectoryPage",
        ("/trajectories/{trajectory_id}", "get"): "TrajectoryDetail",
        ("/trajectories/{trajectory_id}/finish", "post"): "FinishedTrajectory",
        ("/trajectories/{trajectory_id}/key", "post"): "HarnessKey",
        ("/trajectories/{trajectory_id}/sample", "get"): "Sample",
        ("/trajectories/{trajectory_id}/samples", "get"): "SampleList",
        ("/groups/{group_id}/samples", "get"): "GroupSamples",
        ("/admin/jobs", "get"): "JobList",
        ("/admin/jobs/{job_id}", "get"): "JobView",
        ("/admin/weight-version", "put"): "WeightVersionChange",
    }
    got = {k: _ok_schema(doc, *k) for k in expected}
    assert got == {k: f"{{'$ref': '#/components/schemas/{v}'}}" for k, v in expected.items()}
    sample = doc["components"]["schemas"]["Sample"]
    assert list(sample["properties"])[:4] == ["trajectory_id", "group_id", "reward",
                                              "token_ids"]
