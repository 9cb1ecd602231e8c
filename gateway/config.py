"""One typed settings tree, read once from the environment (prefix ``ROLLOUT_GATEWAY_``).

Top-level names are the stable contract (``DATABASE_URL``, ``ADMIN_TOKEN``, ``BACKENDS``,
``POOL``, ``POLICY``); tuning knobs live in nested groups and are set with a double
underscore, e.g. ``ROLLOUT_GATEWAY_UPSTREAM__FIRST_BYTE_TIMEOUT_S=30``.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Literal

import orjson
from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DEFAULT_SQLITE_URL = "sqlite+aiosqlite:///rollout-gateway.db"


class UpstreamSettings(BaseModel):
    """Limits on every call to a backend. All in seconds."""

    connect_timeout_s: float = 5.0
    first_byte_timeout_s: float = 600.0
    idle_timeout_s: float = 300.0
    total_timeout_s: float = 3600.0
    max_attempts: int = Field(3, ge=1, description="backends tried before the first byte")
    max_connections: int = 4096
    keepalive_s: float = Field(
        4.0, ge=0, description="idle pooled connections to a backend are closed after this; "
        "shorter than vLLM's own idle close (uvicorn, 5 s) so a call never races it")
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    unhealthy_after: int = Field(2, ge=1, description="consecutive failed checks")
    breaker_failures: int = Field(
        5, ge=1, description="consecutive failed calls (refused, 5xx, timeout, broken stream) "
        "that open a backend's circuit breaker")
    breaker_cooldown_s: float = Field(
        10.0, ge=0, description="how long an open breaker keeps the backend out of rotation "
        "before one probe call is let through (half-open)")


class TraceSettings(BaseModel):
    """The batched trace writer."""

    queue_size: int = Field(100_000, ge=1)
    overflow_size: int = Field(
        100_000, ge=0, description="records held in memory beyond the queue while neither "
        "the database nor the spool takes them (a full or read-only disk during an outage); "
        "past queue_size + overflow_size records the gateway refuses model calls (503 "
        "recording_unavailable) rather than answer calls it cannot record")
    batch_size: int = Field(500, ge=1)
    routes_backlog: int = Field(
        2_000, ge=0, description="records waiting to be written beyond which a new "
        "record's routed experts (MoE routing replay, docs/moe.md) are left out, counted "
        "in routes_dropped: routes are ~50x a call's tokens, and a writer behind on them "
        "would hold them in memory; its tokens are kept whatever happens")
    routes_retention_s: float | None = Field(
        None, gt=0, description="routed experts of calls that started longer ago than this "
        "are cleared from the store (their tokens stay; docs/moe.md, \"Retention\"); "
        "None: kept as long as the calls")
    routes_store: Literal["files", "database"] = Field(
        "files", description="where routed experts are kept: append-only segment files in "
        "routes_dir, the rows holding where (gateway/store/route_files.py), or the calls' "
        "rows themselves (a fifth of the writer's rate on Postgres; docs/moe.md)")
    routes_dir: Path | None = Field(
        None, description="the segment files' directory, which every process of the "
        "gateway must see (default: beside an SQLite file, <file>.routes/; else "
        "~/.cache/rollout-gateway/routes/<hash of DATABASE_URL>/)")
    flush_interval_s: float = 0.25
    retry_backoff_s: float = 0.5
    retry_backoff_max_s: float = 5.0
    store_text: bool = True
    spool_path: Path | None = Field(
        None, description="spool file for records the database cannot take yet, owned "
        "(locked) by one process (default: the first free slot of "
        "~/.cache/rollout-gateway/spool/<hash of DATABASE_URL>[.sN].jsonl)")
    spool_max_bytes: int = Field(2 * 1024**3, ge=0)


class RestoreSettings(BaseModel):
    """How the first call of a trajectory the gateway does not hold (after a restart)
    finds its state in the store (gateway/trajectories/restore.py). All in seconds."""

    wait_s: float = Field(
        10.0, gt=0, description="how long such a call waits for the store to say whether it "
        "knows the trajectory (and for the trace writer to store what it still holds of "
        "it); past it the call is answered 503 with Retry-After and not run, never served "
        "as a new trajectory on a guess")
    query_timeout_s: float = Field(
        5.0, gt=0, description="one lookup query; a failed or timed-out query is tried "
        "again on a fresh connection while calls still wait for it")
    retry_after_s: float = Field(2.0, ge=0, description="the Retry-After of that 503")
    batch_window_s: float = Field(
        0.001, ge=0, description="the unknown ids arriving within this share one existence "
        "query (a batch start of hundreds of new trajectories costs one query)")


class TrajectorySettings(BaseModel):
    """Live trajectories in memory (gateway/trajectories/expiry.py). In seconds."""

    idle_expire_s: float = Field(
        1800.0, gt=0, description="a trajectory left unfinished, with no call queued or "
        "running and none for this long, is forgotten: its memory is freed and the "
        "policies stop counting it as running (a harness that died never finishes it). "
        "Nothing recorded is lost: a later call of the id restores it from the store, as "
        "after a restart")


class TrainingSettings(BaseModel):
    """The trainer's training-inference mismatch reports (gateway/mismatch.py): a report
    past any one limit raises the alarm (a warning, an event, a counter)."""

    mismatch_kl: float = Field(
        0.01, gt=0, description="k3 estimate of KL(engine || trainer) per trained token")
    mismatch_outside_share: float = Field(
        0.05, gt=0, le=1, description="share of trained tokens whose importance ratio "
        "exp(trainer - engine logprob) is outside [0.8, 1.25]")
    mismatch_abs_diff: float = Field(
        0.1, gt=0, description="mean |trainer logprob - engine logprob| per trained token")


class DispatchSettings(BaseModel):
    """How the dispatcher holds calls it cannot place yet. All in seconds."""

    pause_mode: Literal["wait", "reject"] = Field(
        "wait", description="while paused for weight sync: hold new calls until resume "
        "(429 after pause_max_wait_s), or answer 429 with Retry-After at once")
    pause_max_wait_s: float = Field(600.0, ge=0)
    pause_retry_after_s: float = Field(5.0, ge=0)
    backend_wait_s: float = Field(
        300.0, ge=0, description="while a managed pool reconfigures and no instance is "
        "routable, hold calls this long before answering 503")
    cap_per_gpu: int = Field(
        16, ge=1, description="gateway-side concurrency cap per GPU of an instance: calls "
        "beyond it wait in the gateway queue, where the policy orders them")
    max_queued: int = Field(10_000, ge=1, description="queued calls before 503 + Retry-After")
    queue_timeout_s: float = Field(3600.0, gt=0)
    overload_retry_after_s: float = Field(2.0, ge=0)
    send_priority: bool = Field(True, description="stamp the policy's vLLM `priority` field")
    speed_profile: str = Field(
        "qwen3-14b/H100", description="latency profile (MODEL/GPU) the policies use to "
        "estimate per-token time and interference per TP degree")
    migrate: bool = Field(True, description="let policies move trajectories in tool gaps")
    tick_s: float = Field(0.5, gt=0, description="periodic rescheduling (aging, pool changes)")
    watchdog_s: float = Field(
        10.0, gt=0, description="a queue that has not dispatched for this long while some "
        "backend has a free slot is reported as stalled (log, /status, /metrics)")
    restart_s: float = Field(10.8, ge=0, description="cost of restarting an instance with a "
                             "new TP degree, weighed by planners (Libra measures 10.8 s)")
    time_scale: float = Field(
        1.0, gt=0, description="policy seconds per wall second: the speed factor of a "
        "time-compressed simulated pool, so the policy plans as often as in the simulator")
    model_shares: dict[str, float] = Field(
        {}, description="weights of the models that share a base's engines (the base and "
        "its LoRA families) when their queued calls outnumber its free slots: the free "
        "slots are split by weighted max-min fairness over calls in flight (default weight "
        "1 each); e.g. '{\"solver\": 2}'. See gateway/dispatch/shares.py")

    @field_validator("model_shares")
    @classmethod
    def _positive_shares(cls, value: dict[str, float]) -> dict[str, float]:
        bad = {m: w for m, w in value.items() if not w > 0}
        if bad:
            raise ValueError(f"model_shares must be positive; got {bad}")
        return value


class ServerSettings(BaseModel):
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1, description="larger bodies get 413")
    max_json_depth: int = Field(
        64, ge=2, le=200, description="nesting of objects and arrays a model call's body may "
        "have (the body itself is level 1); deeper is answered 400 at the door. Below the "
        "255 levels the trace writer's JSON encoder takes, so a stored request never fails")
    response_store_size: int = Field(
        10_000, ge=1, description="Responses API: how many responses `previous_response_id` "
        "can refer to (least recently used forgotten first; one sent with `store: false` "
        "is not kept)")
    response_store_ttl_s: float = Field(
        3600.0, gt=0, description="Responses API: how long a stored response can be chained")
    cors_origins: list[str] = []
    max_in_flight: int = Field(
        4096, ge=0, description="LLM calls admitted at once (queued or running); more are "
        "answered 503 with Retry-After. 0: no limit")
    overload_retry_after_s: float = Field(1.0, ge=0)
    wait_ready: bool = Field(
        False, description="open the HTTP port only once the managed pool is ready (its "
        "initial layout started and an engine up; `serve --wait-ready`); startup fails if no "
        "engine of it came up. Off: the port opens at once and GET /ready says when")
    shutdown_delay_s: float = Field(
        2.0, ge=0, description="after SIGTERM, keep serving this long with /health at 503 so "
        "load balancers stop sending, then stop accepting")
    shutdown_grace_s: float = Field(
        30.0, ge=0, description="then wait this long for calls in flight to finish")
    keep_alive_s: float = Field(
        75.0, gt=0, description="idle client connections are closed after this; longer than "
        "clients' own pool expiry (httpx/openai: 5 s) so a request never races the close")
    allowed_hosts: list[str] = Field(
        [], description="Host header values served besides the bound address (and localhost, "
        "127.0.0.1, [::1] on loopback); `*.example.com` matches subdomains, `*` any host. "
        "Other hosts get 400 (DNS rebinding). A wildcard bind (0.0.0.0, ::) serves any host "
        "until this is set")
    header_timeout_s: float = Field(
        10.0, gt=0, description="a request's line and headers must arrive within this "
        "(from the connection's first byte, or the first byte after the previous "
        "response); else 408 and the connection is closed")
    body_timeout_s: float = Field(
        60.0, gt=0, description="a request's whole body must arrive within this after its "
        "headers; else 408 (or, once an answer has started, the connection is closed)")
    max_connections_per_client: int = Field(
        4096, ge=0, description="open connections one client IP may hold; more are answered "
        "429 and closed. 0: no cap. A batch of N concurrent harnesses in one process holds "
        "about N (the benchmarks open up to ~2,100 from one address)")


class CaptureSettings(BaseModel):
    """How a chat call's prompt reaches the engine (docs/token-capture.md)."""

    token_in: bool = Field(
        True, description="when a harness re-renders the model's earlier turns (re-serialized "
        "tool arguments, re-rendered tool-call blocks, decode/encode drift), run the engine "
        "on the tokens the model generated instead, so the sample keeps them all")
    clamp_max_tokens: bool = Field(
        True, description="lower a call's max_tokens to the context its prompt leaves, as "
        "production proxies do, instead of letting the engine answer 400")
    tokenize_timeout_s: float = Field(
        10.0, gt=0, description="limit on the engine's /tokenize call that both need; past "
        "it the call goes on as the harness sent it")
    fast_relay: bool = Field(
        True, description="capture and strip runs of plain streamed token events in one "
        "typed decode and encode (gateway/proxy/token_runs.py) instead of event by event; "
        "off: every event takes the general path (to compare, or if an engine's stream "
        "should confuse it)")
    routes_new_only: bool = Field(
        True, description="ask a mixture-of-experts engine for routed experts only from the "
        "first position the trajectory's record lacks (docs/moe.md); off: every call asks "
        "from position 0 (to measure what asking only new positions saves)")


class ShardSettings(BaseModel):
    """The front of a sharded gateway: when it moves engines between shards on its own
    (docs/scaling.md, "Rebalancing")."""

    rebalance_s: float = Field(
        0.0, ge=0, description="how often the front compares the shards' load; 0: never "
        "(engines move only on request, POST /admin/backends/s0/b1/move)")
    rebalance_ratio: float = Field(
        2.0, gt=1, description="move an engine only when the busiest shard has this many "
        "times the calls per GPU of the idlest (smoothed over the last looks)")
    rebalance_min_calls: int = Field(
        8, ge=1, description="and only when the busiest shard has at least this many calls "
        "running or queued: a near-idle pool is not worth a drain and a start")
    rebalance_cooldown_s: float = Field(
        30.0, ge=0, description="after a move ends, wait this long before the next look "
        "counts (the load must show the new layout first)")


class Settings(BaseSettings):
    """Everything the gateway reads from its environment."""

    model_config = SettingsConfigDict(
        env_prefix="ROLLOUT_GATEWAY_",
        env_nested_delimiter="__",
        extra="ignore",
    )

    database_url: str = DEFAULT_SQLITE_URL
    shard_index: int | None = Field(
        None, ge=0, description="this process's place among a sharded gateway's shards "
        "(set by serve --shards): the store they share has one owner of its upkeep, shard 0")
    admin_token: str | None = Field(
        None, description="the operator's bearer token: everything, the admin API included")
    trainer_token: str | None = Field(
        None, description="the trainer's bearer token: the trajectory API (list, finish with "
        "a reward, samples, scoped keys) and model calls; the admin token works there too")
    api_keys: Annotated[list[str], NoDecode] = Field(
        [], description="harness keys: model calls (/v1) for any trajectory, nothing else")
    key_secret: str | None = Field(
        None, description="signs the harness keys scoped to one trajectory "
        "(POST /trajectories/{id}/key); default: derived from the admin token, else the "
        "trainer token, else random per process (keys then die with it)")
    backends: Annotated[list[str], NoDecode] = []
    pool: Path | None = None
    policy: str = Field("replay",
                        description="scheduling/placement policy (see docs/policies.md)")
    weight_version: str = "0"
    auto_migrate: bool = Field(True, description="run Alembic migrations at start-up")
    model_aliases: Annotated[dict[str, str], NoDecode] = Field(
        {}, description="a harness's own model names mapped to a served model: exact names "
        "or globs (`*`, `?`, `[...]`; the first matching glob in the order given wins, a "
        "served model is never redirected by a glob). From the environment as "
        "`claude-*=qwen3-14b,gpt-5*=qwen3-14b` or a JSON object; see "
        "gateway/proxy/aliases.py")
    lora_models: Annotated[dict[str, str], NoDecode] = Field(
        {}, description="LoRA families served from the start, model name -> base model "
        "(`solver=qwen3-8b,verifier=qwen3-8b` or a JSON object): calls for a family run on "
        "its base's weights until its first adapter (POST /admin/weight-update, method "
        "lora, with `model`), each family with its own weight version; see "
        "gateway/adapters.py")

    server: ServerSettings = ServerSettings()
    upstream: UpstreamSettings = UpstreamSettings()
    traces: TraceSettings = TraceSettings()
    dispatch: DispatchSettings = DispatchSettings()
    capture: CaptureSettings = CaptureSettings()
    restore: RestoreSettings = RestoreSettings()
    trajectories: TrajectorySettings = TrajectorySettings()
    training: TrainingSettings = TrainingSettings()
    shards: ShardSettings = ShardSettings()

    @field_validator("backends", "api_keys", mode="before")
    @classmethod
    def _split_csv(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("model_aliases", "lora_models", mode="before")
    @classmethod
    def _parse_aliases(cls, value: object) -> object:
        """``name=model`` pairs separated by commas, or a JSON object."""
        if not isinstance(value, str):
            return value
        if value.strip().startswith("{"):
            return orjson.loads(value)
        out: dict[str, str] = {}
        for pair in filter(None, (p.strip() for p in value.split(","))):
            pattern, sep, target = (part.strip() for part in pair.partition("="))
            if not sep or not pattern or not target:
                raise ValueError(f"{pair!r} is not of the form name=model")
            out[pattern] = target
        return out

    @field_validator("policy")
    @classmethod
    def _current_policy_name(cls, value: str) -> str:
        """An old policy name (``ours-lane``) still works during the alias period."""
        from gateway.policies.registry import resolve_name

        return resolve_name(value)

    @field_validator("backends")
    @classmethod
    def _normalize_urls(cls, value: list[str]) -> list[str]:
        out = []
        for url in value:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"backend URL must start with http:// or https://: {url!r}")
            out.append(url.rstrip("/").removesuffix("/v1"))
        return out

    @property
    def auth_enabled(self) -> bool:
        """Any credential configured: from then on every route needs its role's credential
        (docs/deployment.md, security model); with none, loopback is open to all."""
        return bool(self.admin_token or self.trainer_token or self.api_keys or self.key_secret)

    @model_validator(mode="after")
    def _roles_apart(self) -> Settings:
        """A harness key that is also the trainer's or operator's token would let a
        sandbox set its own reward: refused."""
        for name, token in (("TRAINER_TOKEN", self.trainer_token),
                            ("ADMIN_TOKEN", self.admin_token)):
            if token is not None and token in self.api_keys:
                raise ValueError(f"ROLLOUT_GATEWAY_{name} is also one of the harness "
                                 "ROLLOUT_GATEWAY_API_KEYS: a harness could then act as "
                                 "the trainer or operator; use different values")
        return self

    def check_safe_to_serve(self) -> None:
        """Refuse unsafe combinations before binding a socket."""
        if not is_loopback(self.server.host) and not self.admin_token:
            raise ValueError(
                f"refusing to bind {self.server.host!r} without an admin token: set "
                "ROLLOUT_GATEWAY_ADMIN_TOKEN (or bind 127.0.0.1)"
            )


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback IP address (a bind address, not a Host header)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
