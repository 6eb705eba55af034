"""What the bytes of a paged KV cache cost to read, apart from any attention kernel.

`cpa bench` compares the CPA kernel with cuDNN SDPA, which reads K/V laid out contiguously;
the read ceiling (cpa.ceilings) is a contiguous stream too. This module reads exactly the
bytes one decode step reads -- every K and V element of every sequence's context, once --
with a plain streaming reader (Triton, no math beyond a checksum) in three access patterns,
over the same work decomposition as the kernel (a program per (sequence, partition, KV-head
group), the CPA grid order):

* ``contiguous``: K/V as SDPA gets them, [num_seqs, num_kv_heads, context, head_size]; a
  program's bytes are one contiguous run per tensor.
* ``paged``: the vLLM cache through the block table, one KV head per program, as the CPA
  kernel reads it: one run of ``head_size * block_size`` elements (4 KB at head 128, block 16,
  fp16) per physical block, at the block stride.
* ``paged_all_heads``: the same cache, a program reading all KV heads of each physical block it
  visits (one contiguous ``num_kv_heads`` times longer run per block per tensor), with a
  ``num_kv_heads`` times shorter partition so programs and bytes per program stay the same.

Each pattern runs a few reader shapes (blocks per iteration, warps, pipeline stages) and keeps
the fastest: the best rate a simple reader gets from that layout. If ``paged`` reads as fast as
``contiguous``, a paged kernel has no layout handicap against SDPA; if ``paged_all_heads``
reads faster than ``paged``, a grid that reads whole physical blocks would gain.
Needs a GPU and Triton (imported lazily).
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

from .bench import kv_read_bytes

PATTERNS = ("contiguous", "paged", "paged_all_heads")
# reader shapes tried per pattern: (physical blocks per loop iteration, warps, pipeline stages).
# Bytes in flight per program are blocks x the run x 2 (K and V); Triton does not pipeline
# these loads itself (the same cubin at 1 and 3 stages, Triton 3.9 for sm_90), hence the blocks.
READER_CONFIGS = tuple(itertools.product((1, 2, 4, 8, 16), (4, 8), (1,)))
MAX_WORDS_PER_THREAD = 64  # reader shapes whose accumulator tile is larger are skipped (registers)
READER_WARPS = (1, 2, 4, 8, 16)


def parse_reader_shape(text: str) -> tuple[int, int, int]:
    """``"<blocks per iteration>x<warps>"`` (e.g. ``"2x8"``) -> a reader config (blocks, warps,
    1 stage) as in :data:`READER_CONFIGS`; anything else raises ValueError."""
    nb, _, warps = str(text).strip().partition("x")
    if not (nb.isdigit() and warps.isdigit() and int(nb) >= 1 and int(warps) in READER_WARPS):
        raise ValueError(f"reader shape {text!r}: expected <blocks per iteration>x<warps>, e.g. 2x8 "
                         f"(warps one of {READER_WARPS})")
    return int(nb), int(warps), 1


def plan(pattern: str, *, num_seqs: int, seq_len: int, num_kv_heads: int, head_size: int, block_size: int,
         elem_bytes: int, partition_size: int) -> dict:
    """The grid and per-program work of one pattern: programs (seq, partition, head group),
    blocks per program, 32-bit words per block run. Checks the shape divides evenly (the
    reader has no tails: every program reads the same bytes)."""
    if pattern not in PATTERNS:
        raise ValueError(f"pattern={pattern!r}: expected one of {PATTERNS}")
    for name, x in (("num_seqs", num_seqs), ("seq_len", seq_len), ("num_kv_heads", num_kv_heads),
                    ("head_size", head_size), ("block_size", block_size), ("elem_bytes", elem_bytes),
                    ("partition_size", partition_size)):
        if int(x) < 1:
            raise ValueError(f"{name}={x}: expected a positive size")
    run_bytes = head_size * block_size * elem_bytes
    if run_bytes % 4:
        raise ValueError(f"head_size * block_size * elem_bytes = {run_bytes}: not whole 32-bit words")
    words = run_bytes // 4
    if words < 16 or words & (words - 1):
        raise ValueError(f"head_size * block_size * elem_bytes = {run_bytes} bytes: the reader takes a run of a "
                         "power-of-two number of 32-bit words, at least 16")
    heads_per_program = num_kv_heads if pattern == "paged_all_heads" else 1
    if partition_size % (block_size * heads_per_program):
        raise ValueError(f"partition_size={partition_size} must be a multiple of block_size x heads per program "
                         f"({block_size} x {heads_per_program})")
    tokens = partition_size // heads_per_program  # tokens per program: same bytes as one head's partition
    if seq_len % tokens:
        raise ValueError(f"seq_len={seq_len} must be a multiple of the program's {tokens} tokens "
                         f"(partition_size {partition_size} over {heads_per_program} heads)")
    return dict(pattern=pattern, heads_per_program=heads_per_program, tokens_per_program=tokens,
                blocks_per_program=tokens // block_size, partitions=seq_len // tokens,
                grid=(num_seqs, seq_len // tokens, num_kv_heads // heads_per_program),
                words_per_run=run_bytes * heads_per_program // 4,
                bytes=kv_read_bytes(num_seqs, seq_len, num_kv_heads, head_size, elem_bytes))


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def read_runs(k_ptr, v_ptr, bt_ptr, out_ptr, bt_stride, block_stride, blocks_per_seq, blocks_per_program,
                  WORDS: tl.constexpr, NB: tl.constexpr, PAGED: tl.constexpr):
        # program (seq, partition, head group); its blocks b in [first, first + blocks_per_program)
        seq, part, grp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        ngrp = tl.num_programs(2)
        first = part * blocks_per_program
        last = first + blocks_per_program
        cols = tl.arange(0, WORDS)[None, :]
        acc = tl.zeros([NB, WORDS], dtype=tl.int32)
        row = bt_ptr + seq * bt_stride
        b = first + tl.arange(0, NB)
        if PAGED:
            pb = tl.load(row + b)
        for i in range(0, blocks_per_program, NB):
            if PAGED:  # physical block through the table; the group's run inside it
                # the next iteration's table entries first, so its loads need not wait for them
                pb_next = tl.load(row + b + NB, mask=b + NB < last, other=0)
                base = pb.to(tl.int64) * block_stride + grp * WORDS
            else:  # [seq, head, token, dim]: block b of (seq, head) is the b-th run of that row
                base = ((seq * ngrp + grp).to(tl.int64) * blocks_per_seq + b) * WORDS
            # runs start on whole runs (Triton then issues 16-byte loads)
            offs = tl.multiple_of(base, 16)[:, None] + cols
            acc += tl.load(k_ptr + offs)
            acc += tl.load(v_ptr + offs)
            b += NB
            if PAGED:
                pb = pb_next
        pid = (seq * tl.num_programs(1) + part) * ngrp + grp
        tl.store(out_ptr + pid, tl.sum(tl.sum(acc, axis=1), axis=0))

    return read_runs


def _wrap(x: int) -> int:
    return (x + 2**31) % 2**32 - 2**31


def checksum(words) -> int:
    """The int32-wrapping sum the reader computes, of a tensor of 32-bit words (any order)."""
    import torch

    return _wrap(int(words.to(torch.int64).sum().item()))


class Reader:
    """One pattern over one input set: ``__call__`` launches it, ``total()`` is its checksum."""

    def __init__(self, pattern, tensors, *, num_seqs, seq_len, num_kv_heads, head_size, block_size,
                 elem_bytes, partition_size, blocks_per_iter=1, num_warps=4, num_stages=1):
        import torch

        self.plan = plan(pattern, num_seqs=num_seqs, seq_len=seq_len, num_kv_heads=num_kv_heads,
                         head_size=head_size, block_size=block_size, elem_bytes=elem_bytes,
                         partition_size=partition_size)
        if self.plan["blocks_per_program"] % blocks_per_iter:
            raise ValueError(f"blocks_per_iter={blocks_per_iter} must divide the program's "
                             f"{self.plan['blocks_per_program']} blocks")
        per_thread = blocks_per_iter * self.plan["words_per_run"] // (32 * num_warps)
        if per_thread > MAX_WORDS_PER_THREAD:  # the accumulator alone would spill: not a streaming reader
            raise ValueError(f"{blocks_per_iter} blocks x {self.plan['words_per_run']} words over {num_warps} warps: "
                             f"{per_thread} accumulator words per thread (> {MAX_WORDS_PER_THREAD})")
        k, v, bt = tensors  # one input set: K, V and its block table
        self.k, self.v = k.view(torch.int32), v.view(torch.int32)
        self.bt = bt
        self.paged = pattern != "contiguous"
        self.blocks_per_seq = seq_len // block_size
        # int32 words between physical blocks (paged) -- the cache's stride 0 in words
        self.block_stride = k.stride(0) * k.element_size() // 4 if self.paged else 0
        self.out = torch.empty(math.prod(self.plan["grid"]), device=k.device, dtype=torch.int32)
        self.meta = dict(WORDS=self.plan["words_per_run"], NB=blocks_per_iter, PAGED=self.paged,
                         num_warps=num_warps, num_stages=num_stages)
        self.kern = _kernel()

    def __call__(self):
        self.kern[self.plan["grid"]](self.k, self.v, self.bt, self.out, self.bt.stride(0) if self.paged else 0,
                                     self.block_stride, self.blocks_per_seq, self.plan["blocks_per_program"],
                                     **self.meta)

    def total(self) -> int:
        return checksum(self.out)


def expected_total(pattern, k, v, bt, *, block_size, seq_len) -> int:
    """The checksum of every K and V word the pattern must read (from torch, not the reader)."""
    import torch

    if pattern != "contiguous":  # every KV head of each sequence's blocks
        used = bt[:, : seq_len // block_size].reshape(-1).long()
        k, v = k[used], v[used]
    return _wrap(checksum(k.contiguous().view(torch.int32)) + checksum(v.contiguous().view(torch.int32)))


KV_BYTES = {"auto": 2, "fp8": 1}  # bytes per cached element: the bench's fp16 cache, or fp8 e4m3


def make_byte_sets(num_seqs, seq_len, *, num_kv_heads, head_size, block_size, elem_bytes, block_order="shuffled",
                   seed=0, device="cuda", pool_bytes=None):
    """Random cache bytes for the reader, which never interprets them: a pool of physical blocks
    ([pool, num_kv_heads, run] uint8, one run = head_size x block_size elements, as both of
    vLLM's caches hold one (block, KV head)) for K and for V, disjoint block tables per input set
    and per set contiguous K and V ([num_seqs, num_kv_heads, seq_len x head_size] bytes, SDPA's
    layout); pool and tables as `cpa bench` makes them (cpa.bench.pool_size, block_tables).
    Returns {pattern: [(k, v, block_table) per set]}."""
    import torch

    from . import bench as B

    B.check_block_order(block_order)
    run = head_size * block_size * elem_bytes
    bps = seq_len // block_size
    pool, n_sets = B.pool_size(num_seqs, bps, 2 * num_kv_heads * run, pool_bytes)
    g = torch.Generator(device=device).manual_seed(seed)

    def rand_bytes(*shape):
        return torch.randint(0, 256, shape, device=device, dtype=torch.uint8, generator=g)

    kc, vc = rand_bytes(pool, num_kv_heads, run), rand_bytes(pool, num_kv_heads, run)
    bts = B.block_tables(pool, num_seqs, bps, n_sets, block_order, g)
    paged = [(kc, vc, bt) for bt in bts]
    contiguous = [(rand_bytes(num_seqs, num_kv_heads, seq_len * head_size * elem_bytes),
                   rand_bytes(num_seqs, num_kv_heads, seq_len * head_size * elem_bytes), bt) for bt in bts]
    return {"paged": paged, "paged_all_heads": paged, "contiguous": contiguous}


LOAD_ONLY_LEVELS = (1, 2)  # -DCPA_LOAD_ONLY: 1 the loads alone, 2 the same holding the kernel's registers


def check_load_only(levels) -> tuple:
    levels = tuple(int(x) for x in levels)
    bad = [x for x in levels if x not in LOAD_ONLY_LEVELS]
    if bad:
        raise ValueError(f"load_only={bad}: expected levels among {LOAD_ONLY_LEVELS} (-DCPA_LOAD_ONLY=N)")
    return levels


def run(*, num_seqs=8, seq_len=32768, partition_sizes=(4096, 8192), patterns=PATTERNS, configs=READER_CONFIGS,
        replays=20, block_order="shuffled", progress=True, kernel_rows=True, kv_cache_dtype="auto", load_only=()):
    """Time every pattern x partition size x reader shape at one Llama-3.1-70B decode shape
    (8 KV heads, head 128, block 16; random cache bytes, make_byte_sets), check each
    reader's checksum, and return (rows DataFrame, ceilings). ``kernel_rows``: time the CPA
    kernel (mfma16 at the same partition sizes) and cuDNN SDPA in the same run, through the
    bench. ``kv_cache_dtype``: "auto" (the fp16 cache) or "fp8" (1-byte elements: 2 KB runs at
    head 128, block 16; the kernel rows are fp16-only, so there are none). ``load_only``: levels
    of ``-DCPA_LOAD_ONLY`` (1, 2) to time as well, kind ``load_only``: the kernel's own loads,
    issued as the kernel issues them, with no math (wrong output, so never verified) -- what the
    kernel's load pattern alone reaches beside the readers."""
    import pandas as pd
    import torch

    from . import bench as B
    from . import ceilings
    from .provenance import provenance
    from .timing import time_graph

    B.check_block_order(block_order)
    load_only = check_load_only(load_only)
    if kv_cache_dtype not in KV_BYTES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: expected one of {tuple(KV_BYTES)}")
    elem = KV_BYTES[kv_cache_dtype]
    for p in patterns:  # refuse a bad pattern / shape before any GPU work
        for P in partition_sizes:
            plan(p, num_seqs=num_seqs, seq_len=seq_len, num_kv_heads=B.LLAMA70B["num_kv_heads"],
                 head_size=B.LLAMA70B["head_size"], block_size=B.LLAMA70B["block_size"], elem_bytes=elem,
                 partition_size=P)
    prov = provenance()
    ceil = ceilings.measure()
    shape = dict(num_seqs=num_seqs, max_seq_len=seq_len, num_kv_heads=B.LLAMA70B["num_kv_heads"],
                 head_size=B.LLAMA70B["head_size"], block_size=B.LLAMA70B["block_size"], elem_bytes=elem)
    inputs = make_byte_sets(num_seqs, seq_len, num_kv_heads=shape["num_kv_heads"], head_size=shape["head_size"],
                            block_size=shape["block_size"], elem_bytes=elem, block_order=block_order)
    todo = [(p, P, c) for p in patterns for P in partition_sizes for c in configs]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(todo), desc="read patterns", unit="reader")
    rows = []
    want = {}  # checksum of each pattern's first set: the same words whatever the reader shape
    for pattern, P, (nb, warps, stages) in todo:
        row = dict(pattern=pattern, partition_size=P, blocks_per_iter=nb, num_warps=warps, num_stages=stages,
                   block_order=block_order, kv_cache_dtype=kv_cache_dtype,
                   **{k: v for k, v in shape.items() if k != "elem_bytes"})
        try:
            readers = [Reader(pattern, t, partition_size=P, blocks_per_iter=nb, num_warps=warps, num_stages=stages,
                              **{k: v for k, v in shape.items() if k != "max_seq_len"}, seq_len=seq_len)
                       for t in inputs[pattern]]
        except ValueError as e:  # this reader shape does not divide the program's blocks
            row.update(error=str(e))
            rows.append(row)
            if bar:
                bar.update(1)
            continue
        r0 = readers[0]
        r0.out.fill_(0x5A5A5A5A)  # poisoned: a program that never stores shows in the checksum
        r0()
        torch.cuda.synchronize()
        if pattern not in want:
            want[pattern] = expected_total(pattern, *inputs[pattern][0], block_size=shape["block_size"],
                                           seq_len=seq_len)
        t = time_graph(readers, replays=replays)
        row.update(t.as_dict(), programs=math.prod(r0.plan["grid"]), bytes=r0.plan["bytes"],
                   gbps=r0.plan["bytes"] / (t.median_us * 1e-6) / 1e9, verified=r0.total() == want[pattern])
        row["frac_peak_bw"] = row["gbps"] / ceil["read_gbps"]
        rows.append(row)
        if bar:
            bar.update(1)
    if bar:
        bar.close()
    del inputs
    torch.cuda.empty_cache()
    df = pd.DataFrame(rows)
    df["kind"] = "reader"
    if kernel_rows and kv_cache_dtype == "auto":
        shape_args = dict(num_seqs=num_seqs, seq_len=seq_len, partition_sizes=partition_sizes, block_order=block_order)
        kr = _mfma16_rows(B, sdpa=True, **shape_args).assign(kind="kernel")
        keep = [c for c in ("pattern", "partition_size", "num_seqs", "max_seq_len", "time_us", "time_us_p25",
                            "time_us_p75", "gbps", "verified", "kind", "block_order") if c in kr]
        df = pd.concat([df, kr[keep]], ignore_index=True)
        for level in load_only:
            lr = _load_only_rows(B, level, **shape_args)
            df = pd.concat([df, lr[[c for c in keep + ["build_flags"] if c in lr]]], ignore_index=True)
    for kk, vv in prov.items():
        df[kk] = vv
    df["read_gbps_ceiling"] = ceil["read_gbps"]
    df["copy_gbps_ceiling"] = ceil["copy_gbps"]
    # every row's fraction of the ceiling the row records (the kernel rows came with the one
    # their bench call measured for itself)
    df["frac_peak_bw"] = df.gbps / df.read_gbps_ceiling
    return df, ceil


def _mfma16_rows(B, *, sdpa, num_seqs, seq_len, partition_sizes, block_order):
    """`cpa bench`'s rows at the readers' shape: mfma16 at their partition sizes with the reduce
    launch (and SDPA if asked), the tiling in column ``pattern`` as the reader rows have it."""
    rows, _ = B.run(batches=(num_seqs,), contexts=(seq_len,), tilings=("mfma16",), partition_sizes=partition_sizes,
                    replays=30, sdpa=sdpa, fused=False, cluster=False, shared=False, progress=False,
                    block_order=block_order, default=False)
    return rows.rename(columns={"tiling": "pattern"})


def _load_only_rows(B, level, **shape_args):
    """The bench's mfma16 rows of a ``-DCPA_LOAD_ONLY=level`` build (added to CPA_NVCC_FLAGS for
    this call only; builds are keyed by the flags), as kind ``load_only``, ``verified`` False."""
    from .jit import flags_added

    with flags_added(f"-DCPA_LOAD_ONLY={level}") as flags:
        lr = _mfma16_rows(B, sdpa=False, **shape_args)
    return lr.assign(kind="load_only", pattern=f"mfma16 loads only ({level})", verified=False, build_flags=flags)


def best_per_pattern(df):
    """The fastest verified reader of each (pattern, partition size), and the kernel rows."""
    # readers and kernel rows that passed verification; the load-only rows are never verified (no math)
    ok = df[(df.kind == "load_only") | (df.get("verified", True) == True)]  # noqa: E712
    ok = ok[ok.time_us.notna()]
    best = ok.loc[ok.groupby(["kind", "pattern", "partition_size"]).time_us.idxmin()]
    cols = [c for c in ("kind", "pattern", "partition_size", "blocks_per_iter", "num_warps", "num_stages", "programs",
                        "time_us", "gbps", "frac_peak_bw") if c in best]
    return best[cols].sort_values(["kind", "time_us"]).reset_index(drop=True)


def in_flight_rows(df):
    """The verified reader rows with ``kb_in_flight``, the KB one program has in flight per loop
    iteration (blocks per iteration x the run x 2 tensors), best over reader shapes per
    (run, KV cache dtype, pattern, partition size, KB): one row per point of a rate-vs-bytes curve."""
    d = df[(df.kind == "reader") & (df.get("verified", False) == True)].copy()  # noqa: E712
    if d.empty:
        return d.assign(kb_in_flight=[])
    per_block = d.bytes / (d.num_seqs * d.max_seq_len / d.block_size)  # K + V bytes of one block, all heads
    heads = (d.pattern == "paged_all_heads") * (d.num_kv_heads - 1) + 1  # KV heads one program reads per block
    d["kb_in_flight"] = (d.blocks_per_iter * per_block / d.num_kv_heads * heads / 1024).round(0).astype(int)
    keys = [k for k in ("run", "kv_cache_dtype", "pattern", "partition_size", "kb_in_flight") if k in d]
    return d.loc[d.groupby(keys).gbps.idxmax()].sort_values(keys).reset_index(drop=True)


def rate_by_bytes_in_flight(df):
    """GB/s of each (pattern, partition size) against the bytes one program has in flight per
    loop iteration (blocks per iteration x run x 2 tensors; best over warps): does the layout's
    rate still grow past what one CPA workgroup keeps in flight (64 KB at head 128, fp16)?"""
    d = in_flight_rows(df)
    if d.empty:
        return d
    return d.pivot_table(index=["pattern", "partition_size"], columns="kb_in_flight", values="gbps", aggfunc="max").round(0)


# The shipped runs of `cpa read-patterns` (H200; data/bench/README.md gives each command).
EXPERIMENTS = Path(__file__).resolve().parent.parent / "data" / "bench" / "experiments"


def load_shipped(paths=None, gpu: str = "h200", commit: str | None = None):
    """Every shipped read-pattern run of one card (``data/bench/experiments/<gpu>-read-patterns*.csv``,
    ``gpu`` = "h200" or "h100"; or ``paths``) in one table, with ``run`` = the file's stem: rows
    of different runs (different calls, maybe different cards of the pool) are compared only
    within their run. ``commit``: only the runs measured at a commit starting with it (one
    session's calls, usually one machine: what a line through several runs may mix)."""
    import pandas as pd

    paths = sorted(EXPERIMENTS.glob(f"{gpu}-read-patterns*.csv")) if paths is None else [Path(p) for p in paths]
    if not paths:
        raise FileNotFoundError(f"no read-pattern runs under {EXPERIMENTS}")
    df = pd.concat([pd.read_csv(p).assign(run=Path(p).stem) for p in paths], ignore_index=True)
    if commit is not None:
        df = df[df.git_commit.astype(str).str.startswith(commit)].reset_index(drop=True)
        if df.empty:
            raise FileNotFoundError(f"no {gpu} read-pattern runs at commit {commit!r} under {EXPERIMENTS}")
    return df


def banner(df) -> str:
    """One Markdown line saying where the read-pattern rows come from."""
    def vals(col):
        return ", ".join(sorted({str(v) for v in df[col].dropna()})) if col in df else "?"

    runs = list(dict.fromkeys(df.run)) if "run" in df else []
    commits = ", ".join(sorted({str(c)[:7] for c in df.git_commit.dropna()})) if "git_commit" in df else "?"
    dates = ", ".join(sorted({str(t)[:10] for t in df.timestamp.dropna()})) if "timestamp" in df else "?"
    return (f"**Shipped** `cpa read-patterns` runs, measured on {vals('device_name')} (driver "
            f"{vals('driver_version')}, torch {vals('torch_version')}); {len(runs)} run(s) "
            f"({', '.join(f'`{r}`' for r in runs)}), {len(df)} rows, commit {commits}, {dates}.")


def against_sdpa(df):
    """Per run (one shape and block order each): the fastest verified ``contiguous`` and ``paged``
    reader over its partition sizes and reader shapes, the fastest kernel row (any tiling and
    partition size) and SDPA, with SDPA's time over each (above 1: faster than SDPA). A paged
    reader does nothing but read the bytes the kernel must read, in the kernel's decomposition:
    where even it is not faster than SDPA, a kernel on this layout can beat SDPA only by reading
    the cache faster than the best reader tried."""
    import pandas as pd

    d = df[df.time_us.notna()]
    keys = [k for k in ("run", "num_seqs", "max_seq_len", "block_order", "kv_cache_dtype") if k in d]
    ok = d[(d.kind == "reader") & (d.get("verified", False) == True)]  # noqa: E712
    if ok.empty or "run" not in d:
        return pd.DataFrame()
    out = ok.groupby(keys + ["pattern"]).time_us.min().unstack("pattern")
    out = out.reindex(columns=["contiguous", "paged"]).rename(columns=lambda c: f"{c}_reader_us")
    out.columns.name = None
    k = d[(d.kind == "kernel") & (d.get("verified", True) != False)]  # noqa: E712
    by_run = out.index.get_level_values("run")
    out["kernel_us"] = [k[(k.run == r) & (k.pattern != "sdpa_cudnn")].time_us.min() for r in by_run]
    out["sdpa_us"] = [k[(k.run == r) & (k.pattern == "sdpa_cudnn")].time_us.min() for r in by_run]
    arms = ["contiguous_reader", "paged_reader", "kernel"]
    lo = d[d.kind == "load_only"]
    if len(lo):  # the kernel's loads alone (never verified: no math), best level and partition size
        out["load_only_us"] = [lo[lo.run == r].time_us.min() for r in by_run]
        arms.append("load_only")
    for c in arms:
        out[f"sdpa_over_{c}"] = out.sdpa_us / out[f"{c}_us"]
    return out.reset_index()


def against_sdpa_lines(table, block_order: str = "shuffled", kv_cache_dtype: str = "auto"):
    """The runs of :func:`against_sdpa` (one shape each; those of ``block_order`` and
    ``kv_cache_dtype`` only) as one line per arm, time = fixed + K/V bytes / rate
    (:func:`cpa.bench.fit_line`; K/V bytes at the Llama-3.1-70B shape, 4096 per token with a
    16-bit cache): the contiguous and paged readers, the kernel, its loads alone where the runs
    have them, and SDPA. Splits each arm's time into what does not grow with the context and
    the rate it streams at."""
    import pandas as pd

    from . import bench as B

    t = table[table.block_order == block_order] if "block_order" in table else table
    t = t[t.kv_cache_dtype == kv_cache_dtype] if "kv_cache_dtype" in t else t
    elem = KV_BYTES[kv_cache_dtype]
    kv = B.kv_read_bytes(t.num_seqs, t.max_seq_len, B.LLAMA70B["num_kv_heads"], B.LLAMA70B["head_size"], elem)
    rows = []
    for arm in ("contiguous_reader", "paged_reader", "kernel", "load_only", "sdpa"):
        col = f"{arm}_us"
        if col not in t or t[col].notna().sum() < 2:
            continue
        ok = t[col].notna()
        fixed, rate, resid = B.fit_line(kv[ok], t.loc[ok, col])
        rows.append(dict(arm=arm, fixed_us=fixed, rate_gbps=rate, max_rel_residual=resid, shapes=int(ok.sum())))
    out = pd.DataFrame(rows)
    if len(out) and "sdpa" in set(out.arm):
        out["rate_vs_sdpa"] = out.rate_gbps / float(out.set_index("arm").loc["sdpa", "rate_gbps"])
    return out


def layout_cost(df):
    """Per (run, KV cache dtype, partition size): the best ``paged`` and ``contiguous`` reader
    times and the paged / contiguous ratio (what the paged layout alone costs a reader of the
    same programs and bytes), with the fastest kernel row (any tiling) and SDPA of the same run
    where it has them."""
    import pandas as pd

    d = df[df.time_us.notna()]
    ok = d[(d.kind == "reader") & (d.get("verified", False) == True)]  # noqa: E712
    keys = [k for k in ("run", "kv_cache_dtype", "partition_size") if k in ok]
    best = ok.groupby(keys + ["pattern"]).time_us.min().unstack("pattern")
    if not {"paged", "contiguous"} <= set(best.columns):
        return pd.DataFrame()
    out = best[["contiguous", "paged"]].rename(columns=lambda c: f"{c}_us")
    out["paged_over_contiguous"] = out.paged_us / out.contiguous_us
    k = d[(d.kind == "kernel") & (d.get("verified", True) == True)]  # noqa: E712
    if len(k) and "run" in k:
        sdpa = k[k.pattern == "sdpa_cudnn"].groupby("run").time_us.min()
        kern = k[k.pattern != "sdpa_cudnn"].groupby(["run", "partition_size"]).time_us.min()  # best tiling
        runs = out.index.get_level_values("run")
        parts = out.index.get_level_values("partition_size")
        out["kernel_us"] = [kern.get((r, p), float("nan")) for r, p in zip(runs, parts)]
        out["sdpa_us"] = [sdpa.get(r, float("nan")) for r in runs]
    return out.reset_index()
