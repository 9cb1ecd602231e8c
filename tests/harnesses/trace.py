"""What every harness test asserts: the gateway kept an exact token trace of the run."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

import httpx

from backends.sim.tokenizer import get_tokenizer


def assert_exact_trace(gw: str, traj: str, *, calls: int | None = None,
                       texts: list[str] | None = None) -> list[dict[str, Any]]:
    """Calls of ``traj`` in order, each ok with token ids and logprobs, stored as prefix
    deltas with no mismatch, rebuilt into one sample; ``texts`` (what the client saw as
    each turn's text, where known) must decode from the stored completion ids."""
    detail = httpx.get(f"{gw}/trajectories/{traj}", timeout=10).json()
    got = detail["calls"]
    if calls is not None:
        assert len(got) == calls, [c["seq"] for c in got]
    assert [c["seq"] for c in got] == list(range(len(got)))
    for c in got:
        assert c["status"] == "ok", c["error"]
        assert c["mismatch_pos"] is None
        assert len(c["completion_logprobs"]) == len(c["completion_ids"]) > 0
        assert all(lp <= 0 for lp in c["completion_logprobs"])
    for prev, cur in itertools.pairwise(got):
        assert cur["prompt_offset"] == prev["prompt_offset"] + len(prev["prompt_delta_ids"]) \
            + len(prev["completion_ids"])
    sample = httpx.get(f"{gw}/trajectories/{traj}/sample", timeout=10).json()
    assert len(sample["token_ids"]) == got[-1]["prompt_len"] + len(got[-1]["completion_ids"])
    assert sum(sample["loss_mask"]) == sum(len(c["completion_ids"]) for c in got)
    if texts is not None:
        tok = get_tokenizer()
        for c, text in zip(got, texts, strict=True):
            if text:
                assert text in tok.decode(c["completion_ids"])
    return got


@dataclass(frozen=True, slots=True)
class Kept:
    """What a trajectory's samples kept of what its calls generated."""

    calls: int  # calls answered (status ok)
    generated: int  # completion tokens over those calls
    kept: int  # of them, under loss mask 1 in an exported sample with their logprob
    branches: int
    on_record: int  # calls whose prompt the engine ran partly from the record (token in)

    def line(self, name: str) -> str:
        return (f"{name}: {self.kept}/{self.generated} generated tokens under loss mask 1 "
                f"({self.kept / max(self.generated, 1):.0%}), {self.calls} calls answered, "
                f"{self.branches} branches, {self.on_record} calls ran on the record")


Slice = tuple[dict[str, Any], int, int]  # a call, and the part of its completion: [a, b)


def _limits(calls: list[dict[str, Any]], branch: int) -> dict[int, int | None]:
    """For ``branch`` and each branch it descends from: how many leading tokens of that
    branch's sequence are in ``branch``'s (None: all of them), from the calls' trace
    alone, apart from the gateway's sample code."""
    first: dict[int, dict[str, Any]] = {}
    for c in sorted(calls, key=lambda c: c["seq"]):
        first.setdefault(c["branch"], c)
    out: dict[int, int | None] = {}
    limit: int | None = None
    b: int | None = branch
    while b is not None:
        out[b] = limit
        fork = first[b]["prompt_offset"]
        limit = fork if limit is None else min(limit, fork)
        b = first[b]["parent_branch"]
    return out


def _part(c: dict[str, Any], limit: int | None, inside: bool) -> Slice:
    """The part of ``c``'s completion before ``limit`` (``inside``) or from it on."""
    n = len(c["completion_ids"])
    cut = n if limit is None else max(0, min(n, limit - c["prompt_len"]))
    return (c, 0, cut) if inside else (c, cut, n)


def lineage(calls: list[dict[str, Any]], branch: int) -> list[Slice]:
    """The completion tokens in ``branch``'s sequence, in order: its own calls' and its
    ancestors' before the forks that lead to it (a fork may fall inside a completion)."""
    limits = _limits(calls, branch)
    ordered = sorted(calls, key=lambda c: (c["prompt_len"], c["seq"]))
    return [_part(c, limits[c["branch"]], True) for c in ordered if c["branch"] in limits]


def assert_every_token_kept(gw: str, traj: str) -> Kept:
    """Every token the trajectory's calls generated is in exactly one of its exported
    samples (``/samples``, every branch), under loss mask 1, with the engine's logprob,
    in the order it was generated; the main sample (also ``/sample``) trains every
    generated token in its sequence, those it inherited from the branches it forked from
    included; the others train what their own calls generated that main does not hold."""
    calls = httpx.get(f"{gw}/trajectories/{traj}", timeout=10).json()["calls"]
    ok = [c for c in calls if c["status"] == "ok" and c["attempt"] == calls[-1]["attempt"]]
    samples = httpx.get(f"{gw}/trajectories/{traj}/samples", timeout=10).json()["data"]
    assert sorted({c["branch"] for c in ok}) == [s["branch"] for s in samples]
    [main] = [s for s in samples if s["main"]]
    in_main = _limits(ok, main["branch"])
    default = httpx.get(f"{gw}/trajectories/{traj}/sample", timeout=10).json()
    assert default["branch"] == main["branch"] and default["loss_mask"] == main["loss_mask"]
    kept = 0
    for s in samples:
        own = [(t, lp) for t, lp, m in zip(s["token_ids"], s["logprobs"], s["loss_mask"],
                                            strict=True) if m]
        if s["main"]:
            mine = lineage(ok, s["branch"])
        else:  # its own calls' tokens past what main inherits of this branch
            limit = in_main.get(s["branch"], 0)
            mine = [_part(c, limit, False) for c in sorted(ok, key=lambda c: c["seq"])
                    if c["branch"] == s["branch"]]
        want = [(t, lp) for c, a, b in mine
                for t, lp in list(zip(c["completion_ids"], c["completion_logprobs"],
                                      strict=True))[a:b]]
        assert own == want, f"branch {s['branch']} of {traj}"
        kept += len(own)
    generated = sum(len(c["completion_ids"]) for c in ok)
    assert kept == generated
    return Kept(len(ok), generated, kept, len(samples),
                sum(1 for c in ok if c.get("kept_len")))


class NotMain(AssertionError):
    """The main sample is not the conversation it should be (another one was chosen)."""


def assert_main_is(gw: str, traj: str, seqs: set[int]) -> dict[str, Any]:
    """The main sample (``/sample``) is the conversation of the calls ``seqs`` (their
    ``seq``), trained whole: its line of branches holds exactly their completions, each
    where its call generated it, under loss mask 1 with the engine's logprobs, and it
    trains nothing else. :class:`NotMain` when main holds other calls' tokens than
    ``seqs``; returns the main sample."""
    calls = httpx.get(f"{gw}/trajectories/{traj}", timeout=10).json()["calls"]
    main: dict[str, Any] = httpx.get(f"{gw}/trajectories/{traj}/sample", timeout=10).json()
    assert main["main"] and main["mismatches"] == []
    line = [part for part in lineage(calls, main["branch"]) if part[2] > part[1]]
    on_main = {c["seq"] for c, _, _ in line}
    if on_main != seqs:
        raise NotMain(f"main (branch {main['branch']}) holds calls {sorted(on_main)}, "
                      f"not {sorted(seqs)}")
    for c, a, b in line:
        assert (a, b) == (0, len(c["completion_ids"])), c["seq"]
        start, end = c["prompt_len"], c["prompt_len"] + b
        assert main["token_ids"][start:end] == c["completion_ids"], c["seq"]
        assert main["loss_mask"][start:end] == [1] * b, c["seq"]
        assert main["logprobs"][start:end] == c["completion_logprobs"], c["seq"]
    assert sum(main["loss_mask"]) == sum(b for _, _, b in line)
    return main


@dataclass(frozen=True, slots=True)
class HarnessReport:
    """Per-harness figures of one finished trajectory (docs/integrations.md's table)."""

    calls: int  # calls answered (status ok, latest attempt)
    branches: int  # samples of ``branches=all``
    generated: int  # completion tokens over those calls
    main_trained: int  # of them, under loss mask 1 in the main sample (``/sample``)
    all_tokens: int  # sequence tokens over the ``branches=all`` samples, together
    tree_nodes: int  # tokens of ``/tree``: each token any branch holds, once
    tree_trained: int  # tree nodes under loss mask 1
    mismatches: int  # over the calls and every sample

    @property
    def main_share(self) -> float:
        return self.main_trained / max(self.generated, 1)

    @property
    def all_per_generated(self) -> float:
        return self.all_tokens / max(self.generated, 1)

    @property
    def tree_per_generated(self) -> float:
        return self.tree_nodes / max(self.generated, 1)

    def line(self, name: str) -> str:
        return (f"{name}: {self.calls} calls, {self.branches} branches, main trains "
                f"{self.main_trained}/{self.generated} generated tokens "
                f"({self.main_share:.1%}); sequence tokens per generated token: "
                f"{self.all_tokens}/{self.generated} = {self.all_per_generated:.2f} "
                f"(branches=all), {self.tree_nodes}/{self.generated} = "
                f"{self.tree_per_generated:.2f} (tree); {self.mismatches} mismatches")


def harness_report(gw: str, traj: str) -> HarnessReport:
    """Calls, branches, the share of generated tokens the main sample trains, and sequence
    tokens per generated token: every ``branches=all`` sample together against the prefix
    tree's node count (``/tree``). Asserts nothing: :func:`assert_every_token_kept` does."""
    calls = httpx.get(f"{gw}/trajectories/{traj}", timeout=10).json()["calls"]
    ok = [c for c in calls if c["status"] == "ok" and c["attempt"] == calls[-1]["attempt"]]
    samples = httpx.get(f"{gw}/trajectories/{traj}/samples", params={"branches": "all"},
                        timeout=10).json()["data"]
    main = httpx.get(f"{gw}/trajectories/{traj}/sample", timeout=10).json()
    tree = httpx.get(f"{gw}/trajectories/{traj}/tree", timeout=10).json()
    return HarnessReport(
        calls=len(ok), branches=len(samples),
        generated=sum(len(c["completion_ids"]) for c in ok),
        main_trained=sum(main["loss_mask"]),
        all_tokens=sum(len(s["token_ids"]) for s in samples),
        tree_nodes=len(tree["token_ids"]), tree_trained=sum(tree["loss_mask"]),
        mismatches=sum(c["mismatch_pos"] is not None for c in ok)
        + sum(len(s["mismatches"]) for s in samples))


class StatusLog:
    """ASGI wrapper around the gateway app: the status of every HTTP answer it sent."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.answers: list[tuple[str, str, int]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def logged(message: Any) -> None:
            if message["type"] == "http.response.start":
                self.answers.append((scope["method"], scope["path"], message["status"]))
            await send(message)

        await self.app(scope, receive, logged)


def recorded_calls(gw: str, traj: str, *, endpoint: str, at_least: int, wait_s: float = 10.0
                   ) -> list[dict[str, Any]]:
    """The trajectory's calls in ``seq`` order once ``at_least`` are recorded, each ok,
    through ``endpoint``, with completion ids and one logprob per id. (How they form
    samples is :func:`assert_every_token_kept`'s business.)"""
    deadline = time.monotonic() + wait_s
    while True:
        r = httpx.get(f"{gw}/trajectories/{traj}", timeout=10)
        calls = r.json().get("calls", []) if r.status_code == 200 else []
        if len(calls) >= at_least or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(calls) >= at_least, (traj, r.status_code, len(calls))
    calls.sort(key=lambda c: c["seq"])
    for c in calls:
        assert c["status"] == "ok" and c["error"] is None, c
        assert c["endpoint"] == endpoint
        assert len(c["completion_ids"]) > 0
        assert len(c["completion_logprobs"]) == len(c["completion_ids"])
        assert all(lp <= 0 for lp in c["completion_logprobs"])
    return calls


if __name__ == "__main__":  # python -m tests.harnesses.trace GATEWAY_URL TRAJECTORY_ID
    import sys

    print(harness_report(sys.argv[1], sys.argv[2]).line(sys.argv[2]))
