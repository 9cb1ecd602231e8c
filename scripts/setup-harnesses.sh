#!/usr/bin/env bash
# The coding-agent CLIs the harness tests run as shipped (tests/harnesses, pytest -m cli):
# OpenAI's Codex CLI, Anthropic's Claude Code and Google's Gemini CLI, from the npm
# registry, pinned, into a prefix of their own (never a global install). Idempotent: reuses
# the prefix when every pinned version is there. Prints nothing on success.
#
#   scripts/setup-harnesses.sh      # then: $ROLLOUT_GATEWAY_NPM_PREFIX/node_modules/.bin/{codex,claude,gemini}
#
# ROLLOUT_GATEWAY_NPM_PREFIX   where they live (default: $HOME/.cache/rollout-gateway/npm)
set -euo pipefail

CODEX_VERSION="0.169.0"
CLAUDE_VERSION="2.1.331"
GEMINI_VERSION="0.61.0"
PREFIX="${ROLLOUT_GATEWAY_NPM_PREFIX:-$HOME/.cache/rollout-gateway/npm}"
BIN="$PREFIX/node_modules/.bin"

have() {
  [[ -x "$BIN/codex" && -x "$BIN/claude" && -x "$BIN/gemini" ]] \
    && [[ "$("$BIN/codex" --version 2>/dev/null)" == *"$CODEX_VERSION"* ]] \
    && [[ "$("$BIN/claude" --version 2>/dev/null)" == *"$CLAUDE_VERSION"* ]] \
    && [[ "$("$BIN/gemini" --version 2>/dev/null)" == *"$GEMINI_VERSION"* ]]
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
  "@google/gemini-cli@$GEMINI_VERSION" >/dev/null
have || { echo "setup-harnesses: codex, claude or gemini did not install under $PREFIX" >&2
          exit 1; }
