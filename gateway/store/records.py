"""The record of one call, as handed from the request path to the trace writer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class CallRecord:
    """Everything stored about one LLM call. Built on the request path, written off it."""

    id: str
    trajectory_id: str
    group_id: str | None
    seq: int
    endpoint: str
    model: str
    weight_version: str
    started_at: float
    backend_id: str | None = None
    backend_url: str | None = None
    tp: int | None = None
    status: str = "ok"
    error: str | None = None
    finish_reason: str | None = None
    queued_ms: float = 0.0
    ttft_ms: float | None = None
    total_ms: float = 0.0
    prompt_len: int = 0
    prompt_offset: int = 0
    prompt_delta: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    completion_logprobs: list[float] | None = None
    mismatch_pos: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    extra_choices: list[dict[str, Any]] | None = None
    request_messages: list[Any] | None = None
    completion_text: str | None = None
    attempt: int = 0
    #: [[start, end, weight_version], ...] over the completion tokens when the call ran
    #: across a weight update (None: every token from ``weight_version``).
    weight_segments: list[list[Any]] | None = None
    branch: int = 0
    parent_branch: int | None = None
    kept_len: int | None = None
    requested_model: str | None = None
    #: the kind of constraint its sampling ran under (gateway/proxy/constraints.py)
    constrained: str | None = None
    #: routed experts as the engine sent them: ``[[first position, base64 .npy], ...]``
    #: (gateway/proxy/routes.py); merged into one array when the row is written
    routes: list[list[Any]] | None = None
    #: where the writer put that array (:mod:`gateway.store.route_files`): ``[segment,
    #: offset, length, first position]``, set before the row is written (``routes`` then
    #: None), so a batch retried or spooled does not write its routes twice
    routes_ref: list[Any] | None = None
