#!/bin/bash
# Every GPU test, then the compile check, on the H200 machine (device tool) from the
# repository root, with liger-kernel (and cut-cross-entropy) carried as wheels in .whl/.
# Logs go under $OUT.
. "$(dirname "$0")/gpu_setup.sh"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout ${TEST_TIMEOUT:-400} python3 -m pytest -m gpu -q -rs -p no:cacheprovider ${TESTS:-tests} 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
