#!/usr/bin/env bash
# One device call: install the carried wheels, JIT-build the CUDA ops cold (timed) and cached (timed),
# loongforge_report --verify, the GPU tests, and the benchmarks. Everything lands in $OUT.
#
#   here:   see shared/BENCHMARKS.md to fill .whl/ (DeepSpeed, pydantic, hjson, liger-kernel wheels)
#   device: LF_COMMIT=<sha> bash benchmarks/run_gpu.sh        (carry: [".whl"]; LF_BENCH=0 skips the benchmarks)
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

# cold JIT build of both CUDA ops (fresh extension dir), then a cached load in a fresh process
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

python3 -m ds_loongforge.report --verify 2>&1 | tee "$OUT/verify.log" | tail -25
python3 -m pytest tests -q -m "gpu or cuda_build" -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -15
[ "${LF_BENCH:-1}" = 1 ] || exit 0   # LF_BENCH=0: build, verify and GPU tests only
LF_RESULTS_DIR="$OUT" python3 -m benchmarks.bench_norm_swiglu --repeats 100 2>&1 | tee "$OUT/bench.log" | tail -60
python3 -m benchmarks.profile_ops 2>&1 | grep -v Warning > "$OUT/profile.log"; tail -22 "$OUT/profile.log"
# MoE layer (issue 3): ours vs HF Mixtral (grouped_mm, eager), DeepSpeed MoE and AutoEP. The device returns at
# most 8 files and the steps above write 7, so its log, JSON and markdown come back as one tar.
rm -rf /tmp/lf_moe && mkdir -p /tmp/lf_moe
python3 -m benchmarks.bench_moe --out /tmp/lf_moe 2>&1 | tee /tmp/lf_moe/bench_moe.log | tail -50
tar -C /tmp/lf_moe -cf "$OUT/bench_moe.tar" .
