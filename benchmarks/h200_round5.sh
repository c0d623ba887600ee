#!/bin/bash
# The GPU runs behind this round's figures in docs/benchmarks.md, on the H200 machine (device
# tool) from the repository root, with liger-kernel, cut-cross-entropy and transformers 5.24
# carried as wheels in .whl/. STEPS picks what runs (each prints a short summary; logs under
# $OUT):
#   tests   the GPU tests (all but the TP-on-one-GPU ones: TESTS=tests for those too)
#   sample  vtp.sample / vtp.argmax against gathering the logits and sampling them whole
#   cpu     the CPU cost per call at 16 rows, every op, against F.cross_entropy
#   head    the fused head at N=8192 against the materialized path and its peers
#   soak    benchmarks/soak.py: 10,000 steps on two ranks sharing the GPU
#   step    the end-to-end training step, transformers' Llama with each way of computing the loss
#   topkp   the top-k and top-p sampling arms again (with their peers)
#   sp      benchmarks/sequence_parallel.py: the sequence-parallel head against the gather by hand
#           (its GPU tests are among the tests step's)
#   tune    launch configurations at N=1024, TP=4 (and N=8192) for every op
#   small   every op at N=1024 on TP 1 and 4: % of copy bandwidth in GPU time, loop against graph time
#   tp1gpu  the TP-on-one-GPU tests (every backend at TP 2 and 3, gloo ranks sharing the GPU)
. "$(dirname "$0")/gpu_setup.sh"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
STEPS=${STEPS:-tests,sample,cpu,head}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
if [[ $STEPS == *tests* ]]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -m gpu -q -rs -p no:cacheprovider --timeout 120 \
    ${TESTS:-tests --ignore=tests/test_tp_one_device.py} 2>&1 | tee "$OUT/gpu_tests.log" \
    | grep -E "passed|failed|Error|error:|^E |Timeout|XFAIL|SKIP|FAILED" | head -40
fi
if [[ $STEPS == *sample* ]]; then
  timeout 150 vtp-runtime bench --ops sample,sample_top_k,sample_top_p,argmax --tp 1,2,4 \
    --json "$OUT/sample.json" 2>"$OUT/sample.err" | tee "$OUT/sample.log" | tail -60
fi
if [[ $STEPS == *cpu* ]]; then
  timeout 90 python3 benchmarks/profile_cpu.py --device cuda --tokens 16 --reps 60 --rounds 5 2>&1 | tee "$OUT/cpu.log" | head -48
fi
if [[ $STEPS == *head* ]]; then
  timeout 150 vtp-runtime bench --head 4096 --tokens 8192 --tp 1,2,4 --reps 10 \
    --json "$OUT/head.json" 2>"$OUT/head.err" | tee "$OUT/head.log" | tail -30
fi
if [[ $STEPS == *soak* ]]; then
  timeout ${SOAK_TIMEOUT:-560} python3 benchmarks/soak.py --device cuda --steps ${SOAK_STEPS:-10000} \
    > "$OUT/soak.md" 2> "$OUT/soak.err"; echo "soak exit $?"; tail -30 "$OUT/soak.md"; tail -5 "$OUT/soak.err"
fi
if [[ $STEPS == *step* ]]; then
  timeout 240 python3 benchmarks/step.py --tokens 8192 --seq 2048 --reps 10 --json "$OUT/step_hf.json" \
    --arms hf_torch,hf_vtp_loss,hf_vtp_fused,hf_liger,hf_liger_lce,hf_liger_vtp 2>"$OUT/step_hf.err" \
    | tee "$OUT/step_hf.log" | tail -20
fi
if [[ $STEPS == *tune* ]]; then
  timeout 240 python3 benchmarks/tune.py --variants ${VARIANTS:-default,programs2k,programs4k,bwd8k,programs4k_bwd8k} \
    --shapes ${SHAPES:-cross_entropy:1024:4,logprobs:1024:4,entropy:1024:4,kl:1024:4,jsd:1024:4,cross_entropy:8192:1,jsd:8192:1} \
    2>&1 | tee "$OUT/tune.log" | tail -40
fi
if [[ $STEPS == *small* ]]; then
  timeout 150 vtp-runtime bench --tokens 1024 --tp 1,4 --reps 50 --peers torch \
    --json "$OUT/small.json" 2>"$OUT/small.err" | tee "$OUT/small.log" | tail -40
fi
if [[ $STEPS == *tp1gpu* ]]; then
  timeout 300 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --timeout 200 tests/test_tp_one_device.py -k V151936 2>&1 \
    | tee "$OUT/tp1gpu.log" | grep -E "passed|failed|^E |FAILED" | head -20
fi
if [[ $STEPS == *topkp* ]]; then
  timeout 120 vtp-runtime bench --ops sample_top_k,sample_top_p --tp 1,2,4 \
    --json "$OUT/topkp.json" 2>"$OUT/topkp.err" | tee "$OUT/topkp.log" | tail -34
fi
if [[ $STEPS == *sp* ]]; then
  timeout 150 python3 benchmarks/sequence_parallel.py --json "$OUT/sp_gloo.json" 2>"$OUT/sp_gloo.err" \
    | tee "$OUT/sp_gloo.log" | tail -12
fi
