"""``rollout-gateway bench overhead``, ``store``, ``headroom``, ``split`` and ``relay``
(registered by ``bench.cli``)."""

from __future__ import annotations

import json
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

OVERHEAD_INTRO = """\
What the gateway adds to one call, against a direct call, a plain reverse proxy and the
LiteLLM proxy, on the same upstream and the same core. `bench/harness/fast_upstream.py`
answers at once in vLLM's wire format (16 generated tokens unless `--max-tokens`; prompt
ids, token ids and logprobs when asked, which the gateway always asks and strips); the
load generator (`bench/harness/loadgen.py`, its own process, aiohttp + uvloop) sends chat
calls open-loop at fixed rates, alternating streamed and non-streamed, each with
`X-Trajectory-Id` (8 calls a trajectory) and a bearer key. The plain reverse proxy
(`bench/harness/plain_proxy.py`: aiohttp server and client on uvloop, bytes forwarded and
relayed chunk by chunk, nothing parsed or recorded) is the floor any Python hop pays. The
gateway runs as `python -m gateway serve` (uvloop + httptools, default policy,
`DISPATCH__CAP_PER_GPU=4096`) with traces ON into Postgres; LiteLLM runs its proxy from
its own virtualenv as its production guide sets it up (one worker per core it gets, log
level ERROR, master key, no retries) with a custom logging callback that writes every
call to a file; its own readiness check and error output are read before and after the
run. A max-rate step is sustained when every call of the step is answered without error
and p99 stays under 50 ms. This VM is shared: other sessions' processes run on both
cores, so absolute numbers move between runs; the ratios are measured side by side in
one run.

Profile (py-spy on the gateway process at 300 req/s, this mix; flame graph
[docs/benchmarks/overhead/profile.svg](docs/benchmarks/overhead/profile.svg), taken
before the round described next). Earlier rounds made the API-key dependency `async`,
left the disconnect watcher as the only extra task per call, moved trace batches to
`COPY`, and batched the restore lookup (one existence query per millisecond). The last
round (issue 14) cut what a profile under load showed: the completion routes take a raw ASGI
path (`gateway/api/openai.py: serve_raw`) that skips FastAPI's middleware, router and
dependency solving (about 20% of the samples on FastAPI 0.165) and Starlette's
`StreamingResponse` task group (13%) while keeping the key check, body limits, CORS and
OpenAI error shapes; each SSE token event is parsed once with no repeated lookups; the
`serve` process raises the young-generation GC threshold to 7000 (at 700 the collector
ran ~30 passes a second over the objects of calls in flight, freeing nothing, with
3-10 ms pauses). Byte-level splicing of token events was measured and not done:
re-serializing an event is ~1.2 us of ~13 us. What a profile of the new path shows
(under load, shares of active samples): the trace writer ~6%, restore lookups ~5% plus
their ORM session work, a timeout context per upstream chunk ~5%, SSE decode and capture
~5%, the scheduler loop ~4.5%; the rest is the request path itself (aiohttp client
request building, uvicorn, the proxy)."""

STORE_INTRO = """\
How fast traces reach Postgres, and how big they are. Two measurements, labelled as
such: **writer** drives `gateway.store.writer.TraceWriter` directly with call records
(the gateway's real writer code, no HTTP), **end-to-end** drives multi-turn trajectories
with long token sequences through a gateway process against `bench/harness/fast_upstream.py`
(prompt ids extend the previous prompt+completion token for token, as with a real chat
model) and counts what lands in the database. Bytes per token = `pg_total_relation_size`
of `calls` + `trajectories` (heap, TOAST and indexes) / tokens recorded (new prompt
tokens + completion tokens, each stored once). Linearity: trajectories of 10, 20, 40
and 80 turns alone in a fresh database; a fitted exponent near 1 means storage grows
linearly with length (prefix delta), 2 would be quadratic."""


HEADROOM_INTRO = """\
How many calls per second a large pool sends, and how many a gateway process takes
(`bench/runners/headroom.py`; the design for several processes is docs/scaling.md).
Demand comes from the simulator (when each call becomes ready), per GPU at each
workload's own batch size, projected to larger pools at the same trajectories per GPU;
supply is one gateway process on one core at closed-loop saturation, traces on into
Postgres, for each workload's median output length (a streamed call is one SSE event per
token for the gateway to parse). Processes = peak demand / supply at that length. The
sharding line runs one batch under one scheduler and split into two group-hashed
shards. This VM is shared: the supply figures move with the load printed beside them."""


RecordTo = Annotated[Path | None, typer.Option(
    "--record", help="write this run's section into this BENCHMARKS.md")]


def _progress(console: Console) -> tuple[Progress, Callable[[str], None]]:
    prog = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                    console=console, transient=False)
    task = prog.add_task("starting", total=None)

    def say(msg: str) -> None:
        prog.update(task, description=msg)

    return prog, say


def _command(name: str) -> str:
    return " ".join(["rollout-gateway", "bench", name, *map(shlex.quote, sys.argv[3:])])


def _finish(doc: dict[str, Any], out: Path, name: str, markdown: Callable[..., str],
            plots: Callable[..., dict[str, str]], record_to: Path | None, intro: str) -> str:
    """Write the run's JSON and markdown (and its BENCHMARKS.md section); the markdown."""
    from bench.reports.perf import record

    (out / f"{name}.json").write_text(json.dumps(doc, indent=2))
    paths = plots(doc, out)
    md = markdown(doc, paths)
    (out / f"{name}.md").write_text(f"# bench {name}\n\n{md}")
    if record_to is not None:
        record(record_to, f"bench {name}", intro, md, out, paths,
               record_to.parent / "docs" / "benchmarks" / name)
    return md


def overhead(
    rate: Annotated[list[float] | None, typer.Option(help="fixed open-loop rate, req/s "
                                                          "(repeatable)")] = None,
    duration: Annotated[float, typer.Option(help="seconds per fixed rate")] = 15.0,
    search_step: Annotated[float, typer.Option(help="seconds per max-rate step")] = 4.0,
    search_steps: Annotated[int, typer.Option(help="max-rate search steps at most")] = 7,
    target: Annotated[list[str] | None, typer.Option(
        help="direct | plain | gateway | litellm (repeatable; default all four)")] = None,
    max_tokens: Annotated[int, typer.Option(help="tokens the upstream generates per call "
                                                 "(streamed calls: one SSE event each)")] = 16,
    server_cpus: Annotated[str, typer.Option(help="taskset CPUs of the server under test "
                                                  "('' = unpinned)")] = "0",
    side_cpus: Annotated[str, typer.Option(help="CPUs of upstream + load generator")] = "1",
    pg_admin: Annotated[str, typer.Option(help="Postgres DSN to create the run's DB")]
    = "postgresql://postgres@127.0.0.1:5432/postgres",
    out: Annotated[Path, typer.Option(help="output directory")] = Path(
        "artifacts/bench/overhead"),
    record_to: RecordTo = None,
) -> None:
    """Added latency and max request rate: direct vs a plain reverse proxy vs gateway vs
    the LiteLLM proxy."""
    from bench.reports.perf import overhead_markdown, overhead_plots
    from bench.runners.overhead import OverheadOptions, run_overhead

    opts = OverheadOptions(out=out, duration_s=duration, search_step_s=search_step,
                           search_steps=search_steps,
                           server_cpus=server_cpus or None, side_cpus=side_cpus or None,
                           pg_admin=pg_admin, max_tokens=max_tokens)
    if rate:
        opts.rates = list(rate)
    if target:
        opts.targets = list(target)
    console = Console()
    prog, say = _progress(console)
    with prog:
        doc = run_overhead(opts, say, _command("overhead"))
    out.mkdir(parents=True, exist_ok=True)
    _finish(doc, out, "overhead", overhead_markdown, overhead_plots, record_to,
            OVERHEAD_INTRO)
    console.print_json(json.dumps(doc["summary"]))
    console.print(f"report: {out}/overhead.md")


def store(
    writer_trajectories: Annotated[int, typer.Option(help="trajectories for the writer "
                                                          "measurement")] = 400,
    trajectories: Annotated[int, typer.Option(help="end-to-end trajectories")] = 32,
    turns: Annotated[int, typer.Option(help="turns per trajectory")] = 20,
    concurrency: Annotated[int, typer.Option(help="end-to-end trajectories at once")] = 32,
    linear_turns: Annotated[list[int] | None, typer.Option(
        help="lengths of the linearity trajectories (repeatable)")] = None,
    server_cpus: Annotated[str, typer.Option(help="taskset CPUs of the gateway")] = "0",
    side_cpus: Annotated[str, typer.Option(help="CPUs of upstream + harness")] = "1",
    pg_admin: Annotated[str, typer.Option(help="Postgres DSN to create the run's DBs")]
    = "postgresql://postgres@127.0.0.1:5432/postgres",
    out: Annotated[Path, typer.Option(help="output directory")] = Path("artifacts/bench/store"),
    routes: Annotated[str | None, typer.Option(
        help="also measure the writer without and with this router's routed experts on "
             "every call, in segment files and in the rows (qwen3-30b-a3b, qwen3-235b-a22b, "
             "gpt-oss-120b, glm-4.5-air)")] = None,
    routes_trajectories: Annotated[int, typer.Option(
        help="trajectories of that measurement")] = 40,
    routes_repeats: Annotated[int, typer.Option(
        help="times its runs (without, files, database) are alternated")] = 2,
    record_to: RecordTo = None,
) -> None:
    """Trace-recording rate into Postgres, bytes per token, linear growth per trajectory."""
    from bench.reports.perf import store_markdown, store_plots
    from bench.runners.store import StoreOptions, run_store
    from bench.runners.store_routes import routes_rate

    opts = StoreOptions(writer_trajectories=writer_trajectories,
                        e2e_trajectories=trajectories, turns=turns, concurrency=concurrency,
                        server_cpus=server_cpus or None, side_cpus=side_cpus or None,
                        pg_admin=pg_admin, out=out, routes=routes,
                        routes_trajectories=routes_trajectories,
                        routes_repeats=routes_repeats)
    if routes is not None:
        from backends.sim.routes import MOE_SHAPES

        if routes not in MOE_SHAPES:
            raise typer.BadParameter(f"not one of {sorted(MOE_SHAPES)}", param_hint="--routes")
    if linear_turns:
        opts.linear_turns = list(linear_turns)
    console = Console()
    prog, say = _progress(console)
    with prog:
        doc = run_store(opts, say, _command("store"))
        if routes is not None:  # bench.runners.store_routes
            started = time.time()
            doc["routes"] = routes_rate(opts, say)
            doc["wall_s"] += time.time() - started
    _finish(doc, out, "store", store_markdown, store_plots, record_to, STORE_INTRO)
    console.print_json(json.dumps(doc["targets"]))
    console.print(f"report: {out}/store.md")


def headroom(
    workload: Annotated[list[str] | None, typer.Option(
        help="repeatable; default every workload in workloads.json")] = None,
    gpus: Annotated[int, typer.Option(help="simulated GPUs for the demand side")] = 64,
    check_gpus: Annotated[int, typer.Option(
        help="rerun the first workload at this pool and a proportional batch (0 = skip)")]
    = 128,
    pool: Annotated[list[int] | None, typer.Option(
        help="pool sizes to project to (repeatable; default 512 and 2048)")] = None,
    policy: Annotated[str, typer.Option(help="the policy the simulator runs")] = "slime",
    saturation_s: Annotated[float, typer.Option(help="seconds per saturation step")] = 6.0,
    server_cpus: Annotated[str, typer.Option(help="taskset CPUs of the gateway")] = "0",
    side_cpus: Annotated[str, typer.Option(help="CPUs of upstream + load generator")] = "1",
    out: Annotated[Path, typer.Option(help="output directory")] = Path(
        "artifacts/bench/headroom"),
    record_to: RecordTo = None,
) -> None:
    """Calls per second large pools produce vs what one gateway process sustains."""
    from bench.runners.headroom import HeadroomOptions, headroom_markdown, run_headroom

    opts = HeadroomOptions(gpus=gpus, check_gpus=check_gpus or None, policy=policy,
                           saturation_s=saturation_s, server_cpus=server_cpus or None,
                           side_cpus=side_cpus or None, out=out)
    if workload:
        opts.workloads = list(workload)
    if pool:
        opts.pools = list(pool)
    console = Console()
    prog, say = _progress(console)
    with prog:
        doc = run_headroom(opts, say, _command("headroom"))
    md = _finish(doc, out, "headroom", lambda d, _plots: headroom_markdown(d),
                 lambda _d, _out: {}, record_to, HEADROOM_INTRO)
    console.print(md)
    console.print(f"report: {out}/headroom.md")


def split(
    workload: Annotated[list[str] | None, typer.Option(
        help="repeatable; default swe, search, math-code, tau")] = None,
    seeds: Annotated[int, typer.Option(help="seeds 1..N")] = 5,
    gpus: Annotated[int, typer.Option(help="GPUs per shard")] = 32,
    shards: Annotated[int, typer.Option()] = 2,
    per_gpu: Annotated[int, typer.Option(help="trajectories per GPU")] = 8,
    policy: Annotated[str, typer.Option(help="the policy each scheduler runs")] = "replay",
    rebalance_s: Annotated[float, typer.Option(
        help="also the split with the front's rebalancer looking this often (simulated "
        "seconds; its other settings the defaults); 0: not")] = 10.0,
    jobs: Annotated[int, typer.Option(help="processes")] = 2,
    json_out: Annotated[Path | None, typer.Option("--json")] = None,
) -> None:
    """What scheduling in shards costs: one scheduler vs the batch split by trajectory hash,
    and split with the front's rebalancer moving instances between the shards."""
    from bench.runners.headroom import HeadroomOptions
    from bench.runners.split import run_split
    from bench.simulator.sharded import Rebalancing

    if shards < 2 or seeds < 1:
        raise typer.BadParameter("need --shards >= 2 and --seeds >= 1")
    opts = HeadroomOptions(gpus=gpus, policy=policy, shards=shards,
                           rebalance=Rebalancing(rebalance_s) if rebalance_s > 0 else None)
    wls = workload or ["swe", "search", "math-code", "tau"]
    res = run_split(wls, range(1, seeds + 1), opts, per_gpu, jobs)
    for w, r in res.items():
        lo, hi = r["ci95"]
        typer.echo(f"{w}: {shards} shards of {gpus} GPUs / one scheduler over "
                   f"{shards * gpus}: {r['ratio_geomean']:.3f}x (95% CI {lo:.3f}-{hi:.3f}, "
                   f"{r['seeds']} seeds)")
        if "rebalanced" in r:
            rb = r["rebalanced"]
            typer.echo(f"  with the rebalancer: {rb['ratio_geomean']:.3f}x "
                       f"({rb['ci95'][0]:.3f}-{rb['ci95'][1]:.3f}); over the plain split "
                       f"{rb['over_sharded']['ratio_geomean']:.3f}x, moves per batch "
                       f"{[len(m) for m in rb['moves']]}")
    if json_out is not None:
        json_out.write_text(json.dumps({"command": " ".join(["rollout-gateway", "bench",
                                                             "split", *sys.argv[3:]]),
                                        "results": res}, indent=1))


def relay(
    rounds: Annotated[int, typer.Option(help="end-to-end rounds (0: in process only)")] = 3,
    step_s: Annotated[float, typer.Option(help="seconds per saturation step")] = 6.0,
    repeats: Annotated[int, typer.Option(
        help="in-process repeats, best of (0: end to end only)")] = 7,
    interval_ms: Annotated[float, typer.Option(
        help="between the upstream's events (0: each call's at once)")] = 0.0,
    plain: Annotated[bool, typer.Option(
        help="also the plain reverse proxy: what any Python hop pays")] = False,
    stream_interval: Annotated[int, typer.Option(
        min=1, help="also the fast path on events of N tokens (vLLM's --stream-interval "
        "N); 1: not run")] = 1,
    short: Annotated[int, typer.Option(help="output tokens per call, short")] = 100,
    long: Annotated[int, typer.Option(help="output tokens per call, long")] = 1500,
    baseline: Annotated[str | None, typer.Option(
        help="also run the gateway of this git ref (a worktree), e.g. HEAD~1")] = None,
    server_cpus: Annotated[str, typer.Option(help="taskset CPUs of the gateways")] = "0",
    side_cpus: Annotated[str, typer.Option(help="CPUs of upstream + load generator")] = "1",
    json_out: Annotated[Path, typer.Option("--json", help="write the results here")] = Path(
        "artifacts/bench/relay.json"),
) -> None:
    """CPU per streamed token: the relay's fast path against its general path."""
    from bench.reports.relay_table import relay_markdown
    from bench.runners.relay import RelayOptions, run_relay

    opts = RelayOptions(rounds=rounds, step_s=step_s, repeats=repeats,
                        interval_ms=interval_ms, baseline=baseline, lengths=(short, long),
                        plain=plain, stream_interval=stream_interval,
                        server_cpus=server_cpus or None, side_cpus=side_cpus or None)
    console = Console()
    prog, say = _progress(console)
    with prog:
        doc = run_relay(opts, say, _command("relay"), e2e=rounds > 0)
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(doc, indent=1))
    console.print(relay_markdown(doc))
    console.print(f"results: {json_out}")


def routes(
    router: Annotated[str, typer.Option(
        help="the engine's router: qwen3-30b-a3b, qwen3-235b-a22b, gpt-oss-120b, "
             "glm-4.5-air, tiny-moe")] = "qwen3-30b-a3b",
    trajectories: Annotated[int, typer.Option(min=1, help="trajectories per run")] = 8,
    turns: Annotated[int, typer.Option(min=1, help="turns per trajectory")] = 10,
    concurrency: Annotated[int, typer.Option(min=1, help="trajectories at once")] = 4,
    repeats: Annotated[int, typer.Option(min=1, help="runs of every mode, alternated")] = 2,
    speed: Annotated[float, typer.Option(help="the simulated engines' time compression")]
    = 100.0,
    server_cpus: Annotated[str, typer.Option(help="taskset CPUs of the gateway")] = "0",
    side_cpus: Annotated[str, typer.Option(help="CPUs of the engines and the client")] = "1",
    pg_admin: Annotated[str, typer.Option(help="Postgres DSN to create the run's DBs")]
    = "postgresql://postgres@127.0.0.1:5432/postgres",
    out: Annotated[Path, typer.Option(help="output directory")] = Path("artifacts/bench/routes"),
) -> None:
    """What recording routed experts adds to a call: latency and gateway CPU, dense vs
    routes asked from where the record ends vs from 0, streamed and not (docs/moe.md)."""
    from backends.sim.routes import MOE_SHAPES
    from bench.runners.routes import RoutesOptions, routes_markdown, run_routes

    if router not in MOE_SHAPES:
        raise typer.BadParameter(f"not one of {sorted(MOE_SHAPES)}", param_hint="--router")
    opts = RoutesOptions(router=router, trajectories=trajectories, turns=turns,
                         concurrency=concurrency, repeats=repeats, speed=speed,
                         server_cpus=server_cpus or None, side_cpus=side_cpus or None,
                         pg_admin=pg_admin, out=out)
    console = Console()
    prog, say = _progress(console)
    with prog:
        doc = run_routes(opts, say, _command("routes"))
    (out / "routes.json").write_text(json.dumps(doc, indent=2))
    md = routes_markdown(doc)
    (out / "routes.md").write_text(f"# bench routes\n\n{md}")
    console.print(md)


def viewer(
    calls: Annotated[int, typer.Option(min=1, help="calls in the trajectory")] = 200,
    prompt_tokens: Annotated[int, typer.Option(min=1, help="new prompt tokens a call")] = 250,
    completion_tokens: Annotated[int, typer.Option(min=1, help="generated tokens a call")]
    = 250,
    repeats: Annotated[int, typer.Option(min=1, help="page loads of each mode, alternated")]
    = 3,
    chromium: Annotated[str, typer.Option(help="the Chromium binary (Debian's)")]
    = "/usr/bin/chromium",
    out: Annotated[Path, typer.Option(help="output directory")] = Path("artifacts/bench/viewer"),
) -> None:
    """A long trajectory (100k tokens, 200 calls by default) in the trajectory viewer, in
    headless Chromium: drawn block by block against every token at once (docs/status-page.md)."""
    from bench.runners.viewer import ViewerOptions, run_viewer, viewer_markdown

    opts = ViewerOptions(calls=calls, prompt_tokens=prompt_tokens,
                         completion_tokens=completion_tokens, repeats=repeats,
                         chromium=chromium, out=out)
    console = Console()
    prog, say = _progress(console)
    with prog:
        doc = run_viewer(opts, say, _command("viewer"))
    (out / "viewer.json").write_text(json.dumps(doc, indent=2))
    md = viewer_markdown(doc)
    (out / "viewer.md").write_text(f"# bench viewer\n\n{md}")
    console.print(md)
