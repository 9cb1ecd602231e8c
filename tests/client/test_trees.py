"""One forward pass over a trajectory tree gives every branch's logprobs (issue 42).

A random tiny Llama (transformers, CPU) scores a tree of four branches (a dropped reply,
a title call, a subagent forked late) once with the tree mask and once per branch with
the usual causal mask; every node's logprob must agree, on both of transformers'
attention paths. The same pass with a plain causal mask over the packed tree (what a
trainer that concatenated the branches would compute) must not.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gateway.client.trees import branch_logprobs, tree_inputs, tree_logprobs
from gateway.store.models import Trajectory
from gateway.store.trees import build_tree
from tests.store.rows import Calls


def _tree():
    c = Calls()
    c.call(0, [1, 2, 3], 4)
    c.call(0, [5], 3)
    c.call(1, [6], 2, fork=(0, 8))
    c.call(1, [7], 3)
    c.call(2, [9, 9], 6, fork=(0, 0))
    c.call(3, [8], 4, fork=(1, 11))
    return build_tree(Trajectory(id="t", attempt=0), c.rows)


def _model(attention: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=64, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
                      intermediate_size=128, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval()
    model.config._attn_implementation = attention
    return model


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_one_pass_equals_each_branch_on_its_own(attention: str):
    tree, model = _tree(), _model(attention)
    with torch.no_grad():
        once = tree_logprobs(model, tree)
        apart = branch_logprobs(model, tree)
    assert set(apart) == {i for i, p in enumerate(tree.parents) if p >= 0}
    worst = max(abs(float(once[i]) - lp) for i, lp in apart.items())
    assert worst < 1e-4, worst
    assert all(math.isnan(float(once[i])) for i, p in enumerate(tree.parents) if p < 0)
    trained = [i for i, m in enumerate(tree.loss_mask) if m]
    assert trained and all(i in apart for i in trained)


def test_a_causal_mask_over_the_packed_tree_gives_other_logprobs():
    """The check can fail: packing the branches with the causal mask lets a branch see
    its siblings; their tokens then score differently."""
    tree, model = _tree(), _model("eager")
    ids, positions, _ = tree_inputs(tree)
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=positions).logits[0]
        apart = branch_logprobs(model, tree)
    logp = torch.log_softmax(logits.float(), -1)
    gaps = [abs(float(logp[p, ids[0, i]]) - apart[i])
            for i, p in enumerate(tree.parents) if p >= 0]
    assert max(gaps) > 1e-2
