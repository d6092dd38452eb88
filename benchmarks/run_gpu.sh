#!/usr/bin/env bash
# One device call: install the carried wheels, JIT-build the CUDA ops cold (timed) and cached (timed),
# loongforge_report --verify, the GPU tests, and the benchmarks. Everything lands in $OUT.
#
#   here:   see shared/BENCHMARKS.md to fill .whl/ (DeepSpeed, pydantic, hjson, liger-kernel wheels)
#   device: LF_COMMIT=<sha> bash benchmarks/run_gpu.sh        (carry: [".whl"]; LF_BENCH=0 skips the benchmarks)
#
# LF_STEPS picks steps (default: build verify tests bench_ops bench_moe; LF_LEVERS: diagnose_levers's --levers); the others: build_ops (all ops through
# build_ops, untimed), bench_qkv, diagnose_grouped_gemm, bench_optimizer, bench_sampler, diagnose_moe, diagnose_levers, diagnose_residual, diagnose_dispatch, diagnose_adamw, diagnose_overlap, diagnose_cross_entropy, diagnose_routing, ab_rmsnorm, ncu_kernels, bench_e2e, train_zero3, diagnose_zero_init_bits, pyspy_e2e (needs a py-spy wheel). Steps that write several files
# put them under /tmp/lf_res, which is tarred into $OUT/results.tar after each step (the device returns at most
# 8 files); LF_STEP_TIMEOUT bounds each of those steps (seconds, default 480). LF_TESTS: the pytest paths of the
# "tests" step (default: all of tests/).
set -uo pipefail
OUT=${OUT:-/tmp/lf_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0  # the image presets 9.0a; the H200 is plain sm_90 code here
export MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 RANK=0 WORLD_SIZE=1 LOCAL_RANK=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
# the device image has no network for an editable install's build deps: map op_builder/ into the package
# the way setup.py installs it (ds_loongforge.op_builder), in this throw-away copy of the tree
ln -sfn ../op_builder ds_loongforge/op_builder
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv

LF_STEPS=${LF_STEPS:-build verify tests bench_ops bench_moe}
[ "${LF_BENCH:-1}" = 1 ] || LF_STEPS=${LF_STEPS//bench_ops/}
[ "${LF_BENCH:-1}" = 1 ] || LF_STEPS=${LF_STEPS//bench_moe/}
RES=/tmp/lf_res; rm -rf $RES; mkdir -p $RES
has() { [[ " $LF_STEPS " == *" $1 "* ]]; }
marked() {  # marked NAME CMD...: CMD between "=== NAME (time)" and "=== NAME rc=N S s" lines
  local name=$1; shift
  echo "=== $name ($(date +%T))"
  local t=$SECONDS
  "$@"; local rc=$?
  echo "=== $name rc=$rc $((SECONDS - t)) s"
}
logged() {  # logged NAME CMD...: CMD with a timeout, its output into $RES/NAME.log
  local name=$1; shift
  timeout "${LF_STEP_TIMEOUT:-480}" "$@" > "$RES/$name.log" 2>&1
}
step() {  # step NAME CMD...: marked and logged, the log's tail shown, $RES tarred into $OUT after it
  marked "$1" logged "$@"
  tail -40 "$RES/$1.log"
  tar -C $RES -cf "$OUT/results.tar" .
}
# cold JIT build of both CUDA ops (fresh extension dir), then a cached load in a fresh process
if has build; then
export TORCH_EXTENSIONS_DIR=/tmp/lf_ext_cold
rm -rf "$TORCH_EXTENSIONS_DIR"
python3 - > "$OUT/build.json" <<'PY'
import json, time
t0 = time.time()
from ds_loongforge.op_builder import FusedRMSNormBuilder, FusedSwiGLUBuilder
times = {}
for b in (FusedRMSNormBuilder(), FusedSwiGLUBuilder()):
    t = time.time(); b.load(); times[b.NAME] = round(time.time() - t, 2)
print(json.dumps({"cold_jit_seconds": times, "cold_total_seconds": round(time.time() - t0, 2)}))
PY
python3 - >> "$OUT/build.json" <<'PY'
import json, time
t0 = time.time()
from ds_loongforge.op_builder import FusedRMSNormBuilder, FusedSwiGLUBuilder  # imports torch, deepspeed
t1 = time.time()
for b in (FusedRMSNormBuilder(), FusedSwiGLUBuilder()):
    b.load()
t2 = time.time()
print(json.dumps({"cached_load_seconds_both_ops": round(t2 - t1, 2), "import_torch_deepspeed_seconds": round(t1 - t0, 2)}))
PY
export TORCH_EXTENSIONS_DIR=/tmp/lf_ext_parallel
rm -rf "$TORCH_EXTENSIONS_DIR"
# build_ops spawns one process per op, and a spawned child re-imports the parent's main script: so this
# one is a file, not stdin (python3 - fails there with "No such file or directory: '<stdin>'")
cat > /tmp/lf_build_ops.py <<'PY'
import json, time
from ds_loongforge.op_builder import FusedRMSNormBuilder, FusedSwiGLUBuilder, build_ops
if __name__ == "__main__":
    t = time.time()
    results = build_ops([FusedRMSNormBuilder(), FusedSwiGLUBuilder()])
    assert all(not isinstance(m, Exception) for m in results.values()), results
    print(json.dumps({"cold_jit_seconds_both_ops_build_ops_parallel": round(time.time() - t, 2)}))
PY
python3 /tmp/lf_build_ops.py >> "$OUT/build.json"
cat "$OUT/build.json"
fi
export TORCH_EXTENSIONS_DIR=/tmp/lf_ext_parallel
if has build_ops; then  # every op, in parallel, untimed (the steps below then load them cached)
cat > /tmp/lf_build_all.py <<'PY'
from ds_loongforge.report import all_builders
from ds_loongforge.op_builder import build_ops
if __name__ == "__main__":
    results = build_ops(all_builders())
    print({name: type(m).__name__ for name, m in results.items()})
PY
step build_ops python3 /tmp/lf_build_all.py
fi

has verify && python3 -m ds_loongforge.report --verify 2>&1 | tee "$OUT/verify.log" | tail -25
# the tests' and bench_moe's logs come back as files of their own, so they run marked, not as a step
run_tests() {
  python3 -m pytest ${LF_TESTS:-tests} -q -rs -m "gpu or cuda_build" -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -15
  return "${PIPESTATUS[0]}"
}
has tests && marked tests run_tests
if has bench_ops; then
LF_RESULTS_DIR="$OUT" python3 -m benchmarks.bench_norm_swiglu --repeats 100 2>&1 | tee "$OUT/bench.log" | tail -60
python3 -m benchmarks.profile_ops 2>&1 | grep -v Warning > "$OUT/profile.log"; tail -22 "$OUT/profile.log"
fi
# MoE layer (issue 3): ours vs HF Mixtral (grouped_mm, eager), DeepSpeed MoE and AutoEP. The device returns at
# most 8 files and the steps above write 7, so its log, JSON and markdown come back as one tar.
if has bench_moe; then
rm -rf /tmp/lf_moe && mkdir -p /tmp/lf_moe
run_bench_moe() {
  python3 -m benchmarks.bench_moe --out /tmp/lf_moe 2>&1 | tee /tmp/lf_moe/bench_moe.log | tail -50
  return "${PIPESTATUS[0]}"
}
marked bench_moe run_bench_moe
tar -C /tmp/lf_moe -cf "$OUT/bench_moe.tar" .
fi
has diagnose_moe && step diagnose_moe python3 -m benchmarks.diagnose_moe --out $RES
# issue 5: the optimizer beside the forward on two streams, and the fwd+bwd as one CUDA graph (device-side levers)
if has diagnose_levers; then for shape in ${LF_E2E_SHAPES:-mixtral}; do
  step diagnose_levers_$shape python3 -m benchmarks.diagnose_e2e_levers --model $shape --out $RES ${LF_LEVERS:+--levers $LF_LEVERS}
done; fi
# the decoder layers' residual adds fused (fused_kernels.residual_add) or not: fwd+bwd time, energy and kernels
if has diagnose_residual; then for shape in ${LF_E2E_SHAPES:-mixtral}; do
  step diagnose_residual_$shape python3 -m benchmarks.diagnose_residual --model $shape --out $RES
done; fi
# the unpermute backward's reads in flight: the dispatch op built once per choice, timed side by side
has diagnose_dispatch && step diagnose_dispatch python3 -m benchmarks.diagnose_dispatch --out $RES/diagnose_dispatch.json
# the attention's q/k/v projections: three Linears vs fused_kernels.qkv, fwd + bwd, beside one dense product
# the MoE layer's six GEMMs: torch's grouped GEMM vs a per-expert cuBLAS loop vs one dense GEMM, interleaved; LF_GEMM_ARGS: its options (--host-cost)
has diagnose_grouped_gemm && step diagnose_grouped_gemm python3 -m benchmarks.diagnose_grouped_gemm --out $RES ${LF_GEMM_ARGS:-}
has bench_qkv && step bench_qkv env LF_RESULTS_DIR=$RES python3 -m benchmarks.bench_qkv
# issue 4: the optimizer's GPU tests (also in "tests") and its benchmark
has tests_optim && step tests_optim python3 -m pytest tests/optim -q -m "gpu or cuda_build" -p no:cacheprovider
has bench_optimizer && step bench_optimizer python3 benchmarks/bench_optimizer.py --out $RES
# the AdamW update built per launch shape (block size, resident blocks, elements a thread), timed idle and after GEMMs
has diagnose_adamw && step diagnose_adamw python3 -m benchmarks.diagnose_adamw --out $RES/diagnose_adamw.json
has diagnose_overlap && step diagnose_overlap python3 -m benchmarks.diagnose_overlap --out $RES
# the RMSNorm op against another tree's build (LF_OLD_CSRC): every output's bits over 264 cases, then both builds'
# backward timed side by side
has ab_rmsnorm && step ab_rmsnorm python3 -m benchmarks.ab_rmsnorm_bits --old-csrc "${LF_OLD_CSRC:?set LF_OLD_CSRC to another tree csrc/ directory}" --time
# hardware counters (Nsight Compute) of our kernels that stay below the copy rate in the e2e step; --clock-control
# none leaves the clocks as the device runs them
if has ncu_kernels; then
  ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  step ncu_kernels "${ncu_bin:-ncu}" --clock-control none --nvtx --nvtx-include "lf/" --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis python3 -m benchmarks.ncu_kernels
fi
# the softmax cross-entropy kernel on the LM heads' chunk shapes; LF_OLD_CSRC: another tree's csrc/ to time beside it
has diagnose_cross_entropy && step diagnose_cross_entropy python3 -m benchmarks.diagnose_cross_entropy \
  --out $RES/diagnose_cross_entropy.json ${LF_OLD_CSRC:+--old-csrc $LF_OLD_CSRC}
# the routing kernel (counting sort of the pairs) from the e2e shapes to 16M pairs, beside torch's stable sort and LF_OLD_CSRC's build
has diagnose_routing && step diagnose_routing python3 -m benchmarks.diagnose_routing \
  --out $RES/diagnose_routing.json ${LF_OLD_CSRC:+--old-csrc $LF_OLD_CSRC}
# issue 6: the sampler benchmark on the GPU (pre-scan time, peak-memory spread)
has bench_sampler && step bench_sampler python3 benchmarks/bench_sampler.py --device cuda --out $RES
# issue 5: the end-to-end A/B benchmark, one step per shape in LF_E2E_SHAPES (default mixtral), LF_E2E_ARGS added
if has bench_e2e; then for shape in ${LF_E2E_SHAPES:-mixtral}; do
  # SM clock, power and temperature every 0.5 s beside the variants (a sustained GEMM load runs into the power cap)
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 500 > "$RES/smi_$shape.csv" &
  smi=$!
  # eval: LF_E2E_ARGS keeps its quotes (--train-args "--kernel-profile 3 --memory-snapshot")
  eval "step bench_e2e_$shape python3 launch/bench_e2e.py --shape $shape --out $RES --log-dir $RES/logs_$shape ${LF_E2E_ARGS:-}"
  kill $smi 2>/dev/null
done; fi
# ZeRO-3 on one GPU: the zero.Init, fused-loss and optimizer GPU tests, then train.py at stage 3 (1gpu_zero2_bf16.json
# with stage 3: FusedAdamWClip for LoongForge, DeepSpeed's torch AdamW for stock), LoongForge then stock
if has train_zero3; then
  step tests_zero3 python3 -m pytest tests/integrations tests/optim/test_fused_adamw_clip_deepspeed_gpu.py -q -rs \
    -m "gpu or cuda_build" -k "zero or fused_loss or loss_scale" -p no:cacheprovider
  python3 - "$RES/zero3_bf16.json" <<'PY'
import json, sys
cfg = json.load(open("ds_configs/1gpu_zero2_bf16.json"))
cfg["zero_optimization"] = {"stage": 3}
cfg["optimizer"]["params"]["torch_adam"] = True  # stock's optimizer (no FusedAdam JIT build); FusedAdamWClip ignores it
json.dump(cfg, open(sys.argv[1], "w"), indent=1)
PY
  for v in use-loongforge no-loongforge; do
    step train_zero3_$v python3 launch/train.py --deepspeed_config "$RES/zero3_bf16.json" --model mixtral \
      --seq-len 2048 --steps ${LF_ZERO3_STEPS:-30} --data random --timing events --log-every 10 --eval-every 0 \
      --no-progress --$v ${LF_ZERO3_ARGS:-}
  done
fi
# why bf16 trained bits differ between a zero.Init load and a whole load on the GPU: whole twice, zero.Init twice, per setting
has diagnose_zero_init_bits && step diagnose_zero_init_bits python3 -m benchmarks.diagnose_zero_init_bits \
  --out $RES/diagnose_zero_init_bits.json
# the host's Python in the LoongForge e2e step, sampled by py-spy (carried wheel) without torch's profiler: which
# frames the main thread and autograd's device thread spend the step in (raw collapsed stacks, --threads --idle)
if has pyspy_e2e; then for shape in ${LF_E2E_SHAPES:-mixtral}; do
  cfg=$RES/pyspy_ds_config.json
  python3 -c "import json, sys, launch.bench_e2e as b; open(sys.argv[1], 'w').write(json.dumps(b.make_ds_config(True, 4, 'text')))" "$cfg"
  step pyspy_e2e_$shape /tmp/site/bin/py-spy record ${LF_PYSPY_ARGS:---nonblocking} -r 500 --threads --idle -f raw \
    -o "$RES/pyspy_$shape.txt" -- python3 launch/train.py --deepspeed_config "$cfg" --model $shape --seq-len 2048 \
    --steps ${LF_PYSPY_STEPS:-100} --data text --timing events --log-every 10 --eval-every 0 --no-progress \
    --use-loongforge --profile
  # raw stacks of a 40-step run are ~17 MB, over the device's 16 MiB a file: the tar would not come back
  gzip -f "$RES/pyspy_$shape.txt"; tar -C $RES -cf "$OUT/results.tar" .
done; fi
exit 0
