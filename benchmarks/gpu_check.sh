#!/usr/bin/env bash
# One prepared run for a CUDA machine: the GPU tests, then both benchmarks on the GPU.
# Writes logs under ${OUT:-gpu-results}/ for BENCHMARKS.md. Needs torch with CUDA and `pip install -e .[dev,bench]`.
set -uo pipefail
out="${OUT:-gpu-results}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python -m pytest -q -k "cuda or gemm or kernels" 2>&1 | tee "$out/tests.log"
python benchmarks/quantize.py --device cuda --sizes 1,16,64 2>&1 | tee "$out/quantize.log"
python benchmarks/linear.py --shapes 2048x2048,4096x4096 --reps 10 2>&1 | tee "$out/linear.log"
