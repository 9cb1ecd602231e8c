"""TRL's ``GRPOTrainer`` trained on rollouts that ran through the gateway.

TRL (>= 1.16) lets a ``rollout_func`` produce the batch: token ids of the prompt and of
the completion, the sampling logprobs and an ``env_mask`` (1 on tokens the model
generated, 0 on tool output inside the completion). That is the gateway's sample of an
agentic trajectory, so :class:`GatewayGRPO` plugs the gateway in with three objects::

    with GatewayGRPO("http://gw:8000", my_agent, weights_dir="ckpt",
                     admin_token=TOKEN) as gw:
        trainer = GRPOTrainer(model, reward_funcs=gw.reward_func, args=config,
                              train_dataset=prompts, rollout_func=gw.rollout_func,
                              callbacks=[gw.callback()])
        trainer.train()

* ``rollout_func`` runs ``my_agent`` once per row of TRL's generation batch (TRL repeats
  each prompt ``num_generations`` times: each repetition is one trajectory, each prompt
  one gateway group), finishes every trajectory with the reward the agent returned, then
  fetches each group in one request (``fetch_group``: ``GET /groups/{id}/samples``) and
  hands TRL ``prompt_ids`` (the tokens before the first completion), ``completion_ids``
  (everything after, tool results included), ``logprobs`` and ``env_mask`` (the sample's
  loss mask over the completion). The agent is any OpenAI-speaking harness pointed at
  its trajectory's base URL.
* ``reward_func`` hands TRL the rewards stored in the gateway (the agents' scores) and
  logs the step's gateway numbers (``gateway/*``: staleness, tokens of other versions)
  into TRL's metrics.
* ``callback()`` pushes the trainer's weights to every engine of the pool through the
  gateway's weight-update job (``reload`` from a saved directory): once before the first
  step, so the engines serve what TRL trains, then after every optimizer step, so each
  step's tokens are generated, and stamped, by the version trained so far.

:attr:`GatewayGRPO.steps` keeps one :class:`StepRecord` per step (rewards, versions,
staleness, timings of rollout, fetch, train, save and push). Needs ``trl`` (extra
``trl``); like the rest of :mod:`gateway.client`, nothing here imports a server module.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self, TypeVar

from transformers import TrainerCallback

from gateway.client.aio import AsyncRolloutClient
from gateway.client.errors import GatewayClientError
from gateway.client.mismatch import measure_mismatch, trainer_logprobs
from gateway.client.sync import RolloutClient
from gateway.client.trl_rows import (
    LOGPROB_TOL,
    LogprobCheck,
    check_logprobs,
    compare_logprobs,
    to_trl_row,
)
from gateway.client.trl_steps import Push, StepRecord
from gateway.client.types import SampleBatch
from gateway.schema.mismatch import MismatchReport
from gateway.schema.samples import Sample

__all__ = ["LOGPROB_TOL", "Agent", "GatewayGRPO", "LogprobCheck", "Push", "Rollout",
           "StepRecord", "check_logprobs", "to_trl_row"]

T = TypeVar("T")
log = logging.getLogger(__name__)
#: what to do with a trajectory that forked into branches (side calls, compaction): TRL
#: trains one sequence per generation
MultiBranch = Literal["error", "main", "longest"]


@dataclass(frozen=True, slots=True)
class Rollout:
    """One trajectory to run: the agent calls the model at ``base_url`` only."""

    prompt: Any  # the dataset row's ``prompt``, as TRL passes it
    base_url: str  # OpenAI base URL tagged with the trajectory and its group
    trajectory_id: str
    group_id: str
    index: int  # which generation of the group (0 .. num_generations - 1)
    step: int  # TRL's global step (optimizer steps done so far)
    #: the harness key for this trajectory alone (``RolloutClient.mint_key``): the agent's
    #: OpenAI ``api_key``, so it can make model calls and nothing else
    api_key: str = "EMPTY"


#: runs one trajectory and returns its reward (``None``: no score, TRL leaves it out), or
#: for an agent calling several policies each one's by model name (``finish``'s
#: ``rewards``: each policy's samples carry its own)
Agent = Callable[[Rollout], Awaitable[float | Mapping[str, float] | None]]


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to the end from synchronous code, even inside a running event loop
    (a notebook): on a loop of its own in a worker thread."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def is_lora(model: Any) -> bool:
    """A peft model training LoRA adapters (what ``save_pretrained`` then writes is the
    adapter, not the model)."""
    config = getattr(model, "peft_config", None)
    return isinstance(config, dict) and any(
        str(getattr(c, "peft_type", "")).upper().endswith("LORA") for c in config.values())


def _phase_seconds(job_raw: dict[str, Any]) -> dict[str, float]:
    """Each phase of a finished job (``pause``, ``update``, ``resume``) and its seconds."""
    return {str(p.get("name")): float(p["duration_s"]) for p in job_raw.get("phases") or ()
            if isinstance(p.get("duration_s"), int | float)}


class GatewayGRPO:
    """Rollouts, rewards and weight pushes for TRL's ``GRPOTrainer`` (see the module).

    ``gateway`` is the gateway's root URL; ``admin_token`` (weight updates) and any other
    keyword go to its clients (``self.client`` is the blocking one). ``weights_dir``
    holds the pushed checkpoints; every engine must be able to read it (one machine, or
    a shared filesystem). ``multi_branch``: TRL trains one sequence per generation; a
    trajectory that forked (a title call, a memory subagent, a reply the harness
    dropped) gives its main sample (``"main"``, the default): the task's conversation,
    trained whole, every generated token in its sequence under ``env_mask`` 1. What only
    its side branches generated cannot join that row without changing the context the
    trainer scores it in, so it is counted in ``StepRecord.dropped_tokens`` and logged;
    ``"longest"`` takes the sample training the most tokens instead, ``"error"`` refuses
    such a trajectory. ``mode`` is each push's pause mode (nothing is in flight
    between steps here). ``check_logprobs`` recomputes each generated token's logprob
    with the trainer's model (a forward pass per sample): a check that the batch lines
    up token for token and that the engines serve the weights being trained; the step's
    training-inference mismatch (``StepRecord.mismatch``: KL, importance-ratio
    percentiles, per weight version) is posted to the gateway's status page and
    Prometheus and logged as a warning when it passes a limit. ``policy``: when the pool
    serves several policies (LoRA families of one base: a solver and a verifier, their
    agents calling both), the model name this trainer trains: the rows are that policy's
    samples (its tokens trained, the others' context), its adapter is pushed under that
    name, and its version is counted apart (docs/weight-updates.md, "Several policies").
    """

    def __init__(self, gateway: str, agent: Agent, *, weights_dir: str | Path,
                 admin_token: str | None = None, run_id: str | None = None,
                 multi_branch: MultiBranch = "main", mode: str = "abort-and-continue",
                 concurrency: int = 64, fetch_timeout_s: float = 600.0,
                 push_timeout_s: float = 600.0, keep_checkpoints: int = 2,
                 check_logprobs: bool = False, policy: str | None = None,
                 **client_options: Any) -> None:
        self._client_args: dict[str, Any] = {"admin_token": admin_token, **client_options}
        self.client = RolloutClient(gateway, **self._client_args)
        self.agent = agent
        self.weights_dir = Path(weights_dir)
        self.run_id = run_id or f"trl-{uuid.uuid4().hex[:6]}"
        self.multi_branch = multi_branch
        self.mode = mode
        self.concurrency = concurrency
        self.fetch_timeout_s = fetch_timeout_s
        self.push_timeout_s = push_timeout_s
        self.keep_checkpoints = keep_checkpoints
        self.check_logprobs = check_logprobs
        self.policy = policy
        status = self.client.status()
        if policy is not None and policy not in status.get("models", {}):
            self.client.close()
            raise ValueError(f"the gateway serves no model {policy!r} (models: "
                                     f"{sorted(status.get('models', {}))}); declare the "
                                     "family (ROLLOUT_GATEWAY_LORA_MODELS)")
        self.version = str(status["models"][policy]["version"] if policy is not None
                           else status["weight_version"])
        self.steps: list[StepRecord] = []
        self.pushes: list[Push] = []
        self._handed_at: float | None = None
        self._prefixes: set[str] = set()

    def close(self) -> None:
        """Close the blocking client (the async ones live for one step each)."""
        self.client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- rollouts ----------------------------------------------------------------------

    def rollout_func(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        """TRL's ``rollout_func``: run, finish and fetch one generation batch."""
        size = int(trainer.num_generations if trainer.model.training
                   else trainer.num_generations_eval)
        if len(prompts) % size:
            raise ValueError(f"{len(prompts)} prompts are not groups of {size}")
        step = int(trainer.state.global_step)
        prefix = self._batch_prefix(trainer, step)
        groups = [f"{prefix}-p{i}" for i in range(len(prompts) // size)]
        t0 = time.monotonic()
        _run(self._run_agents(prompts, groups, size, step))
        t1 = time.monotonic()
        batches = _run(self._fetch(groups, size))
        t2 = time.monotonic()
        chosen, dropped = self._choose(groups, size, batches)
        record = self._record(step, groups, chosen)
        record.dropped_tokens, record.rollout_s, record.fetch_s = dropped, t1 - t0, t2 - t1
        if self.check_logprobs:
            logps = trainer_logprobs(trainer.model, chosen)
            record.logprobs = compare_logprobs(chosen, logps)
            record.mismatch = self._mismatch(chosen, logps, step)
        self.steps.append(record)
        rows: dict[str, list[Any]] = {k: [] for k in (
            "prompt_ids", "completion_ids", "logprobs", "env_mask")}
        for s in chosen:
            for key, value in to_trl_row(s).items():
                rows[key].append(value)
        self._handed_at = time.monotonic()
        return {**rows, "gateway_reward": [s.reward for s in chosen],
                "trajectory_id": [s.trajectory_id for s in chosen]}

    def _mismatch(self, chosen: list[Sample], logps: list[list[float]],
                  step: int) -> MismatchReport:
        """The batch's training-inference mismatch, posted to the gateway (its status
        page and Prometheus show it) and logged loudly if it passes a limit."""
        report = measure_mismatch(chosen, logps, mode="sync", step=step, run_id=self.run_id)
        try:
            report = self.client.report_mismatch(report)
        except GatewayClientError as exc:
            log.warning("step %d: mismatch report not posted to the gateway: %s", step, exc)
        if report.alarms:
            log.warning("step %d: training-inference mismatch alarm: %s", step,
                        "; ".join(report.alarms))
        return report

    def _batch_prefix(self, trainer: Any, step: int) -> str:
        """``{run}-s{step}`` (``-eval{step}`` for evaluation, ``-r{rank}`` with several
        processes), made unique if the same step asks for a second batch: trajectory ids
        must not repeat (a finished id called again starts its next attempt)."""
        prefix = f"{self.run_id}-{'s' if trainer.model.training else 'eval'}{step}"
        accelerator = getattr(trainer, "accelerator", None)
        if accelerator is not None and getattr(accelerator, "num_processes", 1) > 1:
            prefix += f"-r{accelerator.process_index}"
        if prefix in self._prefixes:
            prefix += f"-{len(self._prefixes)}"
        self._prefixes.add(prefix)
        return prefix

    def _client(self) -> AsyncRolloutClient:
        return AsyncRolloutClient(self.client.base_url, **self._client_args)

    async def _run_agents(self, prompts: Sequence[Any], groups: list[str], size: int,
                          step: int) -> None:
        gate = asyncio.Semaphore(self.concurrency)
        async with self._client() as gw:
            async def one(row: int) -> None:
                group, k = groups[row // size], row % size
                tid = f"{group}-{k}"
                async with gate:
                    key = await gw.mint_key(tid, group)
                    got = await self.agent(Rollout(prompts[row], gw.base_url_for(tid, group),
                                                   tid, group, k, step, key))
                if isinstance(got, Mapping):  # each policy's own
                    if self.policy is None:
                        raise TypeError("an agent returning one reward per policy needs "
                                        "GatewayGRPO(policy=...): the policy trained here")
                    await gw.finish(tid, got.get(self.policy), group_id=group, rewards=got)
                else:
                    await gw.finish(tid, got, group_id=group)

            await asyncio.gather(*(one(r) for r in range(len(prompts))))

    async def _fetch(self, groups: list[str], size: int) -> list[SampleBatch]:
        async with self._client() as gw:
            return list(await asyncio.gather(*(
                gw.fetch_group(g, size, timeout_s=self.fetch_timeout_s, model=self.policy)
                for g in groups)))

    def _choose(self, groups: list[str], size: int, batches: list[SampleBatch]
                ) -> tuple[list[Sample], int]:
        """One sample per generation, in TRL's row order; and the generated tokens of
        the branches left out."""
        chosen: list[Sample] = []
        dropped = 0
        for group, batch in zip(groups, batches, strict=True):
            by_id = batch.by_trajectory()
            for k in range(size):
                tid = f"{group}-{k}"
                found = by_id.get(tid) or []
                if len(found) > 1 and self.multi_branch == "error":
                    raise ValueError(
                        f"trajectory {tid!r} has {len(found)} branches (side calls or a "
                        "changed history, docs/token-capture.md): TRL trains one sequence "
                        "per generation; pass multi_branch='main' (the default: its task "
                        "conversation, trained whole) or 'longest'")
                if not found:
                    raise ValueError(f"group {group!r} came back without {tid!r}")
                pick = (next(s for s in found if s.main) if self.multi_branch == "main"
                        else max(found, key=lambda s: (sum(s.loss_mask), s.main)))
                chosen.append(pick)
                dropped += sum(sum(s.loss_mask) for s in found if s is not pick)
        if dropped:
            log.warning("%d generated tokens of side branches (title calls, subagents, "
                        "dropped replies) are not in TRL's rows: one sequence per "
                        "generation; each trajectory's task conversation is trained whole",
                        dropped)
        return chosen, dropped

    def _record(self, step: int, groups: list[str], chosen: list[Sample]) -> StepRecord:
        versions: Counter[str] = Counter()
        for s in chosen:
            versions.update(v for v, m in zip(s.weight_versions, s.loss_mask, strict=True)
                            if m)
        stale = [s.max_staleness for s in chosen if s.max_staleness is not None]
        return StepRecord(
            step=step, version=self.version, groups=groups,
            rewards=[s.reward for s in chosen], completion_tokens=sum(versions.values()),
            versions=dict(versions),
            off_version_tokens=sum(n for v, n in versions.items() if v != self.version),
            calls_across_update=sum(1 for s in chosen for c in s.calls if c.weight_segments),
            max_staleness=max(stale) if stale else None)

    # -- rewards -----------------------------------------------------------------------

    def reward_func(self, prompts: list[Any], completions: list[Any],
                    gateway_reward: list[float | None], **kwargs: Any) -> list[float | None]:
        """The rewards the agents reported (stored in the gateway), row for row; also logs
        the step's gateway numbers into TRL's metrics when TRL offers ``log_metric``."""
        log_metric = kwargs.get("log_metric")
        if callable(log_metric) and self.steps:
            last = self.steps[-1]
            log_metric("gateway/max_staleness", float(last.max_staleness or 0))
            log_metric("gateway/off_version_tokens", float(last.off_version_tokens))
            log_metric("gateway/rollout_s", last.rollout_s)
            log_metric("gateway/fetch_s", last.fetch_s)
        return list(gateway_reward)

    # -- weight pushes -----------------------------------------------------------------

    def push(self, model: Any) -> Push:
        """Save ``model`` and have every engine reload it as the next integer version
        (``1`` when the gateway's version is not an integer). A peft model (TRL's
        ``peft_config``) saves its LoRA adapter alone, and the engines load it beside the
        ones they serve, no engine paused (``RolloutClient.update_adapter``; the engines
        run with ``--enable-lora``): no checkpoint of the whole model per step."""
        if self.policy is not None and not is_lora(model):
            raise ValueError(f"policy {self.policy!r} is a LoRA family: train a "
                                     "peft LoRA model (TRL's peft_config)")
        version = str(int(self.version) + 1) if self.version.isdigit() else "1"
        path = (self.weights_dir / f"v{version}").resolve()
        t0 = time.monotonic()
        model.save_pretrained(path)
        t1 = time.monotonic()
        if is_lora(model):  # an engine may read an adapter again: keep_checkpoints >= keep
            job = self.client.update_adapter(version, str(path),
                                             keep=min(self.keep_checkpoints, 64),
                                             timeout_s=self.push_timeout_s,
                                             model=self.policy)
        else:
            job = self.client.update_weights(version, weights_path=str(path),
                                             mode=self.mode, timeout_s=self.push_timeout_s)
        push = Push(version, str(path), t1 - t0, time.monotonic() - t1,
                    _phase_seconds(job.raw))
        self.version = version
        self.pushes.append(push)
        for old in self.pushes[:-self.keep_checkpoints]:  # the engines load the newest
            shutil.rmtree(old.path, ignore_errors=True)
        return push

    def after_step(self, model: Any) -> None:
        """The optimizer step is done: time it, push the new weights."""
        record = self.steps[-1] if self.steps else None
        if record is not None and self._handed_at is not None:
            record.train_s = time.monotonic() - self._handed_at
        push = self.push(model)
        if record is not None:
            record.push = push

    def callback(self, *, push_at_start: bool = True) -> TrainerCallback:
        """A ``TrainerCallback`` that pushes the weights before the first step (unless
        ``push_at_start`` is false: the engines already serve them) and after each."""
        return _PushCallback(self, push_at_start)


class _PushCallback(TrainerCallback):  # type: ignore[misc]
    def __init__(self, owner: GatewayGRPO, push_at_start: bool) -> None:
        self.owner = owner
        self.push_at_start = push_at_start

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.push_at_start and state.is_world_process_zero:
            self.owner.push(kwargs["model"])

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            self.owner.after_step(kwargs["model"])
