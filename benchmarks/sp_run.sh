#!/bin/bash
# The GPU run behind the "Sequence-parallel head" section of docs/benchmarks.md: its GPU tests
# (the head on one GPU over gloo against float64, its memory against the all-gather by hand,
# no host sync over NCCL where two GPUs are lent), then benchmarks/sequence_parallel.py (TP=2
# as two processes on one GPU over gloo; STEPS=...,jsd adds the JSD, STEPS=...,nccl the NCCL
# run on two GPUs). H200 machine (device tool), repository root; logs under $OUT.
. "$(dirname "$0")/gpu_setup.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
STEPS=${STEPS:-tests,bench}
if [[ $STEPS == *tests* ]]; then
  timeout 240 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_head_sequence_parallel_gpu.py 2>-p no:cacheprovider tests/test_sequence_parallel.py 2>&11 \
    | tee "$OUT/sp_gpu_tests.log" | tail -15
fi
if [[ $STEPS == *bench* ]]; then
  timeout 180 python3 benchmarks/sequence_parallel.py --json "$OUT/sp_gloo.json" 2>"$OUT/sp_gloo.err" \
    | tee "$OUT/sp_gloo.log"
fi
if [[ $STEPS == *jsd* ]]; then
  timeout 180 python3 benchmarks/sequence_parallel.py --op jsd --json "$OUT/sp_gloo_jsd.json" 2>"$OUT/sp_gloo_jsd.err" \
    | tee "$OUT/sp_gloo_jsd.log"
fi
if [[ $STEPS == *nccl* ]]; then
  timeout 180 python3 benchmarks/sequence_parallel.py --nccl --json "$OUT/sp_nccl.json" 2>"$OUT/sp_nccl.err" \
    | tee "$OUT/sp_nccl.log"
fi
