"""The trainer's training-inference mismatch reports, as the gateway keeps and shows them.

``POST /training/mismatch`` (trainer role) hands one step's :class:`MismatchReport`
(built by ``gateway.client.mismatch``); the board judges it against the operator's limits
(``TRAINING__MISMATCH_*``), keeps the latest ``KEPT`` reports for ``/status`` and the
status page, exports the latest figures per weight version and step mode to Prometheus,
and logs and emits an event for every report that raises the alarm.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.config import Settings
from gateway.metrics import EventLog
from gateway.schema.mismatch import (
    PERCENTILES,
    MismatchLimits,
    MismatchReport,
    MismatchStats,
)

log = logging.getLogger(__name__)
KEPT = 200  # reports kept in memory (the trainer's own logs keep the rest)
QUANTILES = {f"p{p}": f"{p / 100:.2f}" for p in PERCENTILES}  # p5 -> "0.05"
SERIES = 16  # (version, mode, sampling) series exported to Prometheus: the latest ones


def mismatch_limits(settings: Settings) -> MismatchLimits:
    t = settings.training
    return MismatchLimits(kl=t.mismatch_kl, outside_share=t.mismatch_outside_share,
                          mean_abs_diff=t.mismatch_abs_diff)


class MismatchBoard:
    def __init__(self, limits: MismatchLimits, events: EventLog | None = None) -> None:
        self.limits = limits
        self.events = events
        self.reports: deque[MismatchReport] = deque(maxlen=KEPT)
        self.received = 0
        self.alarmed = 0
        self.tokens = 0
        #: the latest stats per (version, mode, sampling), oldest first
        self._latest: dict[tuple[str, str, str], MismatchStats] = {}

    def add(self, report: MismatchReport) -> MismatchReport:
        """Judge, keep and export one report; the judged report."""
        report = report.judged(self.limits).model_copy(update={"received_at": time.time()})
        self.reports.append(report)
        self.received += 1
        self.tokens += sum(s.tokens for s in (report.overall, report.constrained) if s)
        series = [((v, report.mode, "free"), s) for v, s in report.by_version.items()]
        if report.constrained is not None:
            series.append((("all", report.mode, "constrained"), report.constrained))
        for key, stats in series:
            self._latest.pop(key, None)
            self._latest[key] = stats
            while len(self._latest) > SERIES:
                del self._latest[next(iter(self._latest))]
        if report.alarms:
            self.alarmed += 1
            where = f"step {report.step}" if report.step is not None else "a step"
            message = (f"training-inference mismatch alarm at {where} ({report.mode}"
                       f"{', run ' + report.run_id if report.run_id else ''}): "
                       + "; ".join(report.alarms))
            log.warning("%s", message)
            if self.events is not None:
                self.events.emit("mismatch", message, step=report.step, mode=report.mode,
                                 run_id=report.run_id)
        return report

    def view(self, recent: int = 20) -> dict[str, Any]:
        """What ``/status`` shows: the limits, counts and the latest reports, newest first."""
        return {"limits": self.limits.model_dump(), "reports": self.received,
                "alarms": self.alarmed, "tokens": self.tokens,
                "recent": [r.model_dump(mode="json")
                           for r in list(self.reports)[-recent:][::-1]]}

    def collect(self) -> Iterator[Metric]:
        """Prometheus families (docs/status-page.md lists them)."""
        labels = ["version", "mode", "sampling"]
        kl = GaugeMetricFamily("rollout_gateway_train_mismatch_kl", "k3 estimate of "
                               "KL(engine || trainer) per trained token, latest report",
                               labels=labels)
        diff = GaugeMetricFamily("rollout_gateway_train_mismatch_abs_diff", "Mean |trainer "
                                 "logprob - engine logprob| per trained token, latest "
                                 "report", labels=labels)
        outside = GaugeMetricFamily("rollout_gateway_train_mismatch_outside_share", "Share "
                                    "of trained tokens whose importance ratio is outside "
                                    "[0.8, 1.25], latest report", labels=labels)
        ratio = GaugeMetricFamily("rollout_gateway_train_mismatch_ratio", "Importance "
                                  "ratio exp(trainer - engine logprob) percentiles, latest "
                                  "report", labels=[*labels, "quantile"])
        for key, s in self._latest.items():
            kl.add_metric(list(key), s.kl)
            diff.add_metric(list(key), s.mean_abs_diff)
            outside.add_metric(list(key), s.outside_share)
            for name, value in s.ratio_percentiles.items():
                ratio.add_metric([*key, QUANTILES[name]], value)
        yield from (kl, diff, outside, ratio)
        for name, doc, value in (
                ("reports", "Mismatch reports received from trainers", self.received),
                ("alarms", "Mismatch reports past a limit (TRAINING__MISMATCH_*)",
                 self.alarmed),
                ("tokens", "Trained tokens compared in mismatch reports", self.tokens)):
            counter = CounterMetricFamily(f"rollout_gateway_train_mismatch_{name}", doc)
            counter.add_metric([], value)
            yield counter
