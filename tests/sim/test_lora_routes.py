"""The simulated server's LoRA routes, as vLLM 0.32 answers them (``--enable-lora``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from backends.sim.runner import start_sim_servers
from backends.sim.state import SimServerConfig
from backends.tinylora import write_adapter

MODEL = "qwen3-14b"


@pytest.fixture
async def urls() -> AsyncIterator[list[str]]:
    """One server with LoRA on (rank 8 at most), one without."""
    async with start_sim_servers([SimServerConfig(enable_lora=True, max_lora_rank=8),
                                  SimServerConfig(seed=1)]) as found:
        yield found


async def test_adapters_load_serve_and_unload_as_on_vllm(urls: list[str],
                                                         tmp_path: Path) -> None:
    path = str(write_adapter(tmp_path / "x", seed=5))
    async with httpx.AsyncClient(base_url=urls[0], timeout=30) as http:
        async def load(name: str, where: str) -> httpx.Response:
            return await http.post("/v1/load_lora_adapter",
                                   json={"lora_name": name, "lora_path": where})

        r = await load("a", path)
        assert r.status_code == 200 and "added successfully" in r.text
        r = await load("a", path)
        assert r.status_code == 400 and "already been loaded" in r.text
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "a",
                                                           "lora_path": path,
                                                           "load_inplace": True})
        assert r.status_code == 200
        r = await load(MODEL, path)
        assert r.status_code == 400 and "conflicts with a served base model" in r.text
        r = await load("m", str(tmp_path / "nope"))
        assert r.status_code == 404 and "No adapter found" in r.text
        r = await load("big", str(write_adapter(tmp_path / "big", seed=6, rank=16)))
        assert r.status_code == 500 and "LoRA rank 16 is greater than max_lora_rank 8" \
            in r.json()["error"]["message"]
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "a"})
        assert r.status_code == 400 and "must be provided" in r.text

        cards = {m["id"]: m for m in (await http.get("/v1/models")).json()["data"]}
        assert set(cards) == {MODEL, "a"}
        assert cards["a"]["parent"] == MODEL and cards["a"]["root"] == path
        body = {"model": "a", "max_tokens": 6, "seed": 3, "ignore_eos": True,
                "messages": [{"role": "user", "content": "hi"}]}
        on_adapter = (await http.post("/v1/chat/completions", json=body)).json()
        on_base = (await http.post("/v1/chat/completions",
                                   json={**body, "model": MODEL})).json()
        assert on_adapter["model"] == "a" and on_base["model"] == MODEL
        assert on_adapter["choices"][0]["message"] != on_base["choices"][0]["message"]
        seen = (await http.get("/sim/stats")).json()["requests_seen"]
        assert [s["model"] for s in seen[-2:]] == ["a", MODEL]

        assert (await http.post("/v1/unload_lora_adapter",
                                json={"lora_name": "a"})).status_code == 200
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert r.status_code == 404 and "cannot be found" in r.text
        r = await http.post("/v1/chat/completions", json=body)
        assert r.status_code == 404 and "does not exist" in r.text
    async with httpx.AsyncClient(base_url=urls[1], timeout=30) as http:  # LoRA off
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "a",
                                                           "lora_path": path})
        assert r.status_code == 404 and r.json() == {"detail": "Not Found"}


def test_a_written_adapter_is_a_safetensors_file_vllm_reads(tmp_path: Path) -> None:
    """The adapter files ``backends.tinylora`` writes without torch: the header names
    every A and B matrix with its shape and byte range, the data fills the file."""
    import json
    import struct

    out = write_adapter(tmp_path / "a", seed=1, rank=4)
    data = (out / "adapter_model.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    assert len(header) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)
    q_a = header["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    v_b = header["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    assert q_a["shape"] == [4, 256] and v_b["shape"] == [128, 4]
    end = max(t["data_offsets"][1] for t in header.values())
    assert len(data) == 8 + size + end and (8 + size) % 8 == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["peft_type"] == "LORA"
