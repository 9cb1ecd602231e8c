"""Model aliases: the pure resolution and the setting that feeds it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.config import Settings
from gateway.proxy.aliases import resolve_model

CLAUDE = {"claude-haiku-4-5": "small", "claude-*": "qwen3-14b", "gpt-5*": "qwen3-14b"}


@pytest.mark.parametrize(("name", "expected"), [
    ("claude-haiku-4-5", "small"),          # exact beats a glob listed after it
    ("claude-opus-5-5", "qwen3-14b"),       # glob
    ("claude-sonnet-4-5[1m]", "qwen3-14b"),  # glob over a name with brackets in it
    ("gpt-5.1-codex", "qwen3-14b"),
    ("gpt-4o", "gpt-4o"),                   # no match: unchanged (the 404 names it)
    ("Claude-opus", "Claude-opus"),         # case-sensitive, as model names are
])
def test_exact_then_glob_then_unchanged(name, expected):
    assert resolve_model(CLAUDE, name) == expected


def test_first_matching_glob_in_order_wins_and_star_is_the_fallback():
    aliases = {"claude-haiku-*": "small", "claude-*": "big", "*": "default"}
    assert resolve_model(aliases, "claude-haiku-4-5") == "small"
    assert resolve_model(aliases, "claude-opus-5") == "big"
    assert resolve_model(aliases, "anything") == "default"
    assert resolve_model({"*": "default", "claude-*": "big"}, "claude-x") == "default"


def test_a_served_model_is_never_redirected_by_a_glob_but_an_exact_alias_wins():
    served = {"qwen3-14b", "qwen3-32b"}
    assert resolve_model({"*": "qwen3-14b"}, "qwen3-32b", served) == "qwen3-32b"
    assert resolve_model({"qwen3-32b": "qwen3-14b"}, "qwen3-32b", served) == "qwen3-14b"
    assert resolve_model({"*": "qwen3-14b"}, "claude-x", served) == "qwen3-14b"


def test_no_aliases_is_the_identity():
    assert resolve_model({}, "claude-opus-5-5") == "claude-opus-5-5"


def test_setting_from_pairs_or_json_in_order(monkeypatch):
    monkeypatch.setenv("ROLLOUT_GATEWAY_MODEL_ALIASES", " claude-* = qwen3-14b, gpt-5*=q,*=d ")
    assert list(Settings().model_aliases.items()) == [
        ("claude-*", "qwen3-14b"), ("gpt-5*", "q"), ("*", "d")]
    monkeypatch.setenv("ROLLOUT_GATEWAY_MODEL_ALIASES", '{"claude-*": "qwen3-14b", "*": "d"}')
    assert list(Settings().model_aliases) == ["claude-*", "*"]
    monkeypatch.delenv("ROLLOUT_GATEWAY_MODEL_ALIASES")
    assert Settings().model_aliases == {}


@pytest.mark.parametrize("bad", ["claude-*", "=qwen", "claude-*=", '{"a": 1}', "{not json"])
def test_malformed_setting_is_refused_at_start(monkeypatch, bad):
    monkeypatch.setenv("ROLLOUT_GATEWAY_MODEL_ALIASES", bad)
    with pytest.raises(ValidationError, match="model_aliases"):
        Settings()
