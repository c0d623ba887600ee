#!/bin/bash
# The exact command behind docs/benchmarks.md, run on the H200 machine (device tool) from the
# repository root, with liger-kernel carried as a wheel in .whl/. Writes logs under $OUT.
. "$(dirname "$0")/gpu_setup.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
STEPS=${STEPS:-tests,profile,bench}
if [[ $STEPS == *tests* ]]; then
  timeout 170 python3 -m pytest tests/test_triton_gpu.py -m gpu -q -rs -x -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
fi
if [[ $STEPS == *profile* ]]; then
  timeout 120 python3 benchmarks/profile_passes.py 2>&1 | tee "$OUT/profile.log" | grep -E "^[a-z_0-9]+ +(jsd|cross)"
fi
if [[ $STEPS == *tune* ]]; then
  timeout 110 python3 benchmarks/tune.py 2>&1 | tee "$OUT/tune.log"
fi
if [[ $STEPS == *bench* ]]; then
  timeout 280 vtp-runtime bench --ops jsd,cross_entropy,kl,entropy,logprobs --backends triton --peers torch,liger \
    --vocab 151936 --tp 1,2,4,8 --tokens 1024,8192 --dtype bfloat16 --reps 20 --overhead \
    --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>"$OUT/bench.err" | tee "$OUT/bench.log"
  tail -3 "$OUT/bench.err"
fi
