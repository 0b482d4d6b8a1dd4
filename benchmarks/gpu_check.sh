#!/usr/bin/env bash
# One prepared run for a CUDA machine, within 8 minutes: the GPU tests, then the GPU benchmarks (quantize
# kernels, MLP GEMM level at d=4096/8192, the ~1B Llama step, PTQ inference, the MoE experts layer), each under its own timeout.
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
timeout 150 $py -m pytest -q -p no:cacheprovider tests/kernels/test_cuda.py tests/ptq/test_ptq_kernels.py tests/kernels/test_kernels.py \
    tests/nn/test_linear.py tests/nn/test_nvfp4.py tests/cli/test_device_cuda.py tests/ptq/test_ptq_sequential.py \
    -k cuda 2>&1 | tee "$out/tests.log"
# FP8 attention on CUDA: emulated (torch has no FP8 attention kernel with a backward; the log says so), bit-exact
# with the reference run on the GPU
timeout 60 $py -m pytest -q -p no:cacheprovider tests/nn/test_attention.py tests/nn/test_attention_mx.py -k cuda 2>&1 | tee "$out/attention.log"
timeout 30 $py benchmarks/quantize.py --device cuda --sizes 4,64 2>&1 | tee "$out/quantize.log"
timeout 150 $py benchmarks/linear.py --shapes 4096x8192,8192x8192 --no-eager --recipes current,rowwise,block,delayed \
    --reps 10 2>&1 | tee "$out/linear.log"
# NVFP4 GEMMs: native torch._scaled_mm on SM100 (Blackwell); elsewhere the log names the dequantized fallback
timeout 90 $py benchmarks/linear.py --shapes 4096x8192,8192x8192 --no-eager --recipes nvfp4 --reps 10 2>&1 \
    | tee "$out/linear_nvfp4.log"
timeout 120 $py benchmarks/llama_step.py --size 1b --batch 4 --seq 2048 --steps 5 --recipes current,rowwise,block \
    2>&1 | tee "$out/llama_step.log"
timeout 60 $py benchmarks/inference.py --device cuda --size 1b 2>&1 | tee "$out/inference.log"
# MoE experts layer at d=4096-class shapes (target: row-wise FP8 >= 1.2x the BF16 grouped_mm step); the
# log names any grouped GEMM that fell back to dequantized bf16 operands
timeout 90 $py benchmarks/moe.py --device cuda --experts 16 --topk 2 --d 4096 --inter 1536 --tokens 8192 \
    --recipes rowwise,current,block,mxfp8 --reps 10 2>&1 | tee "$out/moe.log"
