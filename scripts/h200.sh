#!/usr/bin/env bash
# One device call: each argument is a step. Results land under $OUT (the device tool's
# folder), logs too. Steps: env, prebuild, test, sanitize, bench.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CPA_CACHE_DIR="${CPA_CACHE_DIR:-/tmp/cpa-cache}"
OUT="${OUT:-/tmp/cpa-out}"; mkdir -p "$OUT"
PY=python3
for step in "$@"; do
  echo "=== step $step ($(date -u +%H:%M:%S))"
  case "$step" in
    env)
      nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
      $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
      nvcc --version | tail -1; ncu --version | tail -1; compute-sanitizer --version | tail -1
      ;;
    prebuild)
      $PY - <<'PY'
import json, os, time, sys
sys.path.insert(0, "tests")
import cpa.variants as V
from cpa.build import prebuild, device_arch
from test_kernel_gpu import CASES
platform, arch = device_arch()
vs = []
for c in CASES:
    try:
        vs.append(V.variant_for(tiling=c["tiling"], partition_size=c["partition_size"], head_size=c["head_size"],
            block_size=c["block_size"], dtype=c["dtype"], kv_cache_dtype=c["kv"], gqa_ratio=c["gqa"], platform=platform))
    except ValueError:
        pass
extra = os.environ.get("CPA_PREBUILD_EXTRA", "")
for t in V.TILINGS:
    for p in V.PARTITION_SIZES:
        vs.append(V.variant_for(tiling=t, partition_size=p, head_size=128, block_size=16, dtype="fp16",
                                kv_cache_dtype="auto", gqa_ratio=8, platform=platform))
t0 = time.time()
rows = prebuild(vs, arch, jobs=os.cpu_count())
wall = time.time() - t0
errs = [r for r in rows if r["error"]]
cold = [r["build_seconds"] for r in rows if not r["from_cache"] and not r["error"]]
print(f"prebuild: {len(rows)} variants in {wall:.1f} s wall on {os.cpu_count()} cores; "
      f"cold per-variant compile median {sorted(cold)[len(cold)//2] if cold else 0:.1f} s, max {max(cold) if cold else 0:.1f} s; errors {len(errs)}")
for r in errs[:5]:
    print("ERROR", r["variant"], r["error"][-3000:])
json.dump(rows, open(os.path.join(os.environ["OUT"], "prebuild.json"), "w"), indent=1)
PY
      ;;
    test)
      CPA_VERIFY_CSV="$OUT/verification.csv" timeout 480 $PY -m pytest -p cpa.testing -m gpu tests -q -x -rs \
        --tb=short ${CPA_PYTEST_ARGS:-} 2>&1 | tail -60
      ;;
    sanitize)
      for tool in memcheck racecheck; do
        timeout 240 compute-sanitizer --tool $tool --error-exitcode 9 $PY -m cpa.selfcheck --small 2>&1 | tail -8
        echo "compute-sanitizer $tool rc=${PIPESTATUS[0]}"
      done
      ;;
    bench)
      timeout 540 $PY -m cpa bench --out "$OUT/h200-kernel.csv" ${CPA_BENCH_ARGS:-} 2>&1 | tail -80
      ;;
    *) echo "unknown step $step"; exit 2;;
  esac
done
