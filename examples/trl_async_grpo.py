"""TRL's ``AsyncGRPOTrainer`` trains the lookup task through the gateway.

TRL's asynchronous GRPO trainer (``trl.experimental.async_grpo``) takes its rollouts from a
worker and sends its weights through a transfer object; ``gateway.client.trl_async``
provides both. Rollouts keep running while TRL trains (the client's ``StepRunner`` in
async mode, the staleness bound enforced by the gateway: a trajectory that started more
than ``--max-staleness`` versions behind is aborted and run again); after every optimizer
step TRL streams the weights, they are saved, and every engine reloads them through the
gateway's weight-update job as TRL's next ``model_version``. TRL's loss takes each
token's ratio against the logprob the engine recorded when it sampled it, and TRL drops a
sample more than ``max_staleness`` versions old on its side too (counted here: it should
be 0, since the gateway enforces the same bound). The agent is
``examples/lookup_task.py``'s, unchanged.

    python examples/lookup_task.py warm-start --base models/tiny --out models/lookup
    ROLLOUT_GATEWAY_ADMIN_TOKEN=tok python examples/trl_async_grpo.py \\
        --model-path models/lookup

On a machine without CUDA (or without the Hub, where TRL fetches its FlashAttention-3
kernel) the trainer's tree attention runs in PyTorch (``run_on_cpu``). One
line per step; the last line is a JSON summary in ``bench learn``'s shape.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import async_grpo  # examples/async_grpo.py, beside this script: options and report
import lookup_task
import torch
from datasets import Dataset
from openai import OpenAI
from transformers import TrainerCallback

from gateway.client import RolloutClient
from gateway.client.trl_async import (
    GatewayRolloutWorker,
    GatewayWeightTransfer,
    run_on_cpu,
)

#: what TRL logs per step that the summary keeps: its loss, the mean importance ratio of
#: the trained tokens against the recorded logprobs, the KL estimate, the clipped share
TRL_FIGURES = ("loss", "ratio", "kl", "entropy", "clip_ratio/region_mean",
               "sample/staleness_max")


class StepTimes(TrainerCallback):
    """Where each optimizer step's time went: waiting for the batch, training, pushing,
    and what TRL logged for it (its importance ratio and KL against the engine's
    logprobs). Added after the trainer's own callbacks, so ``on_step_end`` comes after
    the push."""

    def __init__(self, worker: GatewayRolloutWorker, push: GatewayWeightTransfer,
                 trainer: Any) -> None:
        self.worker, self.push, self.trainer = worker, push, trainer
        self.steps: list[dict[str, Any]] = []
        self._end = self._begin = time.monotonic()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._begin = time.monotonic()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kw: Any) -> None:
        if self.steps and logs and "ratio" in logs:  # the step's log, after on_step_end
            self.steps[-1]["trl"] = {k: float(logs[k]) for k in TRL_FIGURES if k in logs}

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        now = time.monotonic()
        step = len(self.steps)
        batch = self.worker.batches[step] if step < len(self.worker.batches) else {}
        pushed = self.push.pushes[-1]
        metrics = self.trainer._metrics["train"]
        row = {"step": step, "version": batch.get("version"),
               "rewards": batch.get("rewards", []), "success": batch.get("success"),
               "lag_tokens": batch.get("lag_tokens", {}),
               "max_staleness": max((int(k) for k in batch.get("lag_tokens", {})),
                                    default=0),
               "restarts": batch.get("restarts"),
               "dropped_by_trl": int(sum(metrics.get("sample/dropped_stale_total", []))),
               "wait_s": round(self._begin - self._end, 3),
               "train_s": round(now - self._begin - pushed["save_s"] - pushed["push_s"], 3),
               "push_s": round(pushed["save_s"] + pushed["push_s"], 3)}
        self.steps.append(row)
        self._end = now
        print(f"step {step}: v{row['version']}, success {row['success']:.3f}, trained "
              f"tokens by lag {row['lag_tokens']}, restarts {row['restarts']}, dropped by "
              f"TRL {row['dropped_by_trl']}; wait {row['wait_s']:.2f} s, train "
              f"{row['train_s']:.2f} s, push {row['push_s']:.2f} s -> v{pushed['version']}",
              file=sys.stderr, flush=True)


def train(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    token = os.environ.get("ROLLOUT_GATEWAY_ADMIN_TOKEN")
    with RolloutClient(args.gateway, admin_token=token) as client:
        client.wait_ready(timeout_s=600)
    served = args.model or OpenAI(base_url=f"{args.gateway}/v1", api_key=token or "EMPTY",
                                  max_retries=0).models.list().data[0].id
    run = f"trl-async-{uuid.uuid4().hex[:6]}"
    worker = GatewayRolloutWorker(args.gateway, lookup_task.make_agent(served),
                                  [lookup_task.PROMPT], groups=args.groups,
                                  group_size=args.group_size,
                                  max_staleness=args.max_staleness, admin_token=token,
                                  run_id=run)
    push = GatewayWeightTransfer(args.gateway, config_dir=args.model_path,
                                 weights_dir=work / "weights", admin_token=token)
    config = AsyncGRPOConfig(
        output_dir=str(work / "trl"), max_steps=args.steps, learning_rate=args.lr,
        lr_scheduler_type="constant", per_device_train_batch_size=args.groups
        * args.group_size, gradient_accumulation_steps=1, token_budget=0,
        max_staleness=args.max_staleness, weight_sync_steps=1, epsilon=args.clip,
        temperature=1.0, dtype="float32", use_cpu=not torch.cuda.is_available(),
        bf16=False, report_to="none", save_strategy="no", logging_steps=1,
        seed=args.seed, vllm_server_base_url=args.gateway, heartbeat_stale_after_s=900,
        num_generations=args.group_size)
    prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content":
                                              lookup_task.PROMPT}]]})
    if not torch.cuda.is_available():
        run_on_cpu()
    trainer = AsyncGRPOTrainer(args.model_path, args=config, train_dataset=prompts,
                               rollout_worker=worker, weight_transfer=push)
    times = StepTimes(worker, push, trainer)
    trainer.add_callback(times)
    started = time.monotonic()
    try:
        trainer.train()
    finally:
        worker.stop()
    return {"run": run, "mode": "trl-async", "max_staleness": args.max_staleness,
            "steps": times.steps, "pushes": push.pushes,
            "final_version": str(push.version),
            "total_s": round(time.monotonic() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    args = async_grpo.parser(__doc__.split("\n", 1)[0], "trl-async-run").parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    async_grpo.report(train(args, work), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
