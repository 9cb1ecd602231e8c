"""The simulated vLLM engine core: continuous batching on a latency model.

:class:`EngineCore` is synchronous and clock-free: ``step()`` schedules one batch the way
vLLM v1 does and returns how long that batch takes according to the profile, which
tokens it emitted and which requests finished or were preempted. Whoever drives it owns
time: the async :class:`~backends.sim.driver.SimEngine` sleeps the duration on a wall
clock for the HTTP server; the discrete-event simulator advances a virtual clock.

Scheduling per step (vLLM v1 semantics, our own code):

1. Running requests first, in order: each takes what it still needs to compute (one
   token when decoding, a chunk of its prompt when prefilling), bounded by the step's
   token budget (``max_num_batched_tokens``). If its KV blocks cannot be allocated, the
   lowest-priority running request (FCFS: the last one admitted) is preempted: its blocks
   are freed and it goes back to waiting, to be recomputed later (the prefix cache
   usually keeps most of it).
2. Then waiting requests, in FCFS order or by ``(priority, arrival)``: prefix-cache hits
   are taken, only the uncached remainder is prefilled (chunked by the budget), up to
   ``max_num_seqs`` running. Under the ``priority`` policy a waiting request that does
   not fit may preempt running requests of lower priority.

Drivers add ``profile.request_overhead_ms`` (API server + tokenization) before
``add_request``; the engine itself only models GPU steps.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from typing import Literal

from backends.sim.kv_cache import KVCache
from backends.sim.profiles import LatencyProfile, LoraCost
from backends.sim.request import Seq, SeqState, SimRequest, StepOutput

SchedulingPolicy = Literal["fcfs", "priority"]
#: Upper bound on decode steps fused into one ``step()`` call.
MAX_FUSED_STEPS = 4096


class EngineCore:
    """One simulated vLLM engine (one server instance, any TP degree)."""

    def __init__(
        self,
        profile: LatencyProfile,
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        scheduling_policy: SchedulingPolicy = "fcfs",
        enable_prefix_caching: bool = True,
        seed: int = 0,
        lora: LoraCost | None = None,
    ) -> None:
        if scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {scheduling_policy!r}")
        self.profile = profile
        self.lora = lora  # set: started with --enable-lora (adapters cost their steps)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy: SchedulingPolicy = scheduling_policy
        self.kv = KVCache(profile.num_kv_blocks, profile.block_size, enable_prefix_caching)
        self._bs = profile.block_size
        self._rng = random.Random(seed)
        self._running: list[Seq] = []
        self._fifo: deque[Seq] = deque()
        self._heap: list[tuple[tuple[int, float, int], Seq]] = []
        self._by_id: dict[str, Seq] = {}
        self._order = 0
        self.num_preemptions = 0
        self.num_aborted = 0

    # ------------------------------------------------------------------ queries
    @property
    def has_work(self) -> bool:
        return bool(self._running) or self.num_waiting > 0

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._fifo) + len(self._heap)

    @property
    def kv_usage(self) -> float:
        return self.kv.usage

    def num_generated(self, request_id: str) -> int:
        """Tokens generated so far by a live request (KeyError once it is finished)."""
        return self._by_id[request_id].num_output

    def owned_plain_blocks(self) -> int:
        """Unhashed blocks owned by live requests (for invariant checks)."""
        return sum(s.num_blocks - s.num_hashed for s in self._by_id.values())

    # ------------------------------------------------------------------ requests
    def add_request(self, req: SimRequest) -> None:
        """Queue a request. ValueError if it could never fit in the KV cache."""
        if req.id in self._by_id:
            raise ValueError(f"duplicate request id {req.id!r}")
        if req.max_tokens < 1 or not req.prompt_ids:
            raise ValueError("a request needs a non-empty prompt and max_tokens >= 1")
        out_ids, reason = req.resolve_output(self._rng)
        total = len(req.prompt_ids) + len(out_ids)
        if -(-total // self._bs) > self.kv.num_blocks:
            raise ValueError(
                f"request needs {total} tokens of KV cache; capacity is "
                f"{self.kv.num_blocks * self._bs}"
            )
        tokens = list(req.prompt_ids)
        tokens.extend(out_ids)
        self._order += 1
        seq = Seq(req, tokens, len(req.prompt_ids), len(out_ids), reason, self._order)
        if req.prompt_hashes is not None:
            seq.hashes = list(req.prompt_hashes[: len(req.prompt_ids) // self._bs])
        self._by_id[req.id] = seq
        self._push_waiting(seq, front=False)

    def abort(self, request_id: str) -> bool:
        """Remove a request wherever it is and free its blocks; False if unknown/finished."""
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return False
        if seq.state is SeqState.RUNNING:
            self._running.remove(seq)
        elif self.policy == "priority":
            self._heap = [e for e in self._heap if e[1] is not seq]
            heapq.heapify(self._heap)
        else:
            self._fifo.remove(seq)
        self._free(seq)
        seq.state = SeqState.DONE
        self.num_aborted += 1
        return True

    def live_requests(self) -> list[tuple[SimRequest, int]]:
        """Every request not yet finished, with the tokens it has generated so far."""
        return [(s.req, s.num_output) for s in self._by_id.values()]

    def recompute_all(self) -> int:
        """Send every running request back to waiting with its KV freed (it recomputes
        prompt + tokens so far when scheduled again); returns how many were running."""
        victims = list(self._running)
        out = StepOutput(duration_s=0.0)
        for seq in reversed(victims):  # pushed to the front: keep their order
            self._preempt(seq, {}, out)
        return len(victims)

    # ------------------------------------------------------------------ stepping
    def step(self, horizon_s: float = 0.0) -> StepOutput:
        """Run one scheduling step and report it; an idle engine returns a zero step.

        With ``horizon_s`` > 0 and a pure decode batch (nothing waiting, nothing
        prefilling), consecutive steps are fused while they *start* before
        ``horizon_s`` and no request finishes or needs a block the cache cannot give:
        those steps are identical in structure, so fusing them is exact and saves the
        Python work of thousands of tiny steps.
        """
        if not self._running and not self.num_waiting:
            return StepOutput(duration_s=0.0, num_steps=0)
        if horizon_s > 0 and not self.num_waiting and all(s.is_decoding for s in self._running):
            fused = self._fused_decode(horizon_s)
            if fused is not None:
                return fused
        out = StepOutput(duration_s=0.0)
        sched: dict[Seq, int] = {}
        budget = self._schedule_running(sched, out)
        self._schedule_waiting(sched, budget, out)
        self._execute(sched, out)
        return out

    def _schedule_running(self, sched: dict[Seq, int], out: StepOutput) -> int:
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self._running) and budget > 0:
            seq = self._running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            while not self._grow(seq, n):
                victim = self._victim(self._running)
                if self._running.index(victim) < i:
                    i -= 1  # an already scheduled request leaves the list before us
                budget += self._preempt(victim, sched, out)
                if victim is seq:
                    break
            if seq.state is SeqState.RUNNING:
                sched[seq] = n
                budget -= n
                i += 1
        return budget

    def _schedule_waiting(self, sched: dict[Seq, int], budget: int, out: StepOutput) -> None:
        while budget > 0 and self.num_waiting:
            seq = self._peek_waiting()
            if len(self._running) >= self.max_num_seqs:
                refund = self._preempt_for(seq, sched, out)
                if refund is None:
                    return
                budget += refund
                continue
            n = self._admit(seq, budget)
            if n is None:
                refund = self._preempt_for(seq, sched, out)
                if refund is None:
                    return
                budget += refund
                continue
            self._pop_waiting()
            seq.state = SeqState.RUNNING
            self._running.append(seq)
            sched[seq] = n
            budget -= n

    def _admit(self, seq: Seq, budget: int) -> int | None:
        """Take prefix hits and blocks for the first chunk; None (nothing taken) if no room."""
        bs = self._bs
        max_hit = (seq.num_tokens - 1) // bs  # at least one token must be computed
        hashes = seq.ensure_hashes(max_hit, bs) if self.kv.enable_prefix_caching else []
        hit, hit_free = self.kv.match_prefix(hashes, max_hit)
        n = min(seq.num_tokens - hit * bs, budget)
        new_blocks = -(-(hit * bs + n) // bs) - hit
        if new_blocks > self.kv.num_free - hit_free:
            return None
        self.kv.acquire_cached(hashes[:hit])
        self.kv.allocate(new_blocks)
        self.kv.queries += seq.num_tokens
        self.kv.hits += hit * bs
        seq.num_blocks = hit + new_blocks
        seq.num_hashed = hit
        seq.num_computed = hit * bs
        return n

    def _execute(self, sched: dict[Seq, int], out: StepOutput) -> None:
        n_tokens = 0
        decode_ctx = 0
        prefill_attn = 0.0
        adapter_tokens = 0
        done: list[Seq] = []
        for seq, n in sched.items():
            if seq.req.lora is not None:
                adapter_tokens += n
            if n == 1 and seq.is_decoding:
                n_tokens += 1
                decode_ctx += seq.num_tokens
            else:
                n_tokens += n
                prefill_attn += n * (seq.num_computed + n / 2)
            seq.num_computed += n
            self._register_full_blocks(seq)
            if seq.num_computed == seq.num_tokens:
                seq.num_output += 1
                out.emitted[seq.req.id] = 1
                if seq.num_output == 1:
                    out.first.append(seq.req.id)
                if seq.num_output == seq.target:
                    done.append(seq)
        ms = self.profile.step_ms(
            num_tokens=n_tokens, decode_ctx_tokens=decode_ctx, prefill_attn=prefill_attn
        ) * self._lora_factor(adapter_tokens, n_tokens)
        out.duration_s = ms / 1000.0
        out.num_batched_tokens = n_tokens
        self._finish(done, out)

    def _fused_decode(self, horizon_s: float) -> StepOutput | None:
        run = self._running
        n = len(run)
        bs = self._bs
        k = min(s.target - s.num_output for s in run)
        slack = min(s.num_blocks * bs - s.num_computed for s in run)
        k = min(k, slack + bs * (self.kv.num_free // n), MAX_FUSED_STEPS)
        ctx0 = sum(s.num_tokens for s in run)
        p = self.profile
        f = self._lora_factor(sum(s.req.lora is not None for s in run), n)
        base = p.step_ms(num_tokens=n, decode_ctx_tokens=ctx0) * f
        inc = p.A_ms_per_1k_ctx * n / 1000.0 * f  # each step adds n tokens of decode context
        k = min(k, _steps_starting_before(horizon_s * 1000.0, base, inc))
        if k <= 1:
            return None
        out = StepOutput(duration_s=(k * base + inc * k * (k - 1) / 2) / 1000.0, num_steps=k,
                         num_batched_tokens=n * k)
        done: list[Seq] = []
        for seq in run:
            seq.num_computed += k
            seq.num_output += k
            self._grow(seq, 0)
            self._register_full_blocks(seq)
            out.emitted[seq.req.id] = k
            if seq.num_output == seq.target:
                done.append(seq)
        self._finish(done, out)
        return out

    # ------------------------------------------------------------------ helpers
    def _lora_factor(self, adapter_tokens: int, num_tokens: int) -> float:
        return 1.0 if self.lora is None else self.lora.factor(adapter_tokens, num_tokens)

    def _grow(self, seq: Seq, n: int) -> bool:
        """Own enough blocks for ``num_computed + n`` tokens."""
        need = -(-(seq.num_computed + n) // self._bs) - seq.num_blocks
        if need <= 0:
            return True
        if not self.kv.allocate(need):
            return False
        seq.num_blocks += need
        return True

    def _register_full_blocks(self, seq: Seq) -> None:
        if not self.kv.enable_prefix_caching:
            return
        full = seq.num_computed // self._bs
        if full > seq.num_hashed:
            hashes = seq.ensure_hashes(full, self._bs)
            for h in hashes[seq.num_hashed:full]:
                self.kv.register(h)
            seq.num_hashed = full

    def _free(self, seq: Seq) -> None:
        self.kv.release(seq.hashes[:seq.num_hashed], seq.num_blocks - seq.num_hashed)
        seq.num_blocks = seq.num_hashed = seq.num_computed = 0

    def _finish(self, done: list[Seq], out: StepOutput) -> None:
        if not done:
            return
        for seq in done:
            self._free(seq)
            seq.state = SeqState.DONE
            del self._by_id[seq.req.id]
            out.finished.append((seq.req.id, seq.reason))
        gone = set(done)
        self._running = [s for s in self._running if s not in gone]

    def _victim(self, pool: list[Seq]) -> Seq:
        if self.policy == "priority":
            return max(pool, key=lambda s: s.key)
        return pool[-1]

    def _preempt(self, seq: Seq, sched: dict[Seq, int], out: StepOutput) -> int:
        """Send a running request back to waiting (recompute); returns budget it gave back."""
        self._running.remove(seq)
        refund = sched.pop(seq, 0)
        self._free(seq)
        seq.state = SeqState.WAITING
        self._push_waiting(seq, front=True)
        self.num_preemptions += 1
        out.preempted.append(seq.req.id)
        return refund

    def _preempt_for(self, seq: Seq, sched: dict[Seq, int], out: StepOutput) -> int | None:
        """Priority policy: evict the worst running request if it ranks below ``seq``.

        Returns the token budget given back, or None when nothing may be preempted.
        """
        if self.policy != "priority" or not self._running:
            return None
        victim = self._victim(self._running)
        if victim.key <= seq.key:
            return None
        return self._preempt(victim, sched, out)

    def _push_waiting(self, seq: Seq, *, front: bool) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, (seq.key, seq))
        elif front:
            self._fifo.appendleft(seq)
        else:
            self._fifo.append(seq)

    def _peek_waiting(self) -> Seq:
        return self._heap[0][1] if self.policy == "priority" else self._fifo[0]

    def _pop_waiting(self) -> None:
        if self.policy == "priority":
            heapq.heappop(self._heap)
        else:
            self._fifo.popleft()


def _steps_starting_before(horizon_ms: float, base: float, inc: float) -> int:
    """How many steps (durations base, base+inc, ...) start strictly before the horizon."""
    if inc <= 0:
        return max(1, math.ceil(horizon_ms / base))
    # start of step j: j*base + inc*j*(j-1)/2 < horizon  ->  solve the quadratic for j.
    a, b = inc / 2, base - inc / 2
    j = (-b + math.sqrt(b * b + 4 * a * horizon_ms)) / (2 * a)
    return max(1, math.ceil(j))
