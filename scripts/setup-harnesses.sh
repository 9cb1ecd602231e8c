#!/usr/bin/env bash
# The coding-agent CLIs the harness tests run as shipped (tests/harnesses, pytest -m cli):
# OpenAI's Codex CLI, Anthropic's Claude Code, Google's Gemini CLI, Qwen Code and opencode,
# from the npm registry, pinned, into a prefix of their own (never a global install).
# Idempotent: reuses the prefix when every pinned version is there. Prints nothing on success.
#
#   scripts/setup-harnesses.sh      # then: $ROLLOUT_GATEWAY_NPM_PREFIX/node_modules/.bin/{codex,claude,gemini,qwen,opencode}
#
# Qwen Code declares node >= 22 but runs on node 20 (its tests ran there); npm only warns.
# opencode-ai installs its native binary for this platform (an optional dependency).
#
# ROLLOUT_GATEWAY_NPM_PREFIX   where they live (default: $HOME/.cache/rollout-gateway/npm)
set -euo pipefail

CODEX_VERSION="0.169.0"
CLAUDE_VERSION="2.1.331"
GEMINI_VERSION="0.61.0"
QWEN_VERSION="0.24.4"
OPENCODE_VERSION="1.18.33"
PREFIX="${ROLLOUT_GATEWAY_NPM_PREFIX:-$HOME/.cache/rollout-gateway/npm}"
BIN="$PREFIX/node_modules/.bin"

have() {
  [[ -x "$BIN/codex" && -x "$BIN/claude" && -x "$BIN/gemini" && -x "$BIN/qwen" \
     && -x "$BIN/opencode" ]] \
    && [[ "$("$BIN/codex" --version 2>/dev/null)" == *"$CODEX_VERSION"* ]] \
    && [[ "$("$BIN/claude" --version 2>/dev/null)" == *"$CLAUDE_VERSION"* ]] \
    && [[ "$("$BIN/gemini" --version 2>/dev/null)" == *"$GEMINI_VERSION"* ]] \
    && [[ "$("$BIN/qwen" --version 2>/dev/null)" == *"$QWEN_VERSION"* ]] \
    && [[ "$("$BIN/opencode" --version 2>/dev/null)" == *"$OPENCODE_VERSION"* ]]
}

if have; then
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
fi
mkdir -p "$PREFIX"
npm install --prefix "$PREFIX" --no-audit --no-fund --loglevel=error \
  "@openai/codex@$CODEX_VERSION" "@anthropic-ai/claude-code@$CLAUDE_VERSION" \
  "@google/gemini-cli@$GEMINI_VERSION" "@qwen-code/qwen-code@$QWEN_VERSION" \
  "opencode-ai@$OPENCODE_VERSION" >/dev/null
have || { echo "setup-harnesses: codex, claude, gemini, qwen or opencode did not install under $PREFIX" >&2
          exit 1; }
