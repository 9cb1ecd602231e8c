"""The round-trip contract: echoed completions extend the previous prompt token for token."""

from __future__ import annotations

import random
from typing import Any

from backends.sim.chat import (
    choose_tool_call,
    output_text,
    plan_completion,
    render_chat,
)
from backends.sim.tokenizer import TOOL_CALL_START, get_tokenizer

TOOLS = [{"type": "function", "function": {
    "name": "run_tests", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "verbose": {"type": "boolean"}, "n": {"type": "integer"}}}}}]


def test_arbitrary_text_round_trips_through_bytes() -> None:
    tok = get_tokenizer()
    text = 'Ünïcode ✓ 日本語 {"a": [1, 2.5, null]}\n\ttabs <|im_end|> the end'
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode(text) == ids
    assert tok.eos_id in ids  # special tokens inside user text are recognised


def test_generated_text_retokenizes_to_the_same_ids() -> None:
    tok = get_tokenizer()
    ids = tok.sample_words(random.Random(1), 500)
    assert tok.encode(tok.decode(ids)) == ids


def _echo(messages: list[dict[str, Any]], comp_text: str, call: Any) -> None:
    if call is None:
        messages.append({"role": "assistant", "content": comp_text})
        messages.append({"role": "user", "content": "go on"})
        return
    content = comp_text[: comp_text.find(TOOL_CALL_START)] or None
    messages.append({"role": "assistant", "content": content, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": call.name, "arguments": call.arguments}}]})
    messages.append({"role": "tool", "tool_call_id": "c1", "content": "2 passed, 1 failed"})


def test_multi_turn_prompts_extend_prompt_plus_completion_exactly() -> None:
    tok = get_tokenizer()
    rng = random.Random(7)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You fix bugs."},
                                      {"role": "user", "content": "Fix test_x.py, ünïcode"}]
    kinds = set()
    for _ in range(8):
        prompt = tok.encode(render_chat(messages, TOOLS))
        call = choose_tool_call(TOOLS, "auto", rng, tok, call_prob=0.5)
        comp = plan_completion(tok, rng, natural_len=rng.randint(5, 60), max_tokens=500,
                               ignore_eos=False, tool_call=call)
        kinds.add(comp.finish_reason)
        _echo(messages, output_text(tok, comp.ids), comp.tool_call)
        nxt = tok.encode(render_chat(messages, TOOLS))
        assert nxt[: len(prompt) + len(comp.ids)] == prompt + comp.ids
    assert kinds == {"stop", "tool_calls"}


def test_stop_string_cuts_text_but_keeps_completing_token() -> None:
    tok = get_tokenizer()
    full = plan_completion(tok, random.Random(3), natural_len=40, max_tokens=100,
                           ignore_eos=False)
    text = output_text(tok, full.ids)
    word = text.split()[10]
    cut = plan_completion(tok, random.Random(3), natural_len=40, max_tokens=100,
                          ignore_eos=False, stop=[word])
    assert cut.finish_reason == "stop" and cut.stop_reason == word
    assert cut.text_len == text.find(word)
    assert output_text(tok, cut.ids).endswith(word)
