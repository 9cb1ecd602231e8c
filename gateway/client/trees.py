"""Score a whole trajectory tree in one forward pass (the reference for trainers).

A :class:`~gateway.schema.samples.SampleTree` holds each token of a trajectory's branches
once. Packed as one sequence, node ``i`` must see exactly what it saw when it was
sampled: its ancestors (``parents`` followed to a root) and itself, at its position in
their sequence. So the attention mask is the ancestor relation, not the causal one, and
the position ids are ``tree.positions``; the logits at a node's parent then score the
node, and every generated token's logprob comes out of one pass, each shared prefix
computed once (as TreePO amortises a sampling tree over its shared prefixes).

This builds a dense ``N x N`` mask, a reference for checking a trainer (it equals the
per-branch recomputation within float tolerance: tests/client/test_trees.py); a trainer
on long trees would express the same relation as a block-sparse mask (FlexAttention's
``BlockMask``, or varlen attention per branch segment). Needs torch (the ``learned``
extra) and a Hugging Face causal LM that takes a 4D additive attention mask.
"""

from __future__ import annotations

from typing import Any

import torch

from gateway.schema.samples import SampleTree


def tree_inputs(tree: SampleTree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``position_ids`` (``1 x N``) and the additive attention mask
    (``1 x 1 x N x N``: 0 where node ``i`` may attend to node ``j``, its ancestors and
    itself; the dtype's minimum elsewhere)."""
    n = len(tree.token_ids)
    sees = torch.zeros((n, n), dtype=torch.bool)
    for i, parent in enumerate(tree.parents):
        if parent >= 0:  # parents come first: their rows are done
            sees[i] = sees[parent]
        sees[i, i] = True
    mask = torch.zeros((n, n), dtype=torch.float32)
    mask.masked_fill_(~sees, torch.finfo(torch.float32).min)
    ids = torch.tensor([tree.token_ids], dtype=torch.long)
    positions = torch.tensor([tree.positions], dtype=torch.long)
    return ids, positions, mask[None, None]


def tree_logprobs(model: Any, tree: SampleTree) -> torch.Tensor:
    """Every node's logprob given its ancestors (NaN at a root, which has none), in one
    forward pass of ``model``; read the generated ones with ``tree.loss_mask``."""
    ids, positions, mask = tree_inputs(tree)
    logits = model(input_ids=ids, position_ids=positions, attention_mask=mask).logits[0]
    logp = torch.log_softmax(logits.float(), -1)
    parents = torch.tensor(tree.parents, dtype=torch.long)
    out = torch.full((len(tree.token_ids),), float("nan"))
    has = parents >= 0
    out[has] = logp[parents[has], ids[0, has]]
    return out


def branch_logprobs(model: Any, tree: SampleTree) -> dict[int, float]:
    """The same logprobs the usual way, one causal pass per branch (a node shared by
    several branches is scored once per branch holding it; they agree): node -> logprob.
    What :func:`tree_logprobs` is checked against."""
    out: dict[int, float] = {}
    for branch in tree.branches:
        path = tree.path(branch.leaf)
        if len(path) < 2:
            continue
        ids = torch.tensor([[tree.token_ids[i] for i in path]], dtype=torch.long)
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        for k in range(1, len(path)):
            out[path[k]] = float(logp[k - 1, ids[0, k]])
    return out
