"""The prefix cache's free-block LRU, kept per release, evicts exactly as a per-block LRU."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from backends.sim.kv_cache import KVCache


class PerBlockLRU:
    """The plain model: every freed block goes to the back of one ordered list."""

    def __init__(self, num_blocks: int) -> None:
        self.free_plain = num_blocks
        self.ref: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.evicted = 0

    def acquire_cached(self, hashes: list[int]) -> None:
        for h in hashes:
            if self.ref[h] == 0:
                del self.lru[h]
            self.ref[h] += 1

    def allocate(self, n: int) -> bool:
        if n > self.free_plain + len(self.lru):
            return False
        plain = min(n, self.free_plain)
        self.free_plain -= plain
        for _ in range(n - plain):
            h, _ = self.lru.popitem(last=False)
            del self.ref[h]
            self.evicted += 1
        return True

    def register(self, h: int) -> None:
        if h not in self.ref:
            self.ref[h] = 1
            return
        if self.ref[h] == 0:
            del self.lru[h]
        self.ref[h] += 1
        self.free_plain += 1

    def release(self, hashes: list[int], num_plain: int) -> None:
        self.free_plain += num_plain
        for h in reversed(hashes):
            self.ref[h] -= 1
            if self.ref[h] == 0:
                self.lru[h] = None


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_keeps_the_same_blocks_as_a_per_block_lru(seed):
    """Multi-turn requests over shared prompts: each turn takes back its cached prefix,
    allocates and registers new blocks (evicting when full) and releases everything.
    After every operation both caches hold the same blocks with the same owners."""
    rng = random.Random(seed)
    blocks = 300
    kv, ref = KVCache(blocks), PerBlockLRU(blocks)
    chains = {p: [p * 100_000 + j for j in range(rng.randint(2, 12))] for p in range(6)}
    owned: list[tuple[list[int], int]] = []  # (hashes owned, plain blocks owned)
    next_hash = 10**9
    for _ in range(3000):
        if owned and (rng.random() < 0.45 or len(owned) > 12):
            hashes, plain = owned.pop(rng.randrange(len(owned)))
            kv.release(hashes, plain)
            ref.release(hashes, plain)
        else:
            chain = chains[rng.randrange(len(chains))]
            hit, hit_free = kv.match_prefix(chain, len(chain))
            assert all(h in ref.ref for h in chain[:hit])
            new = rng.randint(1, 40)
            if new + len(chain) - hit > kv.num_free - hit_free:  # as the engine admits
                continue
            kv.acquire_cached(chain[:hit])  # the hits first, so eviction cannot take them
            ref.acquire_cached(chain[:hit])
            assert kv.allocate(new + len(chain) - hit)
            assert ref.allocate(new + len(chain) - hit)
            mine = list(chain[:hit])
            for h in chain[hit:]:  # the prompt's uncached blocks fill and get hashed
                kv.register(h)
                ref.register(h)
                mine.append(h)
            filled = rng.randint(0, new)  # generated blocks that filled up
            for _ in range(filled):
                next_hash += 1
                kv.register(next_hash)
                ref.register(next_hash)
                mine.append(next_hash)
            owned.append((mine, new - filled))
            if rng.random() < 0.3:  # the trajectory continues: its next turn extends it
                chains[rng.randrange(len(chains))] = mine
        assert kv._ref == ref.ref
        assert kv.num_free == ref.free_plain + len(ref.lru)
        kv.check_invariants(sum(p for _, p in owned))
    assert ref.evicted > 100, "the traffic never made the cache evict"


def test_a_cache_that_never_evicts_keeps_its_release_log_bounded():
    kv = KVCache(64)
    for turn in range(2000):  # one trajectory, turn after turn, always cached
        chain = list(range(turn % 7, turn % 7 + 40))
        hit, _ = kv.match_prefix(chain, len(chain))
        kv.acquire_cached(chain[:hit])
        assert kv.allocate(len(chain) - hit)
        for h in chain[hit:]:
            kv.register(h)
        kv.release(chain, 0)
    assert kv._held <= 3 * kv.num_blocks
    kv.check_invariants(0)
