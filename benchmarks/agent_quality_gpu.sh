#!/usr/bin/env bash
# benchmarks/agent_quality.py at full size on the H200 (device tool), SmolLM2 carried as in
# benchmarks/gpu_smollm2.sh (the GGUF in two halves over two calls on the same warm machine):
#   here:    split the GGUF into .gl/a/part_aa and .gl/b/part_ab (+ .gl/b/sha256), wheels in .whl/
#            (gpu_smollm2.sh's header has the commands)
#   call 1:  run(command="mkdir -p .device_out && cp .gl/a/part_aa .device_out/", carry=[".gl/a"])
#   call 2+: run(command="PRUNES=none bash benchmarks/agent_quality_gpu.sh $OUT", carry=[".gl/b", ".whl"])
#            (the committed run: ARGS="--samples 64 --calibrate 0.6 --methods ..." over three calls, each
#            configuration takes 20-250 s there: the steps are host-bound, and h2o/tova read probabilities
#            at every decode step)
#            then PRUNES=lag1 and PRUNES=keep (one call each: a call runs at most 10 minutes), and
#            here: python benchmarks/agent_quality.py --merge none.json lag1.json keep.json \
#                      --out benchmarks/results/agent_quality_gpu.json && python benchmarks/report.py
# Every part saves its JSON after each configuration, so a part cut short keeps what it measured.
set -uo pipefail
out=${1:-/tmp/out}
mkdir -p "$out"
source benchmarks/gpu_env.sh
source benchmarks/gpu_gguf.sh  # SmolLM2 from its two carried halves
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
prunes=${PRUNES:-none}
timeout ${RUN_TIMEOUT_S:-570} python3 benchmarks/agent_quality.py --full --device cuda --prunes "$prunes" \
    ${ARGS:-} --out "$out/$prunes.json" 2>&1 | grep -v "it/s\]" | tail -80
ls -la "$out"
