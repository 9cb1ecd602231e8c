"""ChatML template, hermes-style tool calls, and what the simulated model "says".

The template and the generator are two halves of one contract: whatever the server
generates for an assistant turn (words, an optional ``<tool_call>`` block, ``<|im_end|>``)
is rendered back by :func:`render_chat` as exactly the same text when a harness echoes the
assistant message (``content`` + ``tool_calls``) in the next request. With the tokenizer's
locality, ``prompt_ids + completion_ids`` is then a prefix of the next prompt's ids.

Tool calls are rendered from ``function.arguments`` *verbatim* (the JSON string the
server produced), never re-serialized, so key order and spacing cannot drift.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from backends.sim.tokenizer import (
    IM_END,
    IM_START,
    TOOL_CALL_END,
    TOOL_CALL_START,
    SimTokenizer,
)

DEFAULT_SYSTEM = "You are a helpful assistant."


def content_text(content: Any) -> str:
    """OpenAI ``content``: a string, None, or a list of parts (text parts are joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    raise ValueError("message content must be a string, null or a list of parts")


def render_tool_call(name: str, arguments: str) -> str:
    """The exact text of one tool call; ``arguments`` is a JSON string, used verbatim."""
    body = '{"name": ' + json.dumps(name) + ', "arguments": ' + arguments + "}"
    return f"{TOOL_CALL_START}\n{body}\n{TOOL_CALL_END}"


def _render_message(msg: dict[str, Any]) -> str:
    role = msg.get("role")
    if role not in ("system", "user", "assistant", "tool", "developer"):
        raise ValueError(f"unsupported message role {role!r}")
    text = content_text(msg.get("content"))
    if role == "assistant":
        for tc in msg.get("tool_calls") or []:
            fn = tc.get("function") or {}
            text += render_tool_call(str(fn.get("name", "")), str(fn.get("arguments", "{}")))
    return f"{IM_START}{role}\n{text}{IM_END}\n"


def render_chat(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
) -> str:
    """ChatML rendering; tool definitions go into the system block as one JSON per line."""
    if not messages:
        raise ValueError("messages must not be empty")
    parts: list[str] = []
    rest = messages
    if tools:
        system = DEFAULT_SYSTEM
        if messages[0].get("role") == "system":
            system, rest = content_text(messages[0].get("content")), messages[1:]
        defs = "\n".join(json.dumps(t) for t in tools)
        parts.append(f"{IM_START}system\n{system}\n\n# Tools\n{defs}{IM_END}\n")
    parts.extend(_render_message(m) for m in rest)
    if add_generation_prompt:
        parts.append(f"{IM_START}assistant\n")
    return "".join(parts)


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text


@dataclass(slots=True)
class Completion:
    """A fully planned output: its token ids and how it ends."""

    ids: list[int]
    finish_reason: str  # stop | length | tool_calls
    tool_call: ToolCall | None = None
    stop_reason: str | None = None
    text_len: int | None = None  # text cut before a stop string (None: full text)


def _fake_value(schema: Any, tok: SimTokenizer, rng: random.Random) -> Any:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "integer":
        return rng.randint(0, 100)
    if kind == "number":
        return round(rng.uniform(0, 100), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        return [tok.decode(tok.sample_words(rng, 1)).strip()]
    return tok.decode(tok.sample_words(rng, rng.randint(1, 4))).strip()


def choose_tool_call(
    tools: list[dict[str, Any]], tool_choice: Any, rng: random.Random, tok: SimTokenizer,
    call_prob: float,
) -> ToolCall | None:
    """Which tool the simulated model calls, if any (deterministic given ``rng``)."""
    if not tools or tool_choice == "none":
        return None
    fns = [t.get("function", {}) for t in tools if isinstance(t, dict)]
    if isinstance(tool_choice, dict):
        wanted = (tool_choice.get("function") or {}).get("name")
        fns = [f for f in fns if f.get("name") == wanted] or fns
    elif tool_choice != "required" and rng.random() >= call_prob:
        return None
    fn = rng.choice(fns)
    props = (fn.get("parameters") or {}).get("properties") or {}
    args = {k: _fake_value(v, tok, rng) for k, v in props.items()}
    return ToolCall(name=str(fn.get("name", "")), arguments=json.dumps(args))


def plan_completion(
    tok: SimTokenizer,
    rng: random.Random,
    *,
    natural_len: int,
    max_tokens: int,
    ignore_eos: bool,
    tool_call: ToolCall | None = None,
    stop: list[str] | None = None,
) -> Completion:
    """Draw the output ids: words, then the tool call (if any), then EOS.

    ``natural_len`` is where the model would stop on its own (EOS included). With
    ``ignore_eos`` the output is exactly ``max_tokens`` long and has no EOS; a tool call
    that fits is placed at the end so agent loops keep working under forced lengths.
    """
    tc_ids: list[int] = []
    if tool_call is not None:
        tc_ids = tok.encode(render_tool_call(tool_call.name, tool_call.arguments))
    if ignore_eos:
        if len(tc_ids) >= max_tokens:
            tc_ids, tool_call = [], None
        ids = tok.sample_words(rng, max_tokens - len(tc_ids)) + tc_ids
        reason = "tool_calls" if tool_call else "length"
        return _apply_stop(tok, Completion(ids, reason, tool_call), stop)
    n_words = max(0 if tc_ids else 1, natural_len - len(tc_ids) - 1)
    ids = tok.sample_words(rng, n_words) + tc_ids + [tok.eos_id]
    if len(ids) > max_tokens:
        return _apply_stop(tok, Completion(ids[:max_tokens], "length"), stop)
    return _apply_stop(tok, Completion(ids, "tool_calls" if tool_call else "stop", tool_call),
                       stop)


def _apply_stop(tok: SimTokenizer, comp: Completion, stop: list[str] | None) -> Completion:
    """Cut at the first stop string like vLLM: ids keep the completing token, text stops
    before the stop string."""
    if not stop:
        return comp
    text = output_text(tok, comp.ids)
    hits = [(text.find(s), s) for s in stop if s and s in text]
    if not hits:
        return comp
    pos, s = min(hits)
    remaining, n = pos + len(s), 0
    while remaining > 0:  # the token that completes the stop string is kept
        remaining -= len(output_piece(tok, comp.ids[n]))
        n += 1
    return Completion(comp.ids[:n], "stop", None, stop_reason=s, text_len=pos)


def output_piece(tok: SimTokenizer, token_id: int) -> str:
    """Text one generated token contributes (EOS contributes nothing, like vLLM's
    ``skip_special_tokens``; generated text is ASCII so bytes decode one by one)."""
    if token_id == tok.eos_id:
        return ""
    return tok.decode([token_id])


def output_text(tok: SimTokenizer, ids: list[int]) -> str:
    return "".join(output_piece(tok, i) for i in ids)
