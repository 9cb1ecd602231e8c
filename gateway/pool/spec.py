"""The pool spec file (``--pool FILE`` / ``ROLLOUT_GATEWAY_POOL``): YAML or JSON.

It declares what the gateway may manage: the GPU inventory, how servers are launched,
the model they serve and the initial layout. Example (``examples/pool-sim.yaml``)::

    model: qwen3-14b
    inventory: {gpus: 8}            # or {nodes: [{name: n1, gpus: [0, 1, 2, 3]}, ...]}
    launcher: {kind: sim, speed: 10}
    layout:
      - {tp: 1, count: 4}
      - {tp: 4}

Validation happens at load time (a layout that does not fit the inventory is refused
with the reason), and launchers are imported only when built, so the gateway's import
path never pulls in Ray or vLLM.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from backends.base import Launcher
from backends.vllm_local import STREAM_INTERVAL
from gateway.dispatch.speeds import TP_DEGREES
from gateway.policies.fluid import probe_layout
from gateway.pool.layout import GpuSlot, InstanceRequest, place


class PoolSpecError(ValueError):
    """The pool spec file is missing, unparsable or invalid (message says where)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NodeSpec(_Strict):
    name: str = "local"
    gpus: list[int] | int = Field(description="GPU ids, or a count (ids 0..count-1)")

    def ids(self) -> list[int]:
        return list(range(self.gpus)) if isinstance(self.gpus, int) else list(self.gpus)


class InventorySpec(_Strict):
    """All GPUs the pool may ever use; ``PUT /admin/pool`` selects a subset of them."""

    nodes: list[NodeSpec] = []
    gpus: list[int] | int | None = Field(None, description="shorthand for one node 'local'")

    @model_validator(mode="after")
    def _one_form(self) -> InventorySpec:
        if self.gpus is not None:
            if self.nodes:
                raise ValueError("give either 'gpus' or 'nodes', not both")
            self.nodes, self.gpus = [NodeSpec(name="local", gpus=self.gpus)], None
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise ValueError(f"node names must be unique: {names}")
        return self

    def slots(self) -> list[GpuSlot]:
        return [(n.name, g) for n in self.nodes for g in n.ids()]


class LoraOptions(_Strict):
    """Engines that serve LoRA adapters loaded at run time (docs/weight-updates.md, "LoRA
    adapters"): vLLM's ``--enable-lora`` with runtime loading on."""

    max_rank: int = Field(16, ge=1, le=512, description="the largest adapter rank the "
                          "engines load (vLLM --max-lora-rank)")
    slots: int = Field(2, ge=1, le=64, description="adapters one batch may mix (vLLM "
                       "--max-loras); give at least the adapters a LoRA update keeps")

    def vllm_args(self) -> list[str]:
        return ["--enable-lora", "--max-loras", str(self.slots),
                "--max-lora-rank", str(self.max_rank)]


#: what vLLM needs in its environment to load and unload adapters over HTTP
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


class SimOptions(_Strict):
    """Simulated vLLM servers; ``profile``/``gpu`` pick the latency constants."""

    profile: str = "qwen3-14b"
    gpu: str = "H100"
    speed: float = Field(1.0, gt=0)
    seed: int = 0
    startup_s: float = Field(0.0, ge=0, description="simulated start-up seconds (/ speed)")
    max_model_len: int | None = Field(
        None, ge=1, description="each engine's context in tokens (default: the profile "
        "model's own, 40960 for Qwen3; 131072 as Qwen3 serves with YaRN)")
    options: dict[str, Any] = Field({}, description="other SimServerConfig fields")
    lora: LoraOptions | None = None

    def server_options(self) -> dict[str, Any]:
        """``options`` with what ``lora`` asks of the simulated servers."""
        if self.lora is None:
            return dict(self.options)
        return {**self.options, "enable_lora": True, "max_lora_rank": self.lora.max_rank}

    def launcher_kwargs(self) -> dict[str, Any]:
        """:class:`backends.sim_launcher.SimLauncher`'s keywords (a Ray actor's too)."""
        out = self.model_dump(exclude={"lora"})
        out["options"] = self.server_options()
        return out


class VLLMOptions(_Strict):
    """``python -m vllm.entrypoints.openai.api_server`` processes."""

    python: str = sys.executable
    model_path: str | None = Field(None, description="what vLLM loads (default: model)")
    device: Literal["cuda", "cpu"] = "cuda"
    extra_args: list[str] = []
    env: dict[str, str] = {}
    tool_call_parser: str | None = "hermes"
    stream_interval: int = Field(
        STREAM_INTERVAL, ge=1, le=1024, description="tokens a streamed event carries after "
        "the first (vLLM's --stream-interval, vLLM >= 0.12; 1: one event per token, no "
        "flag). Above 1, a weight update waits for streams it would freeze (docs/pool.md)")
    start_timeout_s: float = Field(600.0, gt=0)
    log_dir: Path | None = None
    state_dir: Path | None = Field(
        None, description="where each engine's record is kept, so that a restarted gateway "
        "stops the engines a dead one left (default ~/.local/state/rollout-gateway/engines)")
    lora: LoraOptions | None = None

    def engine_args(self) -> tuple[list[str], dict[str, str]]:
        """``extra_args`` and ``env`` with what ``lora`` asks of vLLM."""
        if self.lora is None:
            return list(self.extra_args), dict(self.env)
        return [*self.extra_args, *self.lora.vllm_args()], {**self.env, **LORA_ENV}

    def launcher_kwargs(self) -> dict[str, Any]:
        """:class:`backends.vllm_local.LocalVLLMLauncher`'s keywords, as JSON (a Ray
        actor's)."""
        out = self.model_dump(mode="json", exclude={"lora"})
        out["extra_args"], out["env"] = self.engine_args()
        return out

    @field_validator("extra_args")
    @classmethod
    def _no_stream_interval(cls, value: list[str]) -> list[str]:
        return _without_stream_interval(value)

    @field_validator("python", "model_path", "log_dir", "state_dir")
    @classmethod
    def _home(cls, value: Any) -> Any:
        """``~/...`` paths name the home of the user running the gateway."""
        if isinstance(value, Path):
            return value.expanduser()
        return os.path.expanduser(value) if isinstance(value, str) else value


class SimLauncherSpec(SimOptions):
    kind: Literal["sim"]


class VLLMLauncherSpec(VLLMOptions):
    kind: Literal["vllm"]


class RayLauncherSpec(_Strict):
    """One Ray actor per instance, in a placement group holding its GPUs."""

    kind: Literal["ray"]
    address: str | None = Field(None, description="ray.init address when not connected yet")
    server: Literal["sim", "vllm"] = "vllm"
    sim: SimOptions = SimOptions()
    vllm: VLLMOptions = VLLMOptions()
    cpus_per_instance: float = Field(1.0, ge=0)
    start_timeout_s: float = Field(600.0, gt=0)


class StaticBackendSpec(_Strict):
    url: str = Field(pattern=r"^https?://")
    tp: int = Field(1, ge=1)
    id: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]+$")


class StaticLauncherSpec(_Strict):
    kind: Literal["static"]
    backends: list[StaticBackendSpec] = Field(min_length=1)


LauncherSpec = Annotated[
    SimLauncherSpec | VLLMLauncherSpec | RayLauncherSpec | StaticLauncherSpec,
    Field(discriminator="kind"),
]


class LayoutEntry(_Strict):
    tp: int = Field(1, ge=1, le=64)
    gpus: list[int] | None = None
    node: str | None = None
    id: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]+$", max_length=64)
    extra_args: list[str] = []
    count: int = Field(1, ge=1, description="this many identical instances (auto GPUs)")

    @field_validator("extra_args")
    @classmethod
    def _no_stream_interval(cls, value: list[str]) -> list[str]:
        return _without_stream_interval(value)

    def requests(self) -> list[InstanceRequest]:
        if self.count > 1 and (self.gpus is not None or self.id is not None):
            raise ValueError("'count' > 1 cannot be combined with explicit 'gpus' or 'id'")
        gpus = tuple(self.gpus) if self.gpus is not None else None
        return [InstanceRequest(tp=self.tp, gpus=gpus, node=self.node, id=self.id,
                                extra_args=tuple(self.extra_args))] * self.count


class RestartPolicy(_Strict):
    """Crashed instances are restarted up to ``max_restarts`` times (then left failed),
    waiting ``backoff_s * 2**n`` (capped at ``backoff_max_s``) before restart ``n+1``."""

    max_restarts: int = Field(3, ge=0)
    backoff_s: float = Field(1.0, ge=0)
    backoff_max_s: float = Field(60.0, ge=0)


class PoolSpec(_Strict):
    model: str = Field(min_length=1, description="the model name clients send")
    inventory: InventorySpec = InventorySpec()
    launcher: LauncherSpec
    layout: list[LayoutEntry] | Literal["probe"] | None = Field(
        None, description="initial instances (default: all GPUs as default_tp instances); "
        "'probe': one instance of every TP degree a node holds, the rest at the highest, so "
        "the speed meter measures each degree before replay chooses")
    default_tp: int = Field(1, ge=1, description="TP of instances created by a resize")
    restart: RestartPolicy = RestartPolicy()
    drain_timeout_s: float = Field(600.0, ge=0)
    check_interval_s: float = Field(1.0, gt=0, description="crash detection period")
    warmup: bool = Field(True, description="send one max_tokens=1 call before routing")

    @model_validator(mode="after")
    def _fits(self) -> PoolSpec:
        if isinstance(self.launcher, StaticLauncherSpec):
            if self.layout or self.inventory.nodes:
                raise ValueError("a static pool takes its instances from launcher.backends")
            return self
        if not self.inventory.slots():
            raise ValueError("inventory declares no GPUs")
        if self.layout is not None:
            place(self.requests(), self.inventory.slots(), self.model)
        return self

    def requests(self) -> list[InstanceRequest]:
        if self.layout == "probe":
            return [InstanceRequest(tp=tp) for tp in self._probe()]
        return [r for entry in self.layout or () for r in entry.requests()]

    def _probe(self) -> tuple[int, ...]:
        """Per node, :func:`~gateway.policies.replay.probe_layout` of its GPUs (an instance
        never spans nodes), largest first."""
        out: list[int] = []
        for node in self.inventory.nodes:
            n = len(node.ids())
            out += probe_layout(n, [d for d in TP_DEGREES if d <= n])
        return tuple(sorted(out, reverse=True))

    def weights_path(self) -> str | None:
        """The checkpoint the launcher's engines load (vLLM's ``--model``); None where
        the launcher has no weights to name (simulated or someone else's servers)."""
        ls = self.launcher
        if isinstance(ls, VLLMLauncherSpec):
            return ls.model_path or self.model
        if isinstance(ls, RayLauncherSpec) and ls.server == "vllm":
            return ls.vllm.model_path or self.model
        return None


def parse_pool_spec(data: object, source: str = "pool spec") -> PoolSpec:
    try:
        return PoolSpec.model_validate(data)
    except ValidationError as exc:
        lines = [f"  {'.'.join(map(str, e['loc'])) or '(top)'}: {e['msg']}"
                 for e in exc.errors()]
        raise PoolSpecError(f"{source} is invalid:\n" + "\n".join(lines)) from None


def load_pool_spec(path: Path) -> PoolSpec:
    """Read and validate a spec file (``.json`` as JSON, anything else as YAML)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise PoolSpecError(f"pool spec {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise PoolSpecError(f"pool spec {path} does not parse: {exc}") from None
    return parse_pool_spec(data, f"pool spec {path}")


def build_launcher(spec: PoolSpec) -> Launcher:
    """The launcher the spec names; heavy implementations are imported only here."""
    ls = spec.launcher
    if isinstance(ls, SimLauncherSpec):
        from backends.sim_launcher import SimLauncher

        return SimLauncher(profile=ls.profile, gpu=ls.gpu, speed=ls.speed, seed=ls.seed,
                           options=ls.server_options(), startup_s=ls.startup_s,
                           max_model_len=ls.max_model_len)
    if isinstance(ls, VLLMLauncherSpec):
        return vllm_launcher(ls)
    if isinstance(ls, RayLauncherSpec):
        from backends.ray_launcher import RayLauncher

        return RayLauncher(address=ls.address, server=ls.server,
                           sim=ls.sim.launcher_kwargs(), vllm=ls.vllm.launcher_kwargs(),
                           cpus_per_instance=ls.cpus_per_instance,
                           start_timeout_s=ls.start_timeout_s)
    from backends.static import StaticLauncher

    return StaticLauncher({b.id or f"s{i}": b.url for i, b in enumerate(ls.backends)})


def _without_stream_interval(args: list[str]) -> list[str]:
    """``extra_args`` without vLLM's ``--stream-interval``: the pool must know it (a weight
    update pauses engines that group tokens differently), so it is ``stream_interval``."""
    if any(a == "--stream-interval" or a.startswith("--stream-interval=") for a in args):
        raise ValueError("set vLLM's --stream-interval with the launcher's 'stream_interval' "
                         "(the gateway must know it), not in extra_args")
    return args


def stream_interval(spec: PoolSpec) -> int:
    """Tokens a streamed event of the pool's engines carries (1 unless they are vLLM
    engines started with ``--stream-interval``)."""
    ls = spec.launcher
    if isinstance(ls, VLLMLauncherSpec):
        return ls.stream_interval
    if isinstance(ls, RayLauncherSpec) and ls.server == "vllm":
        return ls.vllm.stream_interval
    return 1


def vllm_launcher(opts: VLLMOptions) -> Launcher:
    from backends.vllm_local import LocalVLLMLauncher

    extra_args, env = opts.engine_args()
    return LocalVLLMLauncher(
        python=opts.python, model_path=opts.model_path, device=opts.device,
        extra_args=extra_args, env=env, tool_call_parser=opts.tool_call_parser,
        stream_interval=opts.stream_interval, start_timeout_s=opts.start_timeout_s,
        log_dir=opts.log_dir, state_dir=opts.state_dir)
