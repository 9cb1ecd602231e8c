"""Admission control: a bound on the LLM calls one gateway holds at once.

Every call admitted holds a slot from before its body is read until its last byte is
relayed (or it fails), so memory is bounded by ``max_in_flight`` times the body limit no
matter how many clients arrive. Past the bound a call is refused at once with 503 and
``Retry-After`` (OpenAI clients back off and retry), instead of queueing without limit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.errors import Overloaded


class AdmissionSlot:
    """One admitted call; ``release`` is idempotent so every exit path may call it."""

    __slots__ = ("_admission", "released")

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._admission.active -= 1


class Admission:
    def __init__(self, limit: int, retry_after_s: float) -> None:
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.active = 0
        self.admitted = 0
        self.rejected = 0

    def enter(self) -> AdmissionSlot:
        """A slot, or :class:`~gateway.errors.Overloaded` (503 + Retry-After) when full."""
        if self.limit and self.active >= self.limit:
            self.rejected += 1
            raise Overloaded(
                f"the gateway is at its limit of {self.limit} calls in flight; retry later",
                retry_after_s=self.retry_after_s)
        self.active += 1
        self.admitted += 1
        return AdmissionSlot(self)

    def collect(self) -> Iterator[Metric]:
        active = GaugeMetricFamily("rollout_gateway_calls_in_flight",
                                   "LLM calls admitted and not yet answered")
        active.add_metric([], self.active)
        yield active
        rejected = CounterMetricFamily("rollout_gateway_calls_rejected",
                                       "LLM calls refused with 503 because the gateway was "
                                       "at max_in_flight")
        rejected.add_metric([], self.rejected)
        yield rejected
        tasks = GaugeMetricFamily("rollout_gateway_asyncio_tasks",
                                  "Tasks alive on the gateway's event loop (leak check)")
        tasks.add_metric([], len(asyncio.all_tasks()))
        yield tasks
