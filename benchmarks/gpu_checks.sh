#!/usr/bin/env bash
# What we run on the H200 (device tool): GPU tests, kernel bandwidth, decode throughput, profile.
# Usage: bash benchmarks/gpu_checks.sh OUTDIR [quick|full|tests|perf]   (perf: full without the tests)
#
# Carry the wheels the device image lacks in .whl/ (benchmarks/gpu_env.sh says which) and run:
#   run(command="bash benchmarks/gpu_checks.sh $OUT full", carry=[".whl"])
set -uo pipefail
out=${1:-/tmp/out}; mode=${2:-quick}
mkdir -p "$out"
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton, transformers, grpc; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'grpcio', grpc.__version__)" | tee -a "$out/gpu.txt"
if [ "$mode" != perf ]; then
gpu_tests=$(grep -l "cuda.is_available" tests/*.py tests/reliability/*.py 2>/dev/null | tr '\n' ' ')
echo "python3 -m pytest -q $gpu_tests" | tee "$out/gpu_tests.txt"
python3 -m pytest -q -p no:cacheprovider -rfEs $gpu_tests 2>&1 | tail -25 | tee -a "$out/gpu_tests.txt"
fi
case "$mode" in
  tests) ;;
  quick)
    python3 benchmarks/decode_throughput.py --methods streaming_llm --no-real-prefill --steps 8 \
        --out "$out/decode_throughput.json" 2>&1 | tail -30 ;;
  perf)
    timeout ${THROUGHPUT_S:-400} python3 benchmarks/decode_throughput.py --out "$out/decode_throughput.json" 2>&1 | tee "$out/decode_throughput.txt" | tail -40
    timeout ${PROFILE_S:-150} python3 benchmarks/profile_decode.py --batch 1 4 26 2>&1 | tee "$out/profile_decode.txt" | tail -60 ;;
  full)
    python3 benchmarks/kernel_bandwidth.py --out "$out/kernel_bandwidth.json" 2>&1 | tail -20
    python3 benchmarks/decode_throughput.py --out "$out/decode_throughput.json" 2>&1 | tee "$out/decode_throughput.txt" | tail -40
    python3 benchmarks/profile_decode.py --batch 1 26 2>&1 | tail -40 | tee "$out/profile_decode.txt" ;;
esac
