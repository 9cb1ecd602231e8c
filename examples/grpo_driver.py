"""A GRPO-style rollout driver: groups of agent trajectories per prompt, rewards, batches.

Each step gathers ``--prompts`` GRPO groups of ``--group-size`` trajectories, each an
OpenAI tool-calling agent whose base URL comes from ``AsyncRolloutClient.base_url_for``,
under a step mode (``--mode``, docs/step-modes.md): ``sync`` waits for every group;
``overprovisioned`` starts more groups and takes the first to complete, carrying the rest
across the weight update; ``async`` keeps rollouts going while the trainer trains, within
``--max-staleness`` versions; ``tail-batching`` cuts each round's long tail and runs its
prompts in a long round of their own. When an agent ends, the driver scores it and
finishes it with its reward; the step's batch is pulled as token-exact training samples,
written as Parquet and read back with pyarrow to compute group-relative advantages.
Between steps it does what a trainer does around a weight sync: ``sync`` pauses the
gateway once idle and bumps the version; the other modes pause the engines in
``abort-and-continue`` mode, so running trajectories go on under the new version::

    rollout-gateway sim-backend --port 8100 --count 2 --speed 20 &
    rollout-gateway serve --backend http://127.0.0.1:8100 --backend http://127.0.0.1:8101 &
    python examples/grpo_driver.py --gateway http://127.0.0.1:8000 --out batches/ --mode async

The reward is a toy (answered within the turn limit, minus a cost per turn): replace
``score`` with your verifier. The last line printed is a JSON summary, with each step's
trained tokens by how many versions behind they were.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pyarrow.parquet as pq
from openai import AsyncOpenAI

from gateway.client import AsyncRolloutClient, StepMode, StepRunner
from gateway.client.steps import MODES

PROMPTS = [
    "What is 17 * 23? Check it with Python.",
    "Is 2024 a leap year? Check it with Python.",
    "Sum the squares of 1..10 with Python.",
    "Reverse the string 'rollout' with Python.",
]
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "run_python", "description": "Run a Python snippet; returns stdout and stderr.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                   "required": ["code"]}}}]


async def run_python(code: str, timeout_s: float = 5.0) -> str:
    with tempfile.TemporaryDirectory(prefix="sandbox-") as cwd:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-c", code, cwd=cwd, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return f"timed out after {timeout_s:g} s"
    return f"exit code {proc.returncode}\n{out.decode(errors='replace')[:2000]}"


async def agent(base_url: str, model: str, prompt: str, max_turns: int) -> dict[str, Any]:
    """One trajectory: an ordinary OpenAI tool loop; the base URL carries its identity."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    async with AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0) as llm:
        for turn in range(1, max_turns + 1):
            reply = await llm.chat.completions.create(model=model, messages=messages,
                                                      tools=TOOLS, max_tokens=512)
            msg = reply.choices[0].message
            calls = [c for c in msg.tool_calls or () if c.type == "function"]
            messages.append({"role": "assistant", "content": msg.content, **({"tool_calls": [
                {"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": c.function.arguments}}
                for c in calls]} if calls else {})})
            if not calls:
                return {"turns": turn, "answered": True}
            for c in calls:
                try:
                    code = str(json.loads(c.function.arguments).get("code", ""))
                except (json.JSONDecodeError, AttributeError):
                    code = ""
                out = await run_python(code) if code else "error: no code given"
                messages.append({"role": "tool", "tool_call_id": c.id, "content": out})
    return {"turns": max_turns, "answered": False}


def score(result: dict[str, Any]) -> float:
    """Toy reward: 1 for an answer within the turn limit, minus 0.1 per turn."""
    return (1.0 if result["answered"] else 0.0) - 0.1 * result["turns"]


def advantages(path: Path) -> dict[str, Any]:
    """Read the batch back with pyarrow; GRPO advantages = group-normalized rewards."""
    table = pq.read_table(path)
    rows = table.select(["trajectory_id", "group_id", "reward"]).to_pylist()
    by_group: dict[str, list[float]] = {}
    for r in rows:
        by_group.setdefault(r["group_id"], []).append(r["reward"])
    adv = {}
    for r in rows:
        rewards = by_group[r["group_id"]]
        std = statistics.pstdev(rewards) or 1.0
        adv[r["trajectory_id"]] = (r["reward"] - statistics.fmean(rewards)) / std
    versions = sorted({v for vs in table["weight_versions"].to_pylist() for v in vs if v})
    return {"rows": table.num_rows, "columns": table.column_names,
            "train_tokens": pc.sum(pc.list_flatten(table["loss_mask"])).as_py(),
            "mismatches": pc.sum(table["num_mismatches"]).as_py(),
            "mean_reward": statistics.fmean(r["reward"] for r in rows),
            "weight_versions": versions, "advantages": adv}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    token = os.environ.get("ROLLOUT_GATEWAY_ADMIN_TOKEN")
    steps: list[dict[str, Any]] = []
    mode = StepMode(args.mode, max_staleness=args.max_staleness, over=args.over)
    async with AsyncRolloutClient(args.gateway, admin_token=token, poll_interval_s=0.2) as gw:
        await gw.wait_ready()
        async with AsyncOpenAI(base_url=f"{gw.base_url}/v1", api_key="EMPTY") as probe:
            model = args.model or (await probe.models.list()).data[0].id

        async def launch(trajectory: str, group: str, prompt: str
                         ) -> tuple[float, dict[str, Any]]:
            result = await agent(gw.base_url_for(trajectory, group), model, prompt,
                                 args.max_turns)
            return score(result), result

        async with StepRunner(gw, launch, itertools.cycle(PROMPTS), batch=args.prompts,
                              group_size=args.group_size, mode=mode, run_id=args.run) as run:
            for step in range(args.steps):
                batch = await run.next_batch(timeout_s=args.timeout)
                path = await asyncio.to_thread(batch.samples.to_parquet,
                                               out / f"{args.run}-step{step}.parquet")
                stats = await asyncio.to_thread(advantages, path)
                steps.append({"step": step, "file": str(path), "groups": batch.groups,
                              "lag_tokens": {str(k): n for k, n in
                                             sorted(batch.lag_tokens.items())},
                              "restarts": batch.restarts, **stats})
                print(f"step {step}: {stats['rows']} trajectories, {stats['train_tokens']} "
                      f"trainable tokens, mean reward {stats['mean_reward']:.3f}, "
                      f"{stats['mismatches']} mismatches, tokens by version lag "
                      f"{dict(batch.lag_tokens)} -> {path}", file=sys.stderr)
                await weight_sync(gw, args.mode, str(step + 1))
    return {"run": args.run, "model": model, "mode": args.mode, "steps": steps}


async def weight_sync(gw: AsyncRolloutClient, mode: str, version: str) -> None:
    """Where the trainer would push new weights: ``sync`` waits until idle; the other
    modes pause the engines mid-generation and resume them under the new version."""
    if mode == "sync":
        async with gw.weight_sync(version) as paused:
            print(f"  weight sync: paused (idle={paused['idle']})", file=sys.stderr)
        return
    await gw.pause(mode="abort-and-continue")
    await gw.resume(weight_version=version)  # the trainer's push goes between the two


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--gateway", default="http://127.0.0.1:8000", help="the gateway's root URL")
    ap.add_argument("--model", default=None, help="default: the first model it lists")
    ap.add_argument("--run", default=f"grpo-{uuid.uuid4().hex[:6]}", help="id prefix")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait per step")
    ap.add_argument("--mode", default="sync", choices=MODES, help="docs/step-modes.md")
    ap.add_argument("--max-staleness", type=int, default=1,
                    help="async and overprovisioned: bound on trained tokens' version lag")
    ap.add_argument("--over", type=float, default=0.5,
                    help="overprovisioned, tail-batching: extra groups (0.5: 50%% more)")
    ap.add_argument("--out", default="batches", help="folder for the Parquet batches")
    args = ap.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    summary = asyncio.run(main_async(args))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
