#!/usr/bin/env bash
# What we run on the H200 (device tool): GPU tests, kernel bandwidth, decode throughput.
# Usage: bash benchmarks/gpu_checks.sh OUTDIR [quick|full]
set -uo pipefail
out=${1:-/tmp/out}; mode=${2:-quick}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_gpu.py 2>&1 | tail -15 | tee "$out/gpu_tests.txt"
if [ "$mode" = quick ]; then
  python3 benchmarks/kernel_bandwidth.py --out "$out/kernel_bandwidth.json" 2>&1 | tail -45
  python3 benchmarks/decode_throughput.py --shape tiny --context 2048 --skip-hf --methods streaming_llm --steps 6 \
      --out "$out/decode_tiny.json" 2>&1 | tail -12
  python3 benchmarks/decode_throughput.py --methods streaming_llm --no-real-prefill --steps 8 \
      --out "$out/decode_throughput.json" 2>&1 | tail -30
else
  python3 benchmarks/decode_throughput.py --out "$out/decode_throughput.json" 2>&1 | tail -40
fi
