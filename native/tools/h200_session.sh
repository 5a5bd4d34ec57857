#!/usr/bin/env bash
# One device session on an H200 (run from the repo root, $OUT set by the device tool):
# environment, library load, GPU tests, then the kernel benchmark. Logs and results go to $OUT.
#   bash native/tools/h200_session.sh <test timeout s> <bench timeout s> [kernel_bench args...]
set -u
TEST_T=${1:-150}; BENCH_T=${2:-300}; shift 2 || true
SMOKE=${SMOKE:-1}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export MOESQ_AUTOTUNE_CACHE=$OUT/autotune.json
: "${MOESQ_S24_LIB:=$PWD/native/build/libmoesq_s24.so}"; export MOESQ_S24_LIB
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu --format=csv > "$OUT/env.txt" 2>&1
python3 - >> "$OUT/env.txt" 2>&1 <<'PY'
import torch, platform
from moesq_core.kernels import s24_fp8 as s24
print("python", platform.python_version(), "torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
s24.check_device()
for v in s24.variants():
    print(v)
PY
cat "$OUT/env.txt"
if [ "$SMOKE" = 1 ]; then
# smoke: every variant once on a small problem, max error vs the reference; a hang or crash stops the session
timeout 90 python3 - > "$OUT/smoke.log" 2>&1 <<'PY'
import torch
from moesq_core.kernels import s24_fp8 as s24
from tests.test_kernel_s24 import random_packed, random_activations
gen = torch.Generator().manual_seed(0)
E, M, K, cap = 3, 256, 1024, 40
values, meta, scale = random_packed(E, M, K, gen)
xq, sx = random_activations(E, cap, K, gen)
counts = torch.tensor([cap, 0, 17], dtype=torch.int32)
ref = s24.reference_grouped_gemm(values, meta, scale, xq, sx, counts).double()
w = s24.prepare_weights(values, meta, scale, "cuda")
for v in s24.variants():
    out = torch.full((E, cap, M), float("nan"), dtype=torch.bfloat16, device="cuda")
    s24.grouped_gemm(w, xq.cuda(), sx.cuda(), counts.cuda(), out, variant=v.index)
    torch.cuda.synchronize()
    o = out.cpu().double()
    errs = [float(((o[e, :c] - ref[e, :c]).norm() / ref[e, :c].norm())) for e, c in enumerate(counts.tolist()) if c]
    print(f"{v.name:28s} stages={v.stages} smem={v.smem_bytes} rel_err={max(errs):.2e}")
PY
rc=$?; cat "$OUT/smoke.log"; echo "smoke rc=$rc"
[ $rc -eq 0 ] || exit 1
fi
timeout "$TEST_T" python3 -m pytest tests/test_kernel_s24.py -q -p no:cacheprovider --maxfail=20 -rA > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; grep -E "passed|failed|error" "$OUT/tests.log" | tail -5
# each remaining argument is one quoted kernel_bench argument list, run into $OUT/b<i>/ (JSON kept)
i=0
for spec in "$@"; do
  mkdir -p "$OUT/b$i"
  timeout "$BENCH_T" python3 -m moesq_core.bench.kernel_bench --out "$OUT/b$i" $spec >> "$OUT/bench.log" 2>&1
  echo "bench $i rc=$?"; rm -f "$OUT/b$i"/*.md "$OUT/b$i"/*.png; i=$((i+1))
done
tail -n 45 "$OUT/bench.log"
