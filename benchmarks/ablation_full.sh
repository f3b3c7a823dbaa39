#!/usr/bin/env bash
# The full, pre-registered toy-world ablation (results in benchmarks/results/ablation-toy-v2/), resumable:
# re-running this script continues where it stopped (per-run cache keyed by settings + engine source);
# the report (ablation.json / .md / curves.png) is rewritten after every finished run, so a partial run is
# a valid interim (the primary pair runs seed by seed first).
#
#   MODEL=/path/to/toy nohup benchmarks/ablation_full.sh > /tmp/ablation-full.log 2>&1 &
#   WAIT_LOG=/tmp/toy.log ...   # wait for `rc=0` in a toy-model build log first
#   .venv/bin/python benchmarks/ablation.py --report-only --model M --out benchmarks/results/ablation-toy-v2/n10
#
# Budget (2 idle cores; measured: one N = 10 run ≈ 170 CPU-s, the base evaluation ≈ 20): ≈ 1.35 h for the
# primary pair at N = 10 (27 seeds), ≈ 0.7 h for the 5 secondary arms × 6 seeds, ≈ 0.8 h for N = 17
# (8 + 4 seeds, ≈ 1.6× per run): ≈ 2.9 h in all.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-.chunkgrpo/models/toy}
OUT=${OUT:-benchmarks/results/ablation-toy-v2}
JOBS=${JOBS:-2}
PY=${PY:-.venv/bin/python}
export PYTHONPATH=$PWD OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
if [ -n "${WAIT_LOG:-}" ]; then
  echo "$(date -u +%FT%TZ) waiting for rc=0 in $WAIT_LOG"
  until grep -q "rc=0" "$WAIT_LOG" 2>/dev/null; do sleep 30; done
fi
echo "$(date -u +%FT%TZ) N = 10: the design check (profile, SDE plan, budgets; nothing trained)"
FRACTION=0.6667
if ! $PY benchmarks/ablation.py --model "$MODEL" --out "$OUT/n10" --report-only 2> "$OUT.design.err"; then
  cat "$OUT.design.err"
  # pre-registered fallback (decided before any outcome): if the SDE plan's chunk count K makes int(K·2/3)/K·9
  # a fraction of a step, no step arm can match it; then every arm trains all 9 transitions (fraction 1)
  grep -q "no step arm can match\|unequal budgets" "$OUT.design.err" || exit 2
  FRACTION=1.0
  echo "$(date -u +%FT%TZ) design refused at fraction 2/3; fallback: timestep_fraction=1.0"
fi
rm -f "$OUT.design.err"
echo "$(date -u +%FT%TZ) N = 10: primary pair (27 seeds, power calculation), then 5 secondary arms × 6 seeds"
$PY benchmarks/ablation.py --model "$MODEL" --out "$OUT/n10" --jobs "$JOBS" secondary_seeds=6 timestep_fraction=$FRACTION
echo "$(date -u +%FT%TZ) N = 17, the paper's [2, 3, 4, 7]: 2 of 4 chunks vs 8 of 16 steps; 8 + 4 seeds"
$PY benchmarks/ablation.py --model "$MODEL" --out "$OUT/n17" --jobs "$JOBS" --seeds 8 \
  --methods step_flow,chunk_dynamics,chunk_uniform secondary_seeds=4 sampling.num_steps=17 \
  timestep_fraction=0.5 plan=sizes:2,3,4,7 uniform=uniform:4
echo "$(date -u +%FT%TZ) done"
