"""Pure pieces behind the status page: vLLM metric parsing, history, quantiles, lengths."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from gateway.api.live_status import gantt, length_distribution
from gateway.metrics import EventLog, History, Point, histogram_quantile
from gateway.pool.jobs import Job, JobPhase
from gateway.pool.monitor import EngineSample, derive, parse_vllm_metrics
from gateway.pool.relayouts import RelayoutLog
from gateway.trajectories.state import MAX_SEGMENTS
from gateway.trajectories.tracker import Tracker

VLLM_TEXT = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.4
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 25.0
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0",model_name="m"} 1000.0
# TYPE python_gc_objects_collected counter
python_gc_objects_collected_total{generation="0"} 5.0
"""


def test_parse_vllm_metrics_sums_engines_and_averages_kv():
    s = parse_vllm_metrics(VLLM_TEXT)
    assert s.running == 5.0 and s.waiting is None
    assert s.kv_usage == pytest.approx(0.3)
    assert (s.prefix_queries, s.prefix_hits, s.generation_tokens) == (100.0, 25.0, 1000.0)


def test_derive_rates_between_scrapes():
    first = derive(None, EngineSample(generation_tokens=1000.0, prefix_queries=100.0,
                                      prefix_hits=25.0), now=10.0)
    assert first.tokens_per_s is None and first.prefix_hit_rate == 0.25
    second = derive(first, EngineSample(generation_tokens=1500.0), now=12.0)
    assert second.tokens_per_s == 250.0
    restarted = derive(second, EngineSample(generation_tokens=10.0), now=13.0)
    assert restarted.tokens_per_s is None  # counter reset: no negative rate


def test_history_halves_resolution_when_full():
    h = History(capacity=8)
    for i in range(40):
        h.add(Point(t=float(i), calls=i, prompt_tokens=0, completion_tokens=10 * i,
                    running=0, queued=0, finished=0))
    assert len(h.points) < 8 and h.stride >= 4
    assert h.points[0].t == 0.0 and h.points[-1].t >= 32
    assert all(r["tokens_per_s"] == pytest.approx(10.0) for r in h.rates())
    assert h.recent_rate(5.0, now=40.0)["calls_per_s"] == pytest.approx(1.0)


def test_histogram_quantile_interpolates_like_promql():
    hist = Histogram("h_seconds", "h", buckets=(1, 2, 4), registry=CollectorRegistry())
    assert histogram_quantile(hist, 0.5) is None
    for v in (0.5, 1.5, 1.5, 3.0):
        hist.observe(v)
    assert histogram_quantile(hist, 0.5) == pytest.approx(1.5)
    assert histogram_quantile(hist, 1.0) == pytest.approx(4.0)


def test_event_log_is_bounded_and_counts_by_kind():
    log = EventLog(maxlen=3)
    for i in range(5):
        log.emit("pause" if i % 2 else "migration", f"event {i}", trajectory=f"t{i}")
    assert [e["seq"] for e in log.recent(10)] == [5, 4, 3]
    assert log.counts == {"migration": 3, "pause": 2}
    assert log.recent(1)[0]["trajectory"] == "t4"


def _trajectory(tracker: Tracker, tid: str, start: float, turns: int, tokens: int) -> None:
    st = tracker.touch(tid, "g", start)
    now = start
    for _ in range(turns):
        tracker.call_arrived(st, [], now)
        tracker.call_dispatched(st, "b0", queued_s=0.5)
        now += 2.5
        tracker.call_finished(st, now=now, llm_s=2.0, prompt=[1, 2], completion=[7] * tokens,
                              ok=True)
        now += 1.0  # tool call


def test_tracker_records_queue_llm_and_tool_segments():
    tracker = Tracker()
    _trajectory(tracker, "a", 100.0, turns=3, tokens=4)
    segs = list(tracker.get("a").segments())
    assert [k for k, _, _ in segs] == ["queue", "llm", "tool", "queue", "llm", "tool",
                                       "queue", "llm"]
    assert segs[0] == ("queue", 100.0, 100.5) and segs[1] == ("llm", 100.5, 102.5)
    assert segs[2] == ("tool", 102.5, 103.5)
    _trajectory(tracker, "long", 0.0, turns=MAX_SEGMENTS, tokens=1)
    assert len(list(tracker.get("long").segments())) == MAX_SEGMENTS


def test_gantt_orders_by_elapsed_and_shows_the_open_tool_call():
    tracker = Tracker()
    _trajectory(tracker, "short", 10.0, turns=1, tokens=1)
    _trajectory(tracker, "long", 0.0, turns=3, tokens=1)
    tracker.finish("short", 1.0, 13.0)
    g = gantt(list(tracker), now=20.0)
    assert [r["id"] for r in g["rows"]] == ["long", "short"]
    assert g["t0"] == 0.0 and g["now"] == 20.0
    assert g["rows"][0]["segments"][-1] == ["tool", 9.5, 20.0]  # in a tool call since 9.5
    assert g["rows"][1]["end"] == 13.0 and g["rows"][1]["phase"] == "finished"


def test_relayouts_counted_with_their_phase_times_and_marked_on_the_gantt():
    log = RelayoutLog()
    log.record(5.0, ["b"], [2], "merge", refused="no managed pool to apply it")
    job = Job("7", "relayout", {})
    job.begin()
    job.started = 10.0
    job.phases += [JobPhase("drain", 10.0, 10.5), JobPhase("stop", 10.5, 10.6),
                   JobPhase("start-after-stop", 10.6, 12.0)]
    log.record(9.0, ["c", "d"], [2], "merge into TP2", job=job)
    assert log.summary()["in_progress"] == 1 and log.summary()["applied"] == 0
    job.end()
    job.finished = 12.0
    s = log.summary()
    assert (s["proposed"], s["refused"], s["applied"], s["failed"]) == (2, 1, 1, 0)
    assert (s["drain_s"], s["stop_s"], s["start_s"]) == (0.5, 0.1, 1.4)
    assert [r["status"] for r in s["recent"]] == ["succeeded"]
    assert s["recent"][0]["duration_s"] == 2.0 and s["recent"][0]["job"] == "7"
    assert s["last_refusal"]["status"] == "refused"
    assert s["last_refusal"]["refused"] == "no managed pool to apply it"
    tracker = Tracker()
    _trajectory(tracker, "t", 8.0, turns=1, tokens=1)
    g = gantt(list(tracker), now=20.0, relayouts=log.spans())
    assert g["relayouts"] == [[2.0, 4.0, "c+d -> TP2"]]  # relative to t0 = 8


def test_length_distribution_power_of_two_bins_and_tail():
    tracker = Tracker()
    for i, n in enumerate([0, 1, 3, 4, 100, 100, 5000]):
        _trajectory(tracker, f"t{i}", 0.0, turns=1, tokens=n)
    d = length_distribution(list(tracker))
    assert d["count"] == 7 and d["max"] == 5000 and d["p50"] == 4
    assert d["bins"][0] == {"lo": 0, "hi": 0, "count": 1}
    assert {"lo": 64, "hi": 127, "count": 2} in d["bins"]
    assert d["bins"][-1] == {"lo": 4096, "hi": 8191, "count": 1}
    assert sum(b["count"] for b in d["bins"]) == 7
