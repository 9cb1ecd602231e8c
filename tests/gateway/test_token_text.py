"""The viewer's token pieces (:class:`gateway.token_text.TokenText`) against an engine that
answers ``/detokenize`` as vLLM does, one that has no such route, and one that dies: each
id is asked once per model, at most ``per_view`` new ids a view, and a failing engine
costs a bounded number of requests and a note, never an exception."""

from __future__ import annotations

import aiohttp
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.token_text import TokenText
from tests.servers import LoopThread, app_in_thread


def _engine(asked: list[list[int]], status: int = 200) -> Starlette:
    async def detokenize(request: Request) -> JSONResponse:
        body = await request.json()
        asked.append(body["tokens"])
        if status != 200:
            return JSONResponse({"error": {"message": "no such route"}}, status_code=status)
        return JSONResponse({"prompt": "".join(f"<{t}>" for t in body["tokens"])})

    return Starlette(routes=[Route("/detokenize", detokenize, methods=["POST"])])


def _decode(loop: LoopThread, text: TokenText, url: str, model: str, ids: list[int]
            ) -> tuple[dict[int, str], str | None]:
    async def go() -> tuple[dict[int, str], str | None]:
        async with aiohttp.ClientSession() as session:
            got = await text.decode(session, url, model, ids)
        return got.pieces, got.note

    return loop.run(go())


def test_each_id_is_asked_once_per_model(loop_thread: LoopThread) -> None:
    asked: list[list[int]] = []
    text = TokenText(per_view=1000)
    with app_in_thread(loop_thread, lambda: _engine(asked)) as url:
        pieces, note = _decode(loop_thread, text, url, "m", [5, 3, 5, 9, 3])
        assert pieces == {5: "<5>", 3: "<3>", 9: "<9>"} and note is None
        assert sorted(map(tuple, asked)) == [(3,), (5,), (9,)]  # one id a request, once
        pieces, _ = _decode(loop_thread, text, url, "m", [9, 5, 11])
        assert pieces == {9: "<9>", 5: "<5>", 11: "<11>"}
        assert len(asked) == 4  # only 11 was new
        _decode(loop_thread, text, url, "other", [5])  # another tokenizer: asked again
        assert len(asked) == 5 and text.known("m") == 4 and text.known("other") == 1


def test_a_view_asks_at_most_per_view_new_ids_and_says_so(loop_thread: LoopThread) -> None:
    asked: list[list[int]] = []
    text = TokenText(per_view=10, max_ids=15)
    with app_in_thread(loop_thread, lambda: _engine(asked)) as url:
        pieces, note = _decode(loop_thread, text, url, "m", list(range(25)))
        assert len(asked) == 10 and set(pieces) == set(range(10))
        assert note is not None and "15 distinct ids past the 10 decoded per view" in note
        pieces, note = _decode(loop_thread, text, url, "m", list(range(25)))
        assert set(pieces) == set(range(20))  # 10 known, 10 more asked
        assert text.known("m") == 15  # then the least recently used dropped
        assert "5 distinct ids past" in (note or "")


@pytest.mark.parametrize("status", [404, 500])
def test_an_engine_that_cannot_decode_costs_a_few_requests_and_a_note(
        loop_thread: LoopThread, status: int) -> None:
    asked: list[list[int]] = []
    text = TokenText(at_once=4)
    with app_in_thread(loop_thread, lambda: _engine(asked, status)) as url:
        pieces, note = _decode(loop_thread, text, url, "m", list(range(500)))
    assert pieces == {}
    assert note is not None and f"answered {status}" in note
    assert len(asked) <= 8  # it stops once as many failed as it asks at once


def test_an_engine_that_is_gone_is_a_note(loop_thread: LoopThread) -> None:
    text = TokenText(at_once=2, timeout_s=2)
    pieces, note = _decode(loop_thread, text, "http://127.0.0.1:9", "m", [1, 2, 3])
    assert pieces == {} and note is not None and "failed" in note
