"""`cpa bench`: the CPA kernel at Llama-3.1-70B TP1 decode shapes, every tiling at every
partition size, beside torch SDPA (cuDNN backend, contiguous K/V) in the same run.

A benchmark, not a test: it prints a table and writes a CSV with provenance. Timing is CUDA-
graph replay over rotating input sets (cpa.timing); bandwidth is K+V read once over the
median time, and its fraction of the read ceiling measured at the start of the same run.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .fsio import write_csv_atomic

LLAMA70B = dict(num_heads=64, num_kv_heads=8, head_size=128, block_size=16)
BATCHES = (1, 8, 32, 128)
CONTEXTS = (512, 2048, 8192, 32768)
POOL_BYTES = 1 << 30  # KV pool per shape (1 GiB), far past the 50 MB L2 of an H100 / H200
MAX_SETS = 16
# The sets one replay touches together cover at least this many bytes of K/V (5x the L2), so a
# small shape's sets are not served from the L2 a replay earlier: up to MAX_SMALL_SETS sets
# where MAX_SETS of them would touch less (1 x 512 tokens: 16 sets were 32 MiB).
MIN_TOUCHED_BYTES = 256 << 20
MAX_SMALL_SETS = 512
BENCH_DATA = Path(__file__).resolve().parent.parent / "data" / "bench"  # shipped tables
EXPERIMENTS = BENCH_DATA / "experiments"  # the A/Bs and earlier runs behind them
# The target 2 (batch <= 8, context >= 8k) over its whole domain on the H200, SDPA in
# the same run: the official count (`bash scripts/h200.sh target2`, data/bench/README.md)
TARGET2_CSV = BENCH_DATA / "h200-target2.csv"


def kv_read_bytes(num_seqs, seq_len, num_kv_heads, head_size, elem_bytes):
    """Bytes of K and V a decode step reads once: what every bandwidth figure here divides by
    (the bench, the readers, their fits). Works on ints and on pandas columns alike."""
    return 2 * num_seqs * seq_len * num_kv_heads * head_size * elem_bytes


@dataclass
class DeviceSets:
    """Input sets for one shape on the GPU: one KV pool, disjoint block tables per set."""

    key_cache: object
    value_cache: object
    queries: list
    block_tables: list
    seq_lens: object
    scale: float
    kv_bytes_per_set: int
    # the caches' fp8 scales (1 for make_sets' caches and _fp8_sets'; an fp8 point timed on its
    # verification inputs keeps theirs)
    k_scale: float = 1.0
    v_scale: float = 1.0


BLOCK_ORDERS = ("shuffled", "sequential")


def check_block_order(block_order: str) -> None:
    if block_order not in BLOCK_ORDERS:
        raise ValueError(f"block_order={block_order!r}: expected one of {BLOCK_ORDERS}")


def pool_size(num_seqs, blocks_per_seq, block_bytes, pool_bytes=None) -> tuple[int, int]:
    """(physical blocks in the pool, input sets): the pool covers >= pool_bytes (POOL_BYTES,
    far past the L2) and holds disjoint sets of the shape's blocks: MAX_SETS of them, or more
    (up to MAX_SMALL_SETS) where MAX_SETS would touch fewer than MIN_TOUCHED_BYTES."""
    need = num_seqs * blocks_per_seq
    pool = max(need, math.ceil((pool_bytes or POOL_BYTES) / block_bytes))
    want = max(MAX_SETS, min(MAX_SMALL_SETS, math.ceil(MIN_TOUCHED_BYTES / (need * block_bytes))))
    return pool, max(1, min(want, pool // need))


def block_tables(pool, num_seqs, blocks_per_seq, n_sets, block_order, generator) -> list:
    """Disjoint int32 block tables [num_seqs, blocks_per_seq], one per set, drawn from the pool
    in shuffled or sequential order."""
    import torch

    need = num_seqs * blocks_per_seq
    dev = generator.device
    perm = torch.randperm(pool, device=dev, generator=generator) if block_order == "shuffled" else \
        torch.arange(pool, device=dev)
    return [perm[i * need:(i + 1) * need].view(num_seqs, blocks_per_seq).to(torch.int32).contiguous()
            for i in range(n_sets)]


def sets_layout(num_seqs, seq_len, *, num_kv_heads, head_size, block_size, dtype) -> tuple[int, int, int]:
    """(blocks per sequence, physical blocks in the pool, input sets) that make_sets draws for a
    shape (``dtype``: the caches' torch dtype)."""
    bps = math.ceil(seq_len / block_size)
    return (bps, *pool_size(num_seqs, bps, 2 * num_kv_heads * head_size * block_size * dtype.itemsize))


def make_sets(num_seqs, seq_len, *, num_heads, num_kv_heads, head_size, block_size, dtype, seed=0,
              block_order="shuffled") -> DeviceSets:
    """``block_order``: "shuffled" (each sequence's blocks drawn at random from the pool, as a
    serving engine's allocator leaves them) or "sequential" (each sequence's blocks consecutive
    in the pool: the paged cache laid out as SDPA's contiguous K/V would be, which isolates what
    paging costs the memory system)."""
    check_block_order(block_order)
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    elem = dtype.itemsize
    x = 16 // elem
    bps, pool, n_sets = sets_layout(num_seqs, seq_len, num_kv_heads=num_kv_heads, head_size=head_size,
                                    block_size=block_size, dtype=dtype)
    kc = torch.randn(pool, num_kv_heads, head_size // x, block_size, x, device="cuda", dtype=dtype, generator=g)
    vc = torch.randn(pool, num_kv_heads, head_size, block_size, device="cuda", dtype=dtype, generator=g)
    bts = block_tables(pool, num_seqs, bps, n_sets, block_order, g)
    qs = [torch.randn(num_seqs, num_heads, head_size, device="cuda", dtype=dtype, generator=g) for _ in range(n_sets)]
    seq_lens = torch.full((num_seqs,), seq_len, device="cuda", dtype=torch.int32)
    kv_bytes = kv_read_bytes(num_seqs, seq_len, num_kv_heads, head_size, elem)
    return DeviceSets(kc, vc, qs, bts, seq_lens, 1.0 / math.sqrt(head_size), kv_bytes)


def contiguous_kv(sets: DeviceSets, i: int, seq_len: int):
    """K, V of set i as [num_seqs, num_kv_heads, seq_len, head_size] (what SDPA takes)."""
    bt = sets.block_tables[i].long()
    S, bps = bt.shape
    kc, vc = sets.key_cache, sets.value_cache
    _, kvh, dx, blk, x = kc.shape
    k = kc[bt].permute(0, 2, 1, 4, 3, 5).reshape(S, kvh, bps * blk, dx * x)[:, :, :seq_len]
    v = vc[bt].permute(0, 2, 1, 4, 3).reshape(S, kvh, bps * blk, dx * x)[:, :, :seq_len]
    return k.contiguous(), v.contiguous()


def bench_config(*, tilings, partition_sizes, dtype_name, replays, sdpa, fused, cluster, shared,
                 block_order, default=False) -> str:
    """The options that decide which rows a shape gets and how they are timed, as one JSON
    string stored in every row: a resumed run must continue with the same ones."""
    return json.dumps(dict(tilings=list(tilings), partition_sizes=[int(p) for p in partition_sizes],
                           dtype=dtype_name, replays=int(replays), sdpa=bool(sdpa), fused=bool(fused),
                           cluster=bool(cluster), shared=bool(shared), block_order=block_order,
                           **({"default": True} if default else {}), settle=SETTLE),
                      sort_keys=True)


def resume_state(out_csv, config: str, commit: str):
    """The rows already in ``out_csv`` and the (num_seqs, max_seq_len) shapes they finished.
    The bench writes the file only after a whole shape (every variant and SDPA), so a shape
    present is complete. Refuses (ValueError, before any GPU work) a file written with other
    options or by other code: one table is one configuration of one commit."""
    import pandas as pd

    if not out_csv:
        raise ValueError("resume needs the CSV to continue (out_csv / --out)")
    if not os.path.exists(out_csv):
        return None, set()
    try:
        old = pd.read_csv(out_csv)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise ValueError(f"{out_csv}: not a bench CSV ({type(e).__name__}: {e}); use another --out or run "
                         "without --resume to overwrite it")
    if "bench_config" not in old:
        raise ValueError(f"{out_csv}: no bench_config column (written before --resume existed); "
                         "use another --out or run without --resume to overwrite it")
    torn = old[old.bench_config.isna() | old.git_commit.isna()]
    if len(torn):  # (the bench writes whole files atomically: an edited or damaged file)
        shapes = sorted({(int(b), int(c)) for b, c in zip(torn.num_seqs, torn.max_seq_len) if b == b and c == c})
        raise ValueError(f"{out_csv}: {len(torn)} rows without bench_config or git_commit (a damaged file?), at "
                         f"shapes {shapes}; use another --out or run without --resume to overwrite it")
    configs = set(old.bench_config.dropna())
    if configs != {config}:
        raise ValueError(f"{out_csv} was written with other options ({sorted(configs)}); this run: {config}. "
                         "Use another --out, the same options, or run without --resume to overwrite it")
    commits = set(old.git_commit.astype(str))
    if commits != {commit}:
        raise ValueError(f"{out_csv} holds rows of commit {sorted(commits)}; this run is {commit}: "
                         "one table is one commit's code (use another --out, or run without --resume)")
    return old, set(zip(old.num_seqs.astype(int), old.max_seq_len.astype(int)))


def run(*, batches=BATCHES, contexts=CONTEXTS, tilings=None, partition_sizes=None, dtype_name="fp16",
        replays=30, sdpa=True, fused=True, cluster=True, shared=True, out_csv=None, progress=True,
        block_order="shuffled", resume=False, default=True):
    """``resume``: keep the shapes already in ``out_csv`` (same options, same commit) and
    measure the others -- a bench longer than one sitting (or a device call) runs in pieces.
    ``default``: one more row per shape, ``default_path`` True: the launch with partition size,
    tiling and combine all left to the launcher (its choices in the row's columns)."""
    import torch

    from . import ceilings, reference, variants as V
    from .jit import device_arch
    from .ops import prepare
    from .provenance import git_commit, provenance
    from .timing import SETTLE_US, Settling, settle_read, time_graph

    check_block_order(block_order)  # before any GPU work
    if SETTLE not in SETTLES:
        raise ValueError(f"cpa.bench.SETTLE = {SETTLE!r}: one of {', '.join(SETTLES)}")
    bad = [x for x in (*batches, *contexts) if int(x) < 1]
    if bad or not batches or not contexts:
        raise ValueError(f"batches={tuple(batches)}, contexts={tuple(contexts)}: expected positive sizes")
    tilings = tuple(tilings or V.TILINGS)
    partition_sizes = tuple(partition_sizes or V.PARTITION_SIZES)
    if dtype_name not in ("fp16", "bf16"):
        raise ValueError(f"dtype_name={dtype_name!r}: expected 'fp16' or 'bf16'")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
    config = bench_config(tilings=tilings, partition_sizes=partition_sizes, dtype_name=dtype_name, replays=replays,
                          sdpa=sdpa, fused=fused, cluster=cluster, shared=shared, block_order=block_order,
                          default=default)
    commit = git_commit(ignore=(os.fspath(out_csv),) if out_csv else ())  # (the table's own changes are not code)
    old, done = resume_state(out_csv, config, commit) if resume else (None, set())
    if done and all((b, c) in done for b in batches for c in contexts):
        print(f"# {out_csv}: every shape already measured (nothing to resume)")
        return old, dict(read_gbps=float(old.read_gbps_ceiling.iloc[-1]), copy_gbps=float(old.copy_gbps_ceiling.iloc[-1]))
    prov = dict(provenance(), git_commit=commit)
    platform, arch = device_arch()
    ceil = ceilings.measure()
    read_gbps = ceil["read_gbps"]
    print(f"# {prov['device_name']} ({arch}), driver {prov['driver_version']}, torch {prov['torch_version']}, "
          f"commit {prov['git_commit']}")
    print(f"# ceilings this run: read {read_gbps:.0f} GB/s ({ceil['read_method']}), copy {ceil['copy_gbps']:.0f} GB/s")
    if ceil.get("read_gbps_by_shape"):
        print("# read shapes (GB/s): " + ", ".join(f"{k} {v:.0f}" for k, v in ceil["read_gbps_by_shape"].items()))
    rows = []
    # (fused_reduce, cluster_reduce, shared_steps): the reduce launch over fixed partitions, each
    # in-kernel combine asked for, and the reduce launch over shared steps
    modes = [(False, False, False)] + [(True, False, False)] * bool(fused) + [(False, True, False)] * bool(cluster) \
        + [(False, False, True)] * bool(shared)
    shapes = [(b, c) for b in batches for c in contexts if (b, c) not in done]
    if done:
        print(f"# resuming {out_csv}: {len(done)} shapes already measured, {len(shapes)} to go")
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(shapes) * (len(tilings) * len(partition_sizes) * len(modes) + int(sdpa) + int(default)),
                   desc="bench",
                   unit="run")
    for b, ctx in shapes:
        sets = make_sets(b, ctx, dtype=dtype, block_order=block_order, **LLAMA70B)
        base = dict(num_seqs=b, max_seq_len=ctx, block_order=block_order, num_heads=LLAMA70B["num_heads"],
                    num_kv_heads=LLAMA70B["num_kv_heads"], head_size=LLAMA70B["head_size"],
                    block_size=LLAMA70B["block_size"], dtype=dtype_name, kv_cache_dtype="auto",
                    n_sets=len(sets.queries), kv_bytes=sets.kv_bytes_per_set)
        args0 = dict(query=sets.queries[0], key_cache=sets.key_cache, value_cache=sets.value_cache,
                     block_tables=sets.block_tables[0], seq_lens=sets.seq_lens, scale=sets.scale)
        ref = reference.paged_attention(**args0)
        tol = reference.REL_ERR_TOL[dtype]
        # the shape's first timing after its inputs were written reads slow unless it settles
        # (cpa.timing.SETTLE_US); SETTLE says how: "warmup" (that timing's warm-up is SETTLE_US
        # long), "read" (the K/V pool read for SETTLE_US first), "sleep", "none"
        settling = Settling(SETTLE == "warmup")
        if SETTLE == "read":
            settle_read([sets.key_cache, sets.value_cache])
        elif SETTLE == "sleep":
            time.sleep(SETTLE_US * 1e-6)

        def timed(calls):
            return time_graph(calls, replays=replays, warmup_us=settling.warmup_us())

        def measure(row, **how):
            """Prepare one launch per input set as `how` says, verify set 0 against the
            reference, time them (graph replay) and fill `row`; the first Launch."""
            try:
                launches = [prepare(query=q, key_cache=sets.key_cache, value_cache=sets.value_cache,
                                    block_tables=bt, seq_lens=sets.seq_lens, scale=sets.scale, max_seq_len=ctx,
                                    check_values=(i == 0), **how)
                            for i, (q, bt) in enumerate(zip(sets.queries, sets.block_tables))]
            except ValueError as e:  # not a variant of this platform
                row.update(error=str(e))
                return None
            out0 = launches[0]()
            torch.cuda.synchronize()
            err = reference.relative_error(out0, ref, per_seq=True)
            first = launches[0]
            k = first.kernel
            in_kernel = first.fused_reduce or first.cluster > 0
            t_all = timed([l.__call__ for l in launches])
            t_attn = t_all if in_kernel else timed([l.attention for l in launches])
            t_red = timed([l.reduce for l in launches]) \
                if first.reduce_args is not None else None
            S, H, D, NP = b, LLAMA70B["num_heads"], LLAMA70B["head_size"], first.num_partitions
            partial_bytes = 0 if (NP == 1 or first.cluster) else 2 * S * H * NP * (D + 2) * 4
            total_bytes = sets.kv_bytes_per_set + 2 * S * H * D * 2 + partial_bytes
            row.update(t_all.as_dict(), attn_time_us=t_attn.median_us,
                       reduce_time_us=t_red.median_us if t_red else 0.0, num_partitions=NP,
                       bytes=total_bytes, gbps=sets.kv_bytes_per_set / (t_all.median_us * 1e-6) / 1e9,
                       verified=bool(err <= tol), max_rel_err=err, build_from_cache=k.from_cache,
                       build_seconds=k.build_seconds)
            row["frac_peak_bw"] = row["gbps"] / read_gbps
            return first

        for tiling, P, (fz, cl, sh) in [(t, p, f) for t in tilings for p in partition_sizes for f in modes]:
            row = dict(base, tiling=tiling, partition_size=P, fused_reduce=fz, cluster_reduce=cl, shared_steps=sh,
                       default_path=False)
            # one partition: nothing to fuse or share; a cluster only where the arch and partition
            # count allow; shared steps where the partition has two steps per wave
            if ((fz or sh) and math.ceil(ctx / P) == 1) or (cl and V.cluster_unsupported(arch, math.ceil(ctx / P))) \
                    or (sh and _shared_unsupported(tiling, P, platform)):
                if bar:
                    bar.update(1)
                continue
            measure(row, partition_size=P, tiling=tiling, fused_reduce=fz, cluster_reduce=cl, shared_steps=sh)
            rows.append(row)
            if bar:
                bar.update(1)
        if default:
            # the launch a caller gets with no choice made (partition_size, tiling and the
            # combine all None): what the launcher picks, measured rather than read off the rows
            row = dict(base, default_path=True)
            first = measure(row)
            if first is not None:
                row.update(tiling=first.kernel.variant.tiling, partition_size=first.shape.partition_size,
                           fused_reduce=bool(first.fused_reduce), cluster_reduce=first.cluster > 0,
                           shared_steps=False)
            rows.append(row)
            if bar:
                bar.update(1)
        if sdpa:
            rows.append(_sdpa_row(sets, ctx, base, ref, tol, replays, read_gbps, timed))
            if bar:
                bar.update(1)
        sets = ref = None  # (free the shape's tensors before the next; measure() closes over both)
        torch.cuda.empty_cache()
        if out_csv:  # after every shape: an interrupted run keeps what it measured
            write_csv_atomic(_frame(rows, prov, ceil, arch, config, old), out_csv)
    if bar:
        bar.close()
    df = _frame(rows, prov, ceil, arch, config, old)
    if out_csv:
        write_csv_atomic(df, out_csv)
    return df, ceil


# How each shape's first timing settles (run(); cpa.timing.SETTLE_US): "warmup", "read",
# "sleep" or "none" (the arms of scripts/h200.sh firstlaunch)
SETTLE = "warmup"
SETTLES = ("warmup", "read", "sleep", "none")


def _shared_unsupported(tiling, partition_size, platform) -> bool:
    from . import variants as V

    try:
        v = V.variant_for(tiling=tiling, partition_size=partition_size, platform=platform, **VARIANT_AXES)
    except ValueError:
        return False  # not a variant: prepare() says so in the row
    return V.shared_steps_unsupported(v) is not None


# the bench shape's variant axes (every tiling and partition size at these; jobs.bench_variants)
VARIANT_AXES = dict(head_size=LLAMA70B["head_size"], block_size=LLAMA70B["block_size"], dtype="fp16",
                     kv_cache_dtype="auto", gqa_ratio=LLAMA70B["num_heads"] // LLAMA70B["num_kv_heads"])


def _frame(rows, prov, ceil, arch, config=None, old=None):
    """This run's rows with its provenance and ceilings, after the rows of the runs it resumed
    (which keep theirs: frac_peak_bw is always against the ceiling of the row's own run)."""
    import pandas as pd

    df = pd.DataFrame(rows)
    for kk, vv in prov.items():
        df[kk] = vv
    df["read_gbps_ceiling"] = ceil["read_gbps"]
    df["copy_gbps_ceiling"] = ceil["copy_gbps"]
    df["arch"] = arch
    if config is not None:
        df["bench_config"] = config
    if old is not None and len(old):
        df = pd.concat([old, df], ignore_index=True) if len(df) else old.copy()
    return df


def sdpa_cudnn(q, k, v, scale):
    """The peer as the bench runs it: torch SDPA's cuDNN backend, q [S, H, 1, D] over contiguous
    K/V [S, KVH, ctx, D] with the query heads grouped over the KV heads."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)


def sdpa_calls(sets: DeviceSets, seq_len: int):
    """(calls, outs): one cuDNN SDPA call per input set over that set's contiguous K/V (what SDPA
    is timed on, rotating as the kernel's sets do), each writing its [S, H, 1, D] output to outs[i]."""
    kvs = [contiguous_kv(sets, i, seq_len) for i in range(len(sets.queries))]
    qs = [q.unsqueeze(2) for q in sets.queries]  # [S, H, 1, D]
    outs = [None] * len(qs)

    def call(i):
        def f():
            outs[i] = sdpa_cudnn(qs[i], kvs[i][0], kvs[i][1], sets.scale)
        return f

    return [call(i) for i in range(len(qs))], outs


def _sdpa_row(sets, ctx, base, ref, tol, replays, read_gbps, timed):
    import torch

    from . import reference

    row = dict(base, tiling="sdpa_cudnn", partition_size=0)
    try:
        calls, outs = sdpa_calls(sets, ctx)
        calls[0]()
        torch.cuda.synchronize()
        err = reference.relative_error(outs[0].squeeze(2), ref, per_seq=True)
        t = timed(calls)
        row.update(t.as_dict(), attn_time_us=t.median_us, reduce_time_us=0.0, num_partitions=1,
                   bytes=sets.kv_bytes_per_set + 2 * sets.queries[0].numel() * 2,
                   gbps=sets.kv_bytes_per_set / (t.median_us * 1e-6) / 1e9, verified=bool(err <= tol),
                   max_rel_err=err)
        row["frac_peak_bw"] = row["gbps"] / read_gbps
    except Exception as e:  # cuDNN missing or refusing the shape: say so in the table
        row.update(error=f"{type(e).__name__}: {e}"[:300])
    return row


def _verified(df):
    """The timed rows that passed verification (a row that failed, or has no verdict, is no time)."""
    d = df[df.time_us.notna()]
    if "error" in d:
        d = d[d.error.isna()]
    return d[d.verified.fillna(False).astype(bool)] if "verified" in d else d


def _sdpa_times(df):
    """SDPA's verified time per (num_seqs, max_seq_len)."""
    return _verified(df[df.tiling == "sdpa_cudnn"]).set_index(["num_seqs", "max_seq_len"]).time_us


def summary_table(df):
    """One line per shape: the best verified CPA launch (the `default_path` row included, as in
    `vs_sdpa`, target 2's count), the fixed 256 choice, SDPA. `all_verified`: every CPA row of
    the shape passed (failed rows are never a shape's best)."""
    import pandas as pd

    lines = []
    for (b, ctx), g in df[df.time_us.notna()].groupby(["num_seqs", "max_seq_len"]):
        cpa_all = g[g.tiling != "sdpa_cudnn"]
        cpa_rows = _verified(cpa_all)
        sd = _verified(g[g.tiling == "sdpa_cudnn"])
        if not len(cpa_rows):
            continue
        best = cpa_rows.loc[cpa_rows.time_us.idxmin()]
        cpa_rows = _explicit(cpa_rows)
        p256 = cpa_rows[(cpa_rows.partition_size == 256) & (cpa_rows.tiling == best.tiling)]
        p256 = p256.sort_values("time_us")
        label = _variant_label(best) + (" (default)" if _flag(best, "default_path") else "")
        line = dict(batch=b, context=ctx, best=label,
                    best_us=round(best.time_us, 1), best_bw=f"{best.frac_peak_bw:.0%}",
                    p256_us=round(float(p256.time_us.iloc[0]), 1) if len(p256) else None)
        if len(sd):
            s = sd.iloc[0]
            line.update(sdpa_us=round(s.time_us, 1), sdpa_bw=f"{s.frac_peak_bw:.0%}",
                        speedup_vs_sdpa=round(s.time_us / best.time_us, 3))  # (0.9965 is not "1.00")
        line["all_verified"] = bool(cpa_all.verified.fillna(False).astype(bool).all()) if "verified" in cpa_all \
            else True
        lines.append(line)
    return pd.DataFrame(lines)


def sdpa_gap(df):
    """Where the time against SDPA goes, per shape of a bench CSV with SDPA rows: among the
    verified CPA rows that launch the reduce kernel after the attention (fixed partitions, no
    fused / cluster combine, no shared steps), the fastest (`time_us`, its `partition_size`) and
    its own attention kernel's time (`attn_time_us`); `combine_us` = the difference, what the
    reduce adds to the critical path (PDL overlaps the rest); `best_attn_us` the fastest
    attention kernel alone at any partition size; `vs_sdpa` = SDPA time / `time_us` (> 1:
    faster than SDPA) and `attn_vs_sdpa` = SDPA time / `best_attn_us`, the ratio if the combine
    cost nothing."""
    import pandas as pd

    d, _ = _kernel_rows(df)
    d = d[~d[["fused_reduce", "cluster_reduce", "shared_steps"]].any(axis=1) & d.attn_time_us.notna()]
    sdpa = _sdpa_times(df)
    rows = []
    for (b, ctx), g in d.groupby(["num_seqs", "max_seq_len"]):
        if (b, ctx) not in sdpa.index:
            continue
        r = g.loc[g.time_us.idxmin()]
        s, attn = float(sdpa.loc[(b, ctx)]), float(g.attn_time_us.min())
        rows.append(dict(num_seqs=int(b), max_seq_len=int(ctx), tiling=r.tiling, partition_size=int(r.partition_size),
                         time_us=float(r.time_us), attn_time_us=float(r.attn_time_us),
                         combine_us=float(r.time_us - r.attn_time_us), best_attn_us=attn, sdpa_us=s,
                         vs_sdpa=s / float(r.time_us), attn_vs_sdpa=s / attn))
    return pd.DataFrame(rows)


def vs_sdpa(df):
    """Target 2's count per shape of a bench CSV with SDPA rows: SDPA's time over the fastest
    verified CPA launch of any combine, the `default_path` row included (it is a launch a user
    gets); > 1 is faster than SDPA. A Series indexed by (num_seqs, max_seq_len)."""
    d = _verified(df[df.tiling != "sdpa_cudnn"])
    sdpa = _sdpa_times(df)
    best = d.groupby(["num_seqs", "max_seq_len"]).time_us.min()
    return (sdpa / best).dropna().rename("vs_sdpa")


# Shapes with at least this many tokens in the batch stream (their times lie within about 1%
# of a line in every shipped H200 / H100 run); smaller ones are latency-bound and bend it.
STREAMING_MIN_TOKENS = 131072


def fit_line(kv_bytes, time_us) -> tuple[float, float, float]:
    """Least squares of time_us = fixed + kv_bytes / rate: (fixed us, rate GB/s, largest
    relative residual)."""
    import numpy as np

    b, t = np.asarray(kv_bytes, float), np.asarray(time_us, float)
    a = np.vstack([np.ones(len(b)), b]).T
    (fixed, per_byte), *_ = np.linalg.lstsq(a, t, rcond=None)
    return float(fixed), 1e-3 / float(per_byte), float(np.abs(a @ [fixed, per_byte] / t - 1).max())


def streaming_points(df, min_tokens: int = 0) -> dict:
    """{arm: (points, rows)} for the two arms of a bench CSV, ``cpa_best`` (the fastest verified
    CPA row of each shape) and ``sdpa_cudnn``, over the shapes with at least ``min_tokens``
    tokens in the batch: ``points`` one row per shape (num_seqs, max_seq_len, ``t`` its time in
    us, ``b`` its K/V bytes), ``rows`` the arm's rows behind them (for their read ceilings).
    What streaming_fit fits and plots.streaming_lines draws."""
    d, _ = _kernel_rows(df)
    arms = {"cpa_best": d, "sdpa_cudnn": _verified(df[df.tiling == "sdpa_cudnn"])}
    out = {}
    for arm, g in arms.items():
        g = g[g.num_seqs * g.max_seq_len >= min_tokens]
        best = g.groupby(["num_seqs", "max_seq_len"]).agg(t=("time_us", "min"), b=("kv_bytes", "first")).reset_index()
        out[arm] = (best, g)
    return out


def streaming_fit(df, min_tokens: int = STREAMING_MIN_TOKENS):
    """time = fixed_us + kv_bytes / marginal rate, fitted by least squares over the shapes of a
    bench CSV with at least ``min_tokens`` tokens in the batch (num_seqs x max_seq_len; default
    STREAMING_MIN_TOKENS), once for the fastest verified CPA row per shape and once for SDPA
    (streaming_points). A decode step at these shapes is a
    streaming read, so the two numbers split a time into what does not grow with the context
    (launches, the first loads' latency, the combine, the tail) and the rate at which the bytes
    then stream. One row per arm: ``fixed_us``, ``marginal_gbps``, ``frac_read_ceiling`` (of the
    run's read ceiling), the largest relative residual and the number of shapes; plus
    ``crossover_tokens`` on the CPA row: the batch's tokens above which SDPA's line is below
    the kernel's (NaN where the lines do not cross the right way round)."""
    import pandas as pd

    rows = []
    for arm, (best, g) in streaming_points(df, min_tokens).items():
        if len(best) < 2:
            continue
        fixed, rate, resid = fit_line(best.b, best.t)
        ceil = float(g.read_gbps_ceiling.median()) if "read_gbps_ceiling" in g else float("nan")
        per_token = float((best.b / (best.num_seqs * best.max_seq_len)).median())
        rows.append(dict(arm=arm, fixed_us=float(fixed), marginal_gbps=rate, frac_read_ceiling=rate / ceil,
                         max_rel_residual=resid, shapes=len(best), per_token_bytes=per_token))
    out = pd.DataFrame(rows)
    if set(out.get("arm", [])) >= {"cpa_best", "sdpa_cudnn"}:
        c, s = (out.set_index("arm").loc[a] for a in ("cpa_best", "sdpa_cudnn"))
        # fixed_c + x / rate_c = fixed_s + x / rate_s  (x in bytes, rates in bytes per us)
        slower = 1 / (c.marginal_gbps * 1e3) - 1 / (s.marginal_gbps * 1e3)
        x = (s.fixed_us - c.fixed_us) / slower if slower > 0 and s.fixed_us > c.fixed_us else float("nan")
        out["crossover_tokens"] = [x / c.per_token_bytes if a == "cpa_best" else float("nan") for a in out.arm]
    return out


def combine_costs(df):
    """What each way of combining partitions adds to the attention kernel's own time, per
    (tiling, shape, partition size) of a bench CSV that has both the reduce-launch row (fixed
    partitions, no cluster combine or shared steps; its `attn_time_us` is the attention kernel
    alone) and the fused-reduce row: `reduce_us` = reduce-launch time minus attention alone,
    `fused_us` = fused time minus the same attention time, `num_partitions` of the longest
    sequence. Only verified rows; shapes of one partition (nothing to combine) are left out."""
    import pandas as pd

    d, _ = _kernel_rows(df)
    d = d[~d.cluster_reduce & ~d.shared_steps]
    keys = ["tiling", "num_seqs", "max_seq_len", "partition_size"]
    red = d[~d.fused_reduce & d.attn_time_us.notna()].set_index(keys)
    fz = d[d.fused_reduce].set_index(keys)
    both = red.index.intersection(fz.index)
    out = pd.DataFrame(index=both).reset_index()
    out["num_partitions"] = -(-out.max_seq_len // out.partition_size)
    attn = red.loc[both, "attn_time_us"].to_numpy()
    out["attn_time_us"] = attn
    out["reduce_us"] = red.loc[both, "time_us"].to_numpy() - attn
    out["fused_us"] = fz.loc[both, "time_us"].to_numpy() - attn
    return out[out.num_partitions > 1].reset_index(drop=True)


def _flag(row, name: str) -> bool:
    v = row.get(name, False)
    return bool(v) if v == v and v is not None else False  # (NaN in CSVs that predate the column)


def _variant_label(row) -> str:
    """tiling/partition_size with the row's in-kernel combine or shared steps, e.g. mfma16/1024+fused."""
    return (f"{row.tiling}/{int(row.partition_size)}" + "+fused" * _flag(row, "fused_reduce")
            + "+cluster" * _flag(row, "cluster_reduce") + "+shared" * _flag(row, "shared_steps"))


def best_fixed_choice(df):
    """The (tiling, partition_size, fused_reduce, cluster_reduce, shared_steps) with the
    smallest geometric-mean slowdown against the per-shape best over all benchmarked shapes:
    the one-entry device default. Returns (choice dict, DataFrame of every candidate's geomean
    and worst slowdown)."""
    import numpy as np
    import pandas as pd

    d = _explicit(df)
    d = d[(d.tiling != "sdpa_cudnn") & d.time_us.notna()].copy()
    modes = ["fused_reduce", "cluster_reduce", "shared_steps"]
    for col in modes:
        if col not in d:
            d[col] = False
        d[col] = d[col].fillna(False).astype(bool)
    best = d.groupby(["num_seqs", "max_seq_len"]).time_us.transform("min")
    d["slowdown"] = d.time_us / best
    # a shape where a mode has no row (one partition, or too many for a cluster) is stood for by
    # the same variant's reduce-launch row over fixed partitions
    rows = []
    for (t, p, f, c, sh), g in d.groupby(["tiling", "partition_size", *modes]):
        alt = d[(d.tiling == t) & (d.partition_size == p) & ~d[modes].any(axis=1)]
        g = pd.concat([g, alt[~alt.set_index(["num_seqs", "max_seq_len"]).index.isin(
            g.set_index(["num_seqs", "max_seq_len"]).index)]]) if (f or c or sh) else g
        rows.append(dict(tiling=t, partition_size=int(p), fused_reduce=bool(f), cluster_reduce=bool(c),
                         shared_steps=bool(sh), shapes=len(g), geomean_slowdown=float(np.exp(np.log(g.slowdown).mean())),
                         worst_slowdown=float(g.slowdown.max())))
    table = pd.DataFrame(rows).sort_values("geomean_slowdown").reset_index(drop=True)
    full = table[table.shapes == table.shapes.max()]
    return full.iloc[0].to_dict(), table


SHAPE_KEYS = ("num_seqs", "max_seq_len", "num_heads", "num_kv_heads", "head_size", "block_size", "dtype",
              "kv_cache_dtype", "seq_lens_dist")


def _explicit(df):
    """The rows of variants named by the bench (without the `default_path` rows: those repeat
    one of them, chosen by the launcher)."""
    if "default_path" not in df:
        return df
    return df[~df.default_path.fillna(False).astype(bool)]


def default_path(df):
    """The measured default per shape of a bench CSV with `default_path` rows: what the launcher
    picked (tiling, partition size, combine), its time, the shape's best named variant and
    slowdown = default / best, and vs_sdpa = SDPA time / default time where the table has SDPA."""
    import pandas as pd

    if "default_path" not in df:
        return pd.DataFrame()
    dflt = df[df.default_path.fillna(False).astype(bool) & df.time_us.notna()]
    if "verified" in dflt:
        dflt = dflt[dflt.verified.fillna(False).astype(bool)]
    d, _ = _kernel_rows(df)
    sdpa = _sdpa_times(df)
    rows = []
    for _, r in dflt.iterrows():
        g = d[(d.num_seqs == r.num_seqs) & (d.max_seq_len == r.max_seq_len)]
        if not len(g):
            continue
        best = g.loc[g.time_us.idxmin()]
        key = (r.num_seqs, r.max_seq_len)
        rows.append(dict(num_seqs=int(r.num_seqs), max_seq_len=int(r.max_seq_len), tiling=r.tiling,
                         partition_size=int(r.partition_size), fused_reduce=_flag(r, "fused_reduce"),
                         cluster_reduce=_flag(r, "cluster_reduce"), time_us=float(r.time_us),
                         best=_variant_label(best), best_time_us=float(best.time_us),
                         slowdown=float(r.time_us) / float(best.time_us),
                         vs_sdpa=float(sdpa.loc[key]) / float(r.time_us) if key in sdpa.index else float("nan")))
    return pd.DataFrame(rows)


def _kernel_rows(df):
    """(the verified, timed CPA rows of a bench CSV or sweep table with the three combine
    flags as booleans, False where the table lacks one; the shape keys the table has)."""
    from . import variants as V

    d = _explicit(df)
    d = d[(d.tiling != "sdpa_cudnn") & d.tiling.isin(V.TILINGS) & d.time_us.notna()].copy()
    if "verified" in d:
        d = d[d.verified.fillna(False).astype(bool)]
    for col in ("fused_reduce", "cluster_reduce", "shared_steps"):
        d[col] = d[col].fillna(False).astype(bool) if col in d else False
    return d, [k for k in SHAPE_KEYS if k in d]


def by_shape_choice(df, arch: str = "sm_90", *, compute_units: int | None = None, resident_per_sm=None,
                    fused: bool = False, model=None):
    """What the shape-chosen default (cpa.variants BY_SHAPE) picks for each measured shape of a
    bench CSV or sweep table, and how its measured time compares with the shape's best.

    For each shape: the default tiling and the partition size cpa.occupancy.partition_by_wave_model
    picks (the launcher's rule: cpa.ops.select_variant), with the combine a default call takes
    where the table has the column (cluster_reduce per cpa.variants.cluster_default; a table
    without it, as the sweeps, has reduce-launch rows only; no shared steps). fused=True also
    takes the fused reduce where cpa.variants.fused_default does (and the table has the row):
    for tables of kernels with the one-round combine (f69733a on); the shipped H200 tables of
    earlier commits hold the earlier combine's fused rows, so they are read without it.
    `resident_per_sm(variant) -> int` defaults to the occupancy of
    the variant's row in the shipped ``data/static/<arch>.csv`` (the compiled registers and
    shared memory; cpa.occupancy.resident_workgroups). `compute_units` defaults to the arch's
    device (cpa.hardware). Returns one row per shape: the choice, its time, the best time of
    any CPA row of the shape and which variant that was, slowdown = choice / best. The
    candidates are cpa.variants.partition_candidates less the sizes the table did not measure.
    `model`: a cpa.occupancy.WaveModel to pick with instead of the arch's (SHAPE_MODELS), e.g.
    one refitted to another card's table (:func:`refit_shape_model`)."""
    import pandas as pd

    from . import hardware as hw
    from . import occupancy as O
    from . import variants as V

    model = model or O.shape_model(arch)
    if model is None:
        raise ValueError(f"no wave model for arch {arch!r} (cpa.variants.SHAPE_MODELS)")
    spec = hw.spec_for(arch)
    compute_units = compute_units or spec.compute_units
    platform = V.platform_of_arch(arch)
    resident_per_sm = resident_per_sm or O.static_resident(arch, spec)

    # a table without cluster rows (the sweeps; a bench run with --no-cluster) timed every row
    # with the reduce launch or the fused reduce
    d, keys = _kernel_rows(df)
    has_cluster = bool(d.cluster_reduce.any())
    rows = []
    for key, g in d.groupby(keys):
        shape = dict(zip(keys, key))
        S, L, kvh = int(shape["num_seqs"]), int(shape["max_seq_len"]), int(shape["num_kv_heads"])
        gqa = int(shape["num_heads"]) // kvh
        tiling, part, _ = V.default_choice(arch, gqa, shape["dtype"], shape["kv_cache_dtype"])
        if part != V.BY_SHAPE:
            raise ValueError(f"arch {arch!r}: the default partition size is a fixed {part}, not chosen by shape")
        axes = dict(tiling=tiling, head_size=int(shape["head_size"]), block_size=int(shape["block_size"]),
                    dtype=shape["dtype"], kv_cache_dtype=shape["kv_cache_dtype"], gqa_ratio=gqa, platform=platform)
        cands = V.partition_candidates(max_seq_len=L, **axes)
        cands = [p for p in cands if ((g.partition_size == p) & (g.tiling == tiling)).any()] or cands
        per_sm = resident_per_sm(V.variant_for(partition_size=cands[0], **axes))
        p = O.partition_by_wave_model(model, cands, num_seqs=S, num_heads=int(shape["num_heads"]), num_kv_heads=kvh,
                                      head_size=int(shape["head_size"]), max_seq_len=L,
                                      kv_elem_bytes=1 if shape["kv_cache_dtype"] == "fp8" else 2,
                                      slots=per_sm * compute_units, compute_units=compute_units)
        cluster = V.cluster_default(arch, -(-L // p), S, kvh, compute_units) and has_cluster
        mine = g[(g.tiling == tiling) & (g.partition_size == p) & ~g.shared_steps & (g.cluster_reduce == cluster)]
        fused_here = fused and not cluster and V.fused_default(arch, -(-L // p)) and bool(mine.fused_reduce.any())
        mine = mine[mine.fused_reduce == fused_here]
        best = g.loc[g.time_us.idxmin()]
        t = float(mine.time_us.min()) if len(mine) else float("nan")
        rows.append(dict(shape, tiling=tiling, partition_size=p, candidates=tuple(cands), resident_per_sm=per_sm,
                         workgroups=S * kvh * -(-L // p), cluster_reduce=bool(cluster), fused_reduce=fused_here,
                         time_us=t,
                         best=_variant_label(best), best_time_us=float(best.time_us),
                         slowdown=t / float(best.time_us)))
    return pd.DataFrame(rows)


def refit_shape_model(df, arch: str = "sm_90", *, tiling: str = "mfma16", source: str | None = None):
    """The wave model refitted to one measured table (a sweep): its t_wave, t_reduce and
    t_launch fitted (cpa.occupancy.fit_wave_model) to the verified `tiling` rows at every
    partition size the table measured, with the table's own read ceiling (the median of its
    rows' `read_gbps_ceiling`) and the arch's compiled occupancy (data/static). Returns
    (model, the joined table with `time_us` and `model_us`), as notebook 02 fits SHAPE_MODELS."""
    from . import occupancy as O
    from .analysis import cpa_rows

    rows = cpa_rows(df)
    rows = rows[rows.tiling == tiling]
    if rows.empty:
        raise ValueError(f"refit_shape_model: no verified {tiling} rows")
    shapes = [dict(num_seqs=int(b), num_heads=int(h), num_kv_heads=int(k), max_seq_len=int(c))
              for b, h, k, c in rows[["num_seqs", "num_heads", "num_kv_heads", "max_seq_len"]]
              .drop_duplicates().itertuples(index=False)]
    sizes = sorted(int(p) for p in rows.partition_size.unique())
    fixed = rows[["head_size", "block_size", "dtype", "kv_cache_dtype"]].drop_duplicates()
    if len(fixed) != 1:
        raise ValueError("refit_shape_model: the table mixes head sizes, block sizes or dtypes; fit one at a time")
    (head, block, dtype, kv), = fixed.itertuples(index=False)
    grid = O.grid_table(arch, shapes, tilings=[tiling], partition_sizes=sizes, head_size=int(head),
                        block_size=int(block), dtype=dtype, kv_cache_dtype=kv)
    ceiling = float(df.read_gbps_ceiling.dropna().median())
    return O.fit_wave_model(grid, rows, ceiling * 1e9,
                            source or f"{tiling} rows of a {len(shapes)}-shape table, {len(sizes)} partition sizes")


def model_transfer(df, arch: str = "sm_90", *, tiling: str = "mfma16"):
    """How the arch's shape-chosen default fares on a table measured on another card (e.g. an
    H100 sweep against SHAPE_MODELS fitted on the H200): one row per rule, each against the
    table's own per-shape best (any CPA row) -- the shape choice with the shipped model, the
    shape choice with the model refitted to this table (:func:`refit_shape_model`), and the
    table's best fixed partition size of `tiling`. Columns: rule, the model's constants (NaN for
    the fixed size), fixed_partition_size (NaN for the models), geomean_slowdown,
    worst_slowdown, worst_shape ("batch x context"), same_picks (shapes where the rule picks
    the shipped model's size) and shapes."""
    import pandas as pd

    from . import occupancy as O

    shipped = O.shape_model(arch)
    refit, fitted = refit_shape_model(df, arch, tiling=tiling)
    base = by_shape_choice(df, arch)
    single = O.single_choice(fitted, "time_us")
    size = int(single.partition_size.iloc[0])
    rules = [("shape-chosen, shipped model", shipped, base),
             ("shape-chosen, refitted model", refit, by_shape_choice(df, arch, model=refit)),
             (f"fixed {tiling} / {size}", None, fixed_choice(df, tiling, size))]
    rows = []
    for rule, model, t in rules:
        worst = t.loc[t.slowdown.idxmax()]
        picks = t.set_index(["num_seqs", "max_seq_len"]).partition_size
        same = picks.eq(base.set_index(["num_seqs", "max_seq_len"]).partition_size.reindex(picks.index))
        rows.append(dict(rule=rule, t_wave_us=model.t_wave_us if model else float("nan"),
                         t_reduce_us=model.t_reduce_us if model else float("nan"),
                         t_launch_us=model.t_launch_us if model else float("nan"),
                         read_gbps=model.bw_bytes_per_s / 1e9 if model else float("nan"),
                         fixed_partition_size=float("nan") if model else size,
                         geomean_slowdown=geomean(t.slowdown), worst_slowdown=float(worst.slowdown),
                         worst_shape=f"{int(worst.num_seqs)} x {int(worst.max_seq_len)}",
                         same_picks=int(same.sum()), shapes=len(t)))
    return pd.DataFrame(rows)


def geomean(x) -> float:
    import numpy as np

    return float(np.exp(np.mean(np.log(np.asarray(x, dtype=float)))))


def fixed_choice(df, tiling: str, partition_size: int):
    """Per shape (the keys of by_shape_choice): the time of one fixed (tiling, partition size)
    with the reduce launch (no fused reduce, cluster combine or shared steps), the shape's best
    CPA time, and slowdown = fixed / best. Shapes without that row are left out."""
    import pandas as pd

    d, keys = _kernel_rows(df)
    rows = []
    for key, g in d.groupby(keys):
        mine = g[(g.tiling == tiling) & (g.partition_size == partition_size) & ~g.fused_reduce & ~g.cluster_reduce
                 & ~g.shared_steps]
        if not len(mine):
            continue
        t, best = float(mine.time_us.min()), float(g.time_us.min())
        rows.append(dict(zip(keys, key), tiling=tiling, partition_size=partition_size, time_us=t, best_time_us=best,
                         slowdown=t / best))
    return pd.DataFrame(rows)
