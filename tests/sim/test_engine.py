"""Engine behaviour: each test drives EngineCore directly (no HTTP, no clock)."""

from __future__ import annotations

import dataclasses

import pytest

from backends.sim.engine import EngineCore
from backends.sim.profiles import LatencyProfile, load_profile
from backends.sim.request import FinishReason, SimRequest, StepOutput

P14 = load_profile("qwen3-14b", "H100", 1)


def _prompt(tag: int, n: int) -> list[int]:
    return [tag * 1_000_000 + i for i in range(n)]


def _run(engine: EngineCore, horizon_s: float = 0.0) -> tuple[float, list[StepOutput]]:
    t, outs = 0.0, []
    while engine.has_work:
        out = engine.step(horizon_s)
        t += out.duration_s
        outs.append(out)
        engine.kv.check_invariants(engine.owned_plain_blocks())
    return t, outs


def _small_kv(blocks: int) -> LatencyProfile:
    return dataclasses.replace(P14, kv_capacity_tokens=blocks * 16)


def test_batching_raises_throughput_and_slows_each_token() -> None:
    def decode_time(batch: int) -> tuple[float, int]:
        eng = EngineCore(P14)
        for i in range(batch):
            eng.add_request(SimRequest(f"r{i}", _prompt(i, 100), 200, ignore_eos=True))
        eng.step()  # prefill of the whole batch
        _, outs = _run(eng)
        return sum(o.duration_s for o in outs), sum(sum(o.emitted.values()) for o in outs)

    t1, n1 = decode_time(1)
    t64, n64 = decode_time(64)
    tpot1, tpot64 = t1 / (n1 / 1), t64 / (n64 / 64)
    assert tpot64 > tpot1 * 1.05  # each sequence decodes slower in a big batch...
    assert n64 / t64 > 20 * n1 / t1  # ...but the engine emits far more tokens per second
    # and exactly as the latency model says for the first decode step of each batch:
    ctx = 101
    expected = P14.step_ms(num_tokens=64, decode_ctx_tokens=64 * ctx) / 1000
    eng = EngineCore(P14)
    for i in range(64):
        eng.add_request(SimRequest(f"r{i}", _prompt(i, 100), 200, ignore_eos=True))
    eng.step()
    assert eng.step().duration_s == pytest.approx(expected)


def test_fused_decode_steps_match_single_steps() -> None:
    def run(horizon: float) -> tuple[float, int]:
        eng = EngineCore(P14)
        for i in range(8):
            eng.add_request(SimRequest(f"r{i}", _prompt(i, 50 + 300 * i), 100 + 37 * i,
                                       ignore_eos=True))
        t, outs = _run(eng, horizon)
        return t, len(outs)

    t_single, calls_single = run(0.0)
    t_fused, calls_fused = run(10.0)
    assert t_fused == pytest.approx(t_single, rel=1e-9)
    assert calls_fused < calls_single / 10


def test_prefix_cache_hits_cut_ttft() -> None:
    eng = EngineCore(P14)
    base = _prompt(1, 4000)
    eng.add_request(SimRequest("turn1", base, 20, ignore_eos=True))
    cold_ttft = eng.step().duration_s
    _run(eng)
    eng.add_request(SimRequest("turn2", [*base, *_prompt(2, 100)], 20, ignore_eos=True))
    warm_ttft = eng.step().duration_s
    assert eng.kv.hits == 4000  # 250 full blocks of the first prompt
    assert warm_ttft < cold_ttft / 5
    no_cache = EngineCore(P14, enable_prefix_caching=False)
    no_cache.add_request(SimRequest("x", [*base, *_prompt(2, 100)], 20, ignore_eos=True))
    assert no_cache.step().duration_s > cold_ttft


def test_kv_pressure_queues_then_preempts_and_everything_finishes() -> None:
    eng = EngineCore(_small_kv(40))  # 640 tokens of KV
    for i in range(4):
        eng.add_request(SimRequest(f"r{i}", _prompt(i, 150), 200, ignore_eos=True))
    first = eng.step()
    assert eng.num_running == 4 and eng.num_waiting == 0
    assert first.num_batched_tokens == 600
    _, outs = _run(eng)
    preempted = [rid for o in outs for rid in o.preempted]
    assert preempted and eng.num_preemptions == len(preempted)
    assert preempted[0] == "r3"  # FCFS: the latest admitted request goes first
    finished = {rid: reason for o in outs for rid, reason in o.finished}
    assert finished == {f"r{i}": FinishReason.LENGTH for i in range(4)}
    generated = {f"r{i}": 0 for i in range(4)}
    for o in [first, *outs]:
        for rid, n in o.emitted.items():
            generated[rid] += n
    assert generated == {f"r{i}": 200 for i in range(4)}


def test_requests_wait_when_the_cache_is_full() -> None:
    eng = EngineCore(_small_kv(20))
    eng.add_request(SimRequest("big", _prompt(1, 300), 10, ignore_eos=True))
    eng.add_request(SimRequest("next", _prompt(2, 100), 10, ignore_eos=True))
    eng.step()
    assert (eng.num_running, eng.num_waiting) == (1, 1)


def test_priority_policy_runs_lower_values_first() -> None:
    def order(policy: str) -> list[str]:
        eng = EngineCore(P14, max_num_seqs=1, scheduling_policy=policy)  # type: ignore[arg-type]
        eng.add_request(SimRequest("first", _prompt(0, 10), 5, ignore_eos=True))
        eng.step()  # "first" is running
        eng.add_request(SimRequest("low", _prompt(1, 10), 5, priority=10, arrival=1.0,
                                   ignore_eos=True))
        eng.add_request(SimRequest("high", _prompt(2, 10), 5, priority=-5, arrival=2.0,
                                   ignore_eos=True))
        _, outs = _run(eng)
        return [rid for o in outs for rid, _ in o.finished]

    assert order("fcfs") == ["first", "low", "high"]
    # under "priority" the urgent arrival even preempts the running request
    assert order("priority") == ["high", "first", "low"]


def test_priority_arrival_preempts_when_memory_is_short() -> None:
    eng = EngineCore(_small_kv(30), scheduling_policy="priority")
    eng.add_request(SimRequest("bulk", _prompt(1, 400), 50, priority=5, ignore_eos=True))
    eng.step()
    eng.add_request(SimRequest("urgent", _prompt(2, 200), 5, priority=0, arrival=1.0,
                               ignore_eos=True))
    out = eng.step()
    assert out.preempted == ["bulk"]
    assert "urgent" in out.emitted


def test_abort_frees_capacity_for_waiting_requests() -> None:
    eng = EngineCore(_small_kv(20))
    eng.add_request(SimRequest("hog", _prompt(1, 300), 10, ignore_eos=True))
    eng.add_request(SimRequest("queued", _prompt(2, 200), 10, ignore_eos=True))
    eng.step()
    usage_before = eng.kv_usage
    assert eng.num_waiting == 1
    assert eng.abort("hog") and not eng.abort("hog")
    assert eng.kv_usage < usage_before and eng.num_aborted == 1
    out = eng.step()
    assert "queued" in out.emitted and eng.num_waiting == 0


def test_natural_length_stops_with_eos_reason() -> None:
    eng = EngineCore(P14)
    eng.add_request(SimRequest("a", _prompt(1, 10), max_tokens=50, output_len=7))
    eng.add_request(SimRequest("b", _prompt(2, 10), max_tokens=5, output_len=7))
    _, outs = _run(eng)
    assert dict(f for o in outs for f in o.finished) == {
        "a": FinishReason.STOP, "b": FinishReason.LENGTH}


def test_unknown_profile_lists_the_available_ones() -> None:
    with pytest.raises(ValueError, match=r"available: .*qwen3-14b/H100/tp1"):
        load_profile("gpt-5", "H100", 1)
    tp8 = load_profile("QWEN3-14B", "h100", 8)
    assert tp8.tp_comm_ms(1) > 0.0 == load_profile("qwen3-14b", "H100", 1).tp_comm_ms(1)


def test_a_step_names_the_requests_that_emitted_their_first_token() -> None:
    """``StepOutput.first``: once per request, at the step that ends its prefill (what a
    stream's first byte is; the simulator measures decode speed from there)."""
    eng = EngineCore(P14)
    eng.add_request(SimRequest("a", _prompt(1, 100), 50, ignore_eos=True))
    eng.add_request(SimRequest("b", _prompt(2, 30_000), 50, ignore_eos=True))  # chunked
    _, outs = _run(eng)
    firsts = [rid for o in outs for rid in o.first]
    assert sorted(firsts) == ["a", "b"]
    for rid in ("a", "b"):
        at = next(i for i, o in enumerate(outs) if rid in o.first)
        assert rid not in {r for o in outs[:at] for r in o.emitted}  # nothing before it
