# Sourced by the GPU scripts (gpu_checks.sh, gpu_smollm2.sh, agent_trace_gpu.sh): installs the wheels
# carried in the ignored folder .whl/ into a side folder that comes first on PYTHONPATH. The device
# image has grpcio 1.84, older than the checked-in stubs need (1.85.1); it has no redis or gguf:
#   pip download --no-deps --only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
#       --python-version 312 -d .whl grpcio==1.85.1 protobuf==7.35.1
#   pip download --no-deps -d .whl grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 redis gguf==0.19.0
site=${SITE:-/tmp/site}
mkdir -p "$site"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl/*.whl 2>&1 \
      | grep -v -i warning | tail -3 || true
fi
export PYTHONPATH=$PWD:$site PYTHONUNBUFFERED=1
