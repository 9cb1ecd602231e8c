"""A call's end is structural: the :class:`~gateway.proxy.lifecycle.Call` that owns an
admitted call ends it once, whichever exit path reaches it first, and its ``with`` block
ends it on any exit that did not (docs/architecture.md, gateway/proxy/lifecycle.py)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from gateway.failure_log import FailureLog
from gateway.proxy.admission import Admission
from gateway.proxy.calls import CallContext
from gateway.proxy.capture import Capture, inject
from gateway.proxy.lifecycle import CLIENT_LEFT, Call, arrive
from gateway.trajectories.tracker import Tracker


class _Failures(FailureLog):
    def __init__(self) -> None:
        super().__init__(every_s=0.0)
        self.seen: list[BaseException] = []

    def failed(self, trajectory: str | None, door: str, error: BaseException) -> None:
        self.seen.append(error)
        super().failed(trajectory, door, error)


class _Scheduler:
    def call_arrived(self, state: object) -> None:
        pass


def _admitted() -> tuple[Call, SimpleNamespace, Admission]:
    """A call admitted and queued, not yet dispatched (so its end abandons it)."""
    tracker = Tracker()
    rt = SimpleNamespace(tracker=tracker, failure_log=_Failures(), weight_version="0",
                         version_of=lambda model: "0",
                         dispatcher=SimpleNamespace(scheduler=_Scheduler()))
    admission = Admission(limit=4, retry_after_s=1.0)
    slot = admission.enter()
    state = tracker.touch("t1", None, time.time())
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    seq = arrive(rt, state, [], "m")  # type: ignore[arg-type]
    ctx = CallContext(id="c1", endpoint="chat", state=state, body=body, seq=seq,
                      stream=False, arrived=time.monotonic(), started_wall=time.time(),
                      capture=Capture(chat=True, asked=inject(body, chat=True)), headers={})
    return Call(rt, ctx, slot), rt, admission  # type: ignore[arg-type]


def test_a_call_ends_once_whatever_ends_it_later() -> None:
    call, rt, admission = _admitted()
    assert admission.active == 1 and call.ctx.state.queued == 1
    call.end(error=RuntimeError("first"))
    call.end(error=RuntimeError("second"))  # a later exit path: nothing more happens
    with call:
        pass
    assert call.ended
    assert admission.active == 0  # its slot released once, not twice
    assert call.ctx.state.queued == 0  # abandoned once (a second would count -1)
    assert [str(e) for e in rt.failure_log.seen] == ["first"]


def test_leaving_the_block_by_an_exception_ends_the_call_with_it() -> None:
    call, rt, admission = _admitted()
    with pytest.raises(ValueError), call:
        raise ValueError("bad request")
    assert call.ended and admission.active == 0
    assert [str(e) for e in rt.failure_log.seen] == ["bad request"]


def test_leaving_the_block_without_an_outcome_is_the_client_leaving() -> None:
    call, rt, admission = _admitted()
    with call:
        pass
    assert call.ended and admission.active == 0
    (error,) = rt.failure_log.seen
    assert isinstance(error, asyncio.CancelledError) and error.args == (CLIENT_LEFT,)


def test_a_call_handed_to_its_stream_is_the_stream_s_to_end() -> None:
    call, rt, admission = _admitted()
    with call:
        call.hand_off()  # what RelayStream does when the relay returns it
    assert not call.ended and admission.active == 1  # the stream has not run yet
    call.end()  # the stream's close
    assert call.ended and admission.active == 0 and rt.failure_log.seen == []
    # an exception still ends a handed-off call: the stream that owned it never starts
    other, _, admission2 = _admitted()
    other.hand_off()
    with pytest.raises(KeyError), other:
        raise KeyError("before the stream was sent")
    assert other.ended and admission2.active == 0
