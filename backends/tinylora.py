"""Random LoRA adapters for the tiny model (``backends.tinymodel``), as PEFT writes them.

``write_adapter(out_dir, seed=...)`` writes ``adapter_config.json`` and
``adapter_model.safetensors`` (rank-``r`` A and B matrices on the attention's ``q_proj``
and ``v_proj`` of every layer) with the standard library alone, so the gateway's tests
make adapters without torch; vLLM loads them with ``--enable-lora``. A safetensors file is
an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape
and byte range, and the raw little-endian data.

B is not zero (PEFT initialises it to zero, an adapter that changes nothing): these
adapters stand for ones a trainer has already trained, and each seed changes the tiny
model's greedy output and logprobs.

    python -m backends.tinylora /tmp/adapter-1 --seed 1
"""

from __future__ import annotations

import json
import random
import struct
import sys
from array import array
from pathlib import Path

from backends.tinymodel import MODEL_CONFIG

TARGETS = ("q_proj", "v_proj")


def _shapes(rank: int) -> dict[str, tuple[int, int]]:
    hidden = int(MODEL_CONFIG["hidden_size"])
    head_dim = int(MODEL_CONFIG["head_dim"])
    out = {"q_proj": int(MODEL_CONFIG["num_attention_heads"]) * head_dim,
           "v_proj": int(MODEL_CONFIG["num_key_value_heads"]) * head_dim}
    shapes = {}
    for layer in range(int(MODEL_CONFIG["num_hidden_layers"])):
        for module in TARGETS:
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            shapes[f"{key}.lora_A.weight"] = (rank, hidden)
            shapes[f"{key}.lora_B.weight"] = (out[module], rank)
    return shapes


def write_safetensors(path: Path, tensors: dict[str, tuple[tuple[int, int], array[float]]]) -> None:
    """``tensors``: name -> (shape, float32 values in row-major order)."""
    header: dict[str, object] = {}
    blobs = []
    offset = 0
    for name, (shape, values) in tensors.items():
        data = values.tobytes() if sys.byteorder == "little" else _swapped(values)
        header[name] = {"dtype": "F32", "shape": list(shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for blob in blobs:
            f.write(blob)


def _swapped(values: array[float]) -> bytes:
    copy = array(values.typecode, values)
    copy.byteswap()
    return copy.tobytes()


def write_adapter(out_dir: Path, *, seed: int, rank: int = 8, alpha: int = 16,
                  scale: float = 0.1, base_model: str = "tiny") -> Path:
    """A random rank-``rank`` adapter at ``out_dir`` (created); returns ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    tensors = {}
    for name, (rows, cols) in _shapes(rank).items():
        tensors[name] = ((rows, cols),
                         array("f", (rng.gauss(0.0, scale) for _ in range(rows * cols))))
    write_safetensors(out_dir / "adapter_model.safetensors", tensors)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
              "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none",
              "target_modules": list(TARGETS), "fan_in_fan_out": False,
              "modules_to_save": None, "base_model_name_or_path": base_model,
              "inference_mode": True}
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return out_dir


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m backends.tinylora", description=__doc__)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=8)
    ns = parser.parse_args(argv)
    print(write_adapter(ns.out_dir, seed=ns.seed, rank=ns.rank))
    return 0


if __name__ == "__main__":
    sys.exit(main())
