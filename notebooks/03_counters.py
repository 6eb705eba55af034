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
# # 03 · Hardware counters: why the winner wins
#
# The sweep (notebook 01) says which partition size is fastest; the counters say why. This
# page reads the counters that `cpa profile` collected with **Nsight Compute** (`ncu`, run as
# a subprocess over `profiling/harness.py`) on the H200, for every tiling x partition size at
# six shapes of `llama70b-decode`, and joins them to the sweep rows of the same variants.
#
# Everything here is **measured on the H200** (or modeled from the sm_90 compiled resources
# where it says so), except the sections marked **measured on an H100** (the read patterns and
# the stall tables at the end). The same page works for `rocprofv3` on an MI300 (the portable metric
# names in `profiling/rocprofv3.yaml`), but that path has **not yet run on an MI300**: no
# AMD counters are shown, and nothing here speaks for one.
#
# The counters are of the attention kernel alone: the harness launches no reduce kernel, so
# they are compared with the sweep's `attn_time_us`, not with the whole call.

# %%
from IPython.display import Markdown, display

from cpa import analysis as A
from cpa import counters as C
from cpa import hardware as hw
from cpa import plots as P

counters = C.load("llama70b-decode")
# the sweep of the kernel the counters profiled (the shipped one, or the earlier run kept
# in data/sweeps/experiments when the kernel has moved on since)
sweep = A.shipped_sweep_at("llama70b-decode", counters.df.git_commit.unique())
display(Markdown(counters.banner()))
display(Markdown("Joined to: " + sweep.banner()))
joined = C.with_sweep(counters.df, sweep.df)
print(f"{len(joined)} of {len(counters.df)} counter rows matched a verified sweep row; metrics: "
      f"{', '.join(counters.metrics)}")

# %% [markdown]
# ## Explore a counter against partition size
# Pick a counter (or one of the derived ratios), the tilings and the shapes. Each facet is
# one (batch, context) shape; each line one tiling.

# %%
explore = [m for m in counters.metrics if m not in ("block_size", "shared_memory_bytes")] + \
    [m for m in ("bw_ratio", "time_ratio", "read_ratio") if m in joined.columns]
P.counter_explorer(joined, explore)

# %% [markdown]
# ## DRAM bandwidth: counters against the sweep's accounting
# The sweep divides the bytes the attention kernel must move (K and V once, q, and the fp32
# partials or `out`) by its median time over CUDA-graph replays that rotate through input sets
# in different memory (so the L2 cannot serve one set from another); ncu divides the DRAM
# bytes it counted by the duration of one profiled launch (`--clock-control none`, ncu's
# default cache control flushing the caches before each replay pass). On long contexts
# (>= 8k tokens) the two should agree within 10%.

# %%
agree = C.bandwidth_agreement(joined)
display(agree.round(3))
long = agree[agree.long_context]
print(f"long contexts (>= 8k): counter / sweep bandwidth ratio {long.bw_ratio_min.min():.3f} .. "
      f"{long.bw_ratio_max.max():.3f} over {int(long.rows.sum())} rows; within 10% at "
      f"{int(long.within_10pct.sum())} of {len(long)} shapes")
P.show(P.bandwidth_agreement(joined))

# %% [markdown]
# Where the two differ, two derived columns say why. `time_ratio` is the profiled duration
# over the swept attention time. The short kernels (~40-210 µs) differ most: one profiled
# launch under ncu against the median of graph replays with rotating inputs, so a short
# kernel can read a few percent slower under ncu, and its counter bandwidth a few percent
# lower; the long kernels (>= 250 µs) agree within 1.7% in time (and in counter bandwidth, but
# for one scalar row at 1.033). `read_ratio` is the counted DRAM reads
# over the bytes the kernel must read (K and V once, q, block tables excluded): 1.00 means
# every K/V byte came from DRAM exactly once — no re-reads from a poor access order, and no
# help from the L2 (each launch reads its cache cold).

# %%
by_len = joined.assign(short=joined.attn_time_us < 250).groupby("short")[["time_ratio", "read_ratio", "bw_ratio"]]
display(by_len.agg(["median", "min", "max"]).round(3).rename(index={True: "attn < 250 µs", False: "attn >= 250 µs"}))

# %% [markdown]
# ## Roofline
# Decode attention does 4 x heads x tokens x head_size flops over ~2 x KV heads x tokens x
# head_size x 2 bytes of KV cache: an arithmetic intensity of about the GQA ratio in flops
# per byte (8 here; a little less counted, since the fp32 partials are traffic too, most of
# it at small partitions), far left of the H200's ridge point (datasheet dense fp16 matrix
# peak over HBM bandwidth). The distance below the bandwidth roof is the bandwidth lost.

# %%
ceil = sweep.ceilings()
ridge = hw.H200.matrix_fp16_tflops * 1e12 / hw.H200.hbm_bandwidth_bytes_per_s
ai = joined.arithmetic_intensity
print(f"arithmetic intensity (counted): {ai.min():.2f} .. {ai.max():.2f} flop/byte (GQA ratio "
      f"{int(joined.num_heads.iloc[0] // joined.num_kv_heads.iloc[0])}); H200 ridge point {ridge:.0f} flop/byte, "
      f"{ridge / ai.max():.0f}x to the right")
P.show(P.counter_roofline(joined, hw.H200, read_ceiling_gbps=ceil["read_gbps"]))

# %% [markdown]
# ## Achieved against theoretical occupancy
# Theoretical: resident warps that the attention kernel's compiled registers and shared
# memory allow per SM (sm_90 table of `cpa static`, the Hopper calculator that notebook 02
# checks against the CUDA runtime), over 64 warp slots. Grid-limited: the same, capped by
# the workgroups the launch has (sequences x partitions x KV heads): a large partition at a
# small batch leaves SMs empty, which is the price that partition size pays for its cheaper
# reduce. Achieved: `sm__warps_active` from the counters.

# %%
occ = C.theoretical_occupancy(joined)
P.show(P.occupancy_achieved_vs_theoretical(occ))
cols = ["shape", "tiling", "partition_size", "grid_size", "slots", "theoretical_occupancy", "grid_limited_occupancy",
        "achieved_occupancy", "attn_time_us"]
display(occ[[c for c in cols if c in occ.columns]].round(3).reset_index(drop=True))

# %% [markdown]
# ## Pipes and shared memory per partition size
# Decode is bandwidth-bound, so the tensor pipe is nearly idle; what the counters add is
# where the non-memory time goes. The shared-memory bank-conflict rate (conflicts per
# shared-memory wavefront) of the matrix-core tilings is a lead for the kernel, not a result:
# the counters do not say which instructions conflict, and the rate falling as the partition
# grows points at a once-per-workgroup step (such as the cross-wave combine through shared
# memory) rather than the main loop.

# %%
for m in ("matrix_core_busy", "valu_busy", "lds_bank_conflict_rate", "l2_hit_rate"):
    if m in joined.columns and joined[m].notna().any():
        P.show(P.counters_vs_partition(joined, m))

# %% [markdown]
# ## Bytes in flight: the paged layout read apart from the kernel
# At long contexts decode attention is a streaming read, so two things set its speed besides
# the math: how the bytes lie in memory, and how many of them a workgroup keeps in flight.
# `cpa read-patterns` separates the two from the kernel. It reads exactly one decode step's K
# and V (8 sequences x 32k tokens, head 128, block 16) with a plain Triton streaming reader —
# no math, a checksum compared with torch's — over the kernel's own programs (one per
# sequence, partition and KV head), in three layouts: `contiguous` (K and V as SDPA gets
# them), `paged` (the vLLM cache through the block table, one KV head per program: the
# kernel's pattern) and `paged_all_heads` (whole physical blocks per program). Each line is a
# layout at one partition size; x is the KB one program issues per loop iteration (a CPA
# workgroup holds one 16 KB step per warp in registers: 64 KB). The black lines are the CPA
# kernel and cuDNN SDPA, timed in the same call where the run has them.
#
# All of it is **measured on the H200**, each run compared only within itself (runs may land
# on different H200s of the pool). Nothing here speaks for an MI300.

# %%
from cpa import readpattern as RP

rp = RP.load_shipped()
display(Markdown(RP.banner(rp)))
P.show(P.read_patterns(rp))
cost = RP.layout_cost(rp)
display(cost.round(3))
r = cost.paged_over_contiguous
print(f"the paged layout costs a reader of the same programs and bytes {100 * (r.min() - 1):.1f}-"
      f"{100 * (r.max() - 1):.1f}% (paged / contiguous time, best reader shape of each)")
pts = RP.in_flight_rows(rp)
main = pts[(pts.pattern == "paged") & (pts.partition_size == 8192) & (pts.kv_cache_dtype == "auto")]
kern = rp[(rp.kind == "kernel") & (rp.partition_size == 8192)]
for run, g in main.groupby("run"):
    at = g.set_index("kb_in_flight").gbps
    line = ", ".join(f"{kb} KB {at[kb]:.0f}" for kb in (64, 128) if kb in at)
    k = kern[kern.run == run].gbps
    print(f"{run}: paged reader at P 8192, GB/s by KB per program: {line}"
          + (f"; the CPA kernel at P 8192 in the same call: {k.iloc[0]:.0f}" if len(k) else ""))

# %% [markdown]
# What the shipped runs say (notes/kernel-notes.md, "Read patterns apart from the kernel"):
# the paged layout costs a reader one to three percent against contiguous rows of the same
# programs and bytes, so the layout is not what separates the kernel from SDPA at 8 x 32k. At
# 256 programs (P 8192, the split cuDNN's SDPA runs there) a reader issuing what one CPA
# workgroup keeps in flight (64 KB per program) reads at about the kernel's own rate, and 128 KB
# per program reads faster than SDPA's whole attention in the same call; with 512 programs
# (P 4096) the paged readers read above SDPA's rate at every size tried, while the kernel at
# P 4096 is level with SDPA. The best whole-block reader (`paged_all_heads`) is no faster than
# the best paged one. The fp8 run shows the same ordering at half the bytes.

# %% [markdown]
# ## Can any reader of this layout beat SDPA at the long shapes?
# Target 2 is not met at the 10 shapes with at least 128k tokens in the batch (0.972-0.991x),
# and is missed by under 0.35% at 1 x 64k, 2 x 32k and 4 x 16k (0.997x; notebook 01). The
# readers say whether it could be: each run below times the best `contiguous` and `paged`
# reader, the kernel (mfma16 at the run's partition sizes) and cuDNN SDPA at one long shape, in
# one call (`bash scripts/h200.sh readpattern-shapes`). `sdpa_over_*` above 1 is faster than
# SDPA. These runs are **measured on an H100** (no H200 could be had that session); the H200's
# readers at 8 x 32k are the section above.

# %%
import pandas as pd

bound = RP.load_shipped(gpu="h100", commit="c60f99f")  # one session's calls: one card
display(Markdown(RP.banner(bound)))
bound_vs = RP.against_sdpa(bound)
with pd.option_context("display.precision", 3, "display.width", 200):
    display(bound_vs.drop(columns="run"))
    # one line per arm through the shuffled shapes: time = fixed + K/V bytes / rate
    display(RP.against_sdpa_lines(bound_vs))

# %% [markdown]
# A reader that does nothing but read the paged cache, in the kernel's decomposition, is faster
# than cuDNN's whole attention up to 128k tokens in the batch, level at 256k, and slower at 512k
# and 1M (8 x 128k: 0.989x; with consecutive physical blocks 0.996x). There cuDNN's contiguous
# K/V stream faster than any paged reader tried, so target 2 at those shapes asks the kernel to
# read faster than the best reader of its layout. Everywhere the kernel trails that reader by
# 2-5%: that, not the layout, is what it leaves on the table below 256k tokens.
#
# The lines say the same per byte. The contiguous reader streams at SDPA's rate; the paged
# layout costs a reader about 1.5% of it, and the kernel about as much again on top. The kernel's
# fixed cost (about 7 us: launches, the first loads, the combine) sits between the reader's and
# SDPA's -- which is why it wins the short shapes and loses the long ones.

# %% [markdown]
# ### The kernel's loads alone
# How much of the kernel's gap to the paged reader is the way its loads stream, and how much its
# math? `cpa read-patterns --load-only 1,2` times two builds of the kernel whose main loop issues
# exactly the kernel's loads and folds the registers with XORs (no QK, softmax or P x V: the
# output is wrong, so these rows are never verified; level 1 holds 158 registers, level 2 the
# real kernel's ~220). A later session, **measured on another H100** of the pool (a faster one:
# read ceiling 3226 GB/s), so these runs are fitted on their own.

# %%
alone = RP.load_shipped(gpu="h100", commit="1941857")
display(Markdown(RP.banner(alone)))
alone_vs = RP.against_sdpa(alone)
with pd.option_context("display.precision", 3, "display.width", 200):
    display(alone_vs.drop(columns="run"))
    display(RP.against_sdpa_lines(alone_vs))

# %% [markdown]
# At every shape the contiguous reader is fastest and the kernel's loads alone, then the kernel,
# are slowest; SDPA and the paged reader lie between (the reader ahead at 256k tokens in the
# batch, behind at 512k and 1M). Per byte (the lines' rates against SDPA's) the layout costs a reader about
# 1.4%, the kernel's way of issuing the same loads about 0.9% more, and its math about 0.6%.
# So even a kernel whose math were free would stay behind the paged reader on this card: the
# loads of one 16 KB register step per warp, four warps per workgroup, stream a little less
# steadily than the reader's many small programs.

# %% [markdown]
# ### The same, in Nsight Compute's counters
# `scripts/h200.sh stalls` profiles a reader like a kernel (targets
# `reader-<pattern>-<blocks>x<warps>`), so ncu can set the kernel, its loads alone, readers of
# several shapes and cuDNN side by side at one shape (8 x 32k, P 4096; **measured on the same
# H100**, one row per raw ncu page in `data/counters/experiments/h100-stalls-*-72a477e.csv`).

# %%
import glob

cols = ["label", "time_us", "dram_throughput_pct", "warps_active_pct", "registers", "grid", "dram_read_gb",
        "l2_read_sectors_m"]
for commit, context in (("72a477e", 32768), ("39c06c6", 131072)):  # 8 x 32k, then 8 x 128k
    ncu = C.stall_table(sorted(glob.glob(str(C.SHIPPED / "experiments" / f"h100-stalls-*-{commit}.csv"))))
    display(Markdown(f"8 x {context // 1024}k, P 4096 (commit {commit}):"))
    with pd.option_context("display.precision", 2, "display.width", 200):
        display(ncu[cols].sort_values("time_us"))

# %% [markdown]
# Every one moves the same bytes (1.074 GB from DRAM at 8 x 32k, 4.30 GB at 8 x 128k), and time
# follows the DRAM throughput. The readers reach cuDNN's ~94% with more warps per SM than the
# kernel: 8 warps per program (about four times the kernel's active warps), or the kernel's
# 16 KB per warp with twice its warps (16 warps per SM) -- while a reader with 4
# warps per program sits where the kernel's loads do (92.4-92.9%). cuDNN gets there with the
# kernel's 8 warps per SM by staging K and V through shared memory with cp.async. For this
# kernel, more warps means fewer registers per warp; those forms were measured (notes,
# "Thirteenth session") and did not pay. At 8 x 128k the reader's own shape moves it by 4%
# (4 against 8 warps per program): more than the kernel's whole gap to the best reader.
