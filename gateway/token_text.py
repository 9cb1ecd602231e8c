"""Token ids as text for people reading a trajectory: each id's piece, asked of an engine.

The gateway records ids; where one token's text ends is the tokenizer's to say, and the
tokenizer lives in the engine. vLLM has no route that decodes ids piece by piece, so each
id the cache lacks is one ``POST /detokenize`` of that id alone, a bounded number at once.
A trajectory of 100k tokens holds a few thousand distinct ids of a byte-level BPE, and the
pieces are kept per model, so a later look at the model's trajectories asks for few or
none. A piece is what the id decodes to alone: an id that holds part of a multi-byte
character decodes to U+FFFD, as vLLM's own logprobs show it.

Only the viewer asks (``GET /trajectories/{id}/view`` with the admin token); a model call
never waits on it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import aiohttp
import orjson

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Decoded:
    pieces: dict[int, str]
    note: str | None = None  # what was left undecoded, and why


class TokenText:
    """Pieces of token ids per model, decoded by an engine and kept (least recently used
    dropped past ``max_ids`` per model)."""

    def __init__(self, *, max_ids: int = 262_144, at_once: int = 16, per_view: int = 20_000,
                 timeout_s: float = 10.0) -> None:
        self.max_ids, self.at_once, self.per_view = max_ids, at_once, per_view
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._pieces: dict[str, OrderedDict[int, str]] = {}

    def known(self, model: str) -> int:
        return len(self._pieces.get(model, ()))

    async def decode(self, session: aiohttp.ClientSession, base_url: str, model: str,
                     ids: Iterable[int]) -> Decoded:
        """The piece of each distinct id in ``ids``; at most ``per_view`` of those not yet
        known are asked of the engine at ``base_url`` (the note says how many were not)."""
        cache = self._pieces.setdefault(model, OrderedDict())
        wanted = list(dict.fromkeys(ids))
        missing = [i for i in wanted if i not in cache]
        asked, left = missing[:self.per_view], len(missing) - self.per_view
        failures: list[str] = []
        gate = asyncio.Semaphore(self.at_once)

        async def one(token: int) -> None:
            async with gate:
                if len(failures) >= self.at_once:  # the engine cannot: ask no more
                    return
                piece = await self._ask(session, base_url, model, token, failures)
            if piece is not None:
                cache[token] = piece

        await asyncio.gather(*(one(t) for t in asked))
        out = {}
        for i in wanted:
            if i in cache:
                cache.move_to_end(i)
                out[i] = cache[i]
        while len(cache) > self.max_ids:
            cache.popitem(last=False)
        notes = []
        if left > 0:
            notes.append(f"{left} distinct ids past the {self.per_view} decoded per view "
                         "are shown as ids; open the page again for more")
        if failures:
            notes.append(f"ids could not be decoded ({failures[0]})")
            log.warning("decoding %s token ids of %r at %s failed: %s", len(failures),
                        model, base_url, failures[0])
        return Decoded(out, "; ".join(notes) or None)

    async def _ask(self, session: aiohttp.ClientSession, base_url: str, model: str,
                   token: int, failures: list[str]) -> str | None:
        body = orjson.dumps({"model": model, "tokens": [token]})
        try:
            async with session.post(base_url + "/detokenize", data=body, timeout=self.timeout,
                                    headers={"content-type": "application/json"}) as resp:
                data = await resp.read()
                if resp.status != 200:
                    failures.append(f"the engine's /detokenize answered {resp.status}: "
                                    f"{data[:200].decode(errors='replace')}")
                    return None
                piece = orjson.loads(data).get("prompt")
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError,
                AttributeError) as exc:
            failures.append(f"the engine's /detokenize failed: {type(exc).__name__}: {exc}")
            return None
        if not isinstance(piece, str):
            failures.append("the engine's /detokenize answered no text")
            return None
        return piece
