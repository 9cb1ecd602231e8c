"""TRL's ``AsyncGRPOTrainer`` (``trl.experimental.async_grpo``) trained on gateway rollouts.

The trainer takes two plug-ins, and the gateway provides both::

    worker = GatewayRolloutWorker("http://gw:8000", my_agent, prompts, groups=4,
                                  group_size=8, max_staleness=1, admin_token=TOKEN)
    push = GatewayWeightTransfer("http://gw:8000", config_dir="models/policy",
                                 weights_dir="ckpt", admin_token=TOKEN)
    trainer = AsyncGRPOTrainer("models/policy", args=AsyncGRPOConfig(
                  max_staleness=1, per_device_train_batch_size=4 * 8, token_budget=0, ...),
                  train_dataset=prompts_dataset, rollout_worker=worker,
                  weight_transfer=push)
    trainer.train()

* :class:`GatewayRolloutWorker` runs ``my_agent`` (the same agent as the synchronous
  adapter's, :data:`gateway.client.trl.Agent`: a harness pointed at its trajectory's base
  URL and key, returning the reward) under the client's :class:`~gateway.client.StepRunner`
  in ``async`` mode on a thread of its own: groups keep starting while the trainer trains,
  the gateway enforces the staleness bound (``PUT /admin/staleness``: a trajectory that
  started more than ``max_staleness`` versions behind is aborted and run again), and
  each complete batch of groups goes on TRL's queue as ``RolloutSample``s: the sample's
  token ids, its loss mask (1 on every token a model call generated, 0 on prompts and
  tool output), the engine's logprob of each token, the group-relative advantage of the
  agent's reward and the weight version of its oldest generated token. TRL's data
  loader takes one batch ahead of the one it trains (accelerate's dispatcher fetches the
  next batch before it hands over the current one), so the runner takes batch ``k + 1``
  once the trainer has synced version ``k`` and no sooner: its admission rule ("at most
  ``(batches taken + s + 1) * groups`` groups started") then counts the trainer's steps,
  not the queue's. Both the gateway's bound and TRL's own check (which drops a sample
  more than ``max_staleness`` versions behind when it leaves the queue) judge a batch
  when it is taken; it is trained one sync later, so its tokens are up to
  ``max_staleness + 1`` versions old at the optimizer step, as with TRL's own worker.
* :class:`GatewayWeightTransfer` is how weights reach the engines: TRL streams the
  parameters, they are saved as a checkpoint beside the policy's config and tokenizer,
  and every engine reloads it through the gateway's weight-update job, which pauses and
  resumes the engines itself (``mode``; ``pause``/``resume`` here are no-ops). The
  version pushed is TRL's ``model_version`` after the sync (1 for the cold sync before
  the first step), so the versions the gateway stamps on tokens are the trainer's.

TRL's trainer packs samples as a prefix tree and scores them with a FlashAttention-3
kernel fetched from the Hugging Face Hub (CUDA only). :func:`run_on_cpu` puts an exact
PyTorch version of that attention in its place (:func:`cpu_tree_attention`, in
:mod:`.trl_tree`;
``tests/client/test_trl_async.py`` checks it against per-sample passes) and skips TRL's
CUDA-only MFU lookup, so the trainer runs on a CPU machine.
Needs ``trl`` (extra ``trl``).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import shutil
import statistics
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gateway.client.advantages import group_advantages
from gateway.client.aio import AsyncRolloutClient
from gateway.client.errors import GatewayConnectionError
from gateway.client.steps import StepBatch, StepMode, StepRunner
from gateway.client.sync import RolloutClient
from gateway.client.trl import Agent, Rollout
from gateway.client.trl_tree import cpu_tree_attention, run_on_cpu, use_cpu_tree_attention
from gateway.schema.samples import Sample

__all__ = ["GatewayRolloutWorker", "GatewayWeightTransfer", "cpu_tree_attention",
           "run_on_cpu", "to_rollout_sample", "use_cpu_tree_attention"]

log = logging.getLogger(__name__)
#: times a batch whose samples could not be fetched is fetched again (1, 2, 4, 8 s apart)
FETCH_RETRIES = 4
#: what is copied beside the pushed weights, so an engine can load the directory
CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                "vocab.json", "merges.txt")


def sample_version(sample: Sample) -> int:
    """The integer weight version of the sample's oldest generated token: what TRL
    judges its staleness by. A version that is not an integer raises."""
    versions = {v for m, v in zip(sample.loss_mask, sample.weight_versions, strict=False)
                if m and v}
    if not versions:
        raise ValueError(f"trajectory {sample.trajectory_id!r} has no generated token "
                         "with a weight version")
    try:
        return min(int(v) for v in versions)
    except ValueError:
        raise ValueError(f"weight versions {sorted(versions)} of {sample.trajectory_id!r} "
                         "are not integers: push TRL's versions (GatewayWeightTransfer) "
                         "before the first rollout") from None


def to_rollout_sample(sample: Sample, advantage: float, group: int) -> Any:
    """One gateway sample as TRL's ``RolloutSample``: the whole sequence, the loss mask
    as ``completion_mask`` and the engine's logprobs, each aligned with the token ids."""
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    n = len(sample.token_ids)
    if not (len(sample.loss_mask) == len(sample.logprobs) == n):
        raise ValueError(f"sample {sample.trajectory_id!r}: {n} tokens, "
                         f"{len(sample.loss_mask)} mask entries, {len(sample.logprobs)} "
                         "logprobs")
    if not any(sample.loss_mask):
        raise ValueError(f"trajectory {sample.trajectory_id!r} has no generated token")
    return RolloutSample(
        prompt=[], completion=[],  # read by TRL's trace logging only; the ids are here
        input_ids=np.asarray(sample.token_ids, dtype=np.int64),
        completion_mask=np.asarray(sample.loss_mask, dtype=np.int64),
        old_log_probs=np.asarray(sample.logprobs, dtype=np.float32),
        advantage=float(advantage), model_version=sample_version(sample), group_id=group,
        metrics={"reward": float(sample.reward or 0.0)}, enqueued_at=time.time())


class GatewayRolloutWorker:
    """TRL's rollout worker protocol over the gateway (see the module).

    ``agent`` runs one trajectory (a :class:`~gateway.client.trl.Rollout`: its base URL,
    its own harness key, its group) and returns the reward. ``prompts`` is cycled, one
    per group. ``batches`` keeps a summary of each batch handed over (version, rewards,
    staleness, restarts) for the caller's report.
    """

    def __init__(self, gateway: str, agent: Agent, prompts: Iterable[Any], *,
                 groups: int, group_size: int, max_staleness: int = 1,
                 admin_token: str | None = None, run_id: str | None = None,
                 batch_timeout_s: float = 3600.0) -> None:
        self.rollout_buffer: queue.Queue[Any] = queue.Queue()
        self.metrics_queue: queue.Queue[dict[str, Any]] = queue.Queue()
        self.gateway, self.agent, self.admin_token = gateway, agent, admin_token
        self.prompts = list(prompts)
        if not self.prompts:
            raise ValueError("no prompts")
        self.groups, self.group_size = groups, group_size
        self.mode = StepMode("async", max_staleness=max_staleness)
        self.run_id = run_id or f"trl-async-{uuid.uuid4().hex[:6]}"
        self.batch_timeout_s = batch_timeout_s
        self.batches: list[dict[str, Any]] = []
        self._version = 0  # TRL's model_version: the weights the engines serve
        self._cond = threading.Condition()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._progress = time.monotonic()
        self._waiting_on_trainer = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None

    # -- RolloutWorkerProtocol -----------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the rollout worker was started already")
        self._progress = time.monotonic()
        self._thread = threading.Thread(target=self._main, name="gateway-rollouts",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Abort what runs (the runner aborts its trajectories at the gateway) and wait."""
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        loop, task = self._loop, self._task
        if loop is not None and task is not None and not loop.is_closed():
            loop.call_soon_threadsafe(task.cancel)
        if self._thread is not None:
            self._thread.join(timeout=120)
            if self._thread.is_alive():
                log.error("the gateway rollout worker did not stop within 120 s")

    def update_model_version(self, model_version: int) -> None:
        with self._cond:
            self._version = model_version
            self._cond.notify_all()

    def check_health(self, stale_after_s: float) -> None:
        if self._error is not None:
            raise RuntimeError(f"the gateway rollout worker failed: {self._error!r}") \
                from self._error
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("the gateway rollout worker is not running")
        if self._waiting_on_trainer:
            return  # the trainer has not synced the version the next batch waits for
        idle = time.monotonic() - self._progress
        if idle > stale_after_s:
            raise TimeoutError(f"the gateway rollout worker gave no batch in {idle:.0f} s "
                               f"(limit {stale_after_s:.0f} s): see the gateway's "
                               "/status page for stuck trajectories")

    # -- the thread ----------------------------------------------------------------------

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except asyncio.CancelledError:
            pass
        except BaseException as e:
            if not self._stopping.is_set():
                self._error = e
                log.exception("the gateway rollout worker stopped")

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        if self._stopping.is_set():
            return
        async with AsyncRolloutClient(self.gateway, admin_token=self.admin_token) as gw:
            members: dict[str, list[str]] = {}
            taken = 0

            async def launch(tid: str, gid: str, prompt: Any) -> float | None:
                seen = members.setdefault(gid, [])
                if tid not in seen:
                    seen.append(tid)
                got = await self.agent(Rollout(
                    prompt=prompt, base_url=gw.base_url_for(tid, gid), trajectory_id=tid,
                    group_id=gid, index=seen.index(tid), step=taken,
                    api_key=await gw.mint_key(tid, gid)))
                if isinstance(got, Mapping):
                    raise TypeError("the async rollout worker trains one policy: its agent "
                                    "returns one reward, not one per policy")
                return got

            async with StepRunner(gw, launch, _cycle(self.prompts), batch=self.groups,
                                  group_size=self.group_size, mode=self.mode,
                                  run_id=self.run_id) as runner:
                while not self._stopping.is_set():
                    await asyncio.to_thread(self._wait_for_version, taken)
                    if self._stopping.is_set():
                        break
                    batch = await self._next_batch(runner)
                    taken += 1
                    for gid in batch.groups:
                        members.pop(gid, None)
                    self._hand_over(batch, taken)
            await gw.set_max_staleness(None)

    async def _next_batch(self, runner: StepRunner) -> StepBatch:
        """The runner's next batch; a gateway that cannot be reached for a moment is
        retried (the runner keeps the groups ready), ``FETCH_RETRIES`` times."""
        for attempt in range(FETCH_RETRIES + 1):
            try:
                return await runner.next_batch(timeout_s=self.batch_timeout_s)
            except GatewayConnectionError as e:
                if attempt == FETCH_RETRIES:
                    raise
                log.warning("fetching a batch failed (%s); retrying in %d s", e, 2 ** attempt)
                await asyncio.sleep(2 ** attempt)
        raise AssertionError("unreachable")

    def _wait_for_version(self, version: int) -> None:
        """Block until the trainer has synced ``version`` (see the module: batch ``k + 1``
        is taken once version ``k`` is on the engines)."""
        with self._cond:
            self._waiting_on_trainer = True
            try:
                while self._version < version and not self._stopping.is_set():
                    self._cond.wait(timeout=1.0)
            finally:
                # the time spent waiting was the trainer's: the batch clock starts now
                self._progress = time.monotonic()
                self._waiting_on_trainer = False

    def _hand_over(self, batch: StepBatch, index: int) -> None:
        samples = list(batch.samples.samples)
        groups = {gid: i for i, gid in enumerate(batch.groups)}
        base = index * (len(groups) + 1)
        skipped = []  # no generated token (every call of it failed): nothing to train
        for s, adv in zip(samples, group_advantages(samples), strict=True):
            if not any(s.loss_mask):
                skipped.append(s.trajectory_id)
                continue
            self.rollout_buffer.put(to_rollout_sample(
                s, adv, base + groups.get(s.group_id or "", 0)))
        if skipped:
            log.warning("gateway batch %d: %d samples without a generated token left out "
                        "(their rewards still count in their groups' baselines): %s",
                        index, len(skipped), ", ".join(skipped))
        rewards = [s.reward or 0.0 for s in samples]
        summary = {"batch": index, "version": batch.version, "samples": len(samples),
                   "trajectories": [s.trajectory_id for s in samples], "rewards": rewards,
                   "success": statistics.fmean(rewards) if rewards else 0.0,
                   "lag_tokens": {str(k): v for k, v in sorted(batch.lag_tokens.items())},
                   "restarts": batch.restarts, "aborted": batch.aborted,
                   "skipped": skipped}
        self.batches.append(summary)
        self.metrics_queue.put({"gateway/success": summary["success"],
                                "gateway/max_staleness": float(batch.max_staleness),
                                "gateway/restarts": float(batch.restarts)})
        self._progress = time.monotonic()
        log.info("gateway batch %d on v%s: %d samples, success %.3f, lag %s", index,
                 batch.version, len(samples), summary["success"], summary["lag_tokens"])


def _cycle(items: list[Any]) -> Iterator[Any]:
    while True:
        yield from items


class GatewayWeightTransfer:
    """TRL's weight-transfer protocol over the gateway (see the module): the streamed
    parameters are saved under ``weights_dir/v{N}`` with ``config_dir``'s config and
    tokenizer files, and every engine reloads them as version ``N``. ``pushes`` keeps
    each push's seconds (save, and the job from pause to resume)."""

    def __init__(self, gateway: str, *, config_dir: str | Path, weights_dir: str | Path,
                 admin_token: str | None = None, mode: str = "abort-and-continue",
                 timeout_s: float = 600.0, keep_checkpoints: int = 2) -> None:
        self.config_dir, self.weights_dir = Path(config_dir), Path(weights_dir)
        if not (self.config_dir / "config.json").is_file():
            raise FileNotFoundError(f"{self.config_dir / 'config.json'} not found: "
                                    "config_dir is the policy's HF directory")
        self.client = RolloutClient(gateway, admin_token=admin_token)
        self.mode, self.timeout_s, self.keep = mode, timeout_s, keep_checkpoints
        self.version = 0
        self.pushes: list[dict[str, float]] = []

    def init_weight_transfer(self) -> None:
        self.client.wait_ready()
        self.weights_dir.mkdir(parents=True, exist_ok=True)

    def pause(self) -> None:
        """Nothing: the weight-update job pauses the engines itself."""

    def resume(self) -> None:
        """Nothing: the weight-update job resumes the engines itself."""

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        from safetensors.torch import save_file

        t0 = time.monotonic()
        version = self.version + 1
        path = (self.weights_dir / f"v{version}").resolve()
        path.mkdir(parents=True, exist_ok=True)
        tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in iterator}
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        for name in CONFIG_FILES:
            if (self.config_dir / name).is_file():
                shutil.copy2(self.config_dir / name, path / name)
        t1 = time.monotonic()
        job = self.client.update_weights(str(version), weights_path=str(path),
                                         mode=self.mode, timeout_s=self.timeout_s)
        t2 = time.monotonic()
        self.version = version
        self.pushes.append({"version": version, "save_s": round(t1 - t0, 3),
                            "push_s": round(t2 - t1, 3)})
        log.info("weights v%d on every engine (job %s): save %.2f s, push %.2f s", version,
                 job.id, t1 - t0, t2 - t1)
        for old in sorted(self.weights_dir.glob("v*"), key=_version_of)[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def destroy(self) -> None:
        self.client.close()


def _version_of(path: Path) -> int:
    return int(path.name[1:]) if path.name[1:].isdigit() else -1
