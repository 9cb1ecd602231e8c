"""The gateway's exception hierarchy: every error a call or an admin request can end in.

::

    GatewayError                      (500 internal_error)
    +-- BadRequest                    (400 invalid_request_error)
    |   +-- InvalidTrajectoryId       (400, param "trajectory_id")
    +-- Unauthorized                  (401 authentication_error)
    +-- Forbidden                     (403 permission_error: a valid credential, wrong role)
    +-- NotFound                      (404 not_found_error)
    |   +-- ModelNotFound             (404 model_not_found)
    +-- Conflict                      (409: the request clashes with the current state)
    |   +-- TrajectoryFinished        (409: a queued call's trajectory attempt finished
    |   |                              before the call was placed)
    |   +-- TrajectoryAborted         (409: the trainer aborted this attempt, or it went
    |                                  past the staleness bound; it is restarted on purpose)
    +-- SchedulingFailed              (500 server_error: placing the call raised; the pool
    |                                  goes on)
    +-- PayloadTooLarge               (413)
    +-- Overloaded                    (429 / 503 with Retry-After)
    |   +-- Paused                    (429 while the pool is paused for weight sync)
    |   +-- QueueTimeout              (503 with Retry-After: the call waited its whole
    |                                  queue timeout in the gateway; nothing ran it)
    +-- UpstreamError                 (502 bad_gateway: a backend failed)
    |   +-- UpstreamTimeout           (504 gateway_timeout)
    +-- NoBackendAvailable            (503 service_unavailable)
    +-- StoreUnavailable              (503 with Retry-After: a trajectory's state could not
    |                                  be read from the store; the call was not run)
    +-- RecordingUnavailable          (503 with Retry-After: the gateway cannot record calls
                                       now, so it runs none; gateway/store/writer.py)

Each class carries its HTTP status, OpenAI error ``type`` and ``code``. How they are
written on the wire (OpenAI's envelope on ``/v1/*``, Anthropic's on the Messages routes,
``{"detail": ...}`` elsewhere) is :mod:`gateway.api.errors` (the handler map) and
:mod:`gateway.envelopes` (the envelopes, also written mid-stream by the proxy).
"""

from __future__ import annotations


class GatewayError(Exception):
    status_code = 500
    error_type = "internal_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}


class BadRequest(GatewayError):
    status_code = 400
    error_type = "invalid_request_error"


class InvalidTrajectoryId(BadRequest):
    code = "invalid_trajectory_id"


class Unauthorized(GatewayError):
    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(GatewayError):
    status_code = 403
    error_type = "permission_error"
    code = "forbidden"


class NotFound(GatewayError):
    status_code = 404
    error_type = "not_found_error"


class ModelNotFound(NotFound):
    error_type = "invalid_request_error"
    code = "model_not_found"


class Conflict(GatewayError):
    status_code = 409
    error_type = "conflict_error"
    code = "conflict"


class TrajectoryFinished(Conflict):
    """A queued call whose trajectory attempt was finished before it could be placed."""

    code = "trajectory_finished"


class TrajectoryAborted(Conflict):
    """A call on a trajectory attempt the trainer aborted (``POST
    /trajectories/{id}/abort``, or the gateway's staleness bound): refused until the
    trainer restarts the id (``POST /trajectories/{id}/restart``)."""

    code = "trajectory_aborted"


class SchedulingFailed(GatewayError):
    """The scheduler raised while placing this call; the call fails, the pool goes on."""

    status_code = 500
    error_type = "server_error"
    code = "scheduling_failed"


class PayloadTooLarge(GatewayError):
    status_code = 413
    error_type = "invalid_request_error"
    code = "payload_too_large"


class Overloaded(GatewayError):
    status_code = 503
    error_type = "overloaded_error"
    code = "overloaded"

    def __init__(self, message: str, *, retry_after_s: float = 1.0, status: int = 503) -> None:
        super().__init__(message, headers={"Retry-After": str(max(1, round(retry_after_s)))})
        self.status_code = status


class Paused(Overloaded):
    code = "paused_for_weight_sync"

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message, retry_after_s=retry_after_s, status=429)


class QueueTimeout(Overloaded):
    """The call waited ``queue_timeout_s`` in the gateway's queue without being placed:
    the pool is too busy for it, and it can be sent again as it was (no engine is running
    it, nothing was recorded). Not an :class:`UpstreamTimeout`: no engine was slow."""

    code = "queue_timeout"


class UpstreamError(GatewayError):
    status_code = 502
    error_type = "bad_gateway"
    code = "upstream_error"


class UpstreamTimeout(UpstreamError):
    status_code = 504
    error_type = "gateway_timeout"
    code = "upstream_timeout"


class NoBackendAvailable(GatewayError):
    status_code = 503
    error_type = "service_unavailable"
    code = "no_backend"


class StoreUnavailable(GatewayError):
    """The store could not say in time what it holds of a trajectory the gateway does not
    (after a restart): the call is refused rather than run on a guess."""

    status_code = 503
    error_type = "service_unavailable"
    code = "store_unavailable"

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message, headers={"Retry-After": str(max(1, round(retry_after_s)))})


class RecordingUnavailable(GatewayError):
    """The trace writer cannot take records now (its loop is restarting, or the database
    and the spool are both out of reach and its memory is full): the gateway refuses model
    calls rather than answer calls whose tokens it could not record."""

    status_code = 503
    error_type = "service_unavailable"
    code = "recording_unavailable"

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message, headers={"Retry-After": str(max(1, round(retry_after_s)))})
