#!/usr/bin/env bash
# benchmarks/soak.py on the CPU for 100,000 steps (two gloo ranks, every op, logits, Head and
# compiled inputs, groups rebuilt every 500 steps), a token count drawn from 1..2048 at every
# step (so that anything kept per token count would grow for the whole run; V = 64 and H = 16
# keep a step short): the RSS slope after warm-up (the first 20,000 steps) within 256 KiB per
# 1000 steps, the plans per cache, and every other target of the soak.
#   benchmarks/soak_cpu.sh > benchmarks/results/cpu_soak_100k.md     # STEPS=... for fewer
# Extra arguments go to soak.py and override these (e.g. --tracemalloc, --recompile-on-rebuild,
# --tokens 1,48 --vocab 384 --hidden 32 for the earlier runs' shapes).
set -euo pipefail
cd "$(dirname "$0")/.."
exec python benchmarks/soak.py --device cpu --steps "${STEPS:-100000}" --tokens 1,2048 --vocab 64 --hidden 16 \
  --rebuild-every 500 --report-every 10000 --sample-every 100 --backend eager --compile-backend eager \
  --step-timeout 120 "$@"
