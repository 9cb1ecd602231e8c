"""Training-inference mismatch figures (issue 43, item 4): the estimators are right, and a
defect in what reaches the trainer raises the alarm while a clean batch does not.

The clean batch is what the gateway records: a random tiny Llama samples each completion
itself (so the engine's logprobs are its true sampling logprobs), tool output and prompts
sit between completions under loss mask 0 with logprob 0. The trainer recomputes with the
same model through :func:`trainer_logprobs`. Two defects the issue names are then planted
(logprobs shifted by one token, loss mask 1 on tool output), and a third (the engine on
other weights); each must pass a limit by a wide margin.
"""

from __future__ import annotations

import dataclasses
import json
import math

import httpx
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gateway.client import RolloutClient
from gateway.client.mismatch import measure_mismatch, trainer_logprobs
from gateway.schema.mismatch import MismatchLimits, MismatchStats, alarms
from gateway.schema.samples import CallSpan, Sample
from tests.client.conftest import ADMIN_TOKEN


def test_same_logprobs_give_zero_mismatch_and_no_alarm() -> None:
    lp = np.log(np.linspace(0.05, 0.95, 50))
    s = MismatchStats.of(lp, lp)
    assert (s.tokens, s.mean_abs_diff, s.max_abs_diff, s.kl, s.outside_share) == (
        50, 0.0, 0.0, 0.0, 0.0)
    assert set(s.ratio_percentiles) == {"p1", "p5", "p50", "p95", "p99"}
    assert all(v == 1.0 for v in s.ratio_percentiles.values())
    assert alarms(s, MismatchLimits()) == []


def test_a_constant_gap_gives_the_closed_form_figures() -> None:
    engine = np.log(np.full(10, 0.2))
    s = MismatchStats.of(engine + 0.5, engine)
    assert s.mean_abs_diff == pytest.approx(0.5)
    assert s.kl == pytest.approx(math.exp(0.5) - 1.5)  # k3 at d = 0.5
    assert s.log_ratio_mean == pytest.approx(-0.5)
    assert s.ratio_percentiles["p50"] == pytest.approx(math.exp(0.5))
    assert s.outside_share == 1.0
    assert len(alarms(s, MismatchLimits())) == 3


def test_k3_estimates_the_exact_kl_on_the_engines_own_samples() -> None:
    """Tokens drawn from the engine's distribution q; the k3 mean is KL(q || p)."""
    rng = np.random.default_rng(0)
    q = rng.dirichlet(np.ones(32))
    p = 0.7 * q + 0.3 * rng.dirichlet(np.ones(32))
    tokens = rng.choice(32, size=200_000, p=q)
    s = MismatchStats.of(np.log(p[tokens]), np.log(q[tokens]))
    exact = float((q * np.log(q / p)).sum())
    assert s.kl == pytest.approx(exact, rel=0.05)
    assert s.log_ratio_mean == pytest.approx(exact, rel=0.1)  # k1 is unbiased too


def _model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
                      intermediate_size=128, max_position_embeddings=512)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # peaked, as a trained model's next-token distributions are
        model.lm_head.weight.mul_(40.0)
    return model


def _rollout(model: LlamaForCausalLM, seed: int, version: str) -> Sample:
    """Prompt, completion, tool output, completion: as the gateway's sample lays it out."""
    g = torch.Generator().manual_seed(seed)
    s = Sample(trajectory_id=f"t{seed}", group_id="g", reward=None)

    def fed(n: int) -> None:
        s.token_ids += torch.randint(0, 256, (n,), generator=g).tolist()
        s.loss_mask += [0] * n
        s.logprobs += [0.0] * n
        s.weight_versions += [""] * n

    def generated(n: int, seq: int) -> None:
        start = len(s.token_ids)
        with torch.no_grad():
            for _ in range(n):
                logits = model(input_ids=torch.tensor([s.token_ids])).logits[0, -1]
                logp = torch.log_softmax(logits.float(), -1)
                tok = int(torch.multinomial(logp.exp(), 1, generator=g))
                s.token_ids.append(tok)
                s.logprobs.append(float(logp[tok]))
        s.loss_mask += [1] * n
        s.weight_versions += [version] * n
        s.calls.append(CallSpan(seq, f"c{seq}", 0, start, len(s.token_ids), version, "b0", 1))

    fed(12)
    generated(10, 0)
    fed(8)  # the tool's output
    generated(10, 1)
    return s


@pytest.fixture(scope="module")
def batch() -> tuple[LlamaForCausalLM, list[Sample], list[list[float]]]:
    model = _model(0)
    samples = [_rollout(model, seed, "3" if seed % 2 else "4") for seed in range(6)]
    return model, samples, trainer_logprobs(model, samples)


def test_a_clean_batch_matches_and_raises_no_alarm(batch) -> None:
    _, samples, logps = batch
    report = measure_mismatch(samples, logps, mode="async", step=7)
    assert report.overall.tokens == 6 * 20 and report.skipped_tokens == 0
    assert sorted(report.by_version) == ["3", "4"]
    assert report.by_version["3"].tokens == report.by_version["4"].tokens == 60
    assert report.overall.mean_abs_diff < 1e-4 and report.overall.kl < 1e-6
    assert report.alarms == [], report.alarms
    assert (report.mode, report.step) == ("async", 7)


def test_logprobs_shifted_by_one_token_raise_the_alarm(batch) -> None:
    _, samples, logps = batch
    shifted = [Sample(**{**{f: getattr(s, f) for f in s.__slots__},
                         "logprobs": [*s.logprobs[1:], 0.0]}) for s in samples]
    report = measure_mismatch(shifted, logps)
    assert report.overall.mean_abs_diff > 1.0, report.overall
    assert len(report.alarms) >= 2, report.alarms


def test_loss_mask_on_tool_output_raises_the_alarm(batch) -> None:
    _, samples, logps = batch
    masked = []
    for s in samples:
        mask = list(s.loss_mask)
        first, second = s.calls
        mask[first.completion_end:second.completion_start] = [1] * (
            second.completion_start - first.completion_end)
        masked.append(Sample(**{**{f: getattr(s, f) for f in s.__slots__}, "loss_mask": mask}))
    report = measure_mismatch(masked, logps)
    assert report.overall.tokens == 6 * 28
    assert "?" in report.by_version  # tokens no engine sampled carry no version
    assert report.by_version["?"].outside_share > 0.9
    assert report.alarms, report.overall


def test_engines_on_other_weights_raise_the_alarm(batch) -> None:
    _, samples, _ = batch
    report = measure_mismatch(samples, trainer_logprobs(_model(1), samples))
    assert report.overall.kl > 0.1 and len(report.alarms) >= 2


def test_constrained_calls_are_reported_apart_and_not_held_against_the_limits(batch) -> None:
    """A forced tool call's engine logprobs are the masked distribution's (higher than the
    trainer's): reported as ``constrained``, the free tokens judged alone."""
    _, samples, logps = batch
    forced = []
    for s in samples:
        first = s.calls[0]
        lp = list(s.logprobs)
        for j in range(first.completion_start, first.completion_end):
            lp[j] = min(0.0, lp[j] + 2.0)  # the grammar left fewer tokens to choose from
        calls = [dataclasses.replace(first, constrained="tool_choice"), *s.calls[1:]]
        forced.append(Sample(**{**{f: getattr(s, f) for f in s.__slots__},
                                "logprobs": lp, "calls": calls}))
    report = measure_mismatch(forced, logps)
    assert report.alarms == [] and report.overall is not None
    assert report.overall.tokens == report.constrained.tokens == 6 * 10
    assert report.constrained.outside_share > 0.5, report.constrained
    unmarked = measure_mismatch([Sample(**{**{f: getattr(s, f) for f in s.__slots__},
                                           "calls": samples[i].calls})
                                 for i, s in enumerate(forced)], logps)
    assert unmarked.constrained is None and unmarked.alarms  # the same gap, unmarked


def test_rows_that_do_not_line_up_are_refused(batch) -> None:
    _, samples, logps = batch
    with pytest.raises(ValueError, match="logprob rows"):
        measure_mismatch(samples, logps[:-1])
    with pytest.raises(ValueError, match="logprobs for"):
        measure_mismatch(samples[:1], [logps[0][:-1]])


def test_the_gateway_judges_keeps_and_exports_reports(batch, gateway, sqlite_url) -> None:
    """The trainer posts; the gateway judges against its own limits, keeps the report for
    /status, exports it to Prometheus and emits an event on an alarm. Harness keys and
    anonymous callers cannot post."""
    _, samples, logps = batch
    clean = measure_mismatch(samples, logps, mode="async", step=1, run_id="r")
    shifted = measure_mismatch(
        [Sample(**{**{f: getattr(s, f) for f in s.__slots__},
                   "logprobs": [*s.logprobs[1:], 0.0]}) for s in samples], logps,
        mode="async", step=2, run_id="r")
    with gateway(sqlite_url, admin_token=ADMIN_TOKEN, trainer_token="trainer-secret",
                 api_keys=["harness-key"]) as gw, \
            RolloutClient(gw, admin_token="trainer-secret") as client:
        strict = clean.model_copy(update={"alarms": ["planted"]})
        judged = client.report_mismatch(strict)
        assert judged.alarms == [] and judged.received_at is not None  # the gateway judges
        assert client.report_mismatch(shifted).alarms
        for key in ("harness-key", None):
            r = httpx.post(f"{gw}/training/mismatch", json=clean.model_dump(mode="json"),
                           headers={"authorization": f"Bearer {key}"} if key else {})
            assert r.status_code in (401, 403), r.text
        r = httpx.post(f"{gw}/training/mismatch", json={"mode": "sync"},
                       headers={"authorization": "Bearer trainer-secret"})
        assert r.status_code == 422 and "overall" in r.text, r.text
        good = clean.model_dump(mode="json")
        bad_overall = [{**good["overall"], "ratio_percentiles": {"": 1.0}},
                       {**good["overall"], "kl": float("nan")}]
        for bad in [*({**good, "overall": o} for o in bad_overall),
                    {**good, "by_version": {"v" * 200: good["overall"]}}]:
            r = httpx.post(f"{gw}/training/mismatch", content=json.dumps(bad),  # NaN too
                           headers={"authorization": "Bearer trainer-secret",
                                    "content-type": "application/json"})
            assert r.status_code == 422, r.text  # refused whole: nothing kept
        assert httpx.get(f"{gw}/metrics").status_code == 200

        board = client.status()["training_mismatch"]
        assert (board["reports"], board["alarms"]) == (2, 1)
        assert [r["step"] for r in board["recent"]] == [2, 1]
        assert board["limits"] == MismatchLimits().model_dump()
        events = client.status()["events"]
        assert any(e["kind"] == "mismatch" and e["step"] == 2 for e in events), events

        text = httpx.get(f"{gw}/metrics").text
        kl = [line for line in text.splitlines()
              if line.startswith("rollout_gateway_train_mismatch_kl{")]
        assert sorted(kl) == sorted(
            f'rollout_gateway_train_mismatch_kl{{mode="async",sampling="free",version="{v}"}} '
            f'{shifted.by_version[v].kl!r}' for v in ("3", "4")), kl
        assert "rollout_gateway_train_mismatch_alarms_total 1.0" in text
