"""Trainer-side client for the gateway's REST API (sync and asyncio).

The trainer launches harnesses with :meth:`RolloutClient.base_url_for` as their
``OPENAI_BASE_URL``, waits for the batch, fetches token-exact training samples, sets
rewards, and drives weight syncs and the pool::

    from gateway.client import RolloutClient

    with RolloutClient("http://gateway:8000", admin_token=TOKEN) as gw:
        url = gw.base_url_for("traj-7", group_id="step3-prompt12")  # -> the harness
        ...
        gw.finish("traj-7", reward=1.0)
        batch = gw.fetch_group("step3-prompt12", count=8, timeout_s=600)
        batch.to_parquet("step3.parquet")            # gateway.schema.table.SAMPLE_SCHEMA
        with gw.weight_sync("step-4"):               # pause until idle ... resume
            load_new_weights()
        gw.resize_pool(gpus=4)                       # training borrows the other GPUs

Everything is read from the gateway on demand; the client keeps no state of its own.
Errors are :mod:`gateway.client.errors` exceptions; answers are read with the models the
routes declare (:mod:`gateway.schema`). Needs ``httpx`` (extra ``client``), not the server:
importing it loads neither the store, SQLAlchemy nor FastAPI.
"""

from gateway.client._base import new_id, openai_base_url, session_headers
from gateway.client.aio import AsyncRolloutClient
from gateway.client.errors import (
    AuthenticationError,
    BadRequestError,
    ConflictError,
    GatewayClientError,
    GatewayConnectionError,
    GatewayHTTPError,
    JobFailed,
    NotFoundError,
    OverloadedError,
    PausedError,
    UpstreamError,
    WaitTimeout,
)
from gateway.client.steps import StepBatch, StepMode, StepRunner
from gateway.client.sync import RolloutClient
from gateway.client.types import JobInfo, SampleBatch, TrajectoryInfo, sample_from_json
from gateway.schema.samples import CallSpan, Mismatch, Sample

__all__ = [
    "AsyncRolloutClient",
    "AuthenticationError",
    "BadRequestError",
    "CallSpan",
    "ConflictError",
    "GatewayClientError",
    "GatewayConnectionError",
    "GatewayHTTPError",
    "JobFailed",
    "JobInfo",
    "Mismatch",
    "NotFoundError",
    "OverloadedError",
    "PausedError",
    "RolloutClient",
    "Sample",
    "SampleBatch",
    "StepBatch",
    "StepMode",
    "StepRunner",
    "TrajectoryInfo",
    "UpstreamError",
    "WaitTimeout",
    "new_id",
    "openai_base_url",
    "sample_from_json",
    "session_headers",
]
