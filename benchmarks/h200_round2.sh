#!/bin/bash
# The GPU tests and the fused-head benchmark behind docs/benchmarks.md ("Fused head"), run on
# the H200 machine (device tool) from the repository root with liger-kernel, cut-cross-entropy
# and pytest-timeout carried as wheels in .whl/. Logs go under $OUT.
. "$(dirname "$0")/gpu_setup.sh"
STEPS=${STEPS:-tests,tp,head}
if [[ $STEPS == *tests* ]]; then
  timeout 220 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --timeout 150 tests/test_triton_gpu.py \
    tests/test_head_gpu.py tests/test_reliability.py tests/test_dtensor.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -12
fi
if [[ $STEPS == *tp* ]]; then
  timeout 170 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --timeout 120 tests/test_tp_one_device.py \
    -k "${TP_FILTER:-V151936}" 2>&1 | tee "$OUT/tp_tests.log" | tail -8
fi
if [[ $STEPS == *head* ]]; then
  timeout 240 vtp-runtime bench --head 4096 --tokens 2048,8192 --tp 1,2,4 --reps 10 \
    --json "$OUT/head.json" --plot "$OUT/head.png" 2>"$OUT/head.err" | tee "$OUT/head.log" | tail -40
  tail -3 "$OUT/head.err"
fi
