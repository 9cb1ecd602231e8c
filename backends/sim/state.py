"""Configuration and per-app state of one simulated vLLM server."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from backends.sim.chat import ToolCall
from backends.sim.clock import WallClock, shared_clock
from backends.sim.driver import SimEngine
from backends.sim.engine import EngineCore, SchedulingPolicy
from backends.sim.metrics import ServerMetrics
from backends.sim.profiles import LatencyProfile, LoraCost, load_profile, native_context
from backends.sim.protocol import APIError, _Body
from backends.sim.request import SimRequest
from backends.sim.responses import Choice
from backends.sim.routes import MOE_SHAPES, MoeShape, RouteAsk
from backends.sim.tokenizer import SimTokenizer, get_tokenizer


@dataclass(frozen=True, slots=True)
class LoadedAdapter:
    """A LoRA adapter the server holds (``backends.sim.lora``)."""

    name: str
    path: str
    rank: int


@dataclass(frozen=True, slots=True)
class SimServerConfig:
    """One simulated server. ``model``/``gpu``/``tp`` pick the latency profile; the
    server answers to ``served_model_name`` (default: ``model``).

    Output lengths without ``ignore_eos`` are lognormal(median, sigma) tokens (EOS
    included). ``tick_real_s`` is the real-time granularity of token delivery.
    """

    model: str = "qwen3-14b"
    gpu: str = "H100"
    tp: int = 1
    served_model_name: str | None = None
    tp_penalty: float | None = None
    speed: float = 1.0
    seed: int = 0
    scheduling_policy: SchedulingPolicy = "fcfs"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    #: the context in tokens (prompt and output); None: the model's own
    #: (:data:`backends.sim.profiles.NATIVE_CONTEXT`, 40,960 for Qwen3)
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    output_len_median: float = 200.0
    output_len_sigma: float = 0.9
    tool_call_prob: float = 0.7
    #: Scripted tool use for harness tests: on turn N (the number of assistant messages
    #: in the request) a request with tools calls one iff ``tool_script[N]``; past the
    #: end of the script it answers with text. None: ``tool_call_prob`` decides. A
    #: :class:`ToolCall` entry calls that tool with exactly those arguments when the
    #: request offers it (an agent CLI that runs what it is told, e.g. a shell command),
    #: and any tool otherwise; a tuple of them, the first the request offers (one server
    #: for several harnesses, each with its own tool names). A scripted tool turn is the
    #: call alone, with no words before it, so a harness that treats text as its final
    #: answer (pydantic-ai's ``run_stream``) follows the script.
    tool_script: tuple[bool | ToolCall | tuple[ToolCall, ...], ...] | None = None
    tick_real_s: float = 0.01
    #: Use these constants instead of looking up (model, gpu, tp) (fits, what-if runs).
    latency: LatencyProfile | None = None
    #: the checkpoint it "loads" at start (a simulated server has no weights; this is what
    #: it reports, as vLLM's ``/v1/models`` root names the model it loaded)
    weights_path: str | None = None
    #: run on the process-wide clock of this name (:func:`backends.sim.clock.shared_clock`,
    #: made at ``speed``) instead of one of its own, so the embedding process can slow
    #: every server together (the demo, when the host falls behind)
    clock: str | None = None
    #: vLLM's ``--enable-lora`` with runtime updating on: the LoRA routes
    #: (``backends.sim.lora``) exist and requests may name a loaded adapter
    enable_lora: bool = False
    max_lora_rank: int = 16  # vLLM's default
    #: vLLM's ``--enable-return-routed-experts``: non-streamed answers carry each
    #: forwarded position's routed experts (``backends.sim.routes``), of the router
    #: ``moe`` (default: :data:`backends.sim.routes.MOE_SHAPES` of ``model``)
    enable_return_routed_experts: bool = False
    moe: MoeShape | None = None
    #: what adapters cost the engine when ``enable_lora``: slower steps, loads that hold it
    lora_cost: LoraCost = field(default_factory=LoraCost)

    def router(self) -> MoeShape | None:
        """The router whose routes answers carry; None when routes are off."""
        if not self.enable_return_routed_experts:
            return None
        shape = self.moe or MOE_SHAPES.get(self.model.lower())
        if shape is None:
            raise ValueError(f"routed experts need a mixture-of-experts model: {self.model!r} "
                             f"is not one of {sorted(MOE_SHAPES)}; pass moe=MoeShape(...)")
        return shape

    def make_clock(self) -> WallClock:
        return shared_clock(self.clock, self.speed) if self.clock else WallClock(self.speed)

    @property
    def served_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def context_len(self) -> int:
        """``max_model_len``, else the model's native context."""
        return self.max_model_len or native_context(self.model)

    def profile(self) -> LatencyProfile:
        if self.latency is not None:
            return self.latency
        return load_profile(self.model, self.gpu, self.tp, tp_penalty=self.tp_penalty)


def sim_of(request: Request) -> SimState:
    """The server's state, from a route's request (the app's lifespan put it there)."""
    state: SimState = request.state.sim
    return state


class SimState:
    """Engine, tokenizer, metrics and bookkeeping of one server (lives in the lifespan)."""

    def __init__(self, config: SimServerConfig) -> None:
        self.config = config
        self.router = config.router()
        self.tok: SimTokenizer = get_tokenizer()
        self.core = EngineCore(config.profile(), max_num_seqs=config.max_num_seqs,
                               max_num_batched_tokens=config.max_num_batched_tokens,
                               scheduling_policy=config.scheduling_policy,
                               enable_prefix_caching=config.enable_prefix_caching,
                               seed=config.seed,
                               lora=config.lora_cost if config.enable_lora else None)
        self.engine = SimEngine(self.core, config.make_clock(),
                                tick_s=config.tick_real_s * config.speed)
        self.metrics = ServerMetrics(self.engine, config.served_name)
        self.engine.on_finished = self.metrics.on_finished
        self._counter = itertools.count()
        self.seen: deque[dict[str, Any]] = deque(maxlen=10_000)
        self.num_requests = 0
        self.num_disconnects = 0
        self.weights_path = config.weights_path
        self.num_pauses = 0
        self.num_pause_aborts = 0
        self.num_reloads = 0
        self.adapters: dict[str, LoadedAdapter] = {}  # by name (``backends.sim.lora``)
        self.num_adapter_loads = 0
        self._seen_by_id: dict[str, dict[str, Any]] = {}

    @property
    def weight_version(self) -> str:
        """The engine's weight label (vLLM ``/weight_info``; ``"default"`` until set)."""
        return self.engine.weight_version

    @weight_version.setter
    def weight_version(self, version: str) -> None:
        self.engine.weight_version = version

    def check_model(self, model: str) -> None:
        """The base model or a loaded adapter; else vLLM's 404."""
        if model != self.config.served_name and model not in self.adapters:
            raise APIError(404, f"The model `{model}` does not exist.",
                           type_="NotFoundError", param="model", code="404")

    def route_ask(self, start: int, prompt_len: int, model: str) -> RouteAsk | None:
        """What a request's answer carries of routed experts; vLLM's 400 for a start
        outside the prompt (checked whether routes are on or not, as vLLM)."""
        if not 0 <= start <= prompt_len:
            raise APIError(400, "routed_experts_prompt_start must be between 0 and the prompt "
                           f"length ({prompt_len}), inclusive.",
                           param="routed_experts_prompt_start")
        if self.router is None:
            return None
        salt = f"{self.weight_version}|{self.adapter_of(model) or ''}"
        return RouteAsk(self.router, start, salt)

    def adapter_of(self, model: str) -> str | None:
        """The LoRA adapter a request on ``model`` runs on (None: the base model)."""
        return model if model in self.adapters else None

    def resolve_max_tokens(self, prompt_len: int, requested: int | None) -> int:
        """vLLM's rule: default to the rest of the context; reject what cannot fit."""
        room = self.config.context_len - prompt_len
        if room <= 0 or (requested is not None and requested > room):
            raise APIError(400, f"This model's maximum context length is "
                           f"{self.config.context_len} tokens. However, you requested "
                           f"{prompt_len + (requested or 0)} tokens ({prompt_len} in the "
                           f"messages, {requested or 0} in the completion).")
        return requested if requested is not None else room

    def rng_for(self, seed: int | None, choice: int,
                adapter: str | None = None) -> tuple[random.Random, int]:
        """A per-choice RNG: from the request's ``seed`` if given, else the server's; a
        request on a LoRA ``adapter`` draws other tokens than the base model."""
        if seed is not None:
            base = hash((seed, choice)) if adapter is None else hash((seed, choice, adapter))
        else:
            base = hash((self.config.seed, next(self._counter)))
        return random.Random(base), base

    def draw_length(self, rng: random.Random) -> int:
        c = self.config
        return max(1, round(rng.lognormvariate(math.log(c.output_len_median),
                                               c.output_len_sigma)))

    def new_id(self, prefix: str, given: str | None = None) -> str:
        """A response id: ``<prefix>-<given>`` (vLLM's for a ``request_id``), or random."""
        return f"{prefix}-{given or uuid.uuid4().hex}"

    def record_seen(self, rid: str, body: _Body, prompt_len: int, max_tokens: int) -> None:
        self.num_requests += 1
        if len(self.seen) == self.seen.maxlen:
            self._seen_by_id.pop(self.seen[0]["id"], None)
        entry = {"id": rid, "model": body.model, "priority": body.priority,
                 "prompt_tokens": prompt_len, "max_tokens": max_tokens, "n": body.n,
                 "stream": body.stream, "ignore_eos": body.ignore_eos, "weight_spans": [],
                 # None when the request left the field out (its default, 0, applies)
                 "routed_experts_prompt_start": body.routed_experts_prompt_start
                 if "routed_experts_prompt_start" in body.model_fields_set else None}
        self.seen.append(entry)
        self._seen_by_id[rid] = entry

    async def submit(self, rid: str, prompt_ids: list[int], choices: list[Choice],
                     priority: int, adapter: str | None = None) -> None:
        async def one(c: Choice) -> None:
            req = SimRequest(f"{rid}-{c.index}", prompt_ids, max_tokens=len(c.comp.ids),
                             ignore_eos=True, priority=priority, output_ids=c.comp.ids,
                             lora=adapter)
            c.handle = await self.engine.submit(req)
            entry = self._seen_by_id.get(rid)
            if entry is not None and c.index == 0:  # the spans fill in as tokens go out
                entry["weight_spans"] = c.handle.spans

        try:
            await asyncio.gather(*(one(c) for c in choices))
        except ValueError as exc:
            self.abort_all(choices)
            raise APIError(400, str(exc)) from None

    def abort_all(self, choices: list[Choice]) -> None:
        """Abort every unfinished choice (client disconnected)."""
        aborted = False
        for c in choices:
            if c.handle is not None and c.handle.finish is None:
                aborted |= self.engine.abort(c.handle.request.id)
        self.num_disconnects += aborted

    def stats(self) -> dict[str, Any]:
        core = self.core
        return {
            "model": self.config.served_name, "profile": core.profile.key,
            "running": core.num_running, "waiting": core.num_waiting,
            "aborted": core.num_aborted, "disconnects": self.num_disconnects,
            "preemptions": core.num_preemptions, "kv_usage": core.kv_usage,
            "prefix_cache_queries": core.kv.queries, "prefix_cache_hits": core.kv.hits,
            "requests_total": self.num_requests, "lag_s": self.engine.lag_s,
            "paused": self.engine.paused, "pauses": self.num_pauses,
            "pause_aborts": self.num_pause_aborts, "reloads": self.num_reloads,
            "weight_version": self.weight_version, "weights_path": self.weights_path,
            "adapters": sorted(self.adapters), "adapter_loads": self.num_adapter_loads,
            "held_s": self.engine.held_s,
            "requests_seen": list(self.seen),
        }
