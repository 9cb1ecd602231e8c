"""A trajectory as a prefix tree (issue 42, item 2): each token once, every branch's
sequence a path of it, every generated token under loss mask 1 once, in the context it
was generated in."""

from __future__ import annotations

from gateway.store.models import Trajectory
from gateway.store.samples import build_samples
from gateway.store.trees import build_tree
from tests.store.rows import Calls


def _forked() -> Calls:
    """A dropped reply (branch 1 beside the conversation), a title call first in its own
    branch (2), a subagent forked late (3)."""
    c = Calls()
    c.call(0, [1, 2, 3], 4)
    c.call(0, [5], 3)
    c.call(1, [6], 2, fork=(0, 8))
    c.call(1, [7], 3)
    c.call(2, [9, 9], 6, fork=(0, 0))
    c.call(3, [8], 4, fork=(1, 11))
    return c


def test_every_branch_is_a_path_and_each_token_is_there_once():
    c = _forked()
    traj = Trajectory(id="t", attempt=0)
    samples = build_samples(traj, c.rows)
    tree = build_tree(traj, c.rows)
    assert sorted(b.branch for b in tree.branches) == [s.branch for s in samples]
    for branch, sample in zip(tree.branches, samples, strict=True):
        path = tree.path(branch.leaf)
        assert [tree.token_ids[i] for i in path] == sample.token_ids
        assert [tree.positions[i] for i in path] == list(range(len(path)))
        assert branch.main == sample.main and branch.length == len(sample.token_ids)
    assert all(p < i for i, p in enumerate(tree.parents))  # parents first
    total = sum(len(s.token_ids) for s in samples)
    shared = total - len(tree.token_ids)
    assert shared == 8 + 11  # branch 1 shares 8 with 0, branch 3 shares 11 with 1
    generated = sorted(t for s in samples for t, m in zip(s.token_ids, s.loss_mask,
                                                           strict=True) if m)
    assert sorted(t for t, m in zip(tree.token_ids, tree.loss_mask, strict=True)
                  if m) == generated  # every generated token once, as over the samples
    assert sum(tree.loss_mask) == sum(len(r.completion_ids) // 4 for r in c.rows)


def test_a_trajectory_without_branches_is_one_path():
    c = Calls()
    c.call(0, [1, 2], 3)
    c.call(0, [4], 2)
    traj = Trajectory(id="t", attempt=0)
    tree = build_tree(traj, c.rows)
    [sample] = build_samples(traj, c.rows)
    assert tree.token_ids == sample.token_ids and tree.loss_mask == sample.loss_mask
    assert tree.parents == [-1, *range(len(tree.token_ids) - 1)]
