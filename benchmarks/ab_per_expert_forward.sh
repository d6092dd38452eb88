#!/usr/bin/env bash
# The MoE layer's forward GEMMs per expert or grouped (LOONGFORGE_PER_EXPERT_FORWARD none / down / all), A/B on
# the device: bench_moe's mixtral_like layer (ours and the dense chain of the same GEMMs, the anchors beside
# them), then the e2e mixtral step (LoongForge alone, 100 steps, text data), each policy in turn, LF_AB_ROUNDS
# times over (ABCABC: a drift of the card's clocks shows as a drift within a policy). Run after run_gpu.sh's
# build_ops step, whose extension dir it loads. Results under $1 (one folder a run), nvidia-smi beside the e2e runs.
#   device: bash benchmarks/run_gpu.sh ... && bash benchmarks/ab_per_expert_forward.sh /tmp/lf_res/ab
set -u
out=${1:?usage: ab_per_expert_forward.sh RESULTS_DIR}
mkdir -p "$out"
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/lf_ext_parallel}
policies=${LF_AB_POLICIES:-none down all}
rounds=${LF_AB_ROUNDS:-1}
for r in $(seq 1 "$rounds"); do for policy in $policies; do
  echo "=== bench_moe mixtral_like LOONGFORGE_PER_EXPERT_FORWARD=$policy round $r ($(date +%T))"
  LOONGFORGE_PER_EXPERT_FORWARD=$policy timeout "${LF_AB_MOE_TIMEOUT:-200}" python3 -m benchmarks.bench_moe \
    --shapes mixtral_like --out "$out/moe_${policy}_$r" > "$out/moe_${policy}_$r.log" 2>&1
  echo "rc=$?"; grep -E "^\| ours \||^- mixtral_like" "$out/moe_${policy}_$r.log"
done; done
[ "${LF_AB_E2E:-1}" = 1 ] || exit 0
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 500 > "$out/smi_e2e.csv" &
smi=$!
for r in $(seq 1 "$rounds"); do for policy in $policies; do
  echo "=== e2e mixtral LOONGFORGE_PER_EXPERT_FORWARD=$policy round $r ($(date +%T))"
  LOONGFORGE_PER_EXPERT_FORWARD=$policy timeout "${LF_AB_E2E_TIMEOUT:-240}" python3 launch/bench_e2e.py \
    --shape mixtral --variants loongforge --steps 100 --timeout 200 --out "$out/e2e_${policy}_$r" \
    --log-dir "$out/e2e_${policy}_$r/logs" > "$out/e2e_${policy}_$r.log" 2>&1
  echo "rc=$?"; grep -E "^\| loongforge \|" "$out"/e2e_"${policy}"_"$r"/*.md 2>/dev/null | head -2
done; done
kill $smi 2>/dev/null
exit 0
