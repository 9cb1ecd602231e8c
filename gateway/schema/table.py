"""Training samples as an Arrow table: the columns of ``rollout-gateway export --format
parquet`` and of the client's ``SampleBatch.to_table()``, defined once; and trajectory
trees (``export --branches tree``), a row per trajectory."""

from __future__ import annotations

import base64
from collections.abc import Iterable
from typing import Any

import orjson
import pyarrow as pa

from gateway.schema.samples import Sample, SampleTree

SAMPLE_SCHEMA = pa.schema([
    ("trajectory_id", pa.string()),
    ("attempt", pa.int32()),
    ("group_id", pa.string()),
    ("reward", pa.float64()),
    ("token_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
    ("logprobs", pa.list_(pa.float32())),
    ("weight_versions", pa.list_(pa.string())),
    ("max_staleness", pa.int32()),
    ("num_calls", pa.int32()),
    ("num_mismatches", pa.int32()),
    ("metadata", pa.string()),
    ("branch", pa.int32()),
    ("parent_branch", pa.int32()),
    ("fork_position", pa.int32()),
    ("is_main", pa.bool_()),
    # MoE routing replay: the sample's ``routed_experts`` as ``.npy`` bytes (int16
    # ``(positions, layers, top_k)``, -1 unknown; ``np.load(io.BytesIO(value))``)
    ("routed_experts", pa.binary()),
])


def sample_record(s: Sample) -> dict[str, Any]:
    return {
        "trajectory_id": s.trajectory_id, "attempt": s.attempt, "group_id": s.group_id,
        "reward": s.reward,
        "token_ids": s.token_ids, "loss_mask": s.loss_mask, "logprobs": s.logprobs,
        "weight_versions": s.weight_versions, "max_staleness": s.max_staleness,
        "num_calls": len(s.calls),
        "num_mismatches": len(s.mismatches),
        "metadata": orjson.dumps(s.metadata).decode() if s.metadata is not None else None,
        "branch": s.branch, "parent_branch": s.parent_branch,
        "fork_position": s.fork_position, "is_main": s.main,
        "routed_experts": base64.b64decode(s.routed_experts)
        if s.routed_experts is not None else None,
    }


def samples_table(samples: Iterable[Sample]) -> pa.Table:
    return pa.Table.from_pylist([sample_record(s) for s in samples], schema=SAMPLE_SCHEMA)


TREE_SCHEMA = pa.schema([
    ("trajectory_id", pa.string()),
    ("attempt", pa.int32()),
    ("group_id", pa.string()),
    ("reward", pa.float64()),
    ("token_ids", pa.list_(pa.int32())),
    ("parents", pa.list_(pa.int32())),
    ("positions", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
    ("logprobs", pa.list_(pa.float32())),
    ("weight_versions", pa.list_(pa.string())),
    ("branches", pa.list_(pa.int32())),
    ("branch_parents", pa.list_(pa.int32())),
    ("branch_leaves", pa.list_(pa.int32())),
    ("main_branch", pa.int32()),
    ("max_staleness", pa.int32()),
    ("metadata", pa.string()),
    ("routed_experts", pa.binary()),  # one row per node, as the samples' column
])


def tree_record(t: SampleTree) -> dict[str, Any]:
    """One tree as a row (``branch_parents``: -1 for a root branch)."""
    return {
        "trajectory_id": t.trajectory_id, "attempt": t.attempt, "group_id": t.group_id,
        "reward": t.reward, "token_ids": t.token_ids, "parents": t.parents,
        "positions": t.positions, "loss_mask": t.loss_mask, "logprobs": t.logprobs,
        "weight_versions": t.weight_versions,
        "branches": [b.branch for b in t.branches],
        "branch_parents": [-1 if b.parent_branch is None else b.parent_branch
                           for b in t.branches],
        "branch_leaves": [b.leaf for b in t.branches],
        "main_branch": next((b.branch for b in t.branches if b.main), None),
        "max_staleness": t.max_staleness,
        "metadata": orjson.dumps(t.metadata).decode() if t.metadata is not None else None,
        "routed_experts": base64.b64decode(t.routed_experts)
        if t.routed_experts is not None else None,
    }


def trees_table(trees: Iterable[SampleTree]) -> pa.Table:
    return pa.Table.from_pylist([tree_record(t) for t in trees], schema=TREE_SCHEMA)
