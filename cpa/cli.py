"""Command line: ``cpa compare`` (and ``python -m cpa compare``)."""

from __future__ import annotations

import functools
import os
import statistics
import time
from typing import Optional

import typer

from .fsio import write_csv_atomic

app = typer.Typer(
    add_completion=False,
    rich_markup_mode="markdown",
    no_args_is_help=True,
    help="cpa: a workbench for paged-attention decode kernels.",
)

_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


@app.callback()
def _main() -> None:
    """cpa: a workbench for paged-attention decode kernels."""


def _is_user_error(e: BaseException) -> bool:
    """Errors that say what the user asked for cannot be done -- a refused value, a path that
    cannot be read or written, a missing module or tool, no GPU -- as opposed to a failure
    inside a run (a kernel error, a bug), which keeps its traceback."""
    if isinstance(e, RuntimeError):
        from .jit import NoGPUError
        from .profile import ProfilerNotFoundError
        from .static import CompilerMissing

        return isinstance(e, (NoGPUError, ProfilerNotFoundError, CompilerMissing))
    return isinstance(e, (ValueError, OSError, ImportError))


def _command(*args, **kwargs):
    """app.command, with the user errors a command raises reported as one line and exit code 2
    (CPA_TRACEBACK=1 re-raises them, for debugging)."""
    def register(fn):
        @functools.wraps(fn)
        def run(*a, **k):
            try:
                return fn(*a, **k)
            except Exception as e:
                # typer's own exits and usage errors (typer vendors click in some versions) pass
                own = type(e).__module__.split(".")[0] in ("typer", "click")
                if own or os.environ.get("CPA_TRACEBACK") or not _is_user_error(e):
                    raise
                typer.echo(f"Error: {e} ({type(e).__name__}; CPA_TRACEBACK=1 shows where)", err=True)
                raise typer.Exit(2) from None
        return app.command(*args, **kwargs)(run)
    return register


def _parse_partitions(text: str) -> list[Optional[int]]:
    """'none' / 'single' (one pass) or positive partition sizes; anything else raises ValueError."""
    out: list[Optional[int]] = []
    for tok in text.split(","):
        tok = tok.strip().lower()
        if tok in ("none", "single"):
            out.append(None)
        elif tok.isdigit() and int(tok) > 0:
            out.append(int(tok))
        else:
            raise ValueError(f"partition_sizes: {tok!r} in {text!r} is not 'none' or a positive size")
    return out


@_command()
def compare(
    device: str = typer.Option("cpu", help="torch device for the reference (cpu, cuda, ...)."),
    seq_lens: str = typer.Option("1024,4096,16384", help="comma-separated context lengths; one batch each."),
    partition_sizes: str = typer.Option(
        "none,64,128,256,512,1024", help="comma-separated partition sizes; 'none' = single pass."
    ),
    num_seqs: int = typer.Option(2, help="sequences per batch (all of the same context length)."),
    num_heads: int = typer.Option(64, help="query heads."),
    num_kv_heads: int = typer.Option(8, help="KV heads."),
    head_size: int = typer.Option(128, help="head size."),
    block_size: int = typer.Option(16, help="KV-cache block size."),
    dtype: str = typer.Option("fp16", help="query/cache dtype: fp32, fp16 or bf16."),
    kv_cache_dtype: str = typer.Option("auto", help="auto or fp8."),
    repeats: int = typer.Option(3, help="timed runs per point (median reported), after one warm-up."),
    seed: int = typer.Option(0, help="input seed."),
) -> None:
    """Partition-size comparison of the torch reference (Llama-70B-like decode shape by default).

    For each context length and partition size: max_num_partitions, the median wall time of
    cpa.reference.paged_attention, and the largest per-(sequence, head) relative error of its
    float32 output against the single-pass float32 output.
    """
    import torch

    from .inputs import make_paged_inputs
    from .reference import paged_attention, reduce_partitions

    if dtype not in _DTYPES:
        raise typer.BadParameter(f"dtype: got {dtype!r}; allowed: {', '.join(_DTYPES)}")
    from .validation import validate_paged_attention_args

    tdtype = getattr(torch, _DTYPES[dtype])
    lens = _ints(seq_lens)
    parts = _parse_partitions(partition_sizes)
    if not lens or min(lens) < 1 or min(num_seqs, num_heads, num_kv_heads) < 1:
        raise typer.BadParameter("seq_lens, num_seqs, num_heads and num_kv_heads must be positive")
    dev = torch.device(device)
    if dev.type == "cuda":
        from .jit import require_gpu

        require_gpu(f"--device {device}")
    # every option checked on a one-token batch before the table starts (shape, dtype, sizes)
    tiny = make_paged_inputs(num_seqs, num_heads, num_kv_heads, head_size, block_size, 1, dtype=tdtype,
                             kv_cache_dtype=kv_cache_dtype).as_kwargs()
    for p in parts:
        validate_paged_attention_args(**tiny, partition_size=p)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)

    typer.echo(
        f"cpa compare -- the pure-torch REFERENCE on {dev} (cpa.reference.paged_attention), not a kernel:\n"
        f"times are of the reference implementation and say nothing about GPU kernel speed.\n"
        f"shape: num_seqs={num_seqs} num_heads={num_heads} num_kv_heads={num_kv_heads} "
        f"head_size={head_size} block_size={block_size} dtype={dtype} kv_cache_dtype={kv_cache_dtype}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads\n"
        f"max_rel_err: max over (seq, head) of ||out_P - out_single|| / ||out_single||, float32 outputs\n"
    )
    header = f"{'seq_len':>8} {'partition_size':>14} {'max_num_partitions':>18} {'time_ms':>10} {'max_rel_err':>12}"
    typer.echo(header)
    typer.echo("-" * len(header))
    for L in lens:
        inp = make_paged_inputs(num_seqs, num_heads, num_kv_heads, head_size, block_size, L, dtype=tdtype,
                                kv_cache_dtype=kv_cache_dtype, seed=seed, device=dev)
        kw = inp.as_kwargs()
        single = None
        for p in parts:
            _, es, ml, to = paged_attention(**kw, partition_size=p, return_intermediates=True)
            out32 = reduce_partitions(es, ml, to).double()
            if single is None:
                single = paged_attention(**kw, return_intermediates=True)[3][:, :, 0].double()
            num = torch.linalg.vector_norm(out32 - single, dim=-1)
            den = torch.linalg.vector_norm(single, dim=-1)
            err = float((num / den).max())
            times = []
            paged_attention(**kw, partition_size=p)  # warm-up
            for _ in range(max(1, repeats)):
                sync()
                t0 = time.perf_counter()
                paged_attention(**kw, partition_size=p)
                sync()
                times.append((time.perf_counter() - t0) * 1e3)
            nparts = 1 if p is None else -(-L // p)
            typer.echo(f"{L:>8} {str(p):>14} {nparts:>18} {statistics.median(times):>10.2f} {err:>12.2e}")


def _ints(text: Optional[str]) -> Optional[list[int]]:
    """Comma-separated integers (None for no text); ValueError naming a token that is not one."""
    if not text:
        return None
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"{text!r}: expected comma-separated integers") from None


def _strs(text: Optional[str]) -> Optional[list[str]]:
    return [t.strip() for t in text.split(",") if t.strip()] if text else None


def _check_jobs(jobs: Optional[int]) -> None:
    if jobs is not None and jobs < 1:
        raise typer.BadParameter(f"{jobs}: at least 1 compiler process", param_hint="--jobs")


def _check_writable(path: Optional[str], hint: str) -> None:
    """Before long work: the folder of an output file exists (or can be made) and takes files."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise typer.BadParameter(f"{path}: cannot create its folder ({e})", param_hint=hint) from None
    if not os.access(folder, os.W_OK) or os.path.isdir(path):
        raise typer.BadParameter(f"{path}: cannot write a file there", param_hint=hint)


@_command()
def bench(
    out: str = typer.Option("data/bench/h200-kernel.csv", help="CSV to write (atomically)."),
    batches: str = typer.Option("1,8,32,128", help="comma-separated batch sizes."),
    contexts: str = typer.Option("512,2048,8192,32768", help="comma-separated context lengths."),
    tilings: Optional[str] = typer.Option(None, help="comma-separated tilings (default: all)."),
    partition_sizes: Optional[str] = typer.Option(None, help="comma-separated partition sizes (default: all)."),
    replays: int = typer.Option(30, help="graph replays per timing (median reported)."),
    sdpa: bool = typer.Option(True, help="time torch SDPA (cuDNN, contiguous K/V) in the same run."),
    fused: bool = typer.Option(True, help="also time each variant with the fused reduce."),
    cluster: bool = typer.Option(True, help="also time each variant with the cluster combine (sm_90+, 2-16 "
                                 "partitions)."),
    shared: bool = typer.Option(True, help="also time each variant with shared steps (the workgroups of a "
                                "sequence take its steps from one counter)."),
    default: bool = typer.Option(True, help="also time, per shape, the launch with partition size, tiling and "
                                 "combine left to the launcher (a default_path row)."),
    block_order: str = typer.Option("shuffled", help="physical block order of each sequence: 'shuffled' "
                                    "(random, as an allocator leaves it) or 'sequential' (what paging costs)."),
    resume: bool = typer.Option(False, help="keep the shapes already in OUT (written by the same options and "
                                "commit) and measure the rest; without it OUT is overwritten."),
) -> None:
    """Benchmark the CPA kernel at Llama-3.1-70B TP1 decode shapes (needs a GPU).

    OUT is rewritten atomically after every shape, so an interrupted run keeps the shapes it
    finished and --resume continues it."""
    import pandas as pd

    from . import bench as B
    from . import variants as V

    try:
        df, ceil = B.run(batches=_ints(batches), contexts=_ints(contexts), tilings=_strs(tilings),
                         partition_sizes=_ints(partition_sizes), replays=replays, sdpa=sdpa, fused=fused,
                         cluster=cluster, shared=shared, out_csv=out, block_order=block_order, resume=resume,
                         default=default)
    except ValueError as e:  # options or OUT refused before any GPU work
        raise typer.BadParameter(str(e)) from None
    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.max_rows", 500):
        cols = ["tiling", "partition_size", "fused_reduce", "cluster_reduce", "shared_steps", "default_path",
                "num_seqs", "max_seq_len", "time_us", "attn_time_us", "reduce_time_us", "gbps", "frac_peak_bw",
                "verified"]
        full = df[[c for c in cols if c in df]].copy()
        print(full.round(3).to_string(index=False))
        print()
        print(B.summary_table(df).to_string(index=False))
        choice, table = B.best_fixed_choice(df)
        print("\nbest single (tiling, partition, combine) over these shapes (geomean slowdown vs per-shape best):")
        print(table.head(6).round(3).to_string(index=False))
        gap = B.sdpa_gap(df) if "attn_time_us" in df else None
        if gap is not None and len(gap):
            print("\nagainst SDPA, reduce-launch rows (combine_us: what the reduce adds after the attention; "
                  "attn_vs_sdpa: the ratio if it cost nothing):")
            print(gap[["num_seqs", "max_seq_len", "tiling", "partition_size", "time_us", "attn_time_us", "combine_us",
                       "sdpa_us", "vs_sdpa", "attn_vs_sdpa"]].round(3).to_string(index=False))
        fit = B.streaming_fit(df) if (df.tiling == "sdpa_cudnn").any() else None
        if fit is not None and len(fit) == 2 and (fit.shapes >= 4).all():
            print(f"\ntime = fixed + K/V bytes / rate, least squares over the shapes with >= "
                  f"{B.STREAMING_MIN_TOKENS} tokens in the batch (cpa.bench.streaming_fit):")
            print(fit.drop(columns="per_token_bytes").round(4).to_string(index=False))
        arch = str(df.arch.iloc[0]) if "arch" in df and len(df) else ""
        if arch in V.SHAPE_MODELS:
            from . import ops

            # rows of this run's kernel: the default's combine as the launcher picks it today
            by_shape = B.by_shape_choice(df, arch, resident_per_sm=lambda v: ops.resident_per_sm(v, "cuda"),
                                         fused=True)
            print(f"\nthe {arch} default (partition size by shape, cpa.variants.BY_SHAPE): geomean "
                  f"{B.geomean(by_shape.slowdown):.3f}x the per-shape best, worst {by_shape.slowdown.max():.3f}x")
            print(by_shape[["num_seqs", "max_seq_len", "tiling", "partition_size", "workgroups", "fused_reduce",
                            "cluster_reduce", "time_us", "best",
                            "best_time_us", "slowdown"]].round(3).to_string(index=False))
        measured = B.default_path(df)
        if len(measured):
            print(f"\nthe default launch itself, measured (partition_size, tiling and combine None): geomean "
                  f"{B.geomean(measured.slowdown):.3f}x the per-shape best, worst {measured.slowdown.max():.3f}x")
            print(measured.round(3).to_string(index=False))
    print(f"\nwrote {out}")


@_command("host-cost")
def host_cost(
    out: str = typer.Option("data/bench/host-cost.csv", help="CSV to write (atomically)."),
    batches: str = typer.Option("1,8", help="comma-separated batch sizes."),
    contexts: str = typer.Option("2048,32768", help="comma-separated context lengths."),
    modes: Optional[str] = typer.Option(None, help="comma-separated launch modes (default: all; see "
                                        "cpa.hostcost)."),
    calls: int = typer.Option(100, help="calls per timed run."),
    repeats: int = typer.Option(7, help="timed runs per mode (median reported)."),
    progress: bool = typer.Option(True, help="show a progress bar."),
) -> None:
    """What one decode call costs the host by launch path (eager checked / unchecked, prepared
    Launch, CUDA graph, SDPA), beside its device time (needs a GPU; Llama-3.1-70B TP1 shapes)."""
    import pandas as pd

    from . import hostcost as H

    try:
        df = H.run(batches=_ints(batches), contexts=_ints(contexts), modes=_strs(modes) or H.MODES, calls=calls,
                   repeats=repeats, out_csv=out, progress=progress)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    except RuntimeError as e:  # no GPU
        typer.echo(f"cpa host-cost: {e}", err=True)
        raise typer.Exit(2) from None
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        print(df[["num_seqs", "max_seq_len", "mode", "tiling", "partition_size", "fused_reduce", "host_us",
                  "wall_us", "device_us", "vs_sdpa", "verified"]].round(2).to_string(index=False))
        print("\nper call, us (host: issue cost with the GPU busy; wall: back to back from an idle GPU):")
        print(H.summary(df).round(1).to_string(index=False))
    print(f"\nwrote {out}")


@_command("host-profile")
def host_profile(
    out: str = typer.Option("data/bench/host-profile.csv", help="CSV to write (atomically)."),
    batch: int = typer.Option(8, help="num_seqs."),
    context: int = typer.Option(32768, help="max_seq_len."),
    mode: str = typer.Option("unchecked", help="launch path: checked, unchecked, fresh_counters or prepared."),
    calls: int = typer.Option(200, help="calls profiled."),
    top: int = typer.Option(30, help="functions kept: this many by own time and by cumulative time."),
) -> None:
    """Where an eager call's host time goes (cProfile, per call; needs a GPU)."""
    import pandas as pd

    from . import bench as B
    from . import hostcost as H

    try:
        df = H.profile(num_seqs=batch, seq_len=context, mode=mode, calls=calls, top=top)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    except RuntimeError as e:
        typer.echo(f"cpa host-profile: {e}", err=True)
        raise typer.Exit(2) from None
    write_csv_atomic(df, out)
    first = df.iloc[0]
    print(f"{mode}, {batch} x {context}: {first.host_us:.1f} us per call unprofiled, "
          f"{first.self_us:.1f} us under cProfile")
    with pd.option_context("display.width", 200, "display.max_colwidth", 90):
        print(df[["function", "ncalls", "self_us", "cum_us"]].round(2).to_string(index=False))
    print(f"\nwrote {out}")


@_command()
def prebuild(
    grid: str = typer.Option("tests", help="'tests' (every variant the GPU tests use) or 'bench'."),
    jobs: Optional[int] = typer.Option(None, help="parallel compiler processes (default: all cores)."),
    tilings: Optional[str] = typer.Option(None, help="comma-separated tilings: only these (default: all)."),
    partition_sizes: Optional[str] = typer.Option(None, help="comma-separated partition sizes: only these "
                                                  "(default: all)."),
) -> None:
    """Compile variants for the visible GPU in parallel into the disk cache (exit status 1 if any failed)."""
    from . import jobs as J

    if grid not in ("tests", "bench"):
        raise typer.BadParameter(f"{grid!r}: 'tests' or 'bench'", param_hint="--grid")
    _check_jobs(jobs)
    rows = J.prebuild_main(grid, jobs, tilings=_strs(tilings) if tilings else None,
                           partition_sizes=_ints(partition_sizes) if partition_sizes else None)
    if any(r["error"] for r in rows):  # (printed above, variant by variant)
        raise typer.Exit(1)


@_command()
def static(
    arch: str = typer.Option(..., help="gfx942, gfx90a or sm_90."),
    out: str = typer.Option(..., help="CSV to write (atomically), one row per variant and kernel."),
    tilings: Optional[str] = typer.Option(None, help="comma-separated tilings (default: all)."),
    partition_sizes: Optional[str] = typer.Option(None, help="comma-separated partition sizes (default: all)."),
    jobs: Optional[int] = typer.Option(None, help="parallel compiler processes (default: all cores)."),
    head_sizes: Optional[str] = typer.Option(None, help="comma-separated head sizes (default: all)."),
    flags: Optional[str] = typer.Option(None, help="space-separated -D knob definitions for a knob's build "
                                        "(e.g. '-DCPA_MIN_BLOCKS=1'; column `build_flags`)."),
    shared_steps: bool = typer.Option(False, "--shared-steps", help="compile the shared-steps attention kernels "
                                      "(ops.prepare(shared_steps=True)) of the variants that can share their "
                                      "steps, instead of the fixed partitions' (column `shared_steps`)."),
) -> None:
    """Compile every valid variant for an arch (no GPU) and record resources and instruction mix."""
    from . import static as S
    from . import variants as V

    _check_jobs(jobs)
    _check_writable(out, "--out")
    filters = {}
    if tilings:
        filters["tilings"] = tuple(_strs(tilings))
    if partition_sizes:
        filters["partition_sizes"] = tuple(_ints(partition_sizes))
    if head_sizes:
        filters["head_sizes"] = tuple(_ints(head_sizes))
    try:
        knob_flags = S.check_knob_flags((flags or "").split())
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--flags") from None
    try:  # (every refusal -- arch, selection, --shared-steps -- comes before the first compiler run)
        vs = S.variants_for_arch(arch, **filters)
        df = S.compile_variants(vs, arch, jobs=jobs, flags=knob_flags, shared_steps=shared_steps)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    write_csv_atomic(df, out)
    att = df[df.kernel == "attention"]
    cols = [c for c in ("tiling", "partition_size", "head_size", "dtype", "kv_cache_dtype", "heads_cap", "vgprs",
                        "agprs", "registers", "lds_bytes", "shared_bytes", "spills", "waves_per_simd_compiler")
            if c in att]
    sel = att[(att.head_size == 128) & (att.block_size == 16)][cols]
    typer.echo(sel.to_string(index=False))
    n = len(att)
    typer.echo(f"\n{n} variants ({V.platform_of_arch(arch)}{', shared steps' if shared_steps else ''}), "
               f"{len(df)} kernels -> {out}")


@_command("same-code")
def same_code(
    base: str = typer.Option(..., help="git revision whose kernel sources a measurement ran (e.g. a data row's "
                                       "git_commit)."),
    head: Optional[str] = typer.Option(None, help="git revision to compare with (default: the working tree)."),
    grid: str = typer.Option("bench", help="'bench' (the `cpa bench` variants) or 'tests' (every variant the GPU "
                                           "tests build)."),
    arch: str = typer.Option("sm_90", help="sm_90 (PTX), gfx942 or gfx90a (assembly)."),
    flags: Optional[str] = typer.Option(None, help="space-separated -D knob definitions for both builds."),
    base_flags: Optional[str] = typer.Option(None, help="-D knob definitions for the BASE build only (the flags a "
                                             "measured knob build ran with)."),
    head_flags: Optional[str] = typer.Option(None, help="-D knob definitions for the HEAD build only."),
    level: Optional[str] = typer.Option(None, help="sm_90: 'ptx' (default) or 'sass' (machine code; needs "
                                        "cuobjdump); AMD: 'asm'."),
    jobs: Optional[int] = typer.Option(None, help="parallel compiler processes (default: all cores)."),
    out: Optional[str] = typer.Option(None, help="also write the per-kernel rows (with provenance) to this CSV."),
    fail_on_change: bool = typer.Option(False, help="exit with status 1 if any kernel differs."),
) -> None:
    """Is the code of these variants compiled from BASE identical to HEAD's? (no GPU)

    Where every kernel of a variant compiles to the same PTX (sm_90) or assembly (gfx942),
    a measurement of that variant made at BASE stands for HEAD."""
    import pandas as pd

    from . import codediff as CD
    from . import jobs as J
    from . import variants as V
    from .static import CompilerMissing

    if grid not in ("bench", "tests"):
        raise typer.BadParameter("'bench' or 'tests'", param_hint="--grid")
    try:
        fl = {k: tuple((x or "").split()) for k, x in (("flags", flags), ("base_flags", base_flags),
                                                           ("head_flags", head_flags))}
        platform = V.platform_of_arch(arch)
        vs = J.test_variants(platform) if grid == "tests" else J.bench_variants(platform)
        df = CD.compare(vs, base, head, arch=arch, level=level, jobs=jobs, **fl)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    except CompilerMissing as e:
        typer.echo(f"same-code: {e}", err=True)
        raise typer.Exit(2) from None
    by = df.groupby("variant", sort=False)
    table = by.agg(kernels=("kernel", "size"), identical=("identical", "sum")).reset_index()
    table["first_difference"] = [
        next((f"{k}: {d}" for k, d, same in zip(g.kernel, g.first_difference, g.identical) if not same), "")
        for _, g in by]
    with pd.option_context("display.width", 220):
        typer.echo(table.to_string(index=False, max_colwidth=90))
    s = CD.summary(df)
    typer.echo(f"\n{arch} {df.level.iloc[0]}, {df.base.iloc[0][:12]} -> {df['head'].iloc[0][:12]}: {s['identical']} of "
               f"{s['variants']} variants compile to identical code in every kernel")
    if out:
        write_csv_atomic(df, out)
        typer.echo(f"wrote {out}")
    if fail_on_change and s["changed"]:
        raise typer.Exit(1)


@_command()
def sweep(
    grid: str = typer.Option(..., help="shipped grid name (llama70b-decode, gqa-scan, head-size-scan, "
                                       "mixed-lengths) or a YAML file with the same schema (cpa.sweep)."),
    out: str = typer.Option(..., help="results parquet (one row per point x variant)."),
    resume: bool = typer.Option(False, help="skip the (point, variant) rows already in OUT."),
    overwrite: bool = typer.Option(False, help="start over, deleting OUT and its journal."),
    retry_errors: bool = typer.Option(False, help="with --resume, run again rows that failed (not unsupported ones)."),
    tilings: Optional[str] = typer.Option(None, help="comma-separated tilings (default: the grid's)."),
    partition_sizes: Optional[str] = typer.Option(None, help="comma-separated partition sizes (default: the grid's)."),
    peers: bool = typer.Option(True, "--peers/--no-peers", help="time SDPA, FlexAttention, FlashInfer as rows too."),
    peer_names: Optional[str] = typer.Option(None, "--peer-names", help="comma-separated subset of sdpa,flex,flashinfer."),
    replays: Optional[int] = typer.Option(None, help="replays per timing (default: 30 on the GPU, 5 on the CPU)."),
    runner: str = typer.Option("auto", help="auto, cuda, cpu (the reference as the timed op) or module:attr."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="tqdm progress bar with ETA."),
    dry_run: bool = typer.Option(False, help="print the points and the row count, run nothing."),
    ceilings_json: Optional[str] = typer.Option(None, help="also add this run's measured read/copy ceilings "
                                                           "(with provenance) to this JSON file."),
    allow_mixed: bool = typer.Option(False, help="with --resume, add rows to a table of another runner, GPU "
                                                 "model, arch or input seeds (refused by default)."),
) -> None:
    """Sweep a grid of decode shapes x tilings x partition sizes (plus peers) into a parquet table.

    Every row is verified against the reference (NaN-poisoned output buffer) and timed;
    rows are journaled atomically, so a killed sweep continues with --resume.
    """
    import pandas as pd

    from . import sweep as SW

    g = SW.load_grid(grid).with_variants(_strs(tilings), _ints(partition_sizes))
    _check_writable(ceilings_json, "--ceilings-json")
    if dry_run:
        typer.echo(f"grid {g.name} ({g.source}): {len(g.points)} points x {len(g.variants())} variants = "
                   f"{len(g.rows())} rows (+ peers)")
        typer.echo(f"tilings {','.join(g.tilings)}; partition sizes {','.join(map(str, g.partition_sizes))}")
        for p in g.points:
            typer.echo(f"  {p.point_id}  max {p.max_seq_len}  mean {p.mean_seq_len:.0f}  "
                       f"KV {p.kv_bytes / 2**20:.1f} MiB")
        return
    r = SW.make_runner(runner, replays=replays, peers=_strs(peer_names))
    try:
        df = SW.run_sweep(g, out, runner=r, resume=resume, overwrite=overwrite, retry_errors=retry_errors,
                          peers=peers, progress=progress, echo=typer.echo, ceilings_json=ceilings_json,
                          allow_mixed=allow_mixed)
    except FileExistsError as e:
        raise typer.BadParameter(str(e), param_hint="--out") from None
    mine = df[df.grid == g.name]
    with pd.option_context("display.width", 220, "display.max_columns", 40, "display.max_rows", 1000):
        typer.echo(SW.summary_table(mine).to_string(index=False))
    errs = mine.error.notna() & ~mine.error.fillna("").astype(str).str.startswith(SW.UNSUPPORTED)
    typer.echo(f"\n{len(mine)} rows of grid {g.name} in {out} ({len(df)} in the file); "
               f"verified {int(mine.verified.sum())}, failed {int(errs.sum())}, "
               f"unsupported {int(mine.error.fillna('').astype(str).str.startswith(SW.UNSUPPORTED).sum())}")


@_command("sweep-spread")
def sweep_spread(
    a: str = typer.Argument(..., help="results parquet of one run."),
    b: str = typer.Argument(..., help="results parquet of a repeat of (some of) its rows."),
    limit: float = typer.Option(0.03, help="the spread (|a - b| / min) a row may show."),
) -> None:
    """Timing repeatability: the same (point, variant) rows in two sweep runs, side by side."""
    from . import sweep as SW

    m = SW.repeat_spread(SW.read_results(a)[0], SW.read_results(b)[0])
    if not len(m):
        raise typer.BadParameter("no verified row is in both files")
    typer.echo(m.head(15).to_string(index=False))
    q = m.spread.quantile([0.5, 0.95]).tolist()
    over = int((m.spread > limit).sum())
    typer.echo(f"\n{len(m)} rows in both: spread median {q[0]:.2%}, p95 {q[1]:.2%}, max {m.spread.max():.2%}; "
               f"{over} over {limit:.0%}")


@_command()
def report(
    out: str = typer.Option("build/report", help="folder for index.html and one page per notebook."),
    notebooks: Optional[str] = typer.Option(None, help="comma-separated notebook .py files (default: all in "
                                                       "notebooks/)."),
    timeout: int = typer.Option(1800, help="seconds one notebook cell may run."),
) -> None:
    """Execute every notebook headless (nbclient) and write a static HTML report.

    Without a GPU the notebooks use the dataset shipped in data/ and each page says so."""
    from pathlib import Path

    from . import report as R

    srcs = [Path(p) for p in _strs(notebooks)] if notebooks else None
    pages = R.build_report(out, notebooks=srcs, timeout=timeout, echo=typer.echo)
    failed = [p for p in pages if p.error]
    if failed:
        typer.echo(f"{len(failed)} notebook(s) failed: {', '.join(p.name for p in failed)}", err=True)
        raise typer.Exit(1)


@_command()
def profile(
    profiler: str = typer.Option(..., help="ncu or rocprofv3 (run as a subprocess)."),
    counters: str = typer.Option("basic", help="a counter set of profiling/PROFILER.yaml (ncu.yaml, "
                                 "rocprofv3.yaml) or comma-separated metrics."),
    grid: str = typer.Option(..., help="shipped grid name or YAML file (cpa.sweep)."),
    out: str = typer.Option(..., help="parquet: one row per (point, variant) with the portable metrics."),
    points: Optional[str] = typer.Option(None, help="comma-separated point indices of the grid (default: all)."),
    tilings: Optional[str] = typer.Option(None, help="comma-separated tilings (default: the grid's)."),
    partition_sizes: Optional[str] = typer.Option(None, help="comma-separated partition sizes (default: the grid's)."),
    repeats: int = typer.Option(1, help="profiled launches per (point, variant); the median is kept."),
    timeout: int = typer.Option(1800, help="seconds the profiler run may take."),
) -> None:
    """Hardware counters of the attention kernel through ncu or rocprofv3, joined to sweep keys."""
    import pandas as pd

    from . import profile as PR

    if repeats < 1:
        raise typer.BadParameter(f"{repeats}: at least one launch per (point, variant)", param_hint="--repeats")
    if timeout <= 0:
        raise typer.BadParameter(f"{timeout}: a positive number of seconds", param_hint="--timeout")
    sets = PR._load_counter_file(PR.counter_set_path(profiler))["sets"] if profiler in ("ncu", "rocprofv3") else {}
    cs = counters if counters in sets else _strs(counters)
    df = PR.profile_grid(profiler, cs, grid, out, points=points, tilings=_strs(tilings),
                         partition_sizes=_ints(partition_sizes), repeats=repeats, timeout=timeout)
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        typer.echo(df.drop(columns=["command"], errors="ignore").to_string(index=False))
    typer.echo(f"{len(df)} rows -> {out}")


@_command("read-patterns")
def read_patterns(
    out: str = typer.Option("data/bench/h200-read-patterns.csv", help="CSV to write (atomically)."),
    num_seqs: int = typer.Option(8, help="sequences."),
    seq_len: int = typer.Option(32768, help="context length of every sequence."),
    partition_sizes: str = typer.Option("4096,8192", help="comma-separated partition sizes (tokens of one KV "
                                        "head per program)."),
    patterns: Optional[str] = typer.Option(None, help="comma-separated subset of contiguous,paged,paged_all_heads."),
    block_order: str = typer.Option("shuffled", help="'shuffled' or 'sequential' physical blocks."),
    kv_cache_dtype: str = typer.Option("auto", help="'auto' (2-byte elements, the bench's fp16 cache) or 'fp8' "
                                       "(1-byte: half the run per block)."),
    kernel: bool = typer.Option(True, "--kernel/--no-kernel", help="time the CPA kernel (mfma16) and cuDNN SDPA "
                                "at the same shape in the same run (fp16 cache only)."),
    load_only: Optional[str] = typer.Option(None, help="comma-separated -DCPA_LOAD_ONLY levels (1, 2) to time "
                                            "too: the kernel's loads alone, no math (with --kernel)."),
    reader_shapes: Optional[str] = typer.Option(None, help="comma-separated reader shapes BLOCKSxWARPS "
                                                "(physical blocks per iteration x warps), e.g. 2x8,16x8 "
                                                "(default: 1-16 blocks at 4 and 8 warps)."),
) -> None:
    """Read a decode step's K/V bytes with a plain streaming reader in the contiguous layout,
    the paged layout one KV head per program, and the paged layout whole physical blocks per
    program (needs a GPU and Triton): what the layout costs, apart from any attention kernel."""
    import pandas as pd

    from . import bench as B
    from . import readpattern as RP

    _check_writable(out, "--out")
    try:
        sizes = _ints(partition_sizes)
        if not sizes:
            raise ValueError("--partition-sizes: name at least one size")
        configs = tuple(RP.parse_reader_shape(x) for x in _strs(reader_shapes) or []) or RP.READER_CONFIGS
        df, ceil = RP.run(num_seqs=num_seqs, seq_len=seq_len, partition_sizes=tuple(sizes),
                          patterns=tuple(_strs(patterns) or RP.PATTERNS), block_order=block_order, kernel_rows=kernel,
                          kv_cache_dtype=kv_cache_dtype, load_only=tuple(_ints(load_only) or ()), configs=configs)
    except ValueError as e:  # pattern, shape or block order refused before any GPU work
        raise typer.BadParameter(str(e)) from None
    write_csv_atomic(df, out)
    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.max_rows", 200):
        typer.echo(RP.best_per_pattern(df).round(3).to_string(index=False))
        typer.echo("\nGB/s by KB in flight per program and iteration (best over warps):")
        typer.echo(RP.rate_by_bytes_in_flight(df).to_string())
        vs = RP.against_sdpa(df.assign(run="this run"))
        if len(vs) and vs.sdpa_us.notna().any():
            typer.echo("\nbest of each against SDPA (above 1: faster than SDPA):")
            typer.echo(vs.drop(columns="run").round(3).to_string(index=False))
    bad = df[(df.kind == "reader") & (df.get("verified", True) == False)]  # noqa: E712
    typer.echo(f"\nread ceiling this run {ceil['read_gbps']:.0f} GB/s; {len(bad)} reader rows failed the checksum")
    typer.echo(f"wrote {out}")


@_command("emu")
def emu_check(
    tilings: str = typer.Option("mfma16,mfma4,scalar", help="comma-separated tilings."),
    partition_sizes: str = typer.Option("256", help="comma-separated partition sizes."),
    dtype: str = typer.Option("fp16", help="fp16 or bf16."),
    kv_cache_dtype: str = typer.Option("auto", help="auto or fp8."),
    head_size: int = typer.Option(128),
    block_size: int = typer.Option(16),
    gqa: Optional[int] = typer.Option(None, help="query heads per KV head (default: 8; 4 for AMD's mfma4)."),
    seq_lens: str = typer.Option("1,17,300,1000", help="comma-separated sequence lengths (one batch)."),
    fused: bool = typer.Option(False, help="the fused reduce instead of the reduce kernel."),
    fp8_format: Optional[str] = typer.Option(None, help="with an fp8 cache: e4m3fnuz (MI300's encoding, as vLLM "
                                             "writes it on gfx94x; the hip default) or e4m3fn (OCP: gfx950, "
                                             "NVIDIA; the cuda default and only choice)."),
    platform: str = typer.Option("hip", help="hip (the AMD code path, wave64 + MFMA) or cuda (the NVIDIA one, "
                                 "warp32 + mma.sync; not its staged loops)."),
    flags: Optional[str] = typer.Option(None, help="space-separated -D knob definitions of the build, e.g. "
                                        "'-DCPA_K_WHOLE_LINES=0' (not -DCPA_KV_ASYNC / -DCPA_LOAD_ONLY)."),
    shared_steps: bool = typer.Option(False, help="the shared-steps kernel (the workgroups of a sequence take "
                                      "its steps from one counter)."),
    workgroups_at_once: int = typer.Option(1, help="1: workgroups one after another in grid order; more: "
                                           "dispatched in a seeded random order to that many host threads "
                                           "taking turns after every wave-wide operation (1-64)."),
    schedule_seed: int = typer.Option(0, help="the seed of that order and of the turns."),
    turns: str = typer.Option("random", help="random (a random pick after every wave-wide operation) or "
                              "until_blocked (a workgroup runs until it waits at a cluster barrier or ends)."),
    cluster: bool = typer.Option(False, help="the sm_90 cluster combine (--platform cuda; 2-16 partitions): a "
                                 "cluster's workgroups run at once."),
    pdl: bool = typer.Option(False, help="the launches chained as sm_90 makes them (--platform cuda): a kernel "
                             "writing the inputs, the attention kernel and the reduce kernel, each a programmatic "
                             "dependent of the one before, started beside it and waiting at griddepcontrol.wait."),
    memory_model: str = typer.Option("acquire-release", help="acquire-release (a workgroup's partial stores are "
                                     "hidden from the other workgroups until it releases them or its grid ends, "
                                     "and from each of their threads until it has acquired the release), release "
                                     "(hidden until released) or sequential (every store visible at once)."),
) -> None:
    """Run kernel variants on the CPU through the wave emulator (cpa.emu) against
    cpa.reference: the AMD code path executed without an AMD GPU, or the NVIDIA one without an
    NVIDIA GPU (no timing)."""
    from . import emu

    from . import variants as V
    from .validation import FP8_FORMATS, normalize_kv_cache_dtype

    lens, names, sizes = _ints(seq_lens), _strs(tilings), _ints(partition_sizes)
    if dtype not in ("fp16", "bf16") or not lens or min(lens) < 1:
        raise typer.BadParameter("dtype must be fp16 or bf16, and seq_lens must name positive lengths")
    if not names or set(names) - set(V.TILINGS):
        raise typer.BadParameter(f"{tilings!r}: one or more of {', '.join(V.TILINGS)}", param_hint="--tilings")
    if not sizes:
        raise typer.BadParameter("name at least one partition size", param_hint="--partition-sizes")
    normalize_kv_cache_dtype(kv_cache_dtype)
    if platform not in V.PLATFORMS:
        raise typer.BadParameter(f"{platform!r}: one of {', '.join(V.PLATFORMS)}", param_hint="--platform")
    if fp8_format is not None and fp8_format not in FP8_FORMATS:
        raise typer.BadParameter(f"{fp8_format!r}: one of {', '.join(FP8_FORMATS)}", param_hint="--fp8-format")
    try:
        emu.check_schedule(workgroups_at_once, turns, memory_model)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--workgroups-at-once / --turns / --memory-model") from None
    try:
        knob_flags = emu.check_flags((flags or "").split())
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--flags") from None
    typer.echo(f"{'variant':<48} {'wave ops':>9} {'seconds':>8} {'rel err':>9}  verdict")
    bad = ran = 0
    for tiling in names:
        for p in sizes:
            try:
                r = emu.check(tiling, p, dtype=dtype, kv_cache_dtype=kv_cache_dtype, head_size=head_size,
                              block_size=block_size, gqa=gqa, seq_lens=lens, fused_reduce=fused,
                              fp8_format=fp8_format, platform=platform, flags=knob_flags,
                              shared_steps=shared_steps, workgroups_at_once=workgroups_at_once,
                              schedule_seed=schedule_seed, turns=turns, cluster_reduce=cluster, pdl=pdl,
                              memory_model=memory_model)
            except ValueError as e:
                typer.echo(f"{tiling}-p{p}: not a {platform} variant ({e})")
                continue
            except RuntimeError as e:
                typer.echo(f"{tiling}-p{p}: FAILED: {e}")
                bad += 1
                continue
            bad += not r["ok"]
            ran += 1
            typer.echo(f"{r['variant']:<48} {r['wave_ops']:>9} {r['seconds']:>8.2f} {r['rel_err']:>9.2e}  "
                       f"{'ok' if r['ok'] else 'WRONG'}")
    if not ran and not bad:
        typer.echo(f"no {platform} variant of these options exists: nothing ran", err=True)
        raise typer.Exit(2)
    raise typer.Exit(1 if bad else 0)


@_command("export")
def export_tuned(
    from_tables: Optional[str] = typer.Option(None, "--from", help="comma-separated measured tables (sweep parquet "
                                              "or `cpa bench` CSV) of one arch: the tuned result is measured."),
    model: Optional[str] = typer.Option(None, help="an arch (e.g. gfx942) to model instead: the H200-fitted wave "
                                        "model on its compiled resources (cpa.export.from_model)."),
    grid: str = typer.Option("llama70b-decode", help="with --model: the sweep grid whose shapes are modeled."),
    fixed_cost_scale: float = typer.Option(1.0, help="with --model: the fixed costs x this (unknown off the H200)."),
    tilings: Optional[str] = typer.Option(None, help="with --from: comma-separated tilings to choose from."),
    partition_sizes: Optional[str] = typer.Option(None, help="comma-separated partition sizes to choose from (e.g. "
                                                  "the sizes a production build instantiates)."),
    json_out: Optional[str] = typer.Option(None, "--json", help="JSON file to write (atomically)."),
    header_out: Optional[str] = typer.Option(None, "--header", help="C++ header to write (atomically)."),
) -> None:
    """Export tuned partition sizes for a production build: a JSON file (for the Python side:
    cpa.export.lookup) and a C++17 header (cpa_tuned::partition_size and the sizes to
    instantiate), from measured tables or, labelled so, from the wave model."""

    from . import export as E

    if (from_tables is None) == (model is None):
        raise typer.BadParameter("give exactly one of --from (measured tables) and --model (an arch to model)")
    if not (json_out or header_out):
        raise typer.BadParameter("give --json and / or --header: where to write the tuned result")
    if fixed_cost_scale < 0:
        raise typer.BadParameter(f"{fixed_cost_scale}: a scale of the fixed costs, >= 0", param_hint="--fixed-cost-scale")
    _check_writable(json_out, "--json")
    _check_writable(header_out, "--header")
    try:
        sizes = _ints(partition_sizes)
        if from_tables:
            tuned = E.from_table(E.read_tables(_strs(from_tables)), source=from_tables, tilings=_strs(tilings),
                                 partition_sizes=sizes)
        else:
            if tilings:
                raise ValueError("--tilings is for --from; a modeled export takes the arch's default tiling")
            tuned = E.from_model(model, grid=grid, partition_sizes=sizes, fixed_cost_scale=fixed_cost_scale)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise typer.BadParameter(str(e)) from None
    E.write(tuned, json_path=json_out, header_path=header_out)
    typer.echo(f"# {tuned['provenance']['evidence_detail']}")
    for c in tuned["configs"]:
        typer.echo(f"gqa {c['gqa_ratio']:>2} head {c['head_size']:>3} block {c['block_size']:>2} {c['dtype']}/"
                   f"{c['kv_cache_dtype']:<4}: {c['tiling']:<6} {len(c['entries']):>3} shapes, sizes "
                   f"{sorted({e['partition_size'] for e in c['entries']})}; best single {c['fixed_partition_size']} "
                   f"({c['fixed_geomean_slowdown']:.3f}x geomean, worst {c['fixed_worst_slowdown']:.3f}x)")
    typer.echo(f"fallback {tuned['fallback_partition_size']}; instantiate {tuned['partition_sizes']}")
    for f in (json_out, header_out):
        if f:
            typer.echo(f"wrote {f}")
