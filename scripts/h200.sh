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
      $PY -m cpa.jobs tests 2>&1 | grep -v "it/s\|variant/s" | tail -12
      ;;
    buildtime)
      $PY -m cpa.jobs buildtime
      ;;
    test)
      CPA_VERIFY_CSV="$OUT/verification.csv" timeout 480 $PY -m pytest -p cpa.testing -m gpu tests -q -rs \
        --tb=short ${CPA_PYTEST_ARGS:-} 2>&1 | tail -60
      ;;
    sanitize)
      for tool in memcheck racecheck; do
        timeout 240 compute-sanitizer --tool $tool --error-exitcode 9 $PY -m cpa.selfcheck --small 2>&1 | tail -8
        echo "compute-sanitizer $tool rc=${PIPESTATUS[0]}"
      done
      ;;
    ncu1)
      # one kernel, key sections: where the attention kernel's time goes
      timeout 300 ncu --clock-control none -k regex:paged_attention_kernel -s 2 -c 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
        --section LaunchStats $PY -m cpa.jobs profile-one ${CPA_NCU_ARGS:-mfma16 1024 8 32768} > "$OUT/ncu1.txt" 2>&1
      echo "ncu rc=$?"; grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Stall|L1/TEX Hit|L2 Hit|Warp Cycles Per Issued|Issued Warp|Mem Busy|Max Bandwidth|ERR" "$OUT/ncu1.txt" | head -40
      ;;
    ab)
      # A/B of two kernel knobs against the default build, mfma16 only
      CPA_NVCC_FLAGS="-DCPA_MIN_BLOCKS=3" CPA_COMMAND="CPA_NVCC_FLAGS=-DCPA_MIN_BLOCKS=3 python3 -m cpa bench --tilings mfma16" \
        $PY -m cpa bench --tilings mfma16 --no-fused --out "$OUT/ab-minblocks3.csv" 2>&1 | grep -A30 "best_us" | head -20
      ;;
    bench)
      timeout 540 $PY -m cpa bench --out "$OUT/h200-kernel.csv" ${CPA_BENCH_ARGS:-} 2>&1 | tail -80
      ;;
    *) echo "unknown step $step"; exit 2;;
  esac
done
