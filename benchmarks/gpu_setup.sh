# Sourced by the GPU scripts beside it: the environment of a run on the H200 machine (device
# tool) from the repository root, with the wheels it needs (liger-kernel, cut-cross-entropy,
# pytest-timeout) carried in .whl/. Logs go under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -2
