#!/bin/bash
# The GPU runs behind the sixth round's figures in docs/benchmarks.md, on the H200 machine
# (device tool) from the repository root, with liger-kernel, cut-cross-entropy, transformers
# 5.24 and trl 1.16 (with datasets, dill, multiprocess) carried as wheels in .whl/, and
# flash-attn 2.8.3's flash_attn/ops/triton/cross_entropy.py as .whl/peers/. STEPS picks what
# runs (logs under $OUT):
#   tests     the GPU tests (all but the TP-on-one-GPU ones, and test_head_variants: the study)
#   cpu       benchmarks/profile_cpu.py: CPU cost per call at 16 and 1 rows (medians of 5 rounds),
#             every op, beside F.cross_entropy, flash-attn's Triton CE and Liger's; N=1024 loop vs
#             graph replay
#   decode    decode-time draws at N = 1, 8, 64 (TP=1), and at TP=2 (two processes, one GPU)
#   generate  benchmarks/generate.py --quick: ms per decode step with and without the hook
#   soak      benchmarks/soak.py: 5,000 steps, RSS and allocated memory slopes after warm-up
#             (SOAK_ARGS: more of its flags, e.g. --max-plans 256; SOAK_TIMEOUT: seconds, 240)
#   head      the fused head at N=8192 (logits GEMM, cuBLAS chunks, materialized; HEAD_TOKENS,
#             HEAD_TP: other sizes; HEAD_TIMEOUT: seconds, 150)
#   step      the transformers step, fuse_lm_head against use_vocab_parallel_loss
. "$(dirname "$0")/gpu_setup.sh"
STEPS=${STEPS:-tests,cpu,decode,generate}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
if [[ $STEPS == *tests* ]]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -m gpu -q -rs -p no:cacheprovider --timeout 150 \
    ${TESTS:-tests --ignore=tests/test_tp_one_device.py --ignore=tests/test_head_variants.py} 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|^E |Timeout|SKIP|FAILED" | head -40
fi
if [[ $STEPS == *cpu* ]]; then
  timeout 150 python3 benchmarks/profile_cpu.py --device cuda --tokens 16,1 --reps 60 --rounds 5 --no-cprofile \
    --flash-attn-ce .whl/peers/flash_attn_cross_entropy.py --graph-tokens 1024 --json "$OUT/cpu.json" \
    2>&1 | tee "$OUT/cpu.log" | tail -60
fi
if [[ $STEPS == *decode* ]]; then
  timeout 120 python3 -m vtp_runtime.tools.bench_sample --json "$OUT/decode_tp1.json" 2>&1 | tee "$OUT/decode_tp1.log" | tail -22
  timeout 90 python3 benchmarks/sample_tp2.py --json "$OUT/decode_tp2.json" 2>&1 | tee "$OUT/decode_tp2.log" | tail -22
fi
if [[ $STEPS == *generate* ]]; then
  timeout 200 python3 benchmarks/generate.py --quick --json "$OUT/generate_quick.json" 2>&1 \
    | tee "$OUT/generate_quick.log" | tail -12
fi
if [[ $STEPS == *soak* ]]; then
  timeout ${SOAK_TIMEOUT:-240} python3 benchmarks/soak.py --device cuda --steps 5000 --warmup-steps 1000 --report-every 1000 ${SOAK_ARGS:-} \
    > "$OUT/soak.md" 2> "$OUT/soak.err"; echo "soak exit $?"; tail -30 "$OUT/soak.md"; tail -3 "$OUT/soak.err"
fi
if [[ $STEPS == *head* ]]; then
  timeout ${HEAD_TIMEOUT:-150} vtp-runtime bench --head 4096 --tokens ${HEAD_TOKENS:-8192} --tp ${HEAD_TP:-1,2,4} --reps 5 --peers torch \
    --json "$OUT/head.json" 2>"$OUT/head.err" | tee "$OUT/head.log" | tail -30
fi
if [[ $STEPS == *step* ]]; then
  timeout 200 python3 benchmarks/step.py --tokens ${STEP_TOKENS:-8192,32768} --seq 2048 --reps 10 \
    --arms hf_vtp_loss,hf_vtp_fused --json "$OUT/step_hf.json" 2>"$OUT/step_hf.err" | tee "$OUT/step_hf.log" | tail -12
fi
