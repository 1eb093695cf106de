#!/usr/bin/env bash
# benchmarks/agent_fidelity.py --size gpu on the H200 (device tool), SmolLM2 carried as in
# benchmarks/gpu_smollm2.sh (the GGUF in two halves over two calls on the same warm machine):
#   here:    split the GGUF into .gl/a/part_aa and .gl/b/part_ab (+ .gl/b/sha256), wheels in .whl/
#            (gpu_smollm2.sh's header has the commands)
#   call 1:  run(command="mkdir -p .device_out && cp .gl/a/part_aa .device_out/", carry=[".gl/a"])
#   call 2:  run(command="bash benchmarks/agent_fidelity_gpu.sh $OUT", carry=[".gl/b", ".whl"])
#            then here: cp <files_at>/agent_fidelity_gpu.json benchmarks/results/ && python benchmarks/report.py
# The configurations run most important first (dense; X+recall and X for snapkv, kvzip, streaming_llm,
# expected_attention, keydiff at 0.25; the other methods at 0.25; then 0.5 and 0.1) and the JSON is saved
# after each one, so a run cut short at RUN_TIMEOUT_S keeps what it measured. ARGS adds flags
# (e.g. ARGS="--samples 4 --budgets 0.25" for a shorter call; a second call for the budgets the first did
# not reach: NAME=agent_fidelity_gpu_b2 ARGS="--budgets 0.5,0.1", a separate file report.py renders too).
set -uo pipefail
out=${1:-/tmp/out}
mkdir -p "$out"
source benchmarks/gpu_env.sh
source benchmarks/gpu_gguf.sh  # SmolLM2 from its two carried halves
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
timeout ${RUN_TIMEOUT_S:-530} python3 benchmarks/agent_fidelity.py --size gpu --device cuda --kv-cache-gb 8 \
    ${ARGS:-} --out "$out/${NAME:-agent_fidelity_gpu}.json" 2>&1 | grep -v "it/s\]" | tail -100
ls -la "$out"
