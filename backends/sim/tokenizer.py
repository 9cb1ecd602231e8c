"""A deterministic tokenizer with a real BPE's bytes per token, whose generated text
re-tokenizes to the same ids.

Real chat models have the property RL users rely on: the assistant text a harness echoes
back in the next turn tokenizes to the ids the model generated, so every prompt of a
trajectory extends the previous prompt+completion token for token. The simulated server
must have it too, or the gateway's prefix-delta storage and drift detection would be
tested against a server that drifts on every turn. It must also count tokens as the
profiled model does, or a coding agent's 48 KB first request would not fit the model's
context (one token per byte did that).

How text becomes ids:

- Text is split at special tokens (``<|im_start|>``, ``<|im_end|>``, ``<tool_call>``...),
  then into pieces by Qwen2/Qwen3's pre-tokenizer regex (written for Python's ``re``): a
  word with at most one leading space or symbol, one digit, a run of symbols, a run of
  whitespace whose last space goes with the word after it.
- A piece in the word list (the pseudo-words the model generates, with and without a
  leading space, and common English words) is one token. Any other ASCII piece is cut
  into chunks by a fixed rule, each chunk one id of an implicit vocabulary whose id is
  computed from its text and back: a word's letters in segments of one case pattern
  (``get``, ``Element``, ``HTTP``), up to 5 letters a chunk (6 for a lowercase word after
  a space), the leading space or symbol in the first chunk; symbols up to 3 a chunk;
  whitespace up to 8. Anything else falls back to one token per UTF-8 byte, so any text
  (unicode, JSON) tokenizes and decodes losslessly.
- The model only generates word tokens of the form ``" word"`` (plus special tokens and
  the tool call's text, encoded as above). A space before a letter always starts a new
  piece, as does a special token, so ``decode`` of generated ids splits back into the
  same pieces, and tokenizing a rendered conversation equals concatenating the
  tokenization of its turns.

Bytes per token: Qwen3's tokenizer (a byte-level BPE of 151,643 entries, like Llama 3's
128k) averages about 4 characters per token on English prose and 3 to 3.5 on code (the
usual published figures: OpenAI's "~4 characters per token" for English on the same
class of BPE; Qwen2.5-Coder and Llama 3 reports of ~3-3.5 on source code). This one, on
the prose and code samples of ``tests/sim/test_tokenizer.py``: 4.3 and 3.6; a real
131k-entry BPE of that class (Mistral's Tekken, which the CPU vLLM environment ships)
4.8 and 3.9 on the same text; Claude Code's first request (48 KB of system prompt, tool
schemas and messages): 13,420 tokens here, 11,954 for Tekken (it was 41,844). Ids of the
implicit vocabulary go up to ~1.6e9 (int32), far past a real vocabulary: only their
count and round trip matter to a simulated engine.
"""

from __future__ import annotations

import random
import re
from collections import OrderedDict
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

# Qwen2's pre-tokenizer, \p{L} written [^\W\d_] and \p{N} \d; the last branch keeps any
# other character (a numeral such as "½" is \w but neither) so no text is lost
_PIECE_RE = re.compile(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|(?:[^\r\n\w]|_)?[^\W\d_]+|\d| ?(?:[^\s\w]|_)+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+|.", re.DOTALL)
#: texts between special tokens at least this long are kept encoded (``_cached_part``)
PART_CACHE_MIN_CHARS = 256
#: and at most this many characters of them (about 3 MB of ids per million characters)
PART_CACHE_CHARS = 16_000_000
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")
_SEGMENT_RE = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])")
_ASCII_WORD_RE = re.compile(r"([^A-Za-z]?)([A-Za-z]+)")

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_WHITESPACE = " \t\n\r"
_SYMBOLS = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~" + _WHITESPACE
_LEADS = "\0" + _SYMBOLS  # "\0": no leading character
CHUNK = 5  # letters in a word chunk
LONG_CHUNK = 6  # ... in the first chunk of a lowercase word after a space
SYMBOL_CHUNK = 3
SPACE_CHUNK = 8
_CASES = 3  # lower, Capitalized (or one capital letter), UPPER


def _count(alphabet: int, longest: int) -> int:
    """Strings of 1..``longest`` characters over ``alphabet`` characters."""
    total, power = 0, 1
    for _ in range(longest):
        power *= alphabet
        total += power
    return total


def _index(text: str, alphabet: str) -> int:
    """Rank of ``text`` among the strings over ``alphabet``, shortest first."""
    value = 0
    for ch in text:
        value = value * len(alphabet) + alphabet.index(ch)
    return _count(len(alphabet), len(text) - 1) + value


def _unindex(rank: int, alphabet: str) -> str:
    n, size = 1, len(alphabet)
    while rank >= size ** n:
        rank -= size ** n
        n += 1
    out = []
    for _ in range(n):
        rank, digit = divmod(rank, size)
        out.append(alphabet[digit])
    return "".join(reversed(out))


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
    """Byte fallback (ids 0-255), special tokens, the word list with and without a
    space, then the implicit vocabulary: whitespace, symbol and word chunks."""

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
        self._space_base = len(self._id_to_str)
        self._symbol_base = self._space_base + _count(len(_WHITESPACE), SPACE_CHUNK)
        self._word_base = self._symbol_base + _count(len(_SYMBOLS), SYMBOL_CHUNK)
        self._words_per_form = _count(len(_LETTERS), CHUNK)
        self._long_base = self._word_base + len(_LEADS) * _CASES * self._words_per_form
        self._size = self._long_base + _count(len(_LETTERS), LONG_CHUNK) - _count(
            len(_LETTERS), LONG_CHUNK - 1)
        self._encoded: dict[str, tuple[int, ...]] = {}
        self._parts: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._parts_chars = 0
        self._decoded: dict[int, str] = {}

    @property
    def vocab_size(self) -> int:
        return self._size

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in _SPECIAL_RE.split(text):
            if not part:
                continue
            sid = self.special_ids.get(part)
            if sid is not None:
                ids.append(sid)
            elif len(part) < PART_CACHE_MIN_CHARS:
                ids.extend(self._encode_part(part))
            else:
                ids.extend(self._cached_part(part))
        return ids

    def _cached_part(self, part: str) -> tuple[int, ...]:
        """A long text between special tokens (a message's body, the tool list), encoded
        once: a chat's next prompt repeats every earlier message, so without this each
        turn re-encodes the whole conversation (O(n^2) over a trajectory, and it ran on
        the server's event loop). Oldest parts are dropped past ``PART_CACHE_CHARS``."""
        found = self._parts.get(part)
        if found is not None:
            self._parts.move_to_end(part)
            return found
        found = self._parts[part] = tuple(self._encode_part(part))
        self._parts_chars += len(part)
        while self._parts_chars > PART_CACHE_CHARS:
            old, _ = self._parts.popitem(last=False)
            self._parts_chars -= len(old)
        return found

    def _encode_part(self, part: str) -> list[int]:
        ids: list[int] = []
        for piece in _PIECE_RE.findall(part):
            found = self._encoded.get(piece)
            if found is None:
                if len(self._encoded) >= 1 << 17:  # bounded: pieces repeat a lot
                    self._encoded.clear()
                found = self._encoded[piece] = tuple(self._encode_piece(piece))
            ids.extend(found)
        return ids

    def _encode_piece(self, piece: str) -> list[int]:
        pid = self._piece_ids.get(piece)
        if pid is not None:
            return [pid]
        if piece.isdigit() and piece.isascii():
            return [ord(piece)]
        if all(ch in _WHITESPACE for ch in piece):
            return [self._space_base + _index(piece[i:i + SPACE_CHUNK], _WHITESPACE)
                    for i in range(0, len(piece), SPACE_CHUNK)]
        if all(ch in _SYMBOLS for ch in piece):
            return [self._symbol_base + _index(piece[i:i + SYMBOL_CHUNK], _SYMBOLS)
                    for i in range(0, len(piece), SYMBOL_CHUNK)]
        word = _ASCII_WORD_RE.fullmatch(piece)
        if word is not None and (not word[1] or word[1] in _SYMBOLS):
            return self._encode_word(word[1], word[2])
        return list(piece.encode("utf-8"))

    def _encode_word(self, lead: str, letters: str) -> list[int]:
        ids: list[int] = []
        for segment in _SEGMENT_RE.findall(letters):
            start = 0
            if lead == " " and not ids and segment.islower() and len(segment) >= LONG_CHUNK:
                ids.append(self._long_base + _index(segment[:LONG_CHUNK], _LETTERS)
                           - _count(len(_LETTERS), LONG_CHUNK - 1))
                start, lead = LONG_CHUNK, ""
            for i in range(start, len(segment), CHUNK):
                chunk = segment[i:i + CHUNK]
                case = 0 if chunk.islower() else 1 if chunk[1:].islower() or \
                    len(chunk) == 1 else 2
                form = _LEADS.index(lead or "\0") * _CASES + case
                ids.append(self._word_base + form * self._words_per_form
                           + _index(chunk.lower(), _LETTERS))
                lead = ""
        return ids

    def _implicit(self, token_id: int) -> str:
        """The text of an id past the word list."""
        text = self._decoded.get(token_id)
        if text is not None:
            return text
        if token_id < self._symbol_base:
            text = _unindex(token_id - self._space_base, _WHITESPACE)
        elif token_id < self._word_base:
            text = _unindex(token_id - self._symbol_base, _SYMBOLS)
        elif token_id < self._long_base:
            form, rank = divmod(token_id - self._word_base, self._words_per_form)
            lead, case = divmod(form, _CASES)
            text = _unindex(rank, _LETTERS)
            text = text if case == 0 else text.capitalize() if case == 1 else text.upper()
            text = (_LEADS[lead] if lead else "") + text
        elif token_id < self._size:
            rank = token_id - self._long_base + _count(len(_LETTERS), LONG_CHUNK - 1)
            text = " " + _unindex(rank, _LETTERS)
        else:
            raise ValueError(f"token id {token_id} is not in the vocabulary")
        if len(self._decoded) >= 1 << 17:
            self._decoded.clear()
        self._decoded[token_id] = text
        return text

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; byte-fallback runs are joined before UTF-8 decoding."""
        out: list[str] = []
        pending = bytearray()
        known = len(self._id_to_str)
        for i in ids:
            if i < NUM_BYTE_TOKENS:
                pending.append(i)
                continue
            if pending:
                out.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
            out.append(self._id_to_str[i] if i < known else self._implicit(i))
        if pending:
            out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_str(self, token_id: int) -> str:
        """The piece one id stands for (a byte token shows as ``<0xNN>``, like vLLM)."""
        if token_id < NUM_BYTE_TOKENS:
            return f"<0x{token_id:02X}>"
        if token_id < len(self._id_to_str):
            return self._id_to_str[token_id]
        return self._implicit(token_id)

    def token_bytes(self, token_id: int) -> list[int]:
        """The piece's UTF-8 bytes (a fresh list: callers may keep or change it)."""
        if token_id < NUM_BYTE_TOKENS:
            return [token_id]
        return list(self.token_str(token_id).encode("utf-8"))

    def sample_words(self, rng: random.Random, n: int) -> list[int]:
        """``n`` pseudo-random word tokens (the simulated model's "thoughts")."""
        return rng.choices(self.generation_ids, k=n)

    def is_special(self, token_id: int) -> bool:
        return NUM_BYTE_TOKENS <= token_id < NUM_BYTE_TOKENS + len(SPECIAL_TOKENS)


@cache
def get_tokenizer() -> SimTokenizer:
    """The shared tokenizer (building the vocabulary takes a few milliseconds)."""
    return SimTokenizer()
