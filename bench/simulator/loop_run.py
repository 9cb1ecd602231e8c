"""One RL-loop run's scenario (the step mode, the trainer's times, the staleness bound)
and what it measured: samples per hour, GPU idle share, trained tokens by version lag,
wasted work and length bias (the loop itself: bench/simulator/loop.py)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from backends.sim.profiles import VLLM_MEMORY_UTILIZATION

MODES = ("sync", "overprovisioned", "async", "tail-batching")
ON_STALE = ("restart", "drop")


@dataclass(frozen=True, slots=True)
class LoopScenario:
    workload: str
    policy: str
    mode: str = "sync"
    seed: int = 1
    steps: int = 8  # trainer steps
    gpus: int = 64
    model: str = "qwen3-14b"
    gpu: str = "H100"
    tp_efficiency: str | float = "calibrated"
    beliefs: str = "live"  # live | true: bench.simulator.steps.live_beliefs
    prompts: int | None = None  # B: groups per trainer step (default: the workload's)
    group_size: int | None = None
    train_s: float = 120.0  # one optimizer step (the trainer's own GPUs)
    push_s: float = 10.0  # the weight push, engines paused
    over: float = 0.25  # extra groups started (overprovisioned, tail-batching)
    over_members: float = 0.25  # tail-batching's short rounds: extra samples per group
    carry: bool = True  # overprovisioned: carry unfinished groups (else drop them)
    max_staleness: int = 1
    on_stale: str = "restart"
    pool_factor: int = 4
    #: the share of each GPU's memory the engines take (vLLM's 0.9; a colocated rollout
    #: less, the trainer's state holding the rest: bench.runners.loop, colocated sync)
    memory: float = VLLM_MEMORY_UTILIZATION

    def check(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown step mode {self.mode!r}; use one of {', '.join(MODES)}")
        if self.on_stale not in ON_STALE:
            raise ValueError(f"on_stale must be one of {', '.join(ON_STALE)}")
        if self.steps < 2 or self.max_staleness < 0 or min(self.over, self.over_members) < 0:
            raise ValueError("need steps >= 2, max_staleness >= 0 and over(_members) >= 0")
        if self.train_s < 0 or self.push_s < 0:
            raise ValueError("train_s and push_s must be >= 0")
        if not 0.0 < self.memory <= 1.0:
            raise ValueError("memory (the engines' share of GPU memory) must be in (0, 1]")


@dataclass(slots=True)
class LoopRun:
    """What one run measured. Times are simulated seconds."""

    scenario: LoopScenario
    train_ends: list[float] = field(default_factory=list)  # each step's push done
    rollout_s: list[float] = field(default_factory=list)  # sync: each round's rollout
    busy_at_end: list[float] = field(default_factory=list)  # GPU-seconds busy, per step
    sandbox_s_at_end: list[float] = field(default_factory=list)  # tool sandbox-seconds held
    sandbox_peaks: list[int] = field(default_factory=list)  # most sandboxes at once, per step
    samples: list[int] = field(default_factory=list)  # trajectories trained per step
    trained_tokens: list[int] = field(default_factory=list)  # output tokens trained per step
    lag_tokens: Counter[int] = field(default_factory=Counter)  # trained tokens by staleness
    wasted_tokens: int = 0
    generated_tokens: int = 0
    restarts: int = 0
    dropped_groups: int = 0
    trained_output: int = 0  # summed total output of trained trajectories
    drawn_output: int = 0  # summed total output of every trajectory started
    drawn_count: int = 0

    def window(self) -> tuple[float, int]:
        """(seconds, samples) of steps 2..K: the steady state (step 1 fills the pipe)."""
        return self.train_ends[-1] - self.train_ends[0], sum(self.samples[1:])

    def samples_per_hour(self, train_s: float | None = None) -> float:
        """Trained samples per hour over steps 2..K. For ``sync`` a ``train_s`` other than
        the run's is exact: the pool idles while the trainer works, so a round's rollout
        does not depend on it (the round times and the push are kept, the train time
        replaced)."""
        return self._per_hour(self.samples, train_s)

    def tokens_per_hour(self, train_s: float | None = None) -> float:
        """Trained output tokens per hour over steps 2..K (``train_s`` as in
        :meth:`samples_per_hour`): what the trainer learns from. A mode that trains the
        short samples first gains samples per hour that it does not gain here."""
        return self._per_hour(self.trained_tokens, train_s)

    def _per_hour(self, per_step: list[int], train_s: float | None) -> float:
        return 3600.0 * sum(per_step[1:]) / self._seconds(train_s)

    def _seconds(self, train_s: float | None) -> float:
        sc = self.scenario
        if train_s is not None and sc.mode == "sync":
            return sum(r + train_s + sc.push_s for r in self.rollout_s[1:])
        return self.window()[0]

    def idle_share(self, train_s: float | None = None) -> float:
        """Share of the pool's GPU-seconds in steps 2..K with no engine step running
        (``train_s`` as in :meth:`samples_per_hour`)."""
        busy = self.busy_at_end[-1] - self.busy_at_end[0]
        return max(0.0, 1.0 - busy / (self.scenario.gpus * self._seconds(train_s)))

    def sandboxes(self, train_s: float | None = None) -> tuple[float, int]:
        """Tool sandboxes (one per running trajectory) over steps 2..K: (mean held, most
        at once). ``sync`` holds none while the trainer trains, so its mean falls with a
        longer ``train_s`` (as in :meth:`samples_per_hour`)."""
        held = self.sandbox_s_at_end[-1] - self.sandbox_s_at_end[0]
        return held / self._seconds(train_s), max(self.sandbox_peaks[1:], default=0)

    def summary(self, train_s: float | None = None) -> dict[str, float]:
        trained = sum(self.lag_tokens.values())
        sandboxes, peak = self.sandboxes(train_s)
        out = {"sandboxes_mean": sandboxes, "sandboxes_peak": float(peak),
               "samples_per_hour": self.samples_per_hour(train_s),
               "tokens_per_hour": self.tokens_per_hour(train_s),
               "idle_share": self.idle_share(train_s),
               "wasted_share": self.wasted_tokens / max(1, self.generated_tokens),
               "max_staleness": float(max(self.lag_tokens, default=0)),
               "restarts": float(self.restarts), "dropped_groups": float(self.dropped_groups),
               "length_bias": (self.trained_output / max(1, sum(self.samples)))
               / (self.drawn_output / max(1, self.drawn_count))}
        for lag in range(3):
            out[f"lag{lag}_share"] = self.lag_tokens.get(lag, 0) / max(1, trained)
        out["lag3plus_share"] = sum(n for k, n in self.lag_tokens.items() if k >= 3) / max(
            1, trained)
        return out
