#!/bin/bash
# The last GPU run behind docs/benchmarks.md: the GPU tests of the newer features, the fused
# head at N=8192, log-probs with the entropy against log-probs alone, the CPU cost per call,
# and (when present) the no-host-sync and CUDA-graph tests. H200 machine (device tool), repo
# root, with liger-kernel, cut-cross-entropy and pytest-timeout carried as wheels in .whl/.
set -o pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -2
STEPS=${STEPS:-tests,head,entropy,cpu}
if [[ $STEPS == *tests* ]]; then
  native=$(ls tests/test_native_gpu.py 2>/dev/null)
  timeout 180 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --timeout 60 tests/test_head_gpu.py $native \
    tests/test_triton_gpu.py -k "not v151936 or entropy" tests/test_dtensor.py 2>&1 | tee "$OUT/gpu_tests.log" \
    | grep -E "passed|failed|Error|error:|^E |Timeout" | head -40
fi
if [[ $STEPS == *head* ]]; then
  timeout 130 vtp-runtime bench --head 4096 --tokens 8192 --tp 1,2,4 --reps 10 \
    --json "$OUT/head.json" 2>"$OUT/head.err" | tee "$OUT/head.log" | tail -24
fi
if [[ $STEPS == *entropy* ]]; then
  timeout 100 vtp-runtime bench --ops logprobs,logprobs_entropy --backends triton --peers torch --vocab 151936 \
    --tp 1,4 --tokens 1024,8192 --dtype bfloat16 --reps 20 --json "$OUT/lp_entropy.json" 2>"$OUT/lp_entropy.err" \
    | tee "$OUT/lp_entropy.log" | tail -14
fi
if [[ $STEPS == *cpu* ]]; then
  timeout 80 python3 benchmarks/profile_cpu.py 2>&1 | tee "$OUT/profile_cpu.log" | head -30
fi
