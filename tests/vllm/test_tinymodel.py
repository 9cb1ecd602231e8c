"""The tiny model builder (run with the vLLM python, as the fixtures do)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from backends.tinymodel import STAMP_FILE, TOOL_TOKENS, build_tiny_model
from tests.vllm.conftest import REPO_ROOT

pytestmark = pytest.mark.vllm


def test_config_matches_what_the_cpu_kernel_accepts(tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["hidden_size"] // config["num_attention_heads"] == config["head_dim"] == 64
    assert (config["num_key_value_heads"], config["num_hidden_layers"]) == (2, 2)
    assert 900 <= config["vocab_size"] <= 1100


def test_tool_tokens_are_single_non_special_tokens(tiny_model_dir: Path) -> None:
    added = json.loads((tiny_model_dir / "tokenizer.json").read_text())["added_tokens"]
    by_content = {t["content"]: t for t in added}
    for token in TOOL_TOKENS:
        assert by_content[token]["special"] is False
    assert by_content["<|im_end|>"]["special"] is True
    template = (tiny_model_dir / "chat_template.jinja").read_text()
    assert "<tool_call>" in template
    assert "tool_response" in template


def test_rebuild_is_a_no_op(tiny_model_dir: Path, vllm_python: str) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in tiny_model_dir.iterdir()}
    subprocess.run(
        [vllm_python, "-m", "backends.tinymodel", str(tiny_model_dir)],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
        timeout=60,
    )
    assert {p.name: p.stat().st_mtime_ns for p in tiny_model_dir.iterdir()} == before
    # The stamp alone decides: no torch needed to see that it is built.
    assert build_tiny_model(tiny_model_dir) == tiny_model_dir
    assert json.loads((tiny_model_dir / STAMP_FILE).read_text())["seed"] == 0
