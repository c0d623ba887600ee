#!/bin/bash
# The GPU run behind the latest figures in docs/benchmarks.md: the GPU tests (DTensor on
# CUDA included; the TP-on-one-GPU tests, five minutes by themselves, only with TESTS=tests),
# the fused head at N=8192 (with reduction="none"), the end-to-end training step, and cross
# entropy / JSD back to back at N=1024 against their peers. H200 machine (device tool), repo
# root, with liger-kernel, cut-cross-entropy and pytest-timeout carried as wheels in .whl/.
. "$(dirname "$0")/gpu_setup.sh"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # many large tests in one process
STEPS=${STEPS:-tests,head,step,b2b}
if [[ $STEPS == *tests* ]]; then
  timeout 280 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --timeout 120 ${TESTS:-tests --ignore=tests/test_tp_one_device.py} 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|Error|error:|^E |Timeout|XFAIL|SKIP" | head -40
fi
if [[ $STEPS == *head* ]]; then
  timeout 150 vtp-runtime bench --head 4096 --tokens 8192 --tp 1,2,4 --reps 10 \
    --json "$OUT/head.json" 2>"$OUT/head.err" | tee "$OUT/head.log" | tail -30
fi
if [[ $STEPS == *step* && -f benchmarks/step.py ]]; then
  timeout 150 python3 benchmarks/step.py --tokens 8192,32768 --reps 10 --json "$OUT/step.json" 2>"$OUT/step.err" \
    | tee "$OUT/step.log" | tail -20
fi
if [[ $STEPS == *b2b* ]]; then
  timeout 90 vtp-runtime bench --ops cross_entropy,jsd --backends triton --peers torch,liger --vocab 151936 \
    --tp 1,2,4 --tokens 1024 --dtype bfloat16 --reps 20 --json "$OUT/b2b.json" 2>"$OUT/b2b.err" \
    | tee "$OUT/b2b.log" | tail -16
fi
