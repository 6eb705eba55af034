"""Device-session jobs: parallel prebuilds and the cold-build / warm-load measurement."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time

from . import variants as V
from .fsio import write_csv_atomic


def test_variants(platform: str) -> list[V.Variant]:
    """Every variant tests/test_kernel_gpu.py exercises, plus the bench grid."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(here, "tests"))
    from test_kernel_gpu import CASES, CLUSTER_CASES, FUSED_CASES  # noqa: E402

    vs = []
    for c in CASES + CLUSTER_CASES + FUSED_CASES:
        try:
            vs.append(V.variant_for(tiling=c["tiling"], partition_size=c["partition_size"], head_size=c["head_size"],
                                    block_size=c["block_size"], dtype=c["dtype"], kv_cache_dtype=c["kv"],
                                    gqa_ratio=c["gqa"], platform=platform))
        except ValueError:
            pass
    return list(dict.fromkeys(vs + bench_variants(platform)))


def bench_variants(platform: str) -> list[V.Variant]:
    """The `cpa bench` shape's variants (fp16, head 128, block 16, GQA 8): every tiling and
    partition size the platform builds for it (on AMD, mfma4 holds at most 4 heads per KV head)."""
    from .bench import VARIANT_AXES

    vs = []
    for t in V.TILINGS:
        for p in V.PARTITION_SIZES:
            try:
                vs.append(V.variant_for(tiling=t, partition_size=p, platform=platform, **VARIANT_AXES))
            except ValueError:
                pass
    return vs


def select_variants(vs: list, tilings: list[str] | None, partition_sizes: list[int] | None) -> list:
    """The variants of `vs` with one of these tilings and partition sizes (None: any); a name that
    is not a tiling or a size the library has is refused, so a typo cannot select nothing."""
    for name, got, known in (("tiling", tilings, V.TILINGS), ("partition size", partition_sizes, V.PARTITION_SIZES)):
        bad = [x for x in (got or []) if x not in known]
        if bad:
            raise ValueError(f"unknown {name} {bad}; known: {list(known)}")
    return [v for v in vs if (tilings is None or v.tiling in tilings)
            and (partition_sizes is None or v.partition_size in partition_sizes)]


def prebuild_main(grid: str, jobs: int | None, tilings: list[str] | None = None,
                  partition_sizes: list[int] | None = None) -> list[dict]:
    from .jit import device_arch, prebuild

    platform, arch = device_arch()
    vs = test_variants(platform) if grid == "tests" else bench_variants(platform)
    vs = select_variants(vs, tilings, partition_sizes)
    t0 = time.time()
    rows = prebuild(vs, arch, jobs=jobs)
    wall = time.time() - t0
    errs = [r for r in rows if r["error"]]
    cold = sorted(r["build_seconds"] for r in rows if not r["from_cache"] and not r["error"])
    med = cold[len(cold) // 2] if cold else 0.0
    print(f"prebuild: {len(rows)} variants in {wall:.1f} s wall on {jobs or os.cpu_count()} processes; "
          f"{len(cold)} compiled (per-variant median {med:.1f} s, max {max(cold) if cold else 0:.1f} s, "
          f"under contention); errors: {len(errs)}")
    for r in errs[:5]:
        print("ERROR", r["variant"], (r["error"] or "")[-2000:])
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "prebuild.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return rows


def build_time_main() -> dict:
    """Cold build of one variant alone (empty cache), then a warm load in a fresh process."""
    import tempfile

    from .jit import device_arch

    platform, arch = device_arch()
    v = V.variant_for(tiling="mfma16", partition_size=256, head_size=128, block_size=16, dtype="fp16",
                      kv_cache_dtype="auto", gqa_ratio=8, platform=platform)
    cache = tempfile.mkdtemp(prefix="cpa-coldcache-")
    env = dict(os.environ, CPA_CACHE_DIR=cache)
    code = ("import time, torch; torch.cuda.init(); import cpa, cpa.variants as V; t=time.perf_counter(); "
            f"k=cpa.build(V.Variant(**{v.as_dict()!r})); "
            "print('RESULT', time.perf_counter()-t, k.from_cache, k.build_seconds)")
    res = {}
    for label in ("cold", "warm"):
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
        if p.returncode or not line:
            raise RuntimeError(f"{label} build failed: {p.stderr[-2000:]}")
        _, total, from_cache, compile_s = line[0].split()
        res[label] = dict(build_call_seconds=float(total), from_cache=from_cache == "True",
                          compile_seconds=float(compile_s))
    print(f"build time of {v.name} on {arch}: cold {res['cold']['build_call_seconds']:.1f} s "
          f"(compile {res['cold']['compile_seconds']:.1f} s), warm load in a new process "
          f"{res['warm']['build_call_seconds']:.3f} s (from cache: {res['warm']['from_cache']})")
    from .provenance import provenance

    os.environ.setdefault("CPA_COMMAND", "bash scripts/h200.sh buildtime  (python3 -m cpa.jobs buildtime)")
    res.update(variant=v.name, arch=arch, provenance=provenance())
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "build_time.json"), "w") as f:
            json.dump(res, f, indent=1)
    return res


def reader_target(tiling: str) -> tuple[str, int, int] | None:
    """``reader-<pattern>-<blocks per iteration>x<warps>`` (e.g. ``reader-paged-2x8``): a
    `cpa read-patterns` reader as a profile target -> (pattern, blocks, warps); None for a tiling.
    Refused before any GPU work when malformed."""
    if not tiling.startswith("reader-"):
        return None
    from .readpattern import PATTERNS, parse_reader_shape

    pattern, _, shape = tiling[len("reader-"):].rpartition("-")
    try:
        if pattern not in PATTERNS:
            raise ValueError(f"unknown pattern {pattern!r}")
        nb, warps, _ = parse_reader_shape(shape)
    except ValueError as e:
        raise ValueError(f"profile target {tiling!r}: expected reader-<{'|'.join(PATTERNS)}>-<blocks>x<warps>, "
                         f"e.g. reader-paged-2x8 ({e})") from None
    return pattern, nb, warps


def profile_one(tiling: str = "mfma16", partition_size: int = 1024, batch: int = 8, context: int = 32768) -> None:
    """Run one Llama-70B decode call a few times: a target for `ncu -k regex:paged_attention` (tiling
    ``sdpa_cudnn``: torch SDPA's cuDNN backend on contiguous K/V instead; ``reader-<pattern>-<NB>x<W>``:
    the `cpa read-patterns` reader of that pattern and shape over the same decomposition, kernel
    ``read_runs``, so ncu can set the reader's memory behaviour beside the kernel's)."""
    import torch

    from .bench import LLAMA70B, make_sets
    from .ops import prepare

    reader = reader_target(tiling)
    if reader is not None:
        from . import readpattern as RP

        pattern, nb, warps = reader
        shape = dict(num_kv_heads=LLAMA70B["num_kv_heads"], head_size=LLAMA70B["head_size"],
                     block_size=LLAMA70B["block_size"], elem_bytes=2)
        sets = RP.make_byte_sets(batch, context, **shape)[pattern]
        readers = [RP.Reader(pattern, t, num_seqs=batch, seq_len=context, partition_size=partition_size,
                             blocks_per_iter=nb, num_warps=warps, **shape) for t in sets]
        turn = itertools.cycle(readers)  # the sets in turn, as the timed runs rotate them (no L2 reuse)
        launch_and_profile(lambda: next(turn)())
        return
    sets = make_sets(batch, context, dtype=torch.float16, **LLAMA70B)
    if tiling == "sdpa_cudnn":  # the peer on contiguous K/V, as `cpa bench` runs it
        from .bench import contiguous_kv, sdpa_cudnn

        k, v = contiguous_kv(sets, 0, context)
        q = sets.queries[0].unsqueeze(2)

        def launch():
            sdpa_cudnn(q, k, v, sets.scale)
    else:
        launch = prepare(query=sets.queries[0], key_cache=sets.key_cache, value_cache=sets.value_cache,
                         block_tables=sets.block_tables[0], seq_lens=sets.seq_lens, scale=sets.scale,
                         partition_size=partition_size, tiling=tiling, fused_reduce=False)
    launch_and_profile(launch)


def launch_and_profile(launch) -> None:
    """One launch outside the profiled range (builds, plans, warms up), then three inside it."""
    import torch

    launch()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()  # ncu --profile-from-start off sees only these launches
    for _ in range(3):
        launch()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def occupancy_check_all(out_csv: str, chunk: int = 128, resume_from: str | None = None) -> None:
    """Every sm_90 variant: build (in parallel), then the Hopper calculator against
    cudaOccupancyMaxActiveBlocksPerMultiprocessor for its kernels (cpa.occupancy.h200_check).

    Chunked: the table is rewritten (atomically) after every `chunk` variants, so a timeout
    keeps what was checked; `resume_from` (a table of an earlier run) skips the variants it
    holds for the same kernel sources."""
    import pandas as pd

    from . import occupancy as O
    from .jit import device_arch, prebuild, sources_digest

    platform, arch = device_arch()
    vs = list(V.all_variants(platform))
    done = pd.DataFrame()
    if resume_from and os.path.exists(resume_from):
        old = pd.read_csv(resume_from)
        done = old[old.sources_digest == sources_digest()[:16]] if "sources_digest" in old else old.iloc[:0]
        vs = [v for v in vs if v.name not in set(done.variant)]
        print(f"occupancy check: {done.variant.nunique() if len(done) else 0} variants already checked, "
              f"{len(vs)} to go")
    t0 = time.time()
    table = done
    for i in range(0, len(vs), chunk):
        part = vs[i:i + chunk]
        errors = [r for r in prebuild(part, arch, progress=False) if r["error"]]
        if errors:
            raise RuntimeError(f"{len(errors)} variants failed to build, e.g. {errors[0]['variant']}: "
                               f"{(errors[0]['error'] or '')[-1000:]}")
        table = pd.concat([table, O.h200_check(part)], ignore_index=True)
        write_csv_atomic(table, out_csv)
        print(f"occupancy check: {table.variant.nunique()} variants, {len(table)} kernels, "
              f"{time.time() - t0:.0f} s", flush=True)
    bad = table[~table["match"]]
    print(f"occupancy check: {table.variant.nunique()} variants, {len(table)} kernels on "
          f"{table.device_name.iloc[0]} in {time.time() - t0:.0f} s; calculator == CUDA runtime on "
          f"{int(table['match'].sum())} of {len(table)}")
    if len(bad):
        print(bad[["variant", "kernel", "registers", "shared_bytes", "blocks_per_sm_cuda", "blocks_per_sm_model",
                   "model_limit"]].head(20).to_string(index=False))


if __name__ == "__main__":
    if sys.argv[1:] == ["buildtime"]:
        build_time_main()
    elif sys.argv[1:2] == ["occupancy-check-all"]:
        occupancy_check_all(sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.environ.get("OUT", "."),
                                                                               "h200-occupancy-check.csv"),
                            resume_from=sys.argv[3] if len(sys.argv) > 3 else None)
    elif sys.argv[1:2] == ["profile-one"]:
        a = sys.argv[2:]
        profile_one(a[0], int(a[1]), int(a[2]), int(a[3]))
    else:
        prebuild_main(sys.argv[1] if len(sys.argv) > 1 else "tests", None)
