#!/usr/bin/env bash
# One prepared run for a CUDA machine: the GPU tests, then both benchmarks on the GPU.
# Writes logs under ${OUT:-gpu-results}/ for BENCHMARKS.md. Needs torch with CUDA plus fp8kit's test
# dependencies; without an installed fp8kit it runs from src/. Wheels in .whl/ (e.g. torchao for the
# comparison row) are installed to /tmp/site first, for machines that cannot reach a package index.
set -uo pipefail
out="${OUT:-gpu-results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=python3
if compgen -G ".whl/*.whl" >/dev/null; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl &&
        export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
$py -c "import fp8kit" 2>/dev/null || export PYTHONPATH="$PWD/src:${PYTHONPATH:-}"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$out/gpu.txt"
timeout 200 $py -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_kernels.py tests/test_linear.py -k cuda 2>&1 |
    tee "$out/tests.log"
timeout 90 $py benchmarks/quantize.py --device cuda --sizes 1,4,16,64 2>&1 | tee "$out/quantize.log"
timeout 240 $py benchmarks/linear.py --shapes 2048x2048,4096x4096 --reps 20 2>&1 | tee "$out/linear.log"
