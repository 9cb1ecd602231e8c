"""A trajectory's branches as one prefix tree: each token once (the tree export).

The samples of ``branches=all`` repeat every shared prefix in each branch's row (a
mini-swe-agent run with 11 branches: 6.3 sequence tokens per token of its final
conversation). A prefix tree holds each token any branch holds once, with the node
before it; a trainer that scores the tree in one forward pass (a tree attention mask and
position ids: :mod:`gateway.client.trees`) computes each shared prefix once, as TreePO
amortises tree-structured sampling over shared prefixes. Each generated token is trained
once there, in the context it was generated in.

Nodes are known as the samples know tokens (:mod:`gateway.store.samples`): by the branch
that appended a position and the position (a fork shares its parent's positions).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gateway.schema.samples import SampleTree, TreeBranch
from gateway.store.models import Call, Trajectory, TrajectoryAttempt
from gateway.store.routes import from_field, to_field
from gateway.store.samples import BranchBuild, build_branches, staleness


def _branch_routes(ordered: Sequence[BranchBuild]) -> dict[int, np.ndarray]:
    """Each branch's routed experts (by branch id), when they are of one router shape."""
    out = {b.sample.branch: from_field(b.sample.routed_experts)
           for b in ordered if b.sample.routed_experts is not None}
    return out if len({a.shape[1:] for a in out.values()}) == 1 else {}


def _node_routes(sources: Sequence[tuple[np.ndarray | None, int]],
                 shape: tuple[int, ...]) -> str:
    """A tree's ``routed_experts``: each node's row from the branch that holds it first."""
    out = np.full((len(sources), *shape), -1, dtype=np.int16)
    for i, (arr, p) in enumerate(sources):
        if arr is not None:
            out[i] = arr[p]
    return to_field(out)


def build_tree(trajectory: Trajectory, calls: Sequence[Call], *, attempt: int | None = None,
               record: TrajectoryAttempt | None = None,
               current_version: str | None = None, model: str | None = None) -> SampleTree:
    """One attempt (by default the latest) of a trajectory as a :class:`SampleTree`;
    ``max_staleness`` as :func:`gateway.store.samples.build_samples` measures it;
    ``model``: one policy's branches and trained tokens (``build_branches``)."""
    ordered, main = build_branches(trajectory, calls, attempt=attempt, record=record,
                                   model=model)
    first = ordered[0].sample
    tree = SampleTree(trajectory.id, trajectory.group_id, first.reward, attempt=first.attempt,
                      metadata=first.metadata)
    nodes: dict[tuple[int, int], int] = {}
    routes = _branch_routes(ordered)
    sources: list[tuple[np.ndarray | None, int]] = []  # each node's routes: (array, row)
    for b in ordered:
        s, leaf = b.sample, -1
        mine = routes.get(s.branch)
        for p, token in enumerate(s.token_ids):
            key = (b.origin[p], p)
            node = nodes.get(key)
            if node is None:
                node = nodes[key] = len(tree.token_ids)
                sources.append((mine, p))
                tree.token_ids.append(token)
                tree.parents.append(leaf)
                tree.positions.append(p)
                tree.loss_mask.append(b.generated[p])
                tree.logprobs.append(s.logprobs[p])
                tree.weight_versions.append(s.weight_versions[p])
            leaf = node
        tree.branches.append(TreeBranch(s.branch, s.parent_branch, leaf, len(s.token_ids),
                                        b is main))
    if routes:
        tree.routed_experts = _node_routes(sources, next(iter(routes.values())).shape[1:])
    tree.max_staleness = staleness(
        [v for v, m in zip(tree.weight_versions, tree.loss_mask, strict=True) if m],
        current_version)
    return tree
