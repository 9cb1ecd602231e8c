"""``rollout-gateway bench relay``: what relaying a streamed token costs the gateway, the
fast path (``gateway/proxy/token_runs.py``) against the general path, side by side.

1. **In process.** The relay's SSE decoder on the benchmark upstream's stream in vLLM's
   wire format (``bench/harness/fast_upstream.py``), cut into reads of ``k`` events each:
   microseconds per event with the fast path on and off, alternating, best of ``repeats``.
   A busy gateway reads several events at once; a gateway that keeps up reads one.
2. **End to end.** Gateway processes with ``CAPTURE__FAST_RELAY`` on and off (and, with
   ``baseline``, the gateway of another git ref, from a worktree), against one upstream,
   on the same core, driven one at a time, closed loop with every call streamed, at a
   short and a long output length. The gateway's CPU per call at each length, and the
   slope between them: the CPU per streamed token, parsing, capture, stripping and the
   rest of the relay included. ``interval_ms`` paces the upstream's events as an engine's
   decode steps do (the gateway then reads about one event at a time); at 0 each call's
   events come at once and a read holds many. ``rounds`` rounds, alternating which side
   runs first; the ratios are per round, then their mean and range. With ``plain``, the
   plain reverse proxy of ``bench overhead`` runs as one more side: what any Python hop
   pays per token, parsing nothing. With ``stream_interval`` N > 1, one more side: the
   fast path against a second upstream that groups N tokens an event as vLLM's
   ``--stream-interval N`` does (the first token alone, the rest N at a time), so a read,
   a parse and a send carry N tokens; its ratio is that side over the fast path.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import statistics
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench.harness import procs
from bench.harness.fast_upstream import FastUpstream
from bench.runners.overhead import OverheadOptions, Target, machine, postgres_db, server_pid
from gateway.proxy.capture import Capture, ClientAsked
from gateway.proxy.sse import SSEDecoder

Progress = Callable[[str], None]
SIDES = {"fast": "true", "general": "false"}


@dataclass
class RelayOptions:
    tokens: int = 1500  # the in-process stream's length
    reads: list[int] = field(default_factory=lambda: [1, 4, 16])  # events per read
    repeats: int = 7
    lengths: tuple[int, int] = (100, 1500)  # output tokens per call, end to end
    rounds: int = 3
    step_s: float = 6.0
    interval_ms: float = 0.0  # between the upstream's events (0: each call's at once)
    baseline: str | None = None  # a git ref whose gateway runs as a third side
    plain: bool = False  # also the plain reverse proxy (bench/harness/plain_proxy.py)
    stream_interval: int = 1  # >1: also the fast path on N-token events (vLLM's flag)
    concurrency: int = 64
    server_cpus: str | None = "0"
    side_cpus: str | None = "1"
    pg_admin: str = "postgresql://postgres@127.0.0.1:5432/postgres"


async def _upstream_stream(tokens: int) -> bytes:
    """The benchmark upstream's answer to one streamed chat call, as the gateway asks it."""
    body = {"model": "bench", "messages": [{"role": "user", "content": "go"}], "stream": True,
            "max_tokens": tokens, "logprobs": True, "top_logprobs": 0,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    msgs = [{"type": "http.request", "body": orjson.dumps(body), "more_body": False}]
    sent: list[bytes] = []

    async def receive() -> dict[str, Any]:
        return msgs.pop(0)

    async def send(m: dict[str, Any]) -> None:
        sent.append(m.get("body", b""))

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    await FastUpstream()(scope, receive, send)
    return b"".join(sent)


def _reads(stream: bytes, k: int) -> list[bytes]:
    events = [e + b"\n\n" for e in stream.split(b"\n\n") if e]
    return [b"".join(events[i:i + k]) for i in range(0, len(events), k)]


def _decode_s(reads: list[bytes], fast: bool) -> float:
    asked = ClientAsked(token_ids=False, logprobs=False, usage=False)
    started = time.perf_counter()
    decoder = SSEDecoder(Capture(chat=True, asked=asked), fast=fast)
    for r in reads:
        decoder.feed(r)
    decoder.flush()
    return time.perf_counter() - started


def in_process(opts: RelayOptions, say: Progress) -> dict[str, Any]:
    stream = asyncio.run(_upstream_stream(opts.tokens))
    events = stream.count(b"\n\n")
    out: dict[str, Any] = {"events": events, "reads": {}}
    for k in opts.reads:
        say(f"in process: {k} events per read")
        reads = _reads(stream, k)
        best = {side: float("inf") for side in SIDES}
        for _ in range(opts.repeats):
            for side in SIDES:
                best[side] = min(best[side], _decode_s(reads, side == "fast"))
        us = {side: best[side] / events * 1e6 for side in SIDES}
        out["reads"][str(k)] = {"us_per_event": us, "ratio": us["fast"] / us["general"]}
    return out


def end_to_end(opts: RelayOptions, say: Progress) -> dict[str, Any]:
    rounds: list[dict[str, Any]] = []
    short, long = opts.lengths
    sides: dict[str, tuple[str, Path | None]] = {"fast": ("true", None),
                                                 "general": ("false", None)}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        if opts.baseline:
            say(f"checking out {opts.baseline}")
            sides["baseline"] = ("true", stack.enter_context(_checkout(opts.baseline, tmp)))
        upstream = stack.enter_context(procs.fast_upstream(
            opts.side_cpus, tmp / "upstream.log", interval_ms=opts.interval_ms))
        upstreams = dict.fromkeys(sides, upstream)
        if opts.stream_interval > 1:  # the same gateway, the engine sending N tokens an event
            sides["grouped"] = ("true", None)
            upstreams["grouped"] = stack.enter_context(procs.fast_upstream(
                opts.side_cpus, tmp / "upstream-grouped.log", interval_ms=opts.interval_ms,
                stream_interval=opts.stream_interval))
        targets: dict[str, Target] = {}
        for side, (flag, source) in sides.items():
            db = stack.enter_context(postgres_db(opts.pg_admin, f"rg_bench_relay_{side}"))
            env = {"ROLLOUT_GATEWAY_DISPATCH__CAP_PER_GPU": "4096",
                   "ROLLOUT_GATEWAY_CAPTURE__FAST_RELAY": flag,
                   "ROLLOUT_GATEWAY_TRACES__SPOOL_PATH": str(tmp / f"spool-{side}.jsonl")}
            url = stack.enter_context(procs.gateway(upstreams[side], db, opts.server_cpus,
                                                    env=env,
                                                    log=tmp / f"gateway-{side}.log",
                                                    source=source))
            targets[side] = Target(side, url, ["authorization: Bearer sk-bench-relay"],
                                   server_pid(url))
        if opts.plain:  # the floor: a Python hop that relays bytes and parses nothing
            url = stack.enter_context(procs.plain_proxy(upstream, opts.server_cpus,
                                                        tmp / "plain.log"))
            targets["plain"] = Target("plain", url, [], server_pid(url))
            sides["plain"] = ("", None)
        for r in range(opts.rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            row: dict[str, Any] = {}
            for side in order:
                row[side] = {}
                for n in (short, long):
                    say(f"round {r + 1}/{opts.rounds}: {side}, {n} tokens per call")
                    o = OverheadOptions(max_tokens=n, streamed="all",
                                        server_cpus=opts.server_cpus, side_cpus=opts.side_cpus)
                    targets[side].step(o, duration=2.0, concurrency=opts.concurrency)
                    step = targets[side].step(o, duration=opts.step_s,
                                              concurrency=opts.concurrency)
                    row[side][str(n)] = {"rps": step["achieved_rps"], "errors": step["errors"],
                                         "cpu_ms_per_call": step["server_cpu_ms_per_call"]}
                cpu = row[side]
                row[side]["us_per_token"] = ((cpu[str(long)]["cpu_ms_per_call"]
                                              - cpu[str(short)]["cpu_ms_per_call"])
                                             * 1000 / (long - short))
            for side in sides:
                if side != "fast":
                    row[f"fast_vs_{side}"] = (row["fast"]["us_per_token"]
                                              / row[side]["us_per_token"])
            if "grouped" in sides:
                row["grouped_vs_fast"] = 1 / row["fast_vs_grouped"]
            rounds.append(row)
        # which relay path each side's events took (the baseline's gateway may predate
        # the counter): proof of what ran
        paths = {side: _relayed_events(t.url) for side, t in targets.items()
                 if side != "plain"}
    out: dict[str, Any] = {"rounds": rounds, "sides": list(sides), "relayed_events": paths}
    keys = [f"fast_vs_{side}" for side in sides if side != "fast"]
    for key in [*keys, *(["grouped_vs_fast"] if "grouped" in sides else [])]:
        ratios = [r[key] for r in rounds]
        out[key] = {"mean": statistics.fmean(ratios), "min": min(ratios), "max": max(ratios)}
    return out


def _relayed_events(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = re.findall(r'^rollout_gateway_relayed_events_total\{path="(\w+)"\} (\S+)$', text,
                       re.M)
    return {path: float(n) for path, n in found}


@contextlib.contextmanager
def _checkout(ref: str, tmp: Path) -> Iterator[Path]:
    """A worktree of this repository at ``ref`` (the gateway as it was), removed after."""
    root = Path(__file__).resolve().parents[2]
    path = tmp / "baseline"
    subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", str(path), ref],
                   check=True, capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(path)],
                       check=False, capture_output=True)


def run_relay(opts: RelayOptions, say: Progress, command: str,
              e2e: bool = True) -> dict[str, Any]:
    started = time.time()
    doc: dict[str, Any] = {"command": command, "machine": machine(),
                           "options": {"tokens": opts.tokens, "reads": opts.reads,
                                       "repeats": opts.repeats, "lengths": list(opts.lengths),
                                       "rounds": opts.rounds, "step_s": opts.step_s,
                                       "interval_ms": opts.interval_ms,
                                       "baseline": opts.baseline, "plain": opts.plain,
                                       "stream_interval": opts.stream_interval,
                                       "concurrency": opts.concurrency},
                           "in_process": in_process(opts, say) if opts.repeats else None}
    if e2e:
        doc["end_to_end"] = end_to_end(opts, say)
    doc["wall_s"] = time.time() - started
    return doc
