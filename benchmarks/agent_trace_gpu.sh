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
# PROFILE_TRACE=1 a shorter middle one; PROFILE=sync|host adds the engine-thread profile (serving_profile.py,
# TORCH_STEPS=N traces N prefill passes per configuration with torch's profiler, from the TORCH_FROM-th), NAME=... names the output
# files, ARGS="..." appends agent_trace.py flags. SCALE=1 runs the many-session, long-context trace twice:
# with 24 GB of KV (NAME_pool24) and with the whole pool (NAME_full; SCALE_FULL=0 skips it), each cut at
# SCALE_TIMEOUT_S seconds (the JSON keeps every configuration that finished).
set -euo pipefail
out=${OUT:-benchmarks/results}
mkdir -p "$out"
source benchmarks/gpu_env.sh  # the carried wheels (.whl/) and PYTHONPATH
if [ ! -f benchmarks/.tokenizer/tokenizer.json ]; then
  echo "benchmarks/.tokenizer/ is missing: run step 1 and carry the folder" >&2
  exit 2
fi
configs=${CONFIGS:-nochain,dense,snapkv,quest,dense+prune,snapkv+prune}
extra=()
if [ -n "${PROFILE:-}" ]; then
  extra+=(--profile "$PROFILE" --torch-profile-steps "${TORCH_STEPS:-0}" --torch-profile-from "${TORCH_FROM:-3}")
  [ "$PROFILE" = host ] && extra+=(--count-syncs)
fi
run_trace() {  # NAME, then agent_trace.py flags; cut at RUN_TIMEOUT_S seconds when set
  local name=$1; shift
  timeout "${RUN_TIMEOUT_S:-0}" python3 benchmarks/agent_trace.py --random-weights llama-3.1-8b --tokenizer benchmarks/.tokenizer \
      --device cuda:0 --page-size 32 --max-model-len 32768 --max-num-seqs 64 --prefill-chunk-size 4096 \
      --max-num-batched-tokens 8192 --gpu-memory-utilization 0.9 --method-budget 1024 \
      "$@" "${extra[@]}" ${ARGS:-} --out "$out/$name.json" 2>&1 | grep -v " done in " | tee "$out/$name.log"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "${SCALE:-0}" = 1 ]; then
  # the regime the product is for: 32 sessions at once, long tool outputs (contexts reach 16-25K), replies
  # of 128 tokens (an agent's reasoning and tool call),
  # run with the whole pool and with 24 GB of KV (the room a 70B-class model leaves per GPU), where
  # dense chain caching cannot hold every session. Both get 64 GB of host memory for demoted KV.
  configs=${CONFIGS:-dense,snapkv,streaming_llm,quest,dense+prune,snapkv+prune,nochain}
  trace=(--sessions 32 --turns 5 --concurrency 32 --system-words 1500 --tool-median 2400 --tool-sigma 0.5
         --tool-max 7000 --output-tokens 128 --think-s 0.5 --host-cache-gb 64)
  RUN_TIMEOUT_S=${SCALE_TIMEOUT_S:-270}
  run_trace "${NAME:-agent_trace_scale}_pool24" --configs "$configs" "${trace[@]}" --kv-cache-gb 24 || true
  if [ "${SCALE_FULL:-1}" = 1 ]; then
    run_trace "${NAME:-agent_trace_scale}_full" --configs "$configs" "${trace[@]}" || true
  fi
  exit 0
fi
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
run_trace "${NAME:-agent_trace_gpu}" --configs "$configs" "${trace[@]}"
