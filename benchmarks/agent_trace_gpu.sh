#!/usr/bin/env bash
# The agent-trace benchmark on the H200: Llama-3.1-8B-shaped random bf16 weights (SmolLM2's
# tokenizer and vocabulary: the device has no model files), the whole trace replayed over gRPC
# against an in-process sidecar, every configuration side by side in one run.
#
# 1. Here (once): copy SmolLM2's tokenizer files into the ignored folder benchmarks/.tokenizer/
#      python benchmarks/agent_trace.py --prep-tokenizer benchmarks/.tokenizer
#    and have the grpc wheels in the ignored folder .whl/ (the device's grpcio is 1.84; the stubs
#    need 1.85.1; benchmarks/gpu_env.sh says how to download them).
# 2. On the device (the `run` tool), carrying both folders:
#      run(command="bash benchmarks/agent_trace_gpu.sh", carry=["benchmarks/.tokenizer", ".whl"],
#          kind="nvidia-h200", timeout_s=600)
#    It writes $OUT/agent_trace_gpu.json (and the log); copy the JSON into benchmarks/results/,
#    then `python benchmarks/report.py`.
# Configurations the sidecar's registry does not have yet (snapkv, quest before they are merged)
# are skipped with a message; CONFIGS=... overrides the list, QUICK=1 runs a small trace, MEDIUM=1 a middle one,
# PROFILE_TRACE=1 a shorter middle one; PROFILE=sync|host adds the engine-thread profile (serving_profile.py),
# NAME=... names the output files, ARGS="..." appends agent_trace.py flags.
set -euo pipefail
out=${OUT:-benchmarks/results}
mkdir -p "$out"
source benchmarks/gpu_env.sh  # the carried wheels (.whl/) and PYTHONPATH
if [ ! -f benchmarks/.tokenizer/tokenizer.json ]; then
  echo "benchmarks/.tokenizer/ is missing: run step 1 and carry the folder" >&2
  exit 2
fi
configs=${CONFIGS:-nochain,dense,snapkv,quest,dense+prune,snapkv+prune}
if [ "${MEDIUM:-0}" = 1 ]; then  # what fits one device call (~4 min) with every configuration
  trace=(--sessions 16 --turns 6 --concurrency 8 --system-words 1500 --tool-median 1200 --tool-sigma 0.6
         --tool-max 4000 --output-tokens 32 --think-s 0.2)
elif [ "${PROFILE_TRACE:-0}" = 1 ]; then  # a shorter MEDIUM for --profile runs (PROFILE=sync|host)
  trace=(--sessions 8 --turns 4 --concurrency 8 --system-words 1500 --tool-median 1200 --tool-sigma 0.6
         --tool-max 4000 --output-tokens 32 --think-s 0.2)
elif [ "${QUICK:-0}" = 1 ]; then
  trace=(--sessions 8 --turns 4 --concurrency 8 --system-words 800 --tool-median 400 --output-tokens 32 --think-s 0.1)
else
  trace=(--sessions 32 --turns 8 --concurrency 16 --system-words 1500 --tool-median 800 --tool-sigma 0.8
         --tool-max 6000 --output-tokens 64 --think-s 0.5)
fi
extra=()
if [ -n "${PROFILE:-}" ]; then
  extra+=(--profile "$PROFILE")
  [ "$PROFILE" = host ] && extra+=(--count-syncs)
fi
name=${NAME:-agent_trace_gpu}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 benchmarks/agent_trace.py --random-weights llama-3.1-8b --tokenizer benchmarks/.tokenizer \
    --device cuda:0 --page-size 32 --max-model-len 32768 --max-num-seqs 64 --prefill-chunk-size 4096 \
    --max-num-batched-tokens 8192 --gpu-memory-utilization 0.9 --method-budget 1024 \
    --configs "$configs" "${trace[@]}" "${extra[@]}" ${ARGS:-} --out "$out/$name.json" 2>&1 | tee "$out/$name.log"
