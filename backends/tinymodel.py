"""A tiny random-weight Llama model for running a real vLLM on CPU in tests.

``build_tiny_model(out_dir)`` writes, without any download, a Hugging Face model
directory that vLLM can serve: a 2-layer Llama (hidden 256, 4 heads of 64, 2 KV heads,
intermediate 512; head_dim 64 because the CPU attention kernel rejects 16), a byte-level
BPE tokenizer of about 1000 tokens trained on a generated corpus, and a ChatML chat
template in the Hermes style (``tools`` in the system prompt, ``<tool_call>`` JSON in
assistant turns, ``tool`` results in ``<tool_response>``), which is what vLLM's
``hermes`` tool parser expects.

The weights are random, so the text is noise, but everything the gateway cares about is
real: token ids, logprobs, prefix caching, batching, priority scheduling, tool-call
parsing (force a call with ``tool_choice`` ``"required"`` or a named function; vLLM then
constrains decoding to valid JSON).

torch/transformers/tokenizers are imported inside the builder: they live in the vLLM
environment, not in the gateway's. Run it there::

    /root/.cache/rollout-gateway/vllm-cpu/bin/python -m backends.tinymodel /tmp/tiny
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

#: Bump when the produced files change, so cached builds are rebuilt.
BUILDER_VERSION = 1
STAMP_FILE = "tinymodel.json"

VOCAB_SIZE = 1000
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Added but *not* special: they must survive detokenization (skip_special_tokens) so the
# hermes tool parser can find them in the text, and they must be single tokens because
# the parser looks them up in the vocabulary.
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

MODEL_CONFIG: dict[str, Any] = {
    "hidden_size": 256,
    "num_attention_heads": 4,
    "head_dim": 64,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "intermediate_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}

#: ``moe=True``: a Qwen3-MoE of the same shape whose MLPs are 8 experts, top 2 (a router
#: vLLM's CPU build serves, though it refuses ``--enable-return-routed-experts``)
MOE_CONFIG: dict[str, Any] = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
}

# ChatML with Hermes-style tools, modelled on the Qwen2.5 template.
CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}
{{- messages[0]['content'] }}
{%- else %}
{{- 'You are a helpful assistant.' }}
{%- endif %}
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}
{{- '\\n' }}{{- tool | tojson }}
{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n\
{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}
{{- '\\n' + message.content }}
{%- endif %}
{%- for tool_call in message.tool_calls | default([], true) %}
{%- if tool_call.function is defined %}
{%- set tool_call = tool_call.function %}
{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}
{{- tool_call.arguments }}
{%- else %}
{{- tool_call.arguments | tojson }}
{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

_WORDS_TEXT = (
    "the a an of to and in is it for on with as at by from this that be are was not or "
    "file test run call tool result error value list read write open close search find "
    "python code function return import class def self name args json query page user "
    "assistant system message content model token patch diff line path repo issue fix "
    "number answer compute sum total step plan first then next done ok yes no true false "
    "weather city temperature time date price order item account status request response"
)
_WORDS = _WORDS_TEXT.split()


def _corpus(seed: int) -> list[str]:
    """Deterministic training text shaped like chat traffic: prose, code, tool JSON."""
    rng = random.Random(seed)
    lines: list[str] = []
    for i in range(4000):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16)))
        kind = i % 4
        if kind == 0:
            lines.append(words.capitalize() + ".")
        elif kind == 1:
            name = "_".join(rng.sample(_WORDS, 2))
            lines.append(f"def {name}(self, {rng.choice(_WORDS)}: int = {i}):\n    return {i % 97}")
        elif kind == 2:
            args = {rng.choice(_WORDS): rng.choice(_WORDS), "n": rng.randint(0, 999)}
            call = {"name": rng.choice(_WORDS), "arguments": args}
            lines.append(f"<tool_call>\n{json.dumps(call)}\n</tool_call>")
        else:
            lines.append(f"<|im_start|>user\n{words}?<|im_end|>\n<|im_start|>assistant\n")
    return lines


def _build_tokenizer(seed: int, max_positions: int) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(TOOL_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=max_positions,
    )


def _build_model(tokenizer: Any, seed: int, max_positions: int, moe: bool = False) -> Any:
    import torch
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    common = dict(vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=eos,
                  pad_token_id=tokenizer.pad_token_id,
                  **{**MODEL_CONFIG, "max_position_embeddings": max_positions})
    torch.manual_seed(seed)
    if moe:
        config = Qwen3MoeConfig(**common, **MOE_CONFIG)
        model = Qwen3MoeForCausalLM(config)
        with torch.no_grad():  # a router with opinions: the default init is near-uniform
            for m in model.modules():
                if type(m).__name__.endswith("TopKRouter"):
                    torch.nn.init.normal_(m.weight, std=0.5)
        model = model.to(torch.bfloat16)
    else:
        model = LlamaForCausalLM(LlamaConfig(**common)).to(torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos[1])
    return model


def _stamp(seed: int, max_positions: int, moe: bool = False) -> dict[str, int]:
    stamp = {"seed": seed, "version": BUILDER_VERSION}
    if max_positions != MODEL_CONFIG["max_position_embeddings"]:
        stamp["max_positions"] = max_positions  # default builds keep their old stamp
    if moe:
        stamp["moe"] = 1
    return stamp


def _is_built(out_dir: Path, seed: int, max_positions: int, moe: bool = False) -> bool:
    stamp = out_dir / STAMP_FILE
    try:
        data = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    return bool(data == _stamp(seed, max_positions, moe))


def build_tiny_model(out_dir: Path, *, seed: int = 0, max_positions: int | None = None,
                     moe: bool = False) -> Path:
    """Build (or reuse) the tiny model at ``out_dir`` and return ``out_dir``.

    ``max_positions`` sets ``max_position_embeddings`` (default 4096), the longest
    ``--max-model-len`` vLLM accepts without overrides; RoPE has no learned positions, so
    a longer one (for harnesses whose first prompt is tens of thousands of tokens) only
    changes the config and the tokenizer's ``model_max_length``, not the weights.

    ``moe``: a mixture-of-experts model instead (Qwen3-MoE, :data:`MOE_CONFIG`), with the
    same tokenizer and chat template.

    Deterministic for a given ``seed`` and idempotent: a directory already built with the
    same seed and builder version is left alone. The build happens in a sibling temporary
    directory that is renamed into place, so a crash never leaves a half-built model.
    """
    out_dir = Path(out_dir)
    positions = max_positions or MODEL_CONFIG["max_position_embeddings"]
    if _is_built(out_dir, seed, positions, moe):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    tmp.chmod(0o755)
    try:
        tokenizer = _build_tokenizer(seed, positions)
        tokenizer.save_pretrained(tmp)
        _build_model(tokenizer, seed, positions, moe).save_pretrained(tmp)
        (tmp / STAMP_FILE).write_text(json.dumps(_stamp(seed, positions, moe)))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        try:
            tmp.rename(out_dir)
        except OSError:
            # A concurrent builder won the race; its result is as good as ours.
            if not _is_built(out_dir, seed, positions, moe):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m backends.tinymodel", description=__doc__)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-positions", type=int, default=None,
                        help="max_position_embeddings (default 4096)")
    parser.add_argument("--moe", action="store_true",
                        help="a mixture-of-experts model (Qwen3-MoE, 8 experts, top 2)")
    ns = parser.parse_args(argv)
    print(build_tiny_model(ns.out_dir, seed=ns.seed, max_positions=ns.max_positions,
                           moe=ns.moe))
    return 0


if __name__ == "__main__":
    sys.exit(main())
