"""A trajectory as a tree of branches, and what a new call continues.

Agent harnesses send more than one line of conversation on one trajectory id: a
title-generation side call, a compaction that restarts from a summary, subagents, a
regenerated turn. Each is a *branch*: a maximal chain of calls whose prompts extend each
other token for token. The first call opens branch 0; a call whose prompt extends a
branch's last ``prompt + completion`` continues it (the longest such branch wins); any
other call opens a new branch, forked from the branch it shares the longest token prefix
with. Every branch is its own training sample, so a side call never overwrites the
conversation it interrupts.

The message side (``digest_messages``, :meth:`Tree.continuation`) is what lets the gateway
run the engine on the tokens the model generated when a harness re-renders its history
(docs/token-capture.md): a request continues a branch when it re-sends that branch's last
request messages unchanged, then the model's turn in any serialization that keeps every
word the model said, then new messages.

Pure code: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
import re
from array import array
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

#: branches a trajectory keeps in memory to match new calls against (the oldest beyond it
#: are forgotten here, never the main one; the store keeps every branch)
MAX_BRANCHES = 16
_WORD = re.compile(r"\w+")


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) and isinstance(p.get("text"), str)
                       else orjson.dumps(p).decode() for p in content)
    return orjson.dumps(content).decode()


def _arguments(raw: Any) -> Any:
    """Tool-call arguments as data (a JSON string parsed; spacing and key order gone)."""
    if isinstance(raw, str):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            return raw
    return raw


def _calls(msg: dict[str, Any]) -> list[tuple[str, Any]]:
    out = []
    for call in msg.get("tool_calls") or ():
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            out.append((str(fn.get("name", "")), _arguments(fn.get("arguments"))))
    return out


def _normal(msg: Any) -> Any:
    """What a message means, not how it was serialized: role, text, tool calls as data."""
    if not isinstance(msg, dict):
        return msg
    role = "system" if msg.get("role") == "developer" else msg.get("role")
    return [role, _text(msg.get("content")), _calls(msg), msg.get("name")]


def _digest(value: Any) -> bytes:
    return hashlib.blake2b(orjson.dumps(value, option=orjson.OPT_SORT_KEYS),
                           digest_size=12).digest()


def digest_messages(messages: Sequence[Any], context: Any = None) -> tuple[bytes, ...]:
    """A digest of ``context`` (what else shapes the rendering: the tool list, template
    arguments), then one per chat message; equal for equal meaning."""
    return (_digest(context), *(_digest(_normal(m)) for m in messages))


def _leaves(value: Any) -> Iterable[str]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield str(k)
            yield from _leaves(v)
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(v)
    elif value is not None:
        yield str(value)


def words(text: str, calls: Iterable[tuple[str, Any]] = ()) -> Counter[str]:
    """The words of a turn: its text, and each tool call's name, argument keys and values."""
    out = Counter(_WORD.findall(text))
    for name, args in calls:
        out.update(_WORD.findall(name))
        for leaf in _leaves(_arguments(args)):
            out.update(_WORD.findall(leaf))
    return out


def echoed_words(messages: Sequence[Any]) -> Counter[str]:
    """Every word of a harness's rendering of a turn (one or more assistant messages)."""
    out: Counter[str] = Counter()
    for msg in messages:
        if isinstance(msg, dict):
            out += words(_text(msg.get("content")), _calls(msg))
    return out


@dataclass(slots=True)
class Branch:
    id: int
    parent: int | None
    sequence: array[int] = field(default_factory=lambda: array("i"))
    #: digests of its last call's request: context, then messages (empty: not known, e.g.
    #: restored from the store)
    messages: tuple[bytes, ...] = ()
    #: the words of the model's last turn, which a harness's echo of it must contain
    said: Counter[str] | None = None
    #: by model: its first positions whose routed experts the record holds of that model
    #: (MoE routing replay; two policies on a branch route its tokens each their own way)
    routes_end: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a finished call's prompt sits in the tree."""

    branch: int
    parent: int | None  # the branch it forked from, on a branch's first call
    offset: int  # tokens shared with the branch (or, on a fork, with its parent)
    delta: list[int]  # the prompt's tokens after ``offset``
    mismatch_pos: int | None  # the call's messages continued a branch its tokens left


@dataclass(frozen=True, slots=True)
class Continuation:
    """A request that continues ``branch``: its messages ``[:turn_start]`` (and its tools)
    are that branch's last request, ``[turn_start:turn_end]`` the harness's rendering of the
    model's turn, and the rest new."""

    branch: int
    turn_start: int
    turn_end: int
    sequence: array[int]
    echo_complete: bool  # the rendering contains every word the model said
    #: by model, the branch's first positions whose routed experts are held
    routes_end: Mapping[str, int] = field(default_factory=dict)


def _common_prefix(a: array[int], b: array[int]) -> int:
    """Length of the longest common prefix (slices compared in C, by bisection)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Tree:
    """The branches of one attempt of a trajectory, as the gateway holds them."""

    def __init__(self) -> None:
        self.branches: dict[int, Branch] = {}
        self.main: int | None = None  # the branch of the last finished call
        self.count = 0  # branches ever opened (ids are 0..count-1)

    @property
    def sequence(self) -> array[int]:
        """The main branch's tokens (what the policies call the trajectory's context)."""
        main = self.branches.get(self.main) if self.main is not None else None
        return main.sequence if main is not None else array("i")

    def continuation(self, digests: Sequence[bytes], messages: Sequence[Any]
                     ) -> Continuation | None:
        """The branch whose last request ``messages`` re-sends, then a turn and new
        messages; the longest such request wins."""
        best: Branch | None = None
        for b in self.branches.values():
            k = len(b.messages)
            if k and len(digests) > k and tuple(digests[:k]) == b.messages \
                    and (best is None or k > len(best.messages)):
                best = b
        if best is None:
            return None
        start = end = len(best.messages) - 1  # the first digest is the context's
        while end < len(messages) and isinstance(messages[end], dict) \
                and messages[end].get("role") == "assistant":
            end += 1
        if end == start or end == len(messages):
            return Continuation(best.id, start, end, best.sequence, False,
                                dict(best.routes_end))
        said = best.said or Counter()
        complete = not (said - echoed_words(messages[start:end]))
        return Continuation(best.id, start, end, best.sequence, complete,
                            dict(best.routes_end))

    def place(self, prompt: Sequence[int], completion: Sequence[int], *,
              expected: int | None = None, digests: tuple[bytes, ...] = (),
              said: Counter[str] | None = None,
              routes: tuple[int, int] | None = None, model: str = "") -> Placement:
        """Put a finished call in the tree and make its branch the main one.

        ``expected``: the branch the call's messages continued (a divergence from it is a
        mismatch: re-rendered history the gateway could not replace with the record).
        ``routes``: the positions ``[start, end)`` whose routed experts the call
        recorded (of ``model``); the branch holds ``model``'s routes for its first
        positions without a gap."""
        ids = array("i", prompt)
        target: Branch | None = None
        for b in self.branches.values():
            n = len(b.sequence)
            if n <= len(ids) and (target is None or n > len(target.sequence)) \
                    and (n == 0 or b.sequence[-1] == ids[n - 1]) and ids[:n] == b.sequence:
                target = b
        if target is not None:
            offset, parent, mismatch = len(target.sequence), None, None
        else:
            parent, offset = self._fork_point(ids, expected)
            mismatch = offset if parent is not None and parent == expected else None
            target = Branch(self.count, parent)
            self.count += 1
            self.branches[target.id] = target
            if parent is not None:  # what the parent held up to the fork
                target.routes_end = {m: min(offset, end) for m, end
                                     in self.branches[parent].routes_end.items()}
        held = target.routes_end.get(model, 0)
        if routes is not None and routes[0] <= held:
            target.routes_end[model] = min(max(held, routes[1]), len(ids) + len(completion))
        seq = ids
        seq.extend(completion)
        target.sequence, target.messages, target.said = seq, digests, said
        self.main = target.id
        self._bound()
        return Placement(target.id, parent, offset, list(prompt[offset:]), mismatch)

    def _fork_point(self, prompt: array[int], expected: int | None
                    ) -> tuple[int | None, int]:
        """The branch sharing the longest prefix with ``prompt`` (ties: the expected
        branch, then the main one), and that prefix's length."""
        best: tuple[int, int, int] | None = None  # (shared, preference, id)
        for b in self.branches.values():
            shared = _common_prefix(b.sequence, prompt)
            rank = (shared, 2 if b.id == expected else 1 if b.id == self.main else 0, b.id)
            if best is None or rank > best:
                best = rank
        if best is None or best[0] == 0:
            return None, 0  # nothing shared: a root of its own
        return best[2], best[0]

    def _bound(self) -> None:
        while len(self.branches) > MAX_BRANCHES:
            victim = min((b for b in self.branches if b != self.main), default=None)
            if victim is None:
                return
            del self.branches[victim]

    def adopt(self, branch: Branch) -> None:
        """Install a branch rebuilt from the store (after a restart)."""
        self.branches[branch.id] = branch
        self.count = max(self.count, branch.id + 1)
        self.main = branch.id
        self._bound()
