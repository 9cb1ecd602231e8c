"""The background-loop base: a failing step is logged and the loop goes on, an overrun is
warned about, close() stops it, and it never ends without saying so."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest

from gateway.loops import Periodic, report_unexpected_end

LOGGER = "gateway.loops"


async def until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.005)


def records(caplog: pytest.LogCaptureFixture, level: int, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == level and text in r.getMessage()]


async def test_a_raising_step_is_logged_once_per_period_and_the_loop_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    calls = 0

    async def step() -> None:
        nonlocal calls
        calls += 1
        if calls <= 3:
            raise RuntimeError(f"boom {calls}")

    loop = Periodic("flaky", step, 0.01)
    loop.start()
    await until(lambda: loop.steps >= 6)
    assert loop.running and loop.failures == 3
    failed = records(caplog, logging.ERROR, "flaky: a step failed")
    assert len(failed) == 1  # three failures inside one minute: one line, with the traceback
    assert failed[0].exc_info is not None and "boom 1" in str(failed[0].exc_info[1])
    await loop.close()


async def test_failures_held_back_are_counted_in_the_next_report(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)

    async def step() -> None:
        raise ValueError("always")

    loop = Periodic("broken", step, 0.01, error_every_s=0.05)
    loop.start()
    await until(lambda: len(records(caplog, logging.ERROR, "more failures since")) >= 1)
    await loop.close()
    assert loop.failures > len(records(caplog, logging.ERROR, "broken: a step failed")) >= 2


async def test_a_step_longer_than_the_interval_is_warned_about(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)

    async def slow() -> None:
        await asyncio.sleep(0.05)

    loop = Periodic("slow", slow, 0.01, immediately=True)
    loop.start()
    await until(lambda: loop.steps >= 3)
    await loop.close()
    assert loop.overruns >= 3 and loop.failures == 0
    warned = records(caplog, logging.WARNING, "slow: a step took")
    assert len(warned) == 1 and "longer than its 0.01 s interval" in warned[0].getMessage()


async def test_a_step_within_its_interval_is_not_an_overrun(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)

    async def quick() -> None:
        return None

    loop = Periodic("quick", quick, 0.01)
    loop.start()
    await until(lambda: loop.steps >= 5)
    await loop.close()
    assert loop.overruns == 0 and not caplog.records


async def test_close_cancels_a_step_under_way_and_no_step_runs_after_it(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    entered = asyncio.Event()

    async def hangs() -> None:
        entered.set()
        await asyncio.Event().wait()

    loop = Periodic("hangs", hangs, 0.01, immediately=True)
    loop.start()
    await until(entered.is_set)
    async with asyncio.timeout(1):
        await loop.close()
    steps = loop.steps
    await asyncio.sleep(0.05)
    assert not loop.running and loop.steps == steps == 1
    assert not caplog.records  # stopped by close(): nothing to report


async def test_the_first_step_waits_an_interval_unless_immediately() -> None:
    ran: list[str] = []

    async def step_a() -> None:
        ran.append("a")

    async def step_b() -> None:
        ran.append("b")

    later, now = Periodic("a", step_a, 60), Periodic("b", step_b, 60, immediately=True)
    later.start()
    now.start()
    await until(lambda: "b" in ran)
    await asyncio.sleep(0.02)
    await later.close()
    await now.close()
    assert ran == ["b"]


async def test_a_loop_ended_by_anything_but_close_says_so(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)

    class Fatal(BaseException):
        """Not an Exception: the loop does not catch it."""

    async def step() -> None:
        raise Fatal("out of the loop")

    loop = Periodic("fatal", step, 0.01, immediately=True)
    loop.start()
    await until(lambda: not loop.running)
    await asyncio.sleep(0)  # the done callback runs on the next iteration
    stopped = records(caplog, logging.ERROR, "fatal: the loop stopped without close()")
    assert len(stopped) == 1 and "Fatal: out of the loop" in stopped[0].getMessage()
    await loop.close()  # already over: nothing to stop, nothing raised again


async def test_a_task_that_is_not_periodic_is_reported_when_it_ends_unasked(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    log = logging.getLogger(LOGGER)
    closing = False

    async def dies() -> None:
        raise OSError("disk full")

    async def runs() -> None:
        await asyncio.Event().wait()

    dying = asyncio.create_task(dies(), name="writer-like")
    running = asyncio.create_task(runs(), name="stopped-on-purpose")
    for task in (dying, running):
        report_unexpected_end(task, log, lambda: closing)
    await asyncio.wait([dying])
    await asyncio.sleep(0)
    closing = True
    running.cancel()
    await asyncio.wait([running])
    await asyncio.sleep(0)
    assert [r.getMessage() for r in caplog.records] == [
        "writer-like: the loop stopped without close() (OSError: disk full)"]


def test_an_interval_must_be_positive() -> None:
    async def step() -> None:
        return None

    with pytest.raises(ValueError, match="interval_s must be positive"):
        Periodic("zero", step, 0)
