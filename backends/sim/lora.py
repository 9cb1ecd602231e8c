"""vLLM's LoRA routes on the simulated server: load and unload adapters at run time.

Same paths, checks and answers as vLLM 0.32 started with ``--enable-lora`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (without ``enable_lora`` the routes do not
exist, as in vLLM, and a request naming an adapter is a 404):

* ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path", "load_inplace"}``: 200 with
  a text body; 400 when a field is missing, the name is the base model's, or the name is
  loaded already (unless ``load_inplace``); 404 when no adapter is at the path; 500 when
  vLLM's own check of its ``adapter_config.json`` fails (rank over ``max_lora_rank``,
  bias, not a LoRA).
* ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``: 200, or 404 when it is not loaded.
  Like vLLM, an unload only forgets the name: requests already running on the adapter
  finish on it.

A request whose ``model`` names a loaded adapter is served on it: its answer names the
adapter, ``/v1/models`` lists it (``parent``: the base model), its tokens differ from the
base model's (the adapter seeds the draw), and ``/sim/stats`` ``requests_seen[].model``
records what served each request: the truth the gateway's per-call versions are
compared with. What adapters cost (:class:`backends.sim.profiles.LoraCost`): a load holds
the engine loop for ``load_s`` between two batches of steps, and a step's time grows with
its share of tokens on adapters.
"""

from __future__ import annotations

import json
from pathlib import Path

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from backends.sim.protocol import APIError, json_object
from backends.sim.state import LoadedAdapter, sim_of

router = APIRouter()
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")


def read_adapter(name: str, path: str, max_rank: int) -> LoadedAdapter:
    """What vLLM's loader checks before it takes an adapter (``PEFTHelper``)."""
    folder = Path(path)
    config_file = folder / "adapter_config.json"
    if not config_file.is_file() or not any((folder / f).is_file() for f in WEIGHT_FILES):
        raise APIError(404, f"Loading lora {name} failed: No adapter found for {path}",
                       type_="NotFoundError")
    try:
        config = json.loads(config_file.read_text())
        rank = int(config["r"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise APIError(500, f"invalid adapter_config.json: {exc}",
                       type_="InternalServerError") from None
    problems = []
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        problems.append(f"peft_type {config.get('peft_type')!r} is not LORA.")
    if rank > max_rank:
        problems.append(f"LoRA rank {rank} is greater than max_lora_rank {max_rank}.")
    if config.get("bias", "none") != "none":
        problems.append("Adapter bias is not supported.")
    if problems:
        raise APIError(500, " ".join(problems), type_="InternalServerError")
    return LoadedAdapter(name, path, rank)


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    sim = sim_of(request)
    body = await json_object(request)
    name, path = body.get("lora_name"), body.get("lora_path")
    if not name or not path or not isinstance(name, str) or not isinstance(path, str):
        raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                       type_="InvalidUserInput")
    if name == sim.config.served_name:
        raise APIError(400, f"The lora adapter '{name}' conflicts with a served base model.",
                       type_="InvalidUserInput")
    if name in sim.adapters and not body.get("load_inplace"):
        raise APIError(400, f"The lora adapter '{name}' has already been loaded. If you "
                       "want to load the adapter in place, set 'load_inplace' to True.",
                       type_="InvalidUserInput")
    adapter = read_adapter(name, path, sim.config.max_lora_rank)
    await sim.engine.hold(sim.config.lora_cost.load_s)  # the engine loads it between steps
    sim.adapters[name] = adapter
    sim.num_adapter_loads += 1
    return Response(f"Success: LoRA adapter '{name}' added successfully.", status_code=200)


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    sim = sim_of(request)
    name = (await json_object(request)).get("lora_name")
    if not name or not isinstance(name, str):
        raise APIError(400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                       type_="InvalidUserInput")
    if sim.adapters.pop(name, None) is None:
        raise APIError(404, f"The lora adapter '{name}' cannot be found.",
                       type_="NotFoundError")
    return Response(f"Success: LoRA adapter '{name}' removed successfully.", status_code=200)
