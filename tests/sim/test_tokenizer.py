"""The round-trip contract: echoed completions extend the previous prompt token for token."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from backends.sim.chat import (
    choose_tool_call,
    output_text,
    plan_completion,
    render_chat,
)
from backends.sim.tokenizer import TOOL_CALL_START, get_tokenizer

#: bytes per token of Qwen3-class byte-level BPE tokenizers: ~4 characters a token on
#: English prose, 3 to 3.5 on code (published rules of thumb for cl100k/Llama-3/Qwen-class
#: vocabularies; backends/sim/tokenizer.py), and what a real 131k-entry BPE of that class
#: (Mistral's Tekken, in the CPU vLLM environment: tests/vllm/test_sim_tokenizer_bpe.py)
#: counts on the samples below
PUBLISHED = {"prose": 4.0, "code": 3.25}
TEKKEN = {"prose": 4.776, "code": 3.936}

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


# Sample texts, written for this test: English prose and a Python module.
PROSE = """\
The lighthouse keeper had lived on the island for eleven years before the supply boat \
stopped coming. At first he assumed the weather was to blame, since the autumn storms \
that year were worse than any he could remember, and the harbour at the mainland town \
was known to close for a week or more when the swell ran high. He rationed what was left \
in the storeroom, mended the nets he had not used since his first winter, and went on \
lighting the lamp each evening as the sun went down behind the western cliffs.

By the third week he began to keep a journal. He wrote down the direction of the wind, \
the height of the waves against the breakwater, the number of ships he saw pass on the \
horizon, and what he ate. The ships were fewer than usual, and none of them turned toward \
the island. He told himself that this was no cause for alarm: the channel was deep and \
wide, and most captains preferred to keep well clear of the reef that ran along the \
northern shore. Still, he found that he was counting them more carefully each day.

In the middle of the second month a small sailing dinghy appeared at the mouth of the \
cove. A young woman was at the tiller, soaked through and visibly exhausted, and she \
brought the boat in on the rising tide with a skill that surprised him. She explained \
that she was a student of marine biology from the university on the mainland, that she \
had been studying seabird colonies on the outer islands, and that her own supplies had \
run out several days earlier. She had seen his light every night and decided that it \
was the only place within reach where she could be certain of finding someone.

They shared what food remained, and over the following evenings they talked about the \
things that people talk about when there is nothing else to do: their families, the \
books they had read, the places they had wanted to visit and never had. She was \
curious about the mechanism of the lamp, and he showed her how the clockwork turned the \
great lens, how the paraffin was stored and measured, and how the wick had to be trimmed \
with care so that the flame burned clean and bright without smoking the glass.

When the supply boat finally returned, its skipper apologised at length. There had been \
a dispute at the harbour over wages, he said, and then an outbreak of influenza among \
the crews, and somehow the island had been forgotten in the confusion. The keeper \
accepted the apology without complaint. He loaded the new provisions into the \
storeroom, helped the student stow her dinghy on the deck, and stood on the jetty until \
the boat had rounded the point and disappeared from view. That night, as always, he \
climbed the spiral staircase at dusk and lit the lamp, and he wrote in his journal that \
the wind had turned to the south and that the sea was calm.
"""

CODE = '''\
"""Small utilities for reading experiment logs and summarising them."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator


@dataclass
class RunSummary:
    name: str
    steps: int = 0
    rewards: list[float] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def mean_reward(self) -> float:
        return statistics.fmean(self.rewards) if self.rewards else 0.0

    def add(self, record: dict) -> None:
        self.steps += 1
        if "reward" in record:
            self.rewards.append(float(record["reward"]))
        if record.get("status") != "ok":
            self.failures[record.get("error_type", "unknown")] += 1


def read_records(path: Path) -> Iterator[dict]:
    """Yield one JSON object per non-empty line, skipping lines that do not parse."""
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                print(f"{path}:{line_number}: skipped ({exc.msg})")


def summarise(paths: Iterable[Path]) -> dict[str, RunSummary]:
    summaries: dict[str, RunSummary] = {}
    for path in sorted(paths):
        run_name = path.stem.split("-", 1)[0]
        summary = summaries.setdefault(run_name, RunSummary(name=run_name))
        for record in read_records(path):
            summary.add(record)
    return summaries


def format_table(summaries: dict[str, RunSummary], *, width: int = 12) -> str:
    header = f"{'run':<{width}} {'steps':>8} {'reward':>10} {'failures':>10}"
    rows = [header, "-" * len(header)]
    for name, summary in sorted(summaries.items(), key=lambda kv: -kv[1].mean_reward):
        failures = sum(summary.failures.values())
        rows.append(f"{name:<{width}} {summary.steps:>8d} "
                    f"{summary.mean_reward:>10.3f} {failures:>10d}")
    return "\\n".join(rows)


class MovingAverage:
    def __init__(self, window: int = 100) -> None:
        if window <= 0:
            raise ValueError("window must be positive")
        self.window = window
        self._values: list[float] = []
        self._total = 0.0

    def update(self, value: float) -> float:
        self._values.append(value)
        self._total += value
        if len(self._values) > self.window:
            self._total -= self._values.pop(0)
        return self._total / len(self._values)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("logs", nargs="+", type=Path, help="JSONL files to read")
    parser.add_argument("--width", type=int, default=12)
    args = parser.parse_args(argv)
    print(format_table(summarise(args.logs), width=args.width))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
'''

SAMPLES = {"prose": PROSE, "code": CODE}


@pytest.mark.parametrize("kind", ["prose", "code"])
def test_bytes_per_token_match_a_real_bpe_within_15_percent(kind: str) -> None:
    """Claude Code's 48 KB first request was 41,844 tokens at ~1.15 bytes a token; a
    Qwen3-class tokenizer makes ~12k of it."""
    tok = get_tokenizer()
    text = SAMPLES[kind]
    assert len(text.encode()) > 2500
    ids = tok.encode(text)
    assert tok.decode(ids) == text and tok.encode(tok.decode(ids)) == ids
    ratio = len(text.encode()) / len(ids)
    for reference in (PUBLISHED[kind], TEKKEN[kind]):
        assert abs(ratio / reference - 1) <= 0.15, (kind, ratio, reference)


def test_implicit_vocabulary_round_trips_and_fits_int32() -> None:
    tok = get_tokenizer()
    assert tok.vocab_size < 2**31  # stored as int32
    text = ("  getElementById(HTTPServer, __init__) it's DON'T x\r\n\t\tindented "
            "Capitalized ABCDEFGHIJK supercalifragilistic ½² \x00\x0b\x7f é日本 ..."
            "\n\n\n\n\n\n\n\n\n" + " " * 20 + "end")
    ids = tok.encode(text)
    assert tok.decode(ids) == text and tok.encode(tok.decode(ids)) == ids
    assert all(0 <= i < tok.vocab_size for i in ids)
    for i in ids:  # each id stands for its own text (logprobs' "bytes")
        if i >= 256:
            assert bytes(tok.token_bytes(i)).decode() == tok.decode([i])
    assert tok.encode(" getElementById") == [tok.encode(p)[0] for p in
                                            (" get", "Eleme", "nt", "By", "Id")]


def test_encoding_is_fast() -> None:
    tok = get_tokenizer()
    text = (PROSE + CODE) * 10  # ~60 KB, a long agent prompt
    start = time.perf_counter()
    tok.encode(text + "fresh")
    assert time.perf_counter() - start < 1.0


def test_long_parts_are_encoded_once_and_exactly_as_the_whole_text() -> None:
    """A chat's next prompt repeats every earlier message: the long texts between special
    tokens are kept encoded, and a prompt encodes to the same ids as piece by piece."""
    from backends.sim.tokenizer import PART_CACHE_MIN_CHARS, SimTokenizer

    rng = random.Random(3)
    alphabet = "ab cd\n\t(){}._-=:XYZ0123456789é漢 "

    def body(n: int) -> str:
        return "".join(rng.choice(alphabet) for _ in range(n))

    messages: list[dict[str, Any]] = [{"role": "system", "content": body(5000)}]
    cached, plain = SimTokenizer(), SimTokenizer()
    for turn in range(12):
        messages.append({"role": "user", "content": body(rng.randint(10, 3000))})
        text = render_chat(messages, None)
        want = [i for part in _parts(plain, text) for i in part]
        assert cached.encode(text) == want, turn
        messages.append({"role": "assistant", "content": body(rng.randint(10, 800))})
    # every long part of the last prompt was kept, each once
    long_parts = [p for p in _split(text) if len(p) >= PART_CACHE_MIN_CHARS]
    assert long_parts and all(p in cached._parts for p in long_parts)
    assert cached._parts_chars == sum(len(p) for p in cached._parts)


def test_the_part_cache_drops_its_oldest_parts_past_its_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from backends.sim import tokenizer as module

    monkeypatch.setattr(module, "PART_CACHE_CHARS", 2100)
    tok = module.SimTokenizer()
    texts = [f"{i} " + "word " * 200 for i in range(5)]  # 1,002-1,003 chars each
    for t in texts:
        tok.encode(t)
    assert list(tok._parts) == texts[3:] and tok._parts_chars <= 2100
    assert tok.encode(texts[0]) == module.SimTokenizer().encode(texts[0])


def _split(text: str) -> list[str]:
    from backends.sim.tokenizer import _SPECIAL_RE

    return [p for p in _SPECIAL_RE.split(text) if p]


def _parts(tok: Any, text: str) -> list[list[int]]:
    """``text`` encoded without the part cache: each special token, each part by pieces."""
    return [[tok.special_ids[p]] if p in tok.special_ids else tok._encode_part(p)
            for p in _split(text)]
