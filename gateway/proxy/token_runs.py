"""The relay's fast path: runs of plain token events, decoded and re-encoded in C.

Most of a streamed chat call is events of one shape, one sampled token each, as vLLM's
chat server writes them (``docs/real-vllm-wire-format.md``)::

    data: {"id":"chatcmpl-..","object":"chat.completion.chunk","created":1795274278,
           "model":"tiny","choices":[{"index":0,"delta":{"content":"close"},
           "logprobs":{"content":[{"token":"close","logprob":-6.1043,"bytes":[99,..],
           "top_logprobs":[]}]},"finish_reason":null,"token_ids":[638]}]}

The general path (:mod:`gateway.proxy.sse`) parses each event into dicts, walks them in
Python and serializes them again: about 3.5 us a token on the machines here. This path
takes every complete event of an upstream read at once (a busy gateway reads several per
call) and decodes them in one ``msgspec`` call into structs that describe exactly that
shape: every key, in vLLM's order, unknown keys refused. What capture needs is read off
the structs; the injected fields the client did not ask for are cleared; one encode
writes the events back, byte for byte what the engine sent less what was removed.

Anything else (the role chunk, a finish, tool calls or reasoning in the delta, usage,
``[DONE]``, several choices, another key order or key, ``/v1/completions``) fails the
decode and takes the general path, which handles every event; both capture the same
tokens and relay the same JSON (``tests/gateway/test_token_runs.py`` feeds them the same
streams). ``Capture.fast`` counts the events taken here.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Generic, Literal, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from gateway.proxy.capture import Capture

E = TypeVar("E")


class _Delta(msgspec.Struct, forbid_unknown_fields=True):
    # vLLM sends {} for a token that ends no character (part of a multi-byte one);
    # reasoning text is relayed, and not captured as text (as on the general path)
    content: str | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    reasoning: str | UnsetType = UNSET


class _Sampled(msgspec.Struct):
    """A logprobs entry when the client did not ask for logprobs: only the value is
    kept (the entry is not relayed)."""

    logprob: float


class _Alternative(msgspec.Struct, forbid_unknown_fields=True):
    token: str
    logprob: float
    bytes: list[int] | UnsetType | None = UNSET


class _Entry(msgspec.Struct, forbid_unknown_fields=True):
    """A logprobs entry the client asked for: relayed as it came."""

    token: str
    logprob: float
    bytes: list[int] | UnsetType | None = UNSET
    top_logprobs: list[_Alternative] | UnsetType = UNSET


class _Logprobs(msgspec.Struct, Generic[E], forbid_unknown_fields=True):
    content: list[E]


class _Choice(msgspec.Struct, Generic[E], forbid_unknown_fields=True):
    index: Literal[0]
    delta: _Delta
    logprobs: _Logprobs[E] | None
    finish_reason: None
    token_ids: list[int] | UnsetType


class _Event(msgspec.Struct, Generic[E], forbid_unknown_fields=True):
    """A plain token event; ``E``: its logprobs entries (only the value when the client
    did not ask for them, which are not relayed; whole when it did)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: tuple[_Choice[E]]  # exactly one


_Plain = _Event[_Sampled]
_Asked = _Event[_Entry]
_DECODE = msgspec.json.Decoder(list[_Plain]).decode
_DECODE_ASKED = msgspec.json.Decoder(list[_Asked]).decode
_DECODE_ONE = msgspec.json.Decoder(_Plain).decode
_DECODE_ONE_ASKED = msgspec.json.Decoder(_Asked).decode
_ENCODE = msgspec.json.Encoder().encode
#: between two events re-encoded as one JSON array ("id" is an event's first key, and
#: these structs hold no other object that starts with it)
_JOIN = b'},{"id":'
_SPLIT = b'}\n\ndata: {"id":'


def token_run(buf: bytes, start: int, end: int, capture: Capture) -> tuple[bytes, int]:
    """Capture the plain token events that ``buf[start:end]`` starts with: the bytes to
    relay for them, and where they stop (``end``: the whole run; else the start of the
    first event that is not one, which the caller passes to the general path; -1: some
    event is not JSON, and the general path takes the whole run). A run may hold any
    event: the decode itself finds the first that is not a plain token event.

    The run is whole events with ``\\n\\n`` between them and none after (CRLF already
    normalized), each ``data: {...}`` on one line."""
    if not capture.chat or not buf.startswith(b"data: {", start):
        return b"", start
    asked = capture.asked
    try:
        if buf.find(b"\n\n", start, end) < 0:  # one event: as a gateway that keeps up reads
            return _one((_DECODE_ONE_ASKED if asked.logprobs else _DECODE_ONE)(
                memoryview(buf)[start + 6:end]), capture, start, end)
        events: Sequence[_Plain | _Asked] = (_DECODE_ASKED if asked.logprobs
                                                  else _DECODE)(
            b"".join((b"[", buf[start + 6:end].replace(b"\n\ndata: ", b","), b"]")))
    except msgspec.ValidationError as exc:  # a valid event of another shape: its index
        found = _AT.search(str(exc))
        return _prefix(buf, start, end, int(found[1]) if found else 0, capture)
    except msgspec.DecodeError:  # an event that is not "data: {...}" (a comment,
        # [DONE]) stops the run there; one that is not JSON sends the run to the general
        # path whole
        bad = _not_data(buf, start, end)
        return (b"", -1) if bad < 0 else _prefix(buf, start, end, bad, capture)
    cap = capture.choice(0)
    tokens, lps, texts = cap.token_ids, cap.logprobs, cap.text
    had = len(tokens), len(lps), len(texts)
    strip_lp, strip_ids = not asked.logprobs, not asked.token_ids
    for i, event in enumerate(events):
        choice = event.choices[0]
        ids, lp = choice.token_ids, choice.logprobs
        if ids is UNSET or lp is None or len(lp.content) != len(ids):
            # the engine did not return both: undo, and let the general path record it
            del tokens[had[0]:], lps[had[1]:], texts[had[2]:]
            return _prefix(buf, start, end, i, capture)
        tokens += ids
        lps += [entry.logprob for entry in lp.content]
        if choice.delta.content is not UNSET:
            texts.append(choice.delta.content)
        if strip_lp:
            choice.logprobs = None
        if strip_ids:
            choice.token_ids = UNSET
    capture.chunks += len(events)
    capture.fast += len(events)
    out = _ENCODE(events).replace(_JOIN, _SPLIT)
    return b"".join((b"data: ", memoryview(out)[1:-1], b"\n\n")), end


_AT = re.compile(r"at `\$\[(\d+)\]")


def _prefix(buf: bytes, start: int, end: int, bad: int, capture: Capture
            ) -> tuple[bytes, int]:
    """The run's events before event ``bad`` through the fast path; stop at ``bad``."""
    stop = start
    for _ in range(bad):
        stop = buf.find(b"\n\n", stop, end) + 2
    if stop == start:
        return b"", start
    out, got = token_run(buf, start, stop - 2, capture)
    return out, stop if got == stop - 2 else got  # all of them, or fewer


def _not_data(buf: bytes, start: int, end: int) -> int:
    """The index of the run's first event that is not ``data: {...}`` (-1: none is)."""
    i, pos = 0, start
    while pos < end:
        if not buf.startswith(b"data: {", pos):
            return i
        nxt = buf.find(b"\n\n", pos, end)
        if nxt < 0:
            return -1
        pos, i = nxt + 2, i + 1
    return -1


def _one(event: _Plain | _Asked, capture: Capture, start: int, end: int
         ) -> tuple[bytes, int]:
    choice = event.choices[0]
    ids, lp = choice.token_ids, choice.logprobs
    if ids is UNSET or lp is None or len(lp.content) != len(ids):
        return b"", start
    cap = capture.choice(0)
    cap.token_ids += ids
    if len(ids) == 1:
        cap.logprobs.append(lp.content[0].logprob)
    else:
        cap.logprobs += [entry.logprob for entry in lp.content]
    if choice.delta.content is not UNSET:
        cap.text.append(choice.delta.content)
    if not capture.asked.logprobs:
        choice.logprobs = None
    if not capture.asked.token_ids:
        choice.token_ids = UNSET
    capture.chunks += 1
    capture.fast += 1
    return b"".join((b"data: ", _ENCODE(event), b"\n\n")), end
