"""The speeds the policy believes: the profile's, scaled per TP by what the engines measured,
and for a degree no engine measured, the trend of the measured ones."""

from __future__ import annotations

import math

import pytest

from backends.sim.profiles import load_profile
from gateway.dispatch.speeds import MIN_CALLS, SpeedMeter, speeds_for

PRIOR = speeds_for("qwen3-14b/H100")


def _measured(meter: SpeedMeter, tp: int, factor: float, calls: int = MIN_CALLS) -> None:
    """``calls`` calls on TP ``tp`` that ran ``factor`` times the profile's step."""
    s = PRIOR[tp]
    for _ in range(calls):
        meter.observe(tp, factor * s.decode_step_s(4, 4 * 2000) * 100, 100, 4, 2000)


def test_a_degree_takes_the_profile_then_one_measurement_then_the_trend() -> None:
    meter = SpeedMeter(PRIOR)
    assert meter.factor(4) == (1.0, "profile", 0)
    assert meter.borrowed() == frozenset(PRIOR)
    _measured(meter, 1, 1.2, calls=MIN_CALLS - 1)  # not enough calls yet
    assert meter.factor(1)[1] == "profile" and 1 in meter.borrowed()
    _measured(meter, 1, 1.2, calls=1)
    assert meter.factor(1) == (pytest.approx(1.2), "measured", MIN_CALLS)
    assert meter.factor(8) == (pytest.approx(1.2), "as measured at TP1", 0)
    _measured(meter, 2, 1.5)  # TP2 scales worse than the profile says: 1.25x a doubling
    assert meter.borrowed() == frozenset(PRIOR) - {1, 2}
    f4, source, _ = meter.factor(4)
    assert source == "on the trend of TP1 and TP2"
    assert f4 == pytest.approx(1.5 * 1.25)
    assert meter.factor(8)[0] == pytest.approx(1.5 * 1.25 ** 2)
    # the believed TP4 step is the profile's times that factor
    assert meter.current()[4].fixed_s == pytest.approx(PRIOR[4].fixed_s * f4)


def test_the_trend_between_and_beyond_is_capped_at_the_band() -> None:
    meter = SpeedMeter(PRIOR)
    _measured(meter, 1, 1.0)
    _measured(meter, 4, 1.44)  # 1.2x a doubling: TP2 between them
    assert meter.factor(2) == (pytest.approx(1.2), "on the trend of TP1 and TP4", 0)
    steep = SpeedMeter(PRIOR)
    _measured(steep, 1, 1.0)
    _measured(steep, 2, 5.0)  # a stalled engine's worth: the trend is capped at 1.6x
    assert steep.factor(8)[0] == pytest.approx(5.0 * 1.6 ** 2)
    assert math.isfinite(steep.factor(8)[0])


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_engines_running_the_profile_measure_a_factor_of_one_at_a_few_calls(tp: int) -> None:
    """A few calls per instance is weight-bound, above the straight line through large
    batches: read off that line, an engine exactly as fast as its profile looked 5% slower."""
    profile = load_profile("qwen3-14b", "H100", tp)
    meter = SpeedMeter(PRIOR)
    for running in (1, 2, 3, 4) * 4:
        step_s = profile.step_ms(num_tokens=running, decode_ctx_tokens=running * 2000) / 1000
        meter.observe(tp, step_s * 100, 100, running, 2000)
    assert meter.factor(tp) == (pytest.approx(1.0, abs=0.005), "measured", 16)
