"""``gateway.client.trl_async``: TRL's AsyncGRPOTrainer plug-ins, against a live gateway
over simulated vLLM servers, and the CPU tree attention against per-sample passes.

TRL's trainer itself runs on real vLLM CPU in tests/vllm/test_trl_async_vllm.py; here the
worker and the weight transfer are driven as the trainer drives them (push, then
``update_model_version``, then take samples off the queue).
"""

from __future__ import annotations

import copy
import json
import queue
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from gateway.client import RolloutClient
from gateway.schema.samples import Sample
from tests.client.conftest import ADMIN_TOKEN, GatewayFactory
from tests.client.test_trl_adapter import _two_turns  # reward: the member's index

pytest.importorskip("trl.experimental.async_grpo")
from gateway.client.trl_async import (
    GatewayRolloutWorker,
    GatewayWeightTransfer,
    sample_version,
    to_rollout_sample,
    use_cpu_tree_attention,
)


def _weights() -> list[tuple[str, torch.Tensor]]:
    return [("model.embed.weight", torch.randn(4, 3)), ("lm_head.weight", torch.ones(4, 3))]


def _take(worker: GatewayRolloutWorker, n: int, timeout_s: float = 60) -> list[Any]:
    out = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n:
        try:
            out.append(worker.rollout_buffer.get(timeout=1))
        except queue.Empty:
            worker.check_health(stale_after_s=timeout_s)
            assert time.monotonic() < deadline, f"{len(out)} of {n} samples in {timeout_s} s"
    return out


def test_worker_hands_trl_the_gateway_samples(gateway: GatewayFactory, sqlite_url: str,
                                               tmp_path: Path) -> None:
    config = tmp_path / "policy"
    config.mkdir()
    (config / "config.json").write_text(json.dumps({"model_type": "test"}))
    with gateway(sqlite_url, admin_token=ADMIN_TOKEN) as gw_url:
        push = GatewayWeightTransfer(gw_url, config_dir=config, weights_dir=tmp_path / "w",
                                     admin_token=ADMIN_TOKEN, keep_checkpoints=1)
        worker = GatewayRolloutWorker(gw_url, _two_turns, ["sum 1 2", "sum 3 4"], groups=2,
                                      group_size=2, max_staleness=1,
                                      admin_token=ADMIN_TOKEN, run_id="ta")
        try:
            push.init_weight_transfer()  # the trainer's cold sync, then the worker starts
            push.send_weights(iter(_weights()))
            worker.update_model_version(1)
            worker.start()
            first = _take(worker, 4)
            tids = worker.batches[0]["trajectories"]  # in the order they were queued
            with RolloutClient(gw_url, admin_token=ADMIN_TOKEN) as client:
                assert client.status()["weight_version"] == "1"
                gateway_samples = {s.trajectory_id: s for s in client.samples(tids).samples}
            for rs, tid in zip(first, tids, strict=True):
                s = gateway_samples[tid]
                assert rs.input_ids.tolist() == s.token_ids
                assert rs.completion_mask.tolist() == s.loss_mask
                assert rs.old_log_probs.tolist() == pytest.approx(s.logprobs, abs=1e-6)
                assert rs.model_version == 1
                assert sum(s.loss_mask) > 0 and rs.metrics["reward"] == s.reward
            by_group: dict[int, list[float]] = {}
            for rs in first:
                by_group.setdefault(rs.group_id, []).append(rs.advantage)
            assert len(by_group) == 2
            for advs in by_group.values():  # one scored 0, one 1: -1 and +1
                assert sorted(round(a, 3) for a in advs) == [-1.0, 1.0]
            # TRL's loader takes one batch ahead: batch 2 is taken at v1, batch 3 only
            # once the trainer has trained batch 1 and synced v2
            second = _take(worker, 4)
            time.sleep(1.0)
            assert worker.rollout_buffer.empty()
            assert len(worker.batches) == 2
            push.send_weights(iter(_weights()))
            worker.update_model_version(2)
            third = _take(worker, 4)
            assert {rs.model_version for rs in second + third} <= {1, 2}
            assert max(int(k) for k in worker.batches[2]["lag_tokens"]) <= 1
            assert [p["version"] for p in push.pushes] == [1, 2]
            assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["v2"]
            assert (tmp_path / "w" / "v2" / "config.json").is_file()
        finally:
            worker.stop()
            push.destroy()
        assert worker._thread is not None and not worker._thread.is_alive()
        # the worker took its bound back off the gateway when it stopped
        status = httpx.get(f"{gw_url}/status", timeout=10).json()
        assert status.get("max_staleness") is None


def test_a_worker_that_cannot_reach_the_gateway_says_so() -> None:
    worker = GatewayRolloutWorker("http://127.0.0.1:9", _two_turns, ["p"], groups=1,
                                  group_size=1)
    worker.update_model_version(1)
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while worker._thread is not None and worker._thread.is_alive():
            assert time.monotonic() < deadline
            time.sleep(0.2)
        with pytest.raises(RuntimeError, match="rollout worker failed"):
            worker.check_health(stale_after_s=600)
    finally:
        worker.stop()


def test_time_waiting_for_the_trainer_is_not_the_workers() -> None:
    """The worker takes batch k+1 only once TRL synced version k; a trainer slower than
    ``stale_after_s`` must not make TRL's health check call the worker stuck."""
    worker = GatewayRolloutWorker("http://127.0.0.1:9", _two_turns, ["p"], groups=1,
                                  group_size=1)
    worker._progress -= 3600  # the last batch was handed over an hour ago
    waiting = threading.Thread(target=worker._wait_for_version, args=(1,), daemon=True)
    worker._thread = waiting
    waiting.start()
    deadline = time.monotonic() + 10
    while not worker._waiting_on_trainer:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    worker.check_health(stale_after_s=60)  # waiting on the trainer: not stale
    worker.update_model_version(1)
    waiting.join(timeout=10)
    assert not waiting.is_alive()
    worker._thread = threading.Thread(target=time.sleep, args=(5,), daemon=True)
    worker._thread.start()
    worker.check_health(stale_after_s=60)  # the batch clock restarted when the wait ended
    worker._progress -= 120
    with pytest.raises(TimeoutError, match="gave no batch"):
        worker.check_health(stale_after_s=60)


def _sample(versions: list[str]) -> Sample:
    n = len(versions)
    return Sample(trajectory_id="t", group_id="g", reward=1.0, token_ids=list(range(n)),
                  loss_mask=[0] + [1] * (n - 1), logprobs=[0.0] * n,
                  weight_versions=versions)


def test_a_sample_is_as_old_as_its_oldest_generated_token() -> None:
    assert sample_version(_sample(["", "3", "2", "3"])) == 2
    rs = to_rollout_sample(_sample(["", "3", "2", "3"]), 0.5, 7)
    assert rs.model_version == 2 and rs.group_id == 7 and rs.advantage == 0.5
    with pytest.raises(ValueError, match="not integers"):
        sample_version(_sample(["", "ckpt-a", "ckpt-a"]))


def test_cpu_tree_attention_scores_each_branch_as_its_own_pass() -> None:
    """Three samples sharing a prefix, packed as TRL packs them (one row, the prefix
    forwarded once), scored through the fused head with the CPU tree attention: every
    trained token's logprob equals the one a plain causal pass over its sample gives."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.experimental.async_grpo.packing import TREE_ATTENTION, TreeRow
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    plain = LlamaForCausalLM(cfg).eval()
    use_cpu_tree_attention()
    tree = LlamaForCausalLM(copy.deepcopy(cfg)).eval()
    tree.load_state_dict(plain.state_dict())
    tree.config._attn_implementation = TREE_ATTENTION
    add_fused_lm_head(tree, outputs=("log_probs", "entropy"))
    prefix = [3, 9, 4, 11, 7]
    seqs = [[*prefix, 20, 21, 22], [*prefix, 30, 31], [*prefix, 20, 21, 40, 41, 42]]
    masks = [[0] * 5 + [1] * 3, [0] * 5 + [1, 1], [0] * 5 + [1, 0, 1, 1, 1]]
    row = TreeRow()
    for ids, mask in zip(seqs, masks, strict=True):
        row.add({"input_ids": np.asarray(ids), "completion_mask": np.asarray(mask),
                 "old_log_probs": np.zeros(len(ids), dtype=np.float32), "advantage": 1.0,
                 "group_id": 0, "metrics": {}})
    p = row.pack()
    assert p["input_ids"].numel() < sum(len(s) for s in seqs)  # the prefix once
    with torch.no_grad():
        out = tree(input_ids=p["input_ids"][None], position_ids=p["position_ids"][None],
                   shift_labels=p["shift_labels"][None], fused_lm_head=True,
                   tree_kv_index=p["tree_kv_index"], tree_cu_seqlens_q=p["tree_cu_seqlens_q"],
                   tree_cu_seqlens_k=p["tree_cu_seqlens_k"],
                   tree_max_seqlen_q=int(p["tree_max_seqlens"][0]),
                   tree_max_seqlen_k=int(p["tree_max_seqlens"][1]))
        got = out.log_probs.flatten()[p["token_index"]]
        want = []
        for ids, mask in zip(seqs, masks, strict=True):
            logits = plain(input_ids=torch.tensor([ids])).logits[0, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
            want += [float(lp[i - 1]) for i in range(1, len(ids)) if mask[i]]
    assert len(got) == len(want) == sum(sum(m) for m in masks)
    assert torch.allclose(got, torch.tensor(want), atol=1e-5), (got, want)
    spread = statistics.pstdev(want)
    assert spread > 0.01  # the check can fail: the tokens' logprobs differ
