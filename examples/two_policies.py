"""Two policies trained at once through one gateway: a solver and a checker, two LoRA
adapters of one base model, both acting in every trajectory.

Each trajectory is the lookup task of ``examples/lookup_task.py`` played by two roles
in turn, each in a conversation of its own on one trajectory id: the solver answers
(its calls ask for the model ``solver``), then the checker is asked the same (calls for
``checker``), and each is rewarded for its own answer. The trajectory is finished with
each policy's reward in ``rewards``, so a ``?model=`` sample carries its policy's own, and
holds that policy's tokens under loss mask 1 (the other's are not in it, or context).
Both adapters start from nothing on the warm start the engines serve (which looks the
code up only now and then); after every step each is trained on its own samples with
GRPO's group advantages over its own rewards and pushed as its family's adapter: no
engine paused, no full checkpoint, each family's version counted apart. Both must learn
to look before answering.

The gateway declares the two families on the served model and its engines load LoRA
adapters at run time (a pool spec's ``launcher.lora``)::

    ROLLOUT_GATEWAY_LORA_MODELS="solver=tiny,checker=tiny" ROLLOUT_GATEWAY_ADMIN_TOKEN=tok \\
        rollout-gateway serve --pool pool.yaml      # engines on models/lookup, lora on
    ROLLOUT_GATEWAY_ADMIN_TOKEN=tok python examples/two_policies.py --model-path models/lookup

Prints one line per step (each policy's success, its trained tokens and version); the
last line is a JSON summary. Needs torch, transformers and peft (the ``trl`` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lookup_task  # examples/lookup_task.py, beside this script
import torch
from async_grpo import advantages, grpo_loss, report
from transformers import AutoModelForCausalLM

from gateway.client import AsyncRolloutClient
from gateway.schema.samples import Sample

POLICIES = ("solver", "checker")


def adapters(model_path: str, rank: int, seed: int) -> Any:
    """The base model with one LoRA adapter per policy (peft, every linear layer)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                        target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(base, config, adapter_name=POLICIES[0])
    for name in POLICIES[1:]:
        model.add_adapter(name, config)
    return model


def optimizers(model: Any, lr: float) -> dict[str, torch.optim.Optimizer]:
    """One optimizer per adapter, over that adapter's weights only."""
    out = {}
    for name in POLICIES:
        params = [p for n, p in model.named_parameters() if f".{name}." in n]
        if not params:
            raise RuntimeError(f"no weights of adapter {name!r}")
        out[name] = torch.optim.AdamW(params, lr=lr)
    return out


async def push(gw: AsyncRolloutClient, model: Any, policy: str, work: Path,
               version: str, base: str) -> str:
    """Save ``policy``'s adapter and load it on every engine as that family's next
    version (nothing paused; the previous one kept for calls still on it)."""
    nxt = str(int(version) + 1) if version.isdigit() else "1"
    path = work / "adapters" / f"{policy}-v{nxt}"
    model.save_pretrained(path, selected_adapters=[policy])
    job = await gw.update_adapter(nxt, str(path / policy), base_model=base, model=policy,
                                  keep=2)
    if not job.succeeded:
        raise RuntimeError(f"adapter update of {policy} to v{nxt} {job.status}: {job.errors}")
    return nxt


async def episode(gw: AsyncRolloutClient, tid: str, gid: str) -> dict[str, float]:
    """One trajectory: the solver's turn, then the checker's; each role's reward."""
    key = await gw.mint_key(tid, gid)
    out = {}
    for policy in POLICIES:
        agent = lookup_task.make_agent(policy)
        out[policy] = await agent(SimpleNamespace(
            trajectory_id=tid, base_url=gw.base_url_for(tid, gid), api_key=key))
    await gw.finish(tid, out[POLICIES[0]], group_id=gid, rewards=out)
    return out


def train_policy(model: Any, opt: torch.optim.Optimizer, policy: str,
                 samples: list[Sample], clip: float) -> int:
    """One GRPO step of ``policy``'s adapter on its samples; the tokens it trained."""
    model.set_adapter(policy)
    loss = grpo_loss(model, samples, advantages(samples), clip)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return sum(sum(s.loss_mask) for s in samples)


async def train(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    model = adapters(args.model_path, args.rank, args.seed)
    opts = optimizers(model, args.lr)
    token = os.environ.get("ROLLOUT_GATEWAY_ADMIN_TOKEN")
    run = f"two-{uuid.uuid4().hex[:6]}"
    steps: list[dict[str, Any]] = []
    started = time.monotonic()
    async with AsyncRolloutClient(args.gateway, admin_token=token) as gw:
        await gw.wait_ready(timeout_s=600)
        status = await gw.status()
        missing = [p for p in POLICIES if p not in status.get("models", {})]
        if missing:
            raise SystemExit(f"the gateway declares no family {missing}: start it with "
                             f"ROLLOUT_GATEWAY_LORA_MODELS=\"solver=<model>,checker=<model>\"")
        base = status["models"][POLICIES[0]]["base"]
        versions = {p: str(status["models"][p]["version"]) for p in POLICIES}
        for p in POLICIES:  # the engines serve what is trained from the first step on
            versions[p] = await push(gw, model, p, work, versions[p], base)
        for step in range(args.steps):
            t0 = time.monotonic()
            groups = [f"{run}-s{step}-g{g}" for g in range(args.groups)]
            rewards = await asyncio.gather(*(
                episode(gw, f"{gid}-{k}", gid) for gid in groups
                for k in range(args.group_size)))
            t1 = time.monotonic()
            row: dict[str, Any] = {"step": step, "rollout_s": round(t1 - t0, 3)}
            for p in POLICIES:
                batches = await asyncio.gather(*(
                    gw.fetch_group(g, args.group_size, branches="main", model=p)
                    for g in groups))
                samples = [s for b in batches for s in b.samples]
                stamped = {v for s in samples for v, m in zip(
                    s.weight_versions, s.loss_mask, strict=True) if m}
                trained = train_policy(model, opts[p], p, samples, args.clip)
                served = versions[p]
                versions[p] = await push(gw, model, p, work, served, base)
                row[p] = {"success": statistics.fmean(r[p] for r in rewards),
                          "rewards": [r[p] for r in rewards], "samples": len(samples),
                          "trained_tokens": trained, "stamped": sorted(stamped),
                          "served_version": served, "pushed": versions[p]}
            row["step_s"] = round(time.monotonic() - t0, 3)
            steps.append(row)
            print(f"step {step}: " + "; ".join(
                f"{p} success {row[p]['success']:.3f} ({row[p]['trained_tokens']} tokens "
                f"trained, v{row[p]['served_version']} -> v{row[p]['pushed']})"
                for p in POLICIES) + f"; {row['step_s']:.1f} s", file=sys.stderr, flush=True)
    return {"run": run, "policies": list(POLICIES), "rank": args.rank, "steps": steps,
            "final_versions": versions, "total_s": round(time.monotonic() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--gateway", default="http://127.0.0.1:8000")
    ap.add_argument("--model-path", required=True, help="HF dir of the model the engines "
                    "serve (the warm start)")
    ap.add_argument("--work-dir", default="two-policies-run", help="adapters (every engine "
                    "must be able to read them)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--groups", type=int, default=4, help="groups per step")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank of both adapters")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the summary here")
    args = ap.parse_args(argv)
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    report(asyncio.run(train(args, work)), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
