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
from collections import OrderedDict
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

    ``_ref`` maps a block hash to its number of owners; an entry with 0 owners sits in
    ``_lru`` (insertion order = least recently freed first) and is evictable. Blocks a
    request owns that are not (yet) hashed are counted by the request, not here.
    """

    def __init__(self, num_blocks: int, block_size: int = 16,
                 enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free_plain = num_blocks
        self._ref: dict[int, int] = {}
        # OrderedDict: popping the oldest entry is O(1); next(iter(dict)) after many
        # front deletions scans dummy slots (quadratic under heavy eviction).
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.queries = 0  # prompt tokens looked up (vLLM: prefix_cache_queries)
        self.hits = 0  # of which found cached (vLLM: prefix_cache_hits)

    @property
    def num_free(self) -> int:
        """Blocks a new allocation could take (plain free blocks + evictable cached ones)."""
        return self._free_plain + len(self._lru)

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
        # bulk form of: per block, leave the LRU if free, take a reference (chain hashes
        # are distinct within one request, so no block appears twice)
        refs = list(map(self._ref.__getitem__, hashes))
        for h in itertools.compress(hashes, [r == 0 for r in refs]):
            del self._lru[h]
        self._ref.update(zip(hashes, [r + 1 for r in refs], strict=True))

    def allocate(self, n: int) -> bool:
        """Take ``n`` unhashed blocks, evicting least recently freed cached ones if needed."""
        if n > self.num_free:
            return False
        plain = min(n, self._free_plain)
        self._free_plain -= plain
        for _ in range(n - plain):
            h, _ = self._lru.popitem(last=False)
            del self._ref[h]
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
            del self._lru[h]
        self._ref[h] = refs + 1
        self._free_plain += 1

    def release(self, hashes: Sequence[int], num_plain: int) -> None:
        """Give back a request's blocks: ``hashes`` it owns plus ``num_plain`` unhashed.

        Hashed blocks are freed tail first so that the *start* of a prefix is the most
        recently freed part and is evicted last (shared prefixes survive longest).
        """
        self._free_plain += num_plain
        tail_first = hashes[::-1]
        refs = [r - 1 for r in map(self._ref.__getitem__, tail_first)]
        self._ref.update(zip(tail_first, refs, strict=True))
        self._lru.update(dict.fromkeys(itertools.compress(tail_first, [r == 0 for r in refs])))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (new weights make old KV invalid).

        Like vLLM's ``reset_prefix_cache``, refuses (False) while requests own blocks.
        """
        if len(self._lru) != len(self._ref):
            return False
        self._free_plain += len(self._lru)
        self._lru.clear()
        self._ref.clear()
        return True

    def check_invariants(self, owned_plain: int) -> None:
        """Assert block conservation (tests): every block is free, cached or owned."""
        total = self._free_plain + len(self._ref) + owned_plain
        assert total == self.num_blocks, (total, self.num_blocks)
        assert all(self._ref[h] == 0 for h in self._lru)
