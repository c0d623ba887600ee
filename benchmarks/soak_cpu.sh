#!/usr/bin/env bash
# benchmarks/soak.py on the CPU for 100,000 steps (two gloo ranks, every op, logits, Head and
# compiled inputs, groups rebuilt every 500 steps): the RSS slope after warm-up (the first
# 20,000 steps) within 256 KiB per 1000 steps, and every other target of the soak.
#   benchmarks/soak_cpu.sh > benchmarks/results/cpu_soak_100k.md     # STEPS=... for fewer
# Extra arguments go to soak.py (e.g. --tracemalloc, --recompile-on-rebuild).
set -euo pipefail
cd "$(dirname "$0")/.."
exec python benchmarks/soak.py --device cpu --steps "${STEPS:-100000}" --rebuild-every 500 --report-every 10000 \
  --sample-every 100 --backend eager --compile-backend eager --step-timeout 120 "$@"
