#!/bin/bash
# Every GPU test, then the compile check, on the H200 machine (device tool) from the
# repository root, with liger-kernel (and cut-cross-entropy) carried as wheels in .whl/.
# Logs go under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout ${TEST_TIMEOUT:-400} python3 -m pytest -m gpu -q -rs -p no:cacheprovider ${TESTS:-tests} 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
