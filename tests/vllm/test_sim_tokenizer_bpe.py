"""The simulated tokenizer against a real byte-level BPE of Qwen3's class: Mistral's
Tekken (131,072 entries, tiktoken-style, shipped inside ``mistral_common``, a dependency
of the CPU vLLM environment). On the same prose and code samples its bytes per token are
within 15% of the simulated one's (backends/sim/tokenizer.py)."""

from __future__ import annotations

import json
import subprocess

import pytest

from backends.sim.tokenizer import get_tokenizer
from tests.sim.test_tokenizer import SAMPLES, TEKKEN

pytestmark = pytest.mark.vllm

_COUNT = """
import json, sys
from importlib import resources
from mistral_common.tokens.tokenizers.tekken import Tekkenizer
path = resources.files("mistral_common") / "data" / "tekken_240911.json"
tok = Tekkenizer.from_file(str(path))
texts = json.load(sys.stdin)
print(json.dumps({k: len(tok.encode(v, bos=False, eos=False)) for k, v in texts.items()}))
"""


def test_bytes_per_token_within_15_percent_of_tekken(vllm_python: str) -> None:
    out = subprocess.run([vllm_python, "-c", _COUNT], input=json.dumps(SAMPLES),
                         capture_output=True, text=True, timeout=120, check=True)
    counts = json.loads(out.stdout)
    tok = get_tokenizer()
    for kind, text in SAMPLES.items():
        size = len(text.encode())
        real, sim = size / counts[kind], size / len(tok.encode(text))
        assert real == pytest.approx(TEKKEN[kind], abs=0.01), (kind, real)  # the constant
        assert abs(sim / real - 1) <= 0.15, (kind, sim, real)
