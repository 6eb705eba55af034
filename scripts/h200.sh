#!/usr/bin/env bash
# One device call: each argument is a step. Results land under $OUT (the device tool's
# folder), logs too. Steps: env, fi, prebuild, occupancy, buildtime, test, sanitize, stalls, ab-old, ab-async, ab-flag, ab-arms,
# racecheck-async, hostcost, hostprofile, firstlaunch, placement,
# ab-reduce, clusters, bench, target2, sweep:<grid>, sweep-memory, sweep-holders, repeat, profile, sass, readpattern, readpattern-shapes,
# readpattern-arms.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CPA_CACHE_DIR="${CPA_CACHE_DIR:-/tmp/cpa-cache}"
OUT="${OUT:-/tmp/cpa-out}"; mkdir -p "$OUT"
PY=python3
# Provenance: the commit must come from the caller's checkout. The device copy's git metadata
# can be stale (on 2026-12-04 it reported the session's first commit for every call).
if [ -z "${CPA_GIT_COMMIT:-}" ]; then
  echo "h200.sh: set CPA_GIT_COMMIT=<the full sha of the local checkout> (git rev-parse HEAD here, not there)" >&2
  exit 2
fi
# A full sha, as `git rev-parse HEAD` prints it (a short or mistyped one would be recorded as is)
if ! [[ $CPA_GIT_COMMIT =~ ^[0-9a-f]{40}$ ]]; then
  echo "h200.sh: CPA_GIT_COMMIT=$CPA_GIT_COMMIT is not a full sha (40 hex digits); pass git rev-parse HEAD of the caller's checkout" >&2
  exit 2
fi
# A commit this copy's git knows must hold the code sent: on 2026-12-07 `$(git rev-parse HEAD)`
# evaluated there named the session's first commit for a tree four commits later. (A newer
# commit is unknown there and passes.)
if git cat-file -e "${CPA_GIT_COMMIT}^{commit}" 2>/dev/null \
   && ! git diff --quiet "$CPA_GIT_COMMIT" -- cpa scripts tests 2>/dev/null; then
  echo "h200.sh: the code here is not that of CPA_GIT_COMMIT=$CPA_GIT_COMMIT (git diff $CPA_GIT_COMMIT -- cpa scripts tests);" \
       "pass the sha of the tree sent, from the caller's checkout" >&2
  exit 2
fi
# scripts/sweep_memory.py's output without torch's warnings and Inductor's error log lines
sweep_memory_lines() {
  grep -v "^E[0-9]\|FutureWarning\|return isinstance\|resource_tracker\|warnings.warn\|live = \["
}
# A/B of a kernel knob: ab_on FLAGS TAG builds the flagged variants in parallel, runs the kernel
# GPU tests with them and benches them ($OUT/ab-TAG-on.csv); ab_off TAG benches the default build
# right after ($OUT/ab-TAG-off.csv). The bench covers the tilings with matrix cores at P 256-1024
# (CPA_AB_ARGS adds options).
AB_BENCH="--tilings mfma16,mfma4 --no-fused --partition-sizes 256,512,1024 --no-sdpa --no-default"
ab_on() {
  local F="$1" tag="$2" A="$AB_BENCH ${CPA_AB_ARGS:-}"
  CPA_NVCC_FLAGS="$F" $PY -m cpa.jobs tests 2>&1 | grep -v "it/s\|variant/s" | tail -2
  CPA_NVCC_FLAGS="$F" timeout ${CPA_AB_TEST_TIMEOUT:-150} $PY -m pytest -p cpa.testing -m gpu \
    tests/test_kernel_gpu.py -q -x --tb=short ${CPA_AB_TEST_ARGS:-} 2>&1 | tail -4
  CPA_NVCC_FLAGS="$F" CPA_COMMAND="CPA_NVCC_FLAGS=$F python3 -m cpa bench $A" \
    timeout 200 $PY -m cpa bench $A --out "$OUT/ab-$tag-on.csv" 2>&1 | grep -A18 "best_us" | head -18
}
ab_off() {
  local A="$AB_BENCH ${CPA_AB_ARGS:-}"
  CPA_COMMAND="python3 -m cpa bench $A" timeout 200 $PY -m cpa bench $A --out "$OUT/ab-$1-off.csv" 2>&1 \
    | grep -A18 "best_us" | head -18
}
# bench_rows FILE TIMEOUT LINES ARGS...: `cpa bench ARGS` into $OUT/FILE, the last LINES of its
# output shown. The whole table outlasts one call: CPA_BENCH_RESUME=<the CSV an earlier call
# brought back, copied into the working tree> continues it (same options, same commit; shapes it
# holds are kept, the rest measured); a timeout keeps the shapes finished (OUT is rewritten after each)
bench_rows() {
  local f="$1" t="$2" n="$3" resume=""
  shift 3
  if [ -n "${CPA_BENCH_RESUME:-}" ]; then cp "$CPA_BENCH_RESUME" "$OUT/$f"; resume="--resume"; fi
  CPA_COMMAND="python3 -m cpa bench --out data/bench/$f $* $resume" \
    timeout "$t" $PY -m cpa bench --out "$OUT/$f" "$@" $resume 2>&1 | tail -"$n"
}
# for_each_arm FN: FN FLAGS INDEX for each arm of CPA_AB_ARMS="flags0|flags1|..." (an empty arm
# is the default build; the appended '|' keeps a trailing empty arm, which read -a would drop)
for_each_arm() {
  local arms F i=0
  IFS='|' read -r -a arms <<< "${CPA_AB_ARMS?set CPA_AB_ARMS}|"
  for F in "${arms[@]}"; do
    echo "--- arm $i: '${F}'"
    "$1" "$F" "$i"
    i=$((i + 1))
  done
}
# The steps that write the shipped H200 tables (bench, target2, sweep:*) run only on an H200:
# the device tool may lend an H100 for a call that names nvidia-h200, and those files are
# H200-only (tests/test_bench_data.py). CPA_ALLOW_OTHER_GPU=1 runs them anyway (the H100 files
# of data/ are such runs, renamed h100-*). Other steps run on any card.
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
GPU_TAG=$(echo "$GPU_NAME" | grep -o 'H[0-9]\{3\}' | head -1 | tr A-Z a-z); GPU_TAG=${GPU_TAG:-gpu}  # h100, h200: file names
h200_only() {
  case "$GPU_NAME" in *H200*) return 0;; esac
  [ -n "${CPA_ALLOW_OTHER_GPU:-}" ] && { echo "h200.sh: step $1 on '$GPU_NAME' (CPA_ALLOW_OTHER_GPU)"; return 0; }
  echo "h200.sh: step $1 skipped: '$GPU_NAME' is not an H200 (CPA_ALLOW_OTHER_GPU=1 runs it anyway)"
  return 1
}
# prebuild_bg FLAGS LABEL JOBS ARGS...: `cpa prebuild --grid bench ARGS` of the build FLAGS
# (CPA_NVCC_FLAGS) in the background, JOBS compilers, its summary line prefixed with LABEL; the
# caller waits for all of them
prebuild_bg() {
  local flags="$1" label="$2" jobs="$3"
  shift 3
  CPA_NVCC_FLAGS="$flags" $PY -m cpa prebuild --grid bench "$@" --jobs "$jobs" 2>&1 | grep "prebuild:" \
    | sed "s/^/$label /" &
}
# rp_shapes TAG: `cpa read-patterns` at each shape of CPA_RP_SHAPES in each order of
# CPA_RP_ORDERS, the build of the caller's CPA_NVCC_FLAGS (recorded in the command), files
# $OUT/<gpu>-read-patterns-<shape>-<order>-<commit>TAG.csv
rp_shapes() {
  local spec shp parts order A pre=""
  [ -n "${CPA_NVCC_FLAGS:-}" ] && pre="CPA_NVCC_FLAGS='$CPA_NVCC_FLAGS' "
  for spec in ${CPA_RP_SHAPES:-8x131072:4096,8192}; do
    shp=${spec%%:*}; parts=${spec#*:}
    for order in ${CPA_RP_ORDERS:-shuffled}; do
      A="--num-seqs ${shp%x*} --seq-len ${shp#*x} --partition-sizes $parts --patterns contiguous,paged --block-order $order"
      A="$A${CPA_RP_LOAD_ONLY:+ --load-only $CPA_RP_LOAD_ONLY} ${CPA_RP_EXTRA:-}"
      echo "--- ${pre}read-patterns $A ($(date -u +%H:%M:%S))"
      CPA_COMMAND="${pre}python3 -m cpa read-patterns $A" timeout ${CPA_RP_TIMEOUT:-200} $PY -m cpa read-patterns $A \
        --out "$OUT/$GPU_TAG-read-patterns-$shp-$order-${CPA_GIT_COMMIT:0:7}$1.csv" 2>&1 \
        | grep -v "reader/s\|it/s" | tail -${CPA_RP_LINES:-14}
    done
  done
}
for step in "$@"; do
  echo "=== step $step ($(date -u +%H:%M:%S))"
  case "$step" in bench|target2|sweep:*) h200_only "$step" || continue;; esac
  case "$step" in
    env)
      nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
      $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
      nvcc --version | tail -1; ncu --version | tail -1; compute-sanitizer --version | tail -1
      ;;
    fi)
      # FlashInfer as an optional peer: the pruned site tarball carried in .peers/ (see README)
      tgz=.peers/flashinfer-0.7.2.post1-pruned-site.tgz
      if [ -f "$tgz" ]; then
        mkdir -p /tmp/fi && tar xzf "$tgz" -C /tmp/fi
        export PYTHONPATH="$PYTHONPATH:/tmp/fi/site" FLASHINFER_WORKSPACE_BASE=/tmp/fiws FLASHINFER_CUDA_ARCH_LIST=9.0a
        $PY -c "import flashinfer; print('flashinfer', flashinfer.__version__)"
      else
        echo "no $tgz: the flashinfer peer will be skipped"
      fi
      ;;
    prebuild)
      $PY -m cpa.jobs tests 2>&1 | grep -v "it/s\|variant/s" | tail -12
      ;;
    occupancy)
      # every sm_90 variant: the Hopper calculator against the CUDA runtime (data/static/h200-occupancy-check.csv)
      # (chunked: a timeout keeps what was checked; resumes the shipped table at the same sources)
      timeout ${CPA_OCC_TIMEOUT:-480} $PY -m cpa.jobs occupancy-check-all "$OUT/h200-occupancy-check.csv" \
        data/static/h200-occupancy-check.csv 2>&1 | grep -v "variant/s" | tail -25
      ;;
    buildtime)
      $PY -m cpa.jobs buildtime
      ;;
    test)
      CPA_VERIFY_CSV="$OUT/verification.csv" CPA_OCCUPANCY_CSV="$OUT/h200-occupancy-check-tests.csv" timeout 480 $PY -m pytest -p cpa.testing -m gpu ${CPA_PYTEST_PATHS:-tests} -q -rs \
        --tb=short ${CPA_PYTEST_ARGS:-} 2>&1 | tail -60
      ;;
    sanitize)
      # each run's cases and summary line, with provenance, into $OUT/<gpu>-sanitizer.csv
      # (appended to data/verification/ after the call)
      # without torch's caching allocator: inside one cached segment an over-read of a small
      # tensor (the block table) lands in memory the allocator owns and memcheck cannot see it
      for tool in memcheck racecheck; do
        cmd="env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool $tool --error-exitcode 9 $PY -m cpa.selfcheck --small"
        timeout 240 $cmd > /tmp/sanitize-$tool.log 2>&1
        rc=$?; tail -8 /tmp/sanitize-$tool.log; echo "compute-sanitizer $tool rc=$rc"
        CPA_COMMAND="$cmd" $PY -m cpa.selfcheck --record-sanitizer $tool $rc /tmp/sanitize-$tool.log \
          "$OUT/$GPU_TAG-sanitizer.csv"
      done
      ;;
    profile)
      # counters of the attention kernel through ncu: every tiling x partition size at 6 shapes
      # (1x32k, 4x8k, 16x2k, 32x32k, 128x2k, 256x8k of llama70b-decode), one ncu run per point
      # so that a timeout keeps the points done; a set ncu refuses falls back to `basic`
      # (variants prebuilt first: building them inside the first ncu run can outlast its timeout)
      mkdir -p "$OUT/counters"; $PY -m cpa prebuild --grid bench 2>&1 | grep "prebuild:"; t0=$SECONDS
      for pt in $(echo ${CPA_POINTS:-7,13,19,31,43,53} | tr , ' '); do
        for set in ${CPA_COUNTERS:-full} basic; do
          CPA_COMMAND="python3 -m cpa profile --profiler ncu --counters $set --grid llama70b-decode --points $pt --out data/counters/h200-llama70b.parquet" \
            timeout ${CPA_PROFILE_TIMEOUT:-200} $PY -m cpa profile --profiler ncu --counters $set \
            --grid llama70b-decode --points $pt --timeout ${CPA_PROFILE_TIMEOUT:-200} \
            --out "$OUT/counters/p$pt.parquet" > "$OUT/counters/p$pt-$set.log" 2>&1
          rc=$?; echo "profile point $pt set $set rc=$rc at $((SECONDS - t0)) s"; tail -4 "$OUT/counters/p$pt-$set.log"
          [ $rc = 0 ] && break
        done
      done
      $PY - "$OUT/counters" <<'PYEOF'
import sys, glob, pandas as pd
fs = sorted(glob.glob(sys.argv[1] + "/p*.parquet"))
if fs:
    df = pd.concat([pd.read_parquet(f) for f in fs], ignore_index=True)
    df.to_parquet(sys.argv[1] + "/h200-llama70b.parquet", index=False)
    cols = [c for c in ("tiling", "partition_size", "num_seqs", "max_seq_len", "duration_ns", "dram_bandwidth",
                        "achieved_occupancy", "matrix_core_busy", "l2_hit_rate") if c in df.columns]
    print(len(df), "rows from", len(fs), "points"); print(df[cols].to_string(index=False, max_rows=100))
PYEOF
      ;;
    stalls)
      # where the attention kernel's warps wait and what its memory system does: ncu's warp-state
      # and memory metrics (raw page) of one launch, for each build in CPA_STALL_FLAGS (';'-separated
      # nvcc flag sets, an empty one is the default build) x each target in CPA_NCU_TARGETS
      # (';'-separated "tiling P batch context"; tiling sdpa_cudnn profiles the peer's kernels,
      # reader-<pattern>-<blocks>x<warps> a `cpa read-patterns` reader, e.g. "reader-paged-2x8 4096 8 32768")
      IFS=';' read -ra builds <<< "${CPA_STALL_FLAGS:-}"; [ ${#builds[@]} = 0 ] && builds=("")
      IFS=';' read -ra targets <<< "${CPA_NCU_TARGETS:-mfma16 1024 8 32768}"
      for F in "${builds[@]}"; do
        for T in "${targets[@]}"; do
          tag=$(echo "${F:-default} $T" | tr -c 'A-Za-z0-9\n' _ | sed 's/^_*//')
          case "$T" in sdpa*) K="-c 6";; reader-*) K="-k regex:read_runs -s 1 -c 1";; *) K="-k regex:paged_attention_kernel -s 1 -c 1";; esac
          CPA_NVCC_FLAGS="$F" timeout 200 ncu --clock-control none --profile-from-start off $K --section WarpStateStats \
            --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
            --section SchedulerStats --section InstructionStats \
            --metrics dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,smsp__inst_executed.sum,dram__bytes_read.sum.per_second --csv --page raw --print-units base $PY -m cpa.jobs profile-one $T > "$OUT/stalls-$tag.csv" 2>&1
          echo "ncu [$F] [$T] rc=$?"
        done
      done
      $PY - "$OUT" <<'PYEOF'
import glob, sys
from cpa.counters import read_ncu_raw
for f in sorted(glob.glob(sys.argv[1] + "/stalls-*.csv")):
    try:
        r = read_ncu_raw(f)
    except Exception as e:
        print(f, "unreadable:", e, open(f).read()[-800:]); continue
    print(f.split("/")[-1], r.pop("kernel")[:60])
    top = r.pop("top_stalls")
    print("   " + " ".join(f"{k}={v:.4g}" for k, v in r.items()))
    print("   stalls/issue: " + top)
PYEOF
      ;;
    ab-reduce)
      # the few-partitions reduce kernel (-DCPA_REDUCE_FEW_MAX=16): correct (kernel GPU tests with
      # the flag), and faster? (bench A/B against the default build, both tilings with matrix cores)
      CPA_NVCC_FLAGS="-DCPA_REDUCE_FEW_MAX=16" timeout 300 $PY -m pytest -p cpa.testing -m gpu tests/test_kernel_gpu.py \
        -q -x --tb=short 2>&1 | tail -4
      A="--tilings mfma16,mfma4 --no-sdpa --no-fused --partition-sizes 256,512,1024 --batches 8,32,128 --contexts 2048,4096,8192"
      CPA_NVCC_FLAGS="-DCPA_REDUCE_FEW_MAX=16" CPA_COMMAND="CPA_NVCC_FLAGS=-DCPA_REDUCE_FEW_MAX=16 python3 -m cpa bench $A" \
        timeout 150 $PY -m cpa bench $A --out "$OUT/ab-reduce-few.csv" 2>&1 | grep -A12 "best_us" | head -12
      timeout 150 $PY -m cpa bench $A --out "$OUT/ab-reduce-default.csv" 2>&1 | grep -A12 "best_us" | head -12
      ;;
    ab-async)
      # the staged main loop (-DCPA_KV_ASYNC=N: each wave's next step copied to shared memory
      # with cp.async during this step's math; N=2 swizzles the slot), each arm against the
      # default build
      for n in ${CPA_ASYNC_ARMS:-1 2}; do ab_on "-DCPA_KV_ASYNC=$n" "async$n"; done
      ab_off async
      ;;
    racecheck-async)
      # compute-sanitizer on the staged loops' slot protocols (CPA_ASYNC_ARMS: 1/2 cp.async groups
      # and warp syncs, 3 the ring's bulk copies and mbarriers)
      for n in ${CPA_ASYNC_ARMS:-1 2}; do
        for tool in racecheck memcheck; do
          CPA_NVCC_FLAGS="-DCPA_KV_ASYNC=$n" timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 \
            $PY -m cpa.selfcheck --small 2>&1 | tail -3
          echo "compute-sanitizer $tool with -DCPA_KV_ASYNC=$n rc=${PIPESTATUS[0]}"
        done
      done
      ;;
    sass)
      # SASS of the attention kernel for CPA_SASS_TARGETS (';'-separated "tiling P"; fp16, head
      # 128, block 16, GQA 8) under each CPA_STALL_FLAGS build: $OUT/sass-<flags>-<tiling>-<P>.txt
      IFS=';' read -ra builds <<< "${CPA_STALL_FLAGS:-}"; [ ${#builds[@]} = 0 ] && builds=("")
      IFS=';' read -ra targets <<< "${CPA_SASS_TARGETS:-mfma16 8192}"
      for F in "${builds[@]}"; do
        for T in "${targets[@]}"; do
          read -r til P <<< "$T"; tag=$(echo "${F:-default}-$til-$P" | tr -c 'A-Za-z0-9\n-' _ | sed 's/^_*//')
          d=$(mktemp -d)
          $PY - "$til" "$P" > "$d/tu.cu" <<'PYEOF'
import sys, torch
import cpa.variants as V, cpa.static as S
v = V.variant_for(tiling=sys.argv[1], partition_size=int(sys.argv[2]), head_size=128, block_size=16,
                  dtype=torch.float16, kv_cache_dtype="auto", gqa_ratio=8, platform="cuda")
print(S._tu_source([v]))
PYEOF
          nvcc -std=c++17 -arch=sm_90 -O3 -Icpa/csrc $F "$d/tu.cu" -cubin -o "$d/tu.cubin" \
            && cuobjdump -sass "$d/tu.cubin" > "$OUT/sass-$tag.txt" 2>&1  # (attention and reduce kernels)
          echo "sass [$F] [$T]: $(grep -c '^ */\*[0-9a-f]*\*/' "$OUT/sass-$tag.txt") instructions"
          rm -rf "$d"
        done
      done
      ;;
    ab-flag)
      # any kernel knob against the default build (CPA_AB_FLAG, e.g. -DCPA_V_AFTER_QK=1)
      F="${CPA_AB_FLAG:?set CPA_AB_FLAG}"; tag=$(echo "$F" | tr -c 'A-Za-z0-9\n' _ | sed 's/^_*//')
      ab_on "$F" "$tag"; ab_off "$tag"
      ;;
    ab-arms)
      # several builds of the kernel back to back in one process tree, each arm's bench variants
      # prebuilt first (an empty arm is the default build), CPA_AB_ARGS the bench options;
      # $OUT/arm-<i>.csv per arm, in arm order; CPA_ARM_PREBUILD_ARGS narrows the prebuild
      # (e.g. "--tilings mfma16 --partition-sizes 1024,2048" to match CPA_AB_ARGS)
      # every arm's prebuild at once first (4 jobs per arm: one arm at a time leaves most of the
      # host's cores idle); each arm's bench then loads its variants from the cache
      arm_prebuild() { prebuild_bg "$1" "arm $2" 4 ${CPA_ARM_PREBUILD_ARGS:-}; }
      t0=$SECONDS; for_each_arm arm_prebuild; wait; echo "all arms prebuilt in $((SECONDS - t0)) s"
      arm_bench() {
        # (no default_path rows unless CPA_AB_ARGS asks: the launcher's pick may be a variant the
        # arm did not prebuild, compiled inside the arm's timeout)
        CPA_NVCC_FLAGS="$1" CPA_COMMAND="CPA_NVCC_FLAGS='$1' python3 -m cpa bench --no-default ${CPA_AB_ARGS:-}" \
          timeout ${CPA_ARM_TIMEOUT:-150} $PY -m cpa bench --no-default ${CPA_AB_ARGS:-} --out "$OUT/arm-$2.csv" 2>&1 \
          | grep -A14 "best_us" | head -14
      }
      for_each_arm arm_bench
      ;;
    sweep-arms)
      # the same builds over one sweep grid (CPA_ARM_GRID, a name or YAML file; CPA_ARM_SWEEP_ARGS
      # more `cpa sweep` options), each verified row by row: $OUT/sweep-arm-<i>.parquet per arm
      arm_sweep() {
        local t0=$SECONDS
        CPA_NVCC_FLAGS="$1" CPA_COMMAND="CPA_NVCC_FLAGS='$1' python3 -m cpa sweep --grid ${CPA_ARM_GRID:?set CPA_ARM_GRID} --no-peers ${CPA_ARM_SWEEP_ARGS:-}" \
          timeout ${CPA_ARM_TIMEOUT:-150} $PY -m cpa sweep --grid "$CPA_ARM_GRID" --no-peers --no-progress \
          ${CPA_ARM_SWEEP_ARGS:-} --out "$OUT/sweep-arm-$2.parquet" 2>&1 | grep -v "^sweep: prebuilt\|Warning" | tail -14
        echo "arm $2: $((SECONDS - t0)) s"
      }
      for_each_arm arm_sweep
      ;;
    ab-old)
      # the same benchmark from an older tree (git archive into .ab/<rev>, carried) and from this
      # one, back to back: is a kernel difference between them real?
      for d in .ab/*/; do
        rev=$(basename "$d")
        (cd "$d" && CPA_GIT_COMMIT=$rev PYTHONPATH="$PWD" timeout 200 $PY -m cpa bench --tilings mfma16 --no-sdpa \
          ${CPA_AB_ARGS:-} --out "$OUT/ab-$rev.csv" 2>&1 | grep -A25 "best_us" | head -20)
      done
      timeout 200 $PY -m cpa bench --tilings mfma16 --no-sdpa --no-fused --no-default ${CPA_AB_ARGS:-} --out "$OUT/ab-head.csv" 2>&1 \
        | grep -A25 "best_us" | head -20
      ;;
    sweep:*)
      # one named grid into $OUT/sweeps (resuming what data/sweeps already holds for it); files
      # are named by the card (h200-*, or h100-* under CPA_ALLOW_OTHER_GPU), so a run on another
      # card neither resumes nor adds to an H200 table or its ceilings
      g=${step#sweep:}; mkdir -p "$OUT/sweeps"
      f="$OUT/sweeps/$GPU_TAG-$g.parquet"; cj="$GPU_TAG-ceilings.json"
      # CPA_SWEEP_FRESH=1: every row again at this commit (else resume what is shipped)
      [ -z "${CPA_SWEEP_FRESH:-}" ] && [ -f "data/sweeps/$GPU_TAG-$g.parquet" ] && cp "data/sweeps/$GPU_TAG-$g.parquet" "$f"
      [ -f "data/sweeps/$cj" ] && [ ! -f "$OUT/sweeps/$cj" ] && cp "data/sweeps/$cj" "$OUT/sweeps/"
      t0=$SECONDS; retry=""
      # CPA_SWEEP_RETRY=1: the resumed table's failed rows (errors, not unsupported variants) again
      [ -n "${CPA_SWEEP_RETRY:-}" ] && retry="--retry-errors"
      CPA_COMMAND="python3 -m cpa sweep --grid $g --out data/sweeps/$GPU_TAG-$g.parquet --resume $retry --ceilings-json data/sweeps/$cj" \
        timeout ${CPA_SWEEP_TIMEOUT:-540} $PY -m cpa sweep --grid "$g" --out "$f" --resume $retry --no-progress \
        --ceilings-json "$OUT/sweeps/$cj" > "$OUT/sweeps/$GPU_TAG-$g.log" 2>&1
      echo "sweep $g rc=$? wall $((SECONDS - t0)) s"; grep -v "^sweep: prebuilt\|Warning" "$OUT/sweeps/$GPU_TAG-$g.log" | tail -70
      ;;
    sweep-memory)
      # the sweep's point set-up: timing on make_sets' sets against the verification inputs
      # (same rows, alternated), then the memory left after each row and point where flex fails
      for m in "ab 32x8192,64x32768" "leak 256x8192,256x16384"; do
        timeout 200 $PY scripts/sweep_memory.py $m 2>&1 | sweep_memory_lines | tail -30
      done
      ;;
    sweep-holders)
      # where a failed FlexAttention row leaves memory allocated after its point closed: the gc
      # referrer chains of every CUDA tensor still alive (scripts/sweep_memory.py holders)
      timeout ${CPA_SM_TIMEOUT:-400} $PY scripts/sweep_memory.py holders ${CPA_SM_SHAPES:-64x32768,128x16384,128x32768} 2>&1 \
        | sweep_memory_lines | tail -150
      ;;
    repeat)
      # the same rows twice: timing repeatability (medians within 3%?)
      mkdir -p "$OUT/sweeps"
      for i in 1 2; do
        CPA_COMMAND="python3 -m cpa sweep --grid llama70b-decode --tilings mfma16 --partition-sizes 256,512 --no-peers (repeat $i)" \
          timeout 200 $PY -m cpa sweep --grid llama70b-decode --tilings mfma16 --partition-sizes 256,512 --no-peers \
          --no-progress --out "$OUT/sweeps/repeat-$i.parquet" > "$OUT/sweeps/repeat-$i.log" 2>&1; echo "repeat $i rc=$?"
      done
      $PY -m cpa sweep-spread "$OUT/sweeps/repeat-1.parquet" "$OUT/sweeps/repeat-2.parquet" 2>&1 | tail -25
      ;;
    clusters)
      # how many clusters of n attention workgroups the device holds at once (the runtime's answer)
      $PY - <<'PYEOF'
import torch
from cpa import variants as V
from cpa.jit import build
print("variant", "blocks/SM", " ".join(f"n={n}" for n in range(2, 17)))
for p in (256, 512, 1024, 2048, 4096):
    v = V.variant_for(tiling="mfma16", partition_size=p, head_size=128, block_size=16, dtype="fp16",
                      kv_cache_dtype="auto", gqa_ratio=8, platform="cuda")
    k = build(v)
    print(v.name, k.attributes()["attention"]["blocks_per_sm"], " ".join(str(k.max_active_clusters(n)) for n in range(2, 17)))
PYEOF
      ;;
    bench)
      # (CPA_BENCH_RESUME: see bench_rows)
      $PY -m cpa prebuild --grid bench 2>&1 | grep "prebuild:"  # in parallel, not one by one inside the timeout
      bench_rows h200-kernel.csv ${CPA_BENCH_TIMEOUT:-540} 80 ${CPA_BENCH_ARGS:-}
      ;;
    target2)
      # target 2 over its whole domain (batch <= 8, context >= 8k) beside cuDNN SDPA in the same
      # call: batches 1, 2, 4, 8 x contexts 8k-128k, the mma tilings at P 512-8192, with the reduce
      # launch and the fused reduce (the cluster combine where the bench allows it; no shared
      # steps: level or slower everywhere they were measured). CPA_BENCH_RESUME as for `bench`.
      # (CPA_T2_BATCHES / CPA_T2_CONTEXTS: e.g. 3,5,6,7, where no power-of-two partition fills the
      # SMs; CPA_T2_ARGS=--shared then adds the shared-steps rows, the last flag given wins)
      V="--tilings mfma16,mfma4 --partition-sizes 512,1024,2048,4096,8192"
      # (and the smaller mfma16 sizes the default_path rows may pick)
      $PY -m cpa prebuild --grid bench --tilings mfma16,mfma4 --partition-sizes 128,256,512,1024,2048,4096,8192 2>&1 \
        | grep "prebuild:"
      bench_rows h200-target2.csv ${CPA_T2_TIMEOUT:-540} 40 \
        --batches ${CPA_T2_BATCHES:-1,2,4,8} --contexts ${CPA_T2_CONTEXTS:-8192,16384,32768,65536,131072} \
        $V --no-shared ${CPA_T2_ARGS:-}
      ;;
    firstlaunch)
      # is a shape's first timed launch slow because it is first? (notes, "Open"; any card) The
      # same variant at positions 0, 1 and 3 of each shape, once per way the shape's first timing
      # settles (cpa.bench.SETTLE: none = the 20 ms warm-up alone, warmup = a 1 s warm-up of
      # that timing, read = the K/V pool read for 1 s first, sleep = 1 s idle); the SM clock
      # logged every 100 ms.
      $PY -m cpa prebuild --grid bench --tilings mfma16 --partition-sizes 512,1024 2>&1 | grep "prebuild:"
      nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 100 \
        > "$OUT/$GPU_TAG-firstlaunch-clocks.csv" 2>&1 & smi=$!
      FL="--batches 1,2 --contexts 8192,16384 --tilings mfma16 --no-fused --no-cluster --no-shared --no-sdpa --no-default"
      for settle in ${CPA_FL_SETTLES:-none warmup read sleep}; do
        CPA_COMMAND="python3 -m cpa bench $FL --partition-sizes 512,512,1024,512 (cpa.bench.SETTLE = $settle)" \
          timeout 150 $PY -c "import cpa.bench as B; B.SETTLE = '$settle'
from cpa.cli import app; app(prog_name='cpa')" bench $FL --partition-sizes 512,512,1024,512 \
          --out "$OUT/$GPU_TAG-firstlaunch-settle-$settle.csv" 2>&1 | grep -A17 "time_us" | cut -c1-20,80-140
      done
      kill $smi
      ;;
    placement)
      # which buffer's placement moves a short shape's time (scripts/placement.py; notes, "Open"):
      # the same launch with its partial buffers, or its K/V pool, placed after a random spacer
      $PY -m cpa prebuild --grid bench --tilings mfma16 --partition-sizes ${CPA_PL_P:-1024} 2>&1 | grep "prebuild:"
      CPA_COMMAND="python3 scripts/placement.py ${CPA_PL_ARGS:-}" timeout ${CPA_PL_TIMEOUT:-300} $PY scripts/placement.py \
        --out "$OUT/$GPU_TAG-placement.csv" --partition-size ${CPA_PL_P:-1024} ${CPA_PL_ARGS:-} 2>&1 | tail -30
      ;;
    hostcost)
      # the host's cost per decode call by launch path (cpa.hostcost), on any card: the file is
      # named after it (CPA_HC_ARGS: more `cpa host-cost` options)
      CPA_COMMAND="python3 -m cpa host-cost --out data/bench/$GPU_TAG-host-cost.csv ${CPA_HC_ARGS:-}" \
        timeout ${CPA_HC_TIMEOUT:-300} $PY -m cpa host-cost --no-progress --out "$OUT/$GPU_TAG-host-cost.csv" ${CPA_HC_ARGS:-} 2>&1 | tail -40
      ;;
    hostprofile)
      # where the eager call's host time goes (cProfile per call; cpa host-profile), each mode
      # that runs Python per call, at batch 8 x 32k; on any card, the file named after it
      for m in ${CPA_HP_MODES:-unchecked prepared checked}; do
        CPA_COMMAND="python3 -m cpa host-profile --mode $m --out data/bench/$GPU_TAG-host-profile-$m.csv ${CPA_HP_ARGS:-}" \
          timeout ${CPA_HP_TIMEOUT:-120} $PY -m cpa host-profile --mode $m --out "$OUT/$GPU_TAG-host-profile-$m.csv" \
          ${CPA_HP_ARGS:-} 2>&1 | tail -45
      done
      ;;
    readpattern)
      # the K/V bytes of 8 x 32k read by a plain Triton reader: contiguous, paged (one KV head
      # per program, the CPA grid) and paged whole blocks, beside the kernel and SDPA (cpa.readpattern)
      # then the same bytes of an fp8 cache (2 KB runs; readers only)
      CPA_COMMAND="python3 -m cpa read-patterns ${CPA_RP_ARGS:-}" timeout ${CPA_RP_TIMEOUT:-360} \
        $PY -m cpa read-patterns --out "$OUT/h200-read-patterns.csv" ${CPA_RP_ARGS:-} 2>&1 | tail -40
      CPA_COMMAND="python3 -m cpa read-patterns --kv-cache-dtype fp8 --no-kernel ${CPA_RP_ARGS:-}" \
        timeout ${CPA_RP_FP8_TIMEOUT:-200} $PY -m cpa read-patterns --kv-cache-dtype fp8 --no-kernel \
        --out "$OUT/h200-read-patterns-fp8.csv" ${CPA_RP_ARGS:-} 2>&1 | tail -30
      ;;
    readpattern-shapes)
      # the same readers (contiguous and paged only) at other decode shapes, each beside the
      # kernel and SDPA: CPA_RP_SHAPES="8x131072:4096,8192 1x131072:1024,4096" (batch x context:
      # partition sizes), each in CPA_RP_ORDERS (shuffled, sequential) -> $OUT/<gpu>-read-patterns-
      # <batch>x<context>-<order>-<commit>.csv; CPA_RP_TIMEOUT per run; CPA_RP_EXTRA more options,
      # e.g. "--load-only 1,2" (the kernel's loads alone beside the readers) or "--reader-shapes
      # 2x8,16x8" (only those reader shapes: a shorter run)
      rp_shapes ""
      ;;
    readpattern-arms)
      # readpattern-shapes once per build of CPA_AB_ARMS="flags0|flags1|..." (CPA_NVCC_FLAGS =
      # the arm: the kernel rows and, with CPA_RP_LOAD_ONLY=1,2, the load-only rows of that
      # build; the readers and SDPA are the same in every arm) -> files ...-<commit>-arm<i>.csv.
      # Every arm's mfma16 builds at the shapes' partition sizes (and load-only levels) are
      # prebuilt in parallel first.
      parts=$(for spec in ${CPA_RP_SHAPES:?set CPA_RP_SHAPES}; do echo "${spec#*:}" | tr , '\n'; done | sort -un | paste -sd,)
      rp_prebuild() {
        local lvl lo=${CPA_RP_LOAD_ONLY:-}
        for lvl in "" ${lo//,/ }; do
          prebuild_bg "$1${lvl:+ -DCPA_LOAD_ONLY=$lvl}" "arm $2${lvl:+ load-only $lvl}" 3 --tilings mfma16 \
            --partition-sizes "$parts"
        done
      }
      t0=$SECONDS; for_each_arm rp_prebuild; wait; echo "all arms prebuilt in $((SECONDS - t0)) s"
      rp_arm() { CPA_NVCC_FLAGS="$1" rp_shapes "-arm$2"; }
      for_each_arm rp_arm
      ;;
    *) echo "unknown step $step"; exit 2;;
  esac
done
# The device tool brings back at most 8 files per call: past that, the result files of this
# invocation go into one $OUT/results-<commit>-<time>.tgz (earlier invocations' archives of the
# same call are left alone; unpack each and file its results as those of $OUT).
n=$(find "$OUT" -type f | wc -l)
if [ "$n" -gt 8 ]; then
  tgz="results-${CPA_GIT_COMMIT:0:7}-$(date -u +%H%M%S).tgz"
  (cd "$OUT" && find . -type f ! -name 'results-*.tgz' -printf '%P\n' | tar czf "$tgz" -T - \
    && find . -type f ! -name 'results-*.tgz' -delete && find . -mindepth 1 -type d -empty -delete)
  echo "h200.sh: $n files in \$OUT: packed into $tgz"
fi
