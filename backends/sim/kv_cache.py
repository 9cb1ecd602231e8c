"""Paged KV cache with automatic prefix caching, modelled on vLLM v1's block manager.

Memory is a fixed number of blocks of ``block_size`` tokens. A block is either owned by
running requests or free. Full blocks carry a *chain hash* (hash of the parent block's
hash and the block's token ids), so two prompts that share a prefix share its blocks.
When the last owner releases a hashed block it stays in the cache, in an LRU list of
free-but-reusable blocks, and is evicted only when a new block is needed and no
never-hashed free block is left. This is what makes a multi-turn trajectory's next call
cheap: its prompt extends the previous prompt+completion, whose blocks are still cached.

The cache only counts blocks; it never stores token ids (the simulator must stay cheap
at 64 engines x thousands of requests).
"""

from __future__ import annotations

import itertools
import operator
from collections import deque
from collections.abc import Sequence

#: Root of every hash chain; a different root would model a different model/LoRA.
ROOT_HASH = 0x5EED


def chain_hash(parent: int, block_tokens: Sequence[int]) -> int:
    """Hash of a full block given its parent's hash (deterministic across processes)."""
    return hash((parent, tuple(block_tokens)))


def block_hashes(token_ids: Sequence[int], block_size: int, start: int = 0,
                 parent: int = ROOT_HASH) -> list[int]:
    """Chain hashes of the full blocks of ``token_ids`` from block index ``start``."""
    out: list[int] = []
    for b in range(start, len(token_ids) // block_size):
        parent = chain_hash(parent, token_ids[b * block_size:(b + 1) * block_size])
        out.append(parent)
    return out


class KVCache:
    """Block accounting plus the prefix-cache hash table.

    ``_ref`` maps a block hash to its number of owners; an entry with 0 owners is free
    but cached, and evictable least recently freed first. Blocks a request owns that are
    not (yet) hashed are counted by the request, not here.

    The free-block LRU is kept per *release*, not per block: a finished call appends the
    blocks it freed (tail first) as one entry, and taking a block back only bumps its
    count. Eviction walks the oldest entry and skips blocks that were taken back or
    freed again later (``_stamp`` names the release that freed a block last), so the
    order is exactly that of a per-block LRU. A per-block ``OrderedDict`` cost a
    multi-turn call one insert per block of its context on release and one delete on
    the next call; at 30-60k tokens of context that was most of a swe simulation.
    """

    def __init__(self, num_blocks: int, block_size: int = 16,
                 enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free_plain = num_blocks
        self._free_cached = 0  # hashed blocks with no owner (evictable)
        self._ref: dict[int, int] = {}
        self._stamp: dict[int, int] = {}  # hash -> id of the release that freed it last
        # (release id, hashes it freed, tail first, next index to look at)
        self._released: deque[tuple[int, list[int], list[int]]] = deque()
        self._held = 0  # hashes held in ``_released``, stale ones included
        self._release_ids = itertools.count()
        self.queries = 0  # prompt tokens looked up (vLLM: prefix_cache_queries)
        self.hits = 0  # of which found cached (vLLM: prefix_cache_hits)

    @property
    def num_free(self) -> int:
        """Blocks a new allocation could take (plain free blocks + evictable cached ones)."""
        return self._free_plain + self._free_cached

    @property
    def usage(self) -> float:
        """Fraction of blocks owned by requests (vLLM's ``kv_cache_usage_perc``)."""
        return 1.0 - self.num_free / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._ref)

    def match_prefix(self, hashes: Sequence[int], max_blocks: int) -> tuple[int, int]:
        """(blocks of ``hashes`` already cached from the start, how many of them are free).

        The second number matters because taking a free cached block removes it from the
        pool a new allocation could draw from.
        """
        if not self.enable_prefix_caching:
            return 0, 0
        # Same walk as block-by-block (stop at the first miss), done in chunks with C-level
        # loops: long agentic contexts are thousands of blocks and this ran per admission
        # attempt (about half the simulator's time at 64 GPUs).
        get = self._ref.get
        n = in_lru = 0
        limit = min(max_blocks, len(hashes))
        chunk = 64
        while n < limit:
            refs = list(map(get, hashes[n:min(limit, n + chunk)]))
            try:
                stop = refs.index(None)
            except ValueError:
                stop = len(refs)
            in_lru += refs[:stop].count(0)
            n += stop
            if stop < len(refs):
                break
            chunk = min(chunk * 4, 4096)
        return n, in_lru

    def acquire_cached(self, hashes: Sequence[int]) -> None:
        """Take ownership of cached blocks found by :meth:`match_prefix`."""
        # chain hashes are distinct within one request, so no block appears twice; a free
        # one leaves the evictable count (its entry in ``_released`` goes stale)
        refs = list(map(self._ref.__getitem__, hashes))
        self._free_cached -= refs.count(0)
        self._ref.update(zip(hashes, map(operator.add, refs, itertools.repeat(1)),
                             strict=True))

    def allocate(self, n: int) -> bool:
        """Take ``n`` unhashed blocks, evicting least recently freed cached ones if needed."""
        if n > self.num_free:
            return False
        plain = min(n, self._free_plain)
        self._free_plain -= plain
        need = n - plain
        ref, stamp = self._ref, self._stamp
        while need:
            rid, hashes, at = self._released[0]
            i = at[0]
            while i < len(hashes) and need:
                h = hashes[i]
                i += 1
                if stamp.get(h) == rid and ref.get(h) == 0:
                    del ref[h], stamp[h]
                    self._free_cached -= 1
                    need -= 1
            if i < len(hashes):
                at[0] = i
            else:
                self._released.popleft()
                self._held -= len(hashes)
        return True

    def register(self, h: int) -> None:
        """A request's unhashed block just became full with hash ``h``: cache it.

        If an identical block is already cached (another request computed the same
        prefix concurrently), share it and return the duplicate to the free pool.
        """
        if not self.enable_prefix_caching:
            return
        refs = self._ref.get(h)
        if refs is None:
            self._ref[h] = 1
            return
        if refs == 0:
            self._free_cached -= 1
        self._ref[h] = refs + 1
        self._free_plain += 1

    def release(self, hashes: Sequence[int], num_plain: int) -> None:
        """Give back a request's blocks: ``hashes`` it owns plus ``num_plain`` unhashed.

        Hashed blocks are freed tail first so that the *start* of a prefix is the most
        recently freed part and is evicted last (shared prefixes survive longest).
        """
        self._free_plain += num_plain
        tail_first = hashes[::-1]
        refs = list(map(operator.sub, map(self._ref.__getitem__, tail_first),
                        itertools.repeat(1)))
        self._ref.update(zip(tail_first, refs, strict=True))
        freed = list(itertools.compress(tail_first, map(operator.not_, refs)))
        if not freed:
            return
        rid = next(self._release_ids)
        self._stamp.update(dict.fromkeys(freed, rid))
        self._released.append((rid, freed, [0]))
        self._free_cached += len(freed)
        self._held += len(freed)
        if self._held > self.num_blocks + 2 * self._free_cached:
            self._compact()

    def _compact(self) -> None:
        """Drop the stale hashes of ``_released`` (taken back, or freed again later), so
        it stays within three times the cache however rarely anything is evicted. A
        compaction leaves ``_free_cached`` hashes and the next comes at least
        ``num_blocks`` released hashes later, so its scan costs O(1) per hash released."""
        ref, stamp = self._ref, self._stamp
        kept: deque[tuple[int, list[int], list[int]]] = deque()
        for rid, hashes, at in self._released:
            live = [h for h in hashes[at[0]:] if stamp.get(h) == rid and ref.get(h) == 0]
            if live:
                kept.append((rid, live, [0]))
        self._released = kept
        self._held = sum(len(e[1]) for e in kept)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (new weights make old KV invalid).

        Like vLLM's ``reset_prefix_cache``, refuses (False) while requests own blocks.
        """
        if self._free_cached != len(self._ref):
            return False
        self._free_plain += self._free_cached
        self._free_cached = self._held = 0
        self._ref.clear()
        self._stamp.clear()
        self._released.clear()
        return True

    def check_invariants(self, owned_plain: int) -> None:
        """Assert block conservation (tests): every block is free, cached or owned."""
        total = self._free_plain + len(self._ref) + owned_plain
        assert total == self.num_blocks, (total, self.num_blocks)
        assert sum(1 for r in self._ref.values() if r == 0) == self._free_cached
        live = [h for rid, hs, at in self._released for h in hs[at[0]:]
                if self._stamp.get(h) == rid and self._ref.get(h) == 0]
        assert len(live) == self._free_cached == len(set(live))
