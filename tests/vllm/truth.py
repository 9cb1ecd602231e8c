"""What the real-vLLM weight tests share: a second checkpoint of the tiny model, reloading
an engine's weights, and recomputing a sequence's logprobs under the weights it serves
(the judge of which weights made a token)."""

from __future__ import annotations

import httpx

#: the name the tiny model is served under
SERVED_NAME = "tiny"

# Re-draw every matrix of a checkpoint (norms kept), five times wider than the tiny
# model's (whose nearly uniform outputs would often give a token about the same logprob
# under both): same shapes and tokenizer, other weights. Runs in the vLLM environment.
REDRAW = """
import shutil, sys, torch
from safetensors.torch import load_file, save_file
src, dst, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
shutil.copytree(src, dst)
weights = load_file(f"{src}/model.safetensors")
g = torch.Generator().manual_seed(seed)
out = {k: (torch.randn(v.shape, generator=g) * 0.1).to(v.dtype) if v.dim() > 1 else v
       for k, v in weights.items()}
save_file(out, f"{dst}/model.safetensors", metadata={"format": "pt"})
"""


async def recompute(engine: str, ids: list[int], model: str = SERVED_NAME) -> list[float]:
    """The logprob of each of ``ids[1:]`` under the engine's current weights (``model``:
    a LoRA adapter's name, under that adapter)."""
    async with httpx.AsyncClient(timeout=300) as http:
        r = await http.post(f"{engine}/v1/completions", json={
            "model": model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0})
        assert r.status_code == 200, r.text
        entries = r.json()["choices"][0]["prompt_logprobs"][1:]
    return [float(e[str(t)]["logprob"]) for e, t in zip(entries, ids[1:], strict=True)]


async def reload_weights(engine: str, path: str) -> None:
    async with httpx.AsyncClient(timeout=300) as http:
        for route, body in (("/collective_rpc", {"method": "reload_weights",
                                                 "kwargs": {"weights_path": path}}),
                            ("/reset_prefix_cache", None)):
            assert (await http.post(engine + route, json=body)).status_code == 200
