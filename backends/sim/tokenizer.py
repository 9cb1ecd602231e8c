"""A deterministic tokenizer whose generated text re-tokenizes to the same ids.

Real chat models have the property RL users rely on: the assistant text a harness echoes
back in the next turn tokenizes to the ids the model generated, so every prompt of a
trajectory extends the previous prompt+completion token for token. The simulated server
must have it too, or the gateway's prefix-delta storage and drift detection would be
tested against a server that drifts on every turn.

How it holds here:

- Text is first split at special tokens (``<|im_start|>``, ``<|im_end|>``,
  ``<tool_call>``...), then into pieces by one regex: a word (``[a-z]+`` with an optional
  leading space) or any single other character. A word piece in the vocabulary is one
  token; everything else falls back to one token per UTF-8 byte, so any text (unicode,
  JSON) tokenizes and decodes losslessly.
- The model only generates word tokens of the form ``" word"`` (plus special tokens and
  byte-fallback JSON inside tool calls). A leading space always starts a new piece, so
  ``decode`` of generated ids splits back into exactly those pieces.
- Splitting is local (no merges across a space, newline or special token), so
  tokenizing a rendered conversation equals concatenating the tokenization of its parts.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable
from functools import cache

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
SPECIAL_TOKENS = (IM_START, IM_END, ENDOFTEXT, TOOL_CALL_START, TOOL_CALL_END)

NUM_BYTE_TOKENS = 256
NUM_BASE_WORDS = 4000
_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"
# Words the chat template and typical prompts use, so they cost one token each.
_COMMON_WORDS = (
    "system", "user", "assistant", "tool", "tools", "you", "are", "a", "an", "the", "of", "to",
    "and", "in", "is", "it", "that", "for", "on", "with", "as", "be", "this", "are", "or",
    "at", "by", "from", "not", "file", "line", "error", "test", "function", "call", "result",
    "name", "arguments", "true", "false", "null", "def", "return", "import", "class", "self",
    "print", "if", "else",
)

_PIECE_RE = re.compile(r" ?[a-z]+|.", re.DOTALL)
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")


@cache
def _base_words() -> tuple[str, ...]:
    """A fixed list of pronounceable pseudo-words (same on every machine and run)."""
    rng = random.Random(20261121)
    words = dict.fromkeys(_COMMON_WORDS)
    while len(words) < NUM_BASE_WORDS:
        n_syll = rng.choice((1, 2, 2, 3))
        words["".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(n_syll))] = None
    return tuple(words)


class SimTokenizer:
    """Byte fallback (ids 0-255), special tokens, then words with and without a space."""

    def __init__(self) -> None:
        self.special_ids = {t: NUM_BYTE_TOKENS + i for i, t in enumerate(SPECIAL_TOKENS)}
        first_word = NUM_BYTE_TOKENS + len(SPECIAL_TOKENS)
        pieces = [p for w in _base_words() for p in (" " + w, w)]
        self._piece_ids = {p: first_word + i for i, p in enumerate(pieces)}
        self._id_to_str: list[str] = [""] * NUM_BYTE_TOKENS
        self._id_to_str += list(SPECIAL_TOKENS) + pieces
        self.eos_id = self.special_ids[IM_END]
        #: Ids the simulated model samples from: every " word" piece.
        self.generation_ids = tuple(self._piece_ids[" " + w] for w in _base_words())

    @property
    def vocab_size(self) -> int:
        return len(self._id_to_str)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in _SPECIAL_RE.split(text):
            if not part:
                continue
            sid = self.special_ids.get(part)
            if sid is not None:
                ids.append(sid)
                continue
            for piece in _PIECE_RE.findall(part):
                pid = self._piece_ids.get(piece)
                if pid is not None:
                    ids.append(pid)
                else:
                    ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; byte-fallback runs are joined before UTF-8 decoding."""
        out: list[str] = []
        pending = bytearray()
        for i in ids:
            if i < NUM_BYTE_TOKENS:
                pending.append(i)
                continue
            if pending:
                out.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
            out.append(self._id_to_str[i])
        if pending:
            out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_str(self, token_id: int) -> str:
        """The piece one id stands for (a byte token shows as ``<0xNN>``, like vLLM)."""
        if token_id < NUM_BYTE_TOKENS:
            return f"<0x{token_id:02X}>"
        return self._id_to_str[token_id]

    def token_bytes(self, token_id: int) -> list[int]:
        if token_id < NUM_BYTE_TOKENS:
            return [token_id]
        return list(self._id_to_str[token_id].encode("utf-8"))

    def sample_words(self, rng: random.Random, n: int) -> list[int]:
        """``n`` pseudo-random word tokens (the simulated model's "thoughts")."""
        return rng.choices(self.generation_ids, k=n)

    def is_special(self, token_id: int) -> bool:
        return NUM_BYTE_TOKENS <= token_id < NUM_BYTE_TOKENS + len(SPECIAL_TOKENS)


@cache
def get_tokenizer() -> SimTokenizer:
    """The shared tokenizer (building the vocabulary takes a few milliseconds)."""
    return SimTokenizer()
