#!/bin/bash
# The exact command behind the multi-GPU section of docs/benchmarks.md, run on a 2-GPU H200
# machine (device tool, kind nvidia-h200-x2) from the repository root, with liger-kernel
# carried as a wheel in .whl/. Writes logs under $OUT. NVLink multicast stays off.
set -o pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -2
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
TP=${TP:-2}
timeout 420 python3 benchmarks/multigpu.py --tp "$TP" --json "$OUT/multigpu_tp$TP.json" 2>&1 | tee "$OUT/multigpu_tp$TP.log" | grep -v "  pass$"
timeout 90 python3 benchmarks/xpu_config_on_cuda.py --json "$OUT/xpu_config_on_cuda.json" 2>&1 | tee "$OUT/xpu_config_on_cuda.log" | tail -15
timeout 45 python3 benchmarks/xpu_config_on_cuda.py --backend liger 2>&1 | tee "$OUT/liger_on_cuda.log" | tail -15
