"""Requests as the simulated engine sees them, and what one engine step reports.

The engine tracks token *counts* (computed, generated) rather than growing token lists:
the output is drawn up front (``output_ids``, or random ids when the caller does not care
about content, as in the discrete-event simulator), so a step only moves integers and
hashes a block when one fills up.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from backends.sim.kv_cache import ROOT_HASH

#: Token ids drawn for outputs whose content nobody supplied start here (any value works;
#: it only has to be a valid int for hashing).
SYNTHETIC_TOKEN_BASE = 1_000


class FinishReason(enum.StrEnum):
    STOP = "stop"  # the output ended with EOS (or a stop string, decided by the caller)
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"


@dataclass(slots=True, eq=False)
class SimRequest:
    """One generation request.

    Output length: with ``ignore_eos`` exactly ``max_tokens``; otherwise the natural
    length (``len(output_ids)``, else ``output_len``, counting the EOS token) capped by
    ``max_tokens``, finishing with ``stop`` if the natural end fits and ``length`` if not.
    ``priority`` follows vLLM: lower runs first; ties by ``arrival``.
    """

    id: str
    prompt_ids: Sequence[int]
    max_tokens: int
    output_len: int | None = None
    ignore_eos: bool = False
    priority: int = 0
    arrival: float = 0.0
    output_ids: Sequence[int] | None = None
    #: Optional precomputed chain hashes of the prompt's full blocks
    #: (``kv_cache.block_hashes(prompt_ids, block_size)``): a caller that extends a
    #: trajectory turn by turn can extend them incrementally instead of rehashing.
    prompt_hashes: Sequence[int] | None = None
    #: the LoRA adapter it runs on (None: the base model): its KV blocks are its own
    #: (vLLM keys a block's hash by the adapter too) and its steps cost more
    #: (:class:`backends.sim.profiles.LoraCost`)
    lora: str | None = None

    def resolve_output(self, rng: random.Random) -> tuple[list[int], FinishReason]:
        """The exact output token ids this request will produce and why it will stop."""
        natural = len(self.output_ids) if self.output_ids is not None else self.output_len
        if self.ignore_eos or natural is None or natural > self.max_tokens:
            target, reason = self.max_tokens, FinishReason.LENGTH
        else:
            target, reason = natural, FinishReason.STOP
        ids = list(self.output_ids[:target]) if self.output_ids is not None else []
        if len(ids) < target:
            ids.extend(b + SYNTHETIC_TOKEN_BASE for b in rng.randbytes(target - len(ids)))
        return ids, reason


def lora_root(adapter: str | None) -> int:
    """The root of a request's block-hash chain: one per adapter, as vLLM adds the LoRA
    to a block's hash keys, so no adapter reuses the base model's (or another's) KV."""
    return ROOT_HASH if adapter is None else hash((ROOT_HASH, adapter))


class SeqState(enum.Enum):
    WAITING = 0
    RUNNING = 1
    DONE = 2


@dataclass(slots=True, eq=False)
class Seq:
    """Engine-side state of a request (identity-hashed: used as a dict key)."""

    req: SimRequest
    tokens: list[int]  # prompt + full pre-drawn output (only read to hash full blocks)
    num_prompt: int
    target: int
    reason: FinishReason
    order: int  # admission counter: final FCFS tie-break
    num_computed: int = 0  # tokens whose KV is in the cache
    num_output: int = 0  # tokens generated so far
    num_blocks: int = 0  # blocks owned
    num_hashed: int = 0  # of which the first num_hashed are the cached hashes[:num_hashed]
    hashes: list[int] = field(default_factory=list)  # chain hashes computed so far
    state: SeqState = SeqState.WAITING

    @property
    def num_tokens(self) -> int:
        return self.num_prompt + self.num_output

    @property
    def key(self) -> tuple[int, float, int]:
        """Scheduling key: smaller runs first (vLLM priority semantics)."""
        return (self.req.priority, self.req.arrival, self.order)

    @property
    def is_decoding(self) -> bool:
        return self.num_output > 0 and self.num_computed == self.num_tokens - 1

    def ensure_hashes(self, n_blocks: int, block_size: int) -> list[int]:
        """Chain hashes of the first ``n_blocks`` blocks, computing missing ones once."""
        h = self.hashes
        parent = h[-1] if h else lora_root(self.req.lora)
        toks = self.tokens
        for b in range(len(h), n_blocks):
            parent = hash((parent, tuple(toks[b * block_size:(b + 1) * block_size])))
            h.append(parent)
        return h


@dataclass(slots=True)
class StepOutput:
    """What one call of ``EngineCore.step`` did.

    ``num_steps`` > 1 when several identical decode-only steps were fused (see
    ``EngineCore.step``); ``emitted`` then counts all tokens of the fused steps.
    """

    duration_s: float
    num_steps: int = 1
    num_batched_tokens: int = 0
    emitted: dict[str, int] = field(default_factory=dict)
    first: list[str] = field(default_factory=list)  # requests that emitted their first token
    finished: list[tuple[str, FinishReason]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
