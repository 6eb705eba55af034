# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 01 · Partition size and tiling: the sweep
#
# A decode step reads every sequence's K and V once. One workgroup of the CPA kernel handles
# one (sequence, KV head, **partition**) — `partition_size` context tokens — and a reduce
# kernel combines the partitions' partial softmax results. Small partitions give the GPU
# more workgroups when batch x KV heads is small; large ones do less reduce work and pay the
# per-workgroup fixed cost less often. The **tiling** decides how the GQA query heads and the
# tokens map onto matrix-core tiles (`mfma16`: 16x16x16 on AMD / m16n8k16 on NVIDIA,
# `mfma4`: 4x4x4 16-block / m16n8k8, `scalar`: no matrix cores).
#
# Every number here comes from `cpa sweep` (cpa/sweep.py): each row verified against
# `cpa.reference` on fresh random inputs into a NaN-poisoned output, then timed by CUDA-graph
# replay over rotating input sets (a KV pool of at least 1 GiB; the 16 sets the shipped sweep
# rotated touch only 8-64 MiB at the smallest points -- 1 x 128 to 1 x 1k -- within reach of
# the 50 MB L2, so those points are optimistic; runs since 2026-12-06 rotate enough sets to
# touch 256 MiB), median of 30 replays. Bandwidth is K+V read once over the median time, against
# the read ceiling measured at the start of the same run.
#
# **These are NVIDIA H200 measurements**, except the sections marked **measured on an H100**.
# Nothing on this page is an MI300 number; the
# MI300X side (compiled resources and modeled occupancy) is notebook 02.

# %%
import pandas as pd

from cpa import analysis as A
from cpa import plots as P
from IPython.display import Markdown, display

GRIDS = ["llama70b-decode", "gqa-scan", "head-size-scan", "mixed-lengths", "kv-dtype-scan"]
data = {g: A.sweep_results(g) for g in GRIDS}
main = data["llama70b-decode"]
display(Markdown(main.banner()))
ceil = main.ceilings()
print(f"read ceiling {ceil['read_gbps']:.0f} GB/s, copy ceiling {ceil['copy_gbps']:.0f} GB/s (same run)")

# %% [markdown]
# ## Latency against partition size
# Llama-3.1-70B at TP1 (64 query heads over 8 KV heads, head 128, 16-token blocks, fp16).
# One panel per batch, one line per context length. At batch 1 the partition size is the
# only source of parallelism: 8 KV heads x 1 sequence = 8 workgroups for a whole 32k
# context unless it is split, against 132 SMs.

# %%
P.show(P.latency_vs_partition(main.df, tiling="mfma16"))

# %% [markdown]
# ## Where the bandwidth goes
# Each point is one shape; the CPA point is its fastest verified variant. Small shapes sit
# far below the roof: their time is launch and per-workgroup latency, not bytes.

# %%
P.show(P.bandwidth_roof(main.df, ceil))

# %% [markdown]
# ## The best partition size over (batch, context)
# The cell says the winning `tiling/partition`. On the H200 the long contexts want the
# largest partitions: with 2 resident workgroups per SM (216-221 registers per thread), a
# workgroup's fixed cost — the dependent loads of sequence length, block table and the first
# K block, and the epilogue — is paid once per partition, and the fp32 partials of small
# partitions are extra traffic for the reduce.

# %%
P.show(P.best_partition_heatmap(main.df))

# %%
sp = A.speedups(main.df, baseline_partition=256)
src = f"measured on {main.device}"
P.show(P.speedup_heatmap(sp, "vs_p256", title="Best variant over the best tiling at a fixed partition size 256",
                         source=src))
print(f"choosing the partition size per shape instead of a fixed 256: median {sp.vs_p256.median():.3f}x, "
      f"max {sp.vs_p256.max():.2f}x over {len(sp)} shapes")

# %% [markdown]
# ## Against the peers
# `sdpa`: torch `scaled_dot_product_attention` (cuDNN backend) on **contiguous** K/V gathered
# before timing — the dense-layout upper bound, not a paged kernel. `flashinfer`: FlashInfer's
# paged batch decode (tensor-core path, HND pages of 16 tokens, the block table as page
# table) — the paged peer. `flex`: `torch.compile(flex_attention)` on contiguous K/V.
# Values above 1 mean the CPA kernel is faster. SDPA and flex ran in the CPA rows' run; the
# FlashInfer rows were **merged from an earlier run** (e7697f4: the wheel was not carried since),
# in which SDPA -- the same code -- ran a median 1.3% slower (0.96-1.07x) than in this one, so
# `vs_flashinfer` leans toward CPA by about that much (the titles say "other run").

# %%
for peer in A.peer_names(main.df):
    col = f"vs_{peer}"
    if col in sp and sp[col].notna().any():
        same = sp.get(f"{peer}_same_run")
        other = same is not None and not bool(same[sp[col].notna()].all())
        P.show(P.speedup_heatmap(sp, col, title=f"{peer} time / best CPA time" + (" (other run)" if other else ""),
                                 source=src))

# %%
cols = ["num_seqs", "max_seq_len", "tiling", "partition_size", "time_us", "frac_peak_bw", "vs_p256"] + \
    [c for c in sp if c.startswith("vs_") and c != "vs_p256"]
with pd.option_context("display.max_rows", 80, "display.precision", 3):
    display(sp[cols])

# %% [markdown]
# ## Against cuDNN SDPA at long contexts
# The kernel's second target: faster than SDPA at batch <= 8 and context >= 8k. `cpa bench`
# over that whole domain (batch 1, 2, 4, 8 x 8k-128k, SDPA in the same run), read by
# `cpa.bench.sdpa_gap`: per shape the fastest variant that launches the reduce after the
# attention, and the same ratio with the attention kernel alone -- what it would be if
# combining the partitions cost nothing. Where the second bar is above 1 and the first below,
# the reduce is the difference; where both are below, the attention kernel's streaming is.
# cuDNN reads its contiguous K/V at 93-100% of the read ceiling at the longest shapes, so the
# paged kernel has one to three percent to find there (notes/kernel-notes.md).

# %%
from cpa import bench as B

t2 = pd.read_csv(B.TARGET2_CSV)
gap = B.sdpa_gap(t2)
t2_src = (f"measured on {', '.join(sorted(set(t2.device_name)))}, commit "
          f"{', '.join(sorted({c[:7] for c in t2.git_commit}))}")
P.show(P.sdpa_gap_bars(gap, source=t2_src))
with pd.option_context("display.precision", 3):
    display(gap)

# %% [markdown]
# The target's count takes the fastest launch of any combine per shape -- the fused reduce
# included, which the bars above leave out (at 8 partitions it beats the reduce launch, e.g.
# 4 x 8k). `speedup_vs_sdpa` above 1 is a shape the target is met at (three decimals: 1 x 64k,
# 2 x 32k and 4 x 16k miss it by under 0.35%).

# %%
display(B.summary_table(t2)[["batch", "context", "best", "best_us", "best_bw", "sdpa_us", "sdpa_bw",
                             "speedup_vs_sdpa", "all_verified"]])

# %% [markdown]
# Why the count splits where it does. At these shapes a decode step is a streaming read, so
# each arm's times lie close to a line, `time = fixed + K/V bytes / rate`
# (`cpa.bench.streaming_fit`, least squares over the shapes with at least 128k tokens in the
# batch). The fixed part -- launches, the first loads' latency, the combine, the tail -- is
# where partitioning pays, and the kernel's is about a microsecond lower than SDPA's. The rate
# is where it does not: cuDNN streams its contiguous K/V about 2.7% faster, so the two lines
# cross at a few tens of thousands of tokens in the batch. Past that, no partition size or
# combine helps; only a faster main loop (or a faster layout) would. How far the paged layout
# lets any reader go, and where the kernel's own rate goes (its loads, its math, too few warps
# per SM to keep the DRAM as busy as cuDNN does), is measured in notebook 03 -- on an H100 so
# far.

# %%
fit = B.streaming_fit(t2)  # the shapes with >= 128k tokens in the batch
P.show(P.streaming_lines(t2, fit, source=t2_src))
with pd.option_context("display.precision", 4):
    display(fit)

# %% [markdown]
# ### The same domain on an H100
# The split is not one card's. The same call on an H100 with the H200 table's kernels
# (`data/bench/experiments/h100-target2-089eec7.csv`, the sm_90 machine code of b81e29d;
# **measured on an H100**, not the target's card, with its own SDPA in the run) divides it
# nearly the same way: behind SDPA at every shape with 128k or more tokens in the batch. Among
# the 64k-token shapes the H100 is behind only at 1 x 64k (0.999x), the H200 at all but 8 x 8k
# (0.997x at 1 x 64k, 2 x 32k and 4 x 16k). The last column is the same call at today's kernels
# (5f5aa63: each sequence clamped to the tokens its launch covers), whose launches take 0.998x
# their time before: 1 x 64k and 8 x 16k at 0.997x. Each cell is target 2's count, SDPA time over the
# fastest verified CPA launch (`cpa.bench.vs_sdpa`).

# %%
h100_t2 = pd.read_csv(B.EXPERIMENTS / "h100-target2-089eec7.csv")
h100_now = pd.read_csv(B.EXPERIMENTS / "h100-target2-5f5aa63.csv")
both = pd.concat({"H200": B.vs_sdpa(t2), "H100": B.vs_sdpa(h100_t2), "H100, today's kernels": B.vs_sdpa(h100_now)},
                 axis=1)
both.index.names = ["batch", "context"]
with pd.option_context("display.precision", 3):
    display(both.unstack("batch"))

# %% [markdown]
# ## Combining the partitions
# Every partitioned launch pays for its combine once the attention kernel is done: the reduce
# launch (a second kernel, started early by programmatic dependent launch) or the fused reduce
# (the last workgroup of each sequence and KV head combines; one L2 round trip per 8
# partitions since the one-round rewrite). `cpa.bench.combine_costs` subtracts the attention
# kernel's own time from each. These A/Bs ran on an **H100** (no H200 could be had for them);
# the fused reduce saves about a microsecond at 8 partitions, so the sm_90 default takes it at
# 5-8 partitions (`cpa.variants.fused_default`) and the reduce launch elsewhere.

# %%
from cpa import variants as V

ab = {"one round per 8 (today's)": "h100-fused-combine-repeat-new-74fe4ab.csv",
      "the earlier combine": "h100-fused-combine-repeat-old-74fe4ab.csv"}
ab = {k: pd.read_csv(B.EXPERIMENTS / f) for k, f in ab.items()}
costs = {k: B.combine_costs(d) for k, d in ab.items()}
ab_src = (f"measured on {', '.join(sorted({n for d in ab.values() for n in d.device_name}))}, commit "
          f"{', '.join(sorted({c[:7] for d in ab.values() for c in d.git_commit}))}")
P.show(P.combine_costs_by_partitions(costs, source=ab_src, auto_partitions=V.FUSED_AUTO_PARTITIONS))

# %% [markdown]
# ## The other grids
# `gqa-scan` holds the KV bytes fixed and raises the query heads per KV head from 1 to 16;
# `head-size-scan` holds the KV bytes and the GQA ratio fixed and changes the head size;
# `mixed-lengths` is a batch of long-tailed (log-normal) context lengths, where a dense
# kernel must pad to the longest sequence.

# %%
for g in GRIDS[1:4]:
    s = data[g]
    display(Markdown(f"### {g}\n{s.banner()}"))
    t = A.speedups(s.df)
    peer_cols = [c for c in t if c.startswith("vs_") and c != "vs_p256"]
    P.show(P.speedup_bars(t, ["vs_p256"] + peer_cols, title=f"{g}: best CPA variant against fixed 256 and peers",
                          source=f"measured on {s.device}"))
    P.show(P.latency_vs_partition(s.df, tiling="mfma16"))

# %% [markdown]
# ## The fp8 KV cache
# `kv-dtype-scan`: the same Llama shape with fp16 and bf16 queries, the KV cache either in the
# query's dtype or in fp8 e4m3 (one byte per element, `k_scale` / `v_scale`), which halves
# the bytes a call reads. The label over each fp8 bar is fp8 time / 16-bit time: 0.5 would
# turn all of the halved bytes into time. The kernel decodes e4m3 in registers after each
# load (on sm_89+ with the hardware `cvt.rn.f16x2.e4m3x2`, on AMD and older NVIDIA with
# integer bit operations), so part of the saving goes to the decode instructions. The decoded
# values are exact in fp16, so bf16 queries with an fp8 cache run fp16 matrix-core tiles (the
# query converted once per workgroup, `Variant.tile_dtype`) and decode no more than fp16
# queries do: the two dtypes' fp8 bars should match.

# %%
kv = data["kv-dtype-scan"]
display(Markdown(kv.banner()))
kvt = A.kv_dtype_table(kv.df)
P.show(P.kv_dtype_bars(kvt, source=f"measured on {kv.device}"))
with pd.option_context("display.precision", 3):
    display(kvt)

# %% [markdown]
# ## Explore
# Choose a grid, dtype, KV cache dtype and tiling. (The controls need a live Jupyter kernel; in the static
# report they show their first selection.)

# %%
display(P.explorer(lambda g: data[g] if g in data else A.sweep_results(g), GRIDS))
