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
# # 02 · Occupancy: what the compilers allocate, and why 256 on MI300X
#
# No MI300 is available to this project, but its compiler is. Every AMD figure on this page
# is **compiled** (read off clang-19's gfx942 / gfx90a output: VGPRs, AGPRs, SGPRs, LDS,
# waves per SIMD) or **modeled** (computed from those numbers with a stated model). None is
# an MI300 measurement. The same analysis runs on the sm_90 build of the same source, and
# there it can be checked against the H200 itself — which is how we learn to trust it.
#
# Sources: `data/static/{gfx942,gfx90a,sm_90}.csv` (`cpa static`), the device specs in
# `cpa.hardware` (each value with its source), the calculators in `cpa.occupancy`,
# `data/static/h200-occupancy-check.csv` (the Hopper calculator against the CUDA runtime on
# the H200) and the measured sweep `data/sweeps/h200-llama70b-decode.parquet`.

# %%
import dataclasses

import pandas as pd
from IPython.display import Markdown, display

from cpa import analysis as A
from cpa import bench as B
from cpa import hardware as hw
from cpa import occupancy as O
from cpa import plots as P

static = {arch: O.load_static_table(arch) for arch in ("gfx942", "gfx90a", "sm_90")}
for arch, t in static.items():
    print(f"{arch}: {t.variant.nunique()} variants, {len(t)} kernels, sources digest "
          f"{t.sources_digest.iloc[0]} (compiled)")

# %% [markdown]
# ## The calculators agree with their references
# On gfx942 and gfx90a the CDNA model of the compiler's `Occupancy [waves/SIMD]` is compared
# with what clang reported, on every row. On sm_90 the Hopper calculator was compared on the
# H200 with `cudaOccupancyMaxActiveBlocksPerMultiprocessor`.

# %%
for arch in ("gfx942", "gfx90a"):
    c = O.compare_cdna(static[arch])
    print(f"{arch}: model == compiler's waves/SIMD on {int((c.compiler_model == c.compiler).sum())} of {len(c)} "
          f"kernels; hardware model (LDS in 512-byte blocks) == compiler on "
          f"{int((c.hardware_model == c.compiler).sum())}")
chk = pd.read_csv(A.ROOT / "data" / "static" / "h200-occupancy-check.csv")
print(f"sm_90: calculator == cudaOccupancyMaxActiveBlocksPerMultiprocessor on {int(chk['match'].sum())} of "
      f"{len(chk)} kernels (measured on {chk.device_name.iloc[0]}, commit {str(chk.git_commit.iloc[0])[:7]})")

# %% [markdown]
# ## The AMD kernels run: the wave emulator
# Compiled figures say what clang allocates, not whether the AMD code computes the right
# thing. `cpa.emu` runs the same HIP source on this machine's CPU through a lock-step wave
# emulator (wave64, `ds_bpermute`, the MFMA operand layouts AMD documents, LDS and barriers)
# and compares it with the reference. These rows are **emulated**: correctness and the count
# of wave-wide operations (MFMA, permutes, wave barriers) per launch, no timing. mfma4's P x V
# was rebuilt this way (tenth session): 4 head dims per 4x4x4 block instead of 4 tokens, so it
# owes no sum over the blocks -- about a tenth of the wave operations it needed, and 2 waves per
# SIMD at head 128 instead of 1 in the table below. The same emulator runs the NVIDIA side
# (`platform="cuda"`: warp32, mma.sync m16n8k16 / m16n8k8, movmatrix), after the AMD rows. Its
# wave-op counts are of other instructions (smaller mma tiles, quad shuffles), and mfma16 holds
# 8 heads there against AMD's 16: compare the counts within a platform only.

# %%
from cpa import emu
from cpa.static import find_clang

try:
    find_clang()
except RuntimeError as e:  # no clang++ on this machine (an emulator failure itself is not caught)
    print(f"emulator skipped: {e}")
else:
    rows = [emu.check(t, p, dtype=dt, kv_cache_dtype=kv, platform=pf) for pf in ("hip", "cuda")
            for t in ("mfma16", "mfma4", "scalar") for p in (256, 1024) for dt, kv in (("fp16", "auto"), ("bf16", "fp8"))]
    display(pd.DataFrame(rows)[["variant", "wave_ops", "rel_err", "ok"]])

# %% [markdown]
# The shared-steps kernel (the workgroups of a sequence take its steps from one counter) is where
# workgroups meet. Run one after another in grid order, the first workgroup of each sequence takes
# every ticket; with `workgroups_at_once=4` they are dispatched in a seeded random order and take
# turns after every wave-wide operation, so the tickets spread. Two schedules, both right; the
# outputs differ in their last bits because other workgroups summed other steps. The last rows
# run NVIDIA's cluster combine the same way (a cluster's workgroups at once; with turns
# "until_blocked" a rank runs ahead of the rest), then its programmatic dependent launches
# (`pdl=True`: a kernel writing the inputs, the attention kernel, the reduce kernel, each started
# beside the one before and held at `griddepcontrol.wait` until it has ended; a kernel that read
# the inputs or the partials before its wait would read poison here). One workgroup runs at a
# time: interleavings, plus the release and acquire of the memory model (a workgroup's partials
# are hidden from the others until its acquire-release count publishes them, and from each thread
# of the last workgroup until it has acquired them).

# %%
try:
    find_clang()
except RuntimeError as e:
    print(f"emulator skipped: {e}")
else:
    rows = [emu.check("mfma16", 512, platform=pf, shared_steps=True, seq_lens=(17, 1600, 4100),
                      workgroups_at_once=n, schedule_seed=seed)
            for pf in ("hip", "cuda") for n, seed in ((1, 0), (4, 1), (4, 2))]
    # the sm_90 cluster combine (NVIDIA only): a cluster's 9 workgroups run at once
    rows += [dict(emu.check("mfma16", 256, platform="cuda", cluster_reduce=True, seq_lens=(17, 2100),
                            workgroups_at_once=9, turns=turns), variant=f"cluster of 9, turns {turns}")
             for turns in ("random", "until_blocked")]
    # the sm_90 PDL chain (NVIDIA only): input writer -> attention -> reduce, 8 workgroups at once
    rows += [dict(emu.check("mfma16", 256, platform="cuda", pdl=True, seq_lens=(17, 2100), workgroups_at_once=8,
                            schedule_seed=seed), variant=f"PDL chain, schedule {seed}") for seed in (1, 2)]
    display(pd.DataFrame(rows)[["variant", "switches", "wave_ops", "rel_err", "ok"]])

# %% [markdown]
# ## Registers decide the occupancy
# Attention kernel, fp16, 16-bit KV cache, block 16. The partition size does not change a
# kernel's registers (it is a loop bound), only the grid; the tiling and the head size do.
# A CDNA3 SIMD has 512 VGPRs per lane (VGPRs and AGPRs from one file, 8-register granule):
# <= 256 gives 2 waves per SIMD, <= 168 gives 3. A Hopper SM has 64K 32-bit registers:
# 4 warps x 216-221 registers per block (the mma tilings) leaves room for 2 blocks.

# %%
res = {arch: O.resource_table(arch, block_size=16, dtype="fp16", kv_cache_dtype="auto")
       for arch in ("gfx942", "sm_90")}
P.show(P.register_budget(res))
cols = {"gfx942": ["tiling", "heads_cap", "head_size", "vgprs", "agprs", "total_vgprs", "lds_bytes", "spills",
                   "waves_per_simd_compiler", "waves_per_simd", "workgroups_per_cu", "limit"],
        "sm_90": ["tiling", "heads_cap", "head_size", "registers", "shared_bytes", "stack_bytes", "spills",
                  "blocks_per_sm", "warps_per_sm", "limit"]}
for arch, t in res.items():
    display(Markdown(f"**{arch}** (compiled; occupancy modeled from it)"))
    display(t[t.partition_size == 256][cols[arch]].reset_index(drop=True))

# %% [markdown]
# ## Grid-level waves against partition size
# One workgroup per (sequence, KV head, partition): Llama-3.1-70B has 8 KV heads, so a
# batch of 1 at 32k tokens launches 8 x 32768 / P workgroups. MI300X has 304 CUs x 3
# resident mfma16 workgroups (head 128: 3 waves per SIMD compiled, the slots modeled from it)
# = 912 slots; the H200 has 132 SMs x 2 = 264.
# MI300X needs more than three times the workgroups to fill, so it wants smaller partitions
# for the same shape.

# %%
SHAPES = [dict(num_seqs=b, num_heads=64, num_kv_heads=8, max_seq_len=c) for b in (1, 8, 32, 128)
          for c in (2048, 8192, 32768)]
grids = [O.grid_table(arch, SHAPES, tilings=["mfma16"]) for arch in ("gfx942", "sm_90")]
P.show(P.grid_fill(grids))

# %% [markdown]
# ## A wave model, fitted on the H200 and then applied to MI300X
# `cpa.occupancy.WaveModel`: every wave of resident workgroups pays a fixed cost
# (`t_wave`: the dependent loads of sequence length, block table and first K block, the
# softmax epilogue); the bytes stream at the read bandwidth times the fraction of compute
# units busy, wave by wave, so a short last wave streams at its own fill (on the H200 one
# workgroup per SM reads about as fast as two); a launched reduce
# adds its own cost and reads the partials back. Its three times are fitted by non-negative
# least squares to the **measured** mfma16 rows of the H200 sweep (partitions 64-8192). If it
# picks the H200's measured best partition size, it is worth applying to the compiled MI300X
# resources.

# %%
sweep = A.sweep_results("llama70b-decode", mode="shipped")
SWEEP_SHAPES = [dict(num_seqs=int(b), num_heads=64, num_kv_heads=8, max_seq_len=int(c))
                for b, c in sweep.df[["num_seqs", "max_seq_len"]].drop_duplicates().itertuples(index=False)]
# the partition sizes the sweep measured (the model is fitted and compared on those only)
SWEEP_P = sorted(int(p) for p in A.cpa_rows(sweep.df).partition_size.unique())
model, fitted = B.refit_shape_model(sweep.df, source=f"the H200 sweep (mfma16, {len(SWEEP_SHAPES)} shapes x "
                                                     f"{len(SWEEP_P)} partition sizes)")
err = fitted.model_us / fitted.time_us
print(f"modeled / measured: median {err.median():.3f}, 10-90% {err.quantile(0.1):.2f}-{err.quantile(0.9):.2f}")
P.show(P.model_vs_measured(fitted, model))
h200 = pd.concat([O.single_choice(fitted, "time_us").assign(scenario="H200 measured"),
                  O.single_choice(fitted, "model_us").assign(scenario="H200 modeled")], ignore_index=True)
display(h200.pivot(index="partition_size", columns="scenario", values="geomean_slowdown").round(3))

# %% [markdown]
# On MI300X the same model gets the compiled slots and MI300X's HBM bandwidth
# (`cpa.hardware.MI300X`, 5.3 TB/s) times the fraction of peak the H200 reached in the same
# sweep. Its fixed costs are **not known** on MI300X: they are varied from half to twice the
# H200's. (The bandwidth MI300X reaches is not known either, but it needs no axis of its own:
# the model's time is streaming plus fixed costs, so dividing the bandwidth by k picks the same
# partition sizes as multiplying the fixed costs by 1 / k -- reaching 80% of peak instead of the
# H200's 96% is the 0.83x case, inside the range shown.) Two builds of the same source: the default, where mfma16 asks clang for two resident
# workgroups per CU (`CPA_MIN_BLOCKS`; clang then keeps the accumulators in VGPRs and head 128
# fits **3** workgroups per CU, 912 slots), and `-DCPA_MIN_BLOCKS=1`, the allocation clang picks
# unasked (accumulators in AGPRs, 145 + 32 registers, **2** per CU, 608 slots;
# `data/static/gfx942-min-blocks-1.csv`). Every MI300X bar below is **modeled**.

# %%
frac = model.bw_bytes_per_s / hw.H200.hbm_bandwidth_bytes_per_s
builds = {"3 per CU": O.load_static_table("gfx942"),
          "2 per CU, -DCPA_MIN_BLOCKS=1": O.load_static_table("gfx942-min-blocks-1")}
rows = [h200[h200.scenario == "H200 measured"]]
for build, table in builds.items():
    g942 = O.grid_table("gfx942", SWEEP_SHAPES, tilings=["mfma16"], partition_sizes=SWEEP_P, df=table)
    print(f"gfx942 mfma16 head 128, {build}: {int(g942.slots.iloc[0])} slots")
    for k in (0.5, 1.0, 2.0):
        m = dataclasses.replace(model, bw_bytes_per_s=hw.MI300X.hbm_bandwidth_bytes_per_s * frac,
                                t_wave_us=model.t_wave_us * k, t_reduce_us=model.t_reduce_us * k,
                                t_launch_us=model.t_launch_us * k, source=f"MI300X, {k}x the H200 fixed costs")
        g = g942.assign(model_us=m.predict(g942))
        rows.append(O.single_choice(g, "model_us").assign(scenario=f"MI300X modeled ({build}), fixed costs {k}x"))
choice = pd.concat(rows, ignore_index=True)
P.show(P.single_choice_bars(choice, title="Best single partition size: H200 measured, MI300X modeled "
                                          "(gfx942 compiled resources, two builds)"))
ranked = choice.sort_values("geomean_slowdown").groupby("scenario", sort=False)
best = pd.DataFrame([dict(scenario=sc, best=int(g.partition_size.iloc[0]), slowdown=round(g.geomean_slowdown.iloc[0], 3),
                          runner_up=int(g.partition_size.iloc[1]), runner_up_slowdown=round(g.geomean_slowdown.iloc[1], 3))
                     for sc, g in ranked])
display(best.sort_values("scenario").reset_index(drop=True))

# %% [markdown]
# Read it as: if one partition size must serve every shape, the H200 (132 SMs, 264 slots) is
# best served by 512, measured and modeled. MI300X has 304 CUs, so the same decode shapes fill it with smaller partitions: with
# 608 slots the model picks 256 — upstream's choice — whether its fixed costs are half or twice
# the H200's; with the 912 slots of the default build it picks 256 at the H200's fixed costs or
# more, and 128 and 256 are within a fraction of a percent of each other at half of them (the
# table above has the margins). More resident workgroups per CU push the best partition down:
# occupancy and partition size are one decision. The fitted fixed cost is the per-wave one (the
# reduce and launch costs fit to zero once the bandwidth term counts busy compute units). All of
# it is a model on compiled resources, not a measurement; an MI300 run of `cpa sweep --grid
# llama70b-decode`, with and without `-DCPA_MIN_BLOCKS=1`, would settle it.

# %% [markdown]
# ## One size per device, or one per shape
# A fixed size is what upstream ships; nothing in the kernel needs it. The model above
# predicts each (shape, partition size) cell, so the launcher can take, for each launch, the
# size the model predicts fastest: that is the sm_90 default (`partition_size=None`:
# `cpa.variants.BY_SHAPE`, `cpa.occupancy.partition_by_wave_model`), among the sizes that give
# each of the workgroup's 4 waves at least one step (128 and up) and with the slots the CUDA
# runtime reports for the built kernel. In effect it takes the largest partition whose grid
# keeps every SM busy in the fewest waves. Against the H200 sweep's **measured** per-shape
# best (any tiling, any size), shape by shape:

# %%
by_shape = B.by_shape_choice(sweep.df)
fixed = B.fixed_choice(sweep.df, "mfma16", 512)
print(f"partition size by shape: {B.geomean(by_shape.slowdown):.3f}x the per-shape best (geometric mean), "
      f"worst {by_shape.slowdown.max():.2f}x; fixed mfma16 / 512: {B.geomean(fixed.slowdown):.3f}x, "
      f"worst {fixed.slowdown.max():.2f}x ({len(by_shape)} shapes, measured on the H200)")
P.show(P.default_vs_fixed(by_shape, fixed, title="H200 (measured): the shape-chosen partition size against a "
                                                 "fixed 512, time / per-shape best"))

# %% [markdown]
# On MI300X the same rule is only a model (no MI300 has run this code), so gfx942 keeps
# upstream's fixed 256. What the model says a per-shape choice would be worth there, with the
# compiled slots of the default build and the H200's fixed costs (**modeled**):

# %%
g942 = O.grid_table("gfx942", SWEEP_SHAPES, tilings=["mfma16"], partition_sizes=SWEEP_P)
mi300 = dataclasses.replace(model, bw_bytes_per_s=hw.MI300X.hbm_bandwidth_bytes_per_s * frac,
                            source="MI300X, the H200's fixed costs")
g942 = g942.assign(model_us=mi300.predict(g942))
per_shape = g942[g942.partition_size >= 128].groupby(["num_seqs", "max_seq_len"]).model_us.min()
at256 = g942[g942.partition_size == 256].set_index(["num_seqs", "max_seq_len"]).model_us
gain = B.geomean(at256 / per_shape)
picks = g942[g942.partition_size >= 128].loc[lambda d: d.groupby(["num_seqs", "max_seq_len"]).model_us.idxmin()]
print(f"MI300X, modeled: fixed 256 is {gain:.3f}x the model's per-shape choice (geometric mean over "
      f"{len(per_shape)} shapes); the per-shape sizes range over {sorted(int(p) for p in picks.partition_size.unique())}")

# %% [markdown]
# The H200 numbers are measured rows, read through the rule; the MI300X line is a model on
# compiled resources. The next H200 session times the default itself in `cpa bench` (its
# closing table).
#
# ## Does the model carry to another card? An H100, measured
# The MI300X lines above take a model fitted on one card to another. That step can be checked
# on a second card that this project can run: the same llama70b-decode sweep on an **NVIDIA
# H100** (132 SMs as the H200 and the same compiled kernels, but a read ceiling of 3.2 TB/s
# against 4.6; `data/sweeps/experiments/h100-llama70b-decode-c7e79b8.parquet`; its two largest
# points, 256 x 16k and 32k, did not fit the card's 80 GB beside the sweep's input sets then;
# they were measured later on another H100, whose read ceiling was 2.5% lower, and are kept
# apart in `h100-llama70b-decode-s256-df60a7d.parquet`, since one fit over two cards' rows
# would read the card's difference as a cost of the kernel).
# Three rules against the H100's own per-shape best: the sm_90 default as shipped (the H200's
# constants, not refitted), the same rule with the model refitted to the H100's rows, and the
# best fixed size. These are H100 measurements, not H200 or MI300 ones.

# %%
h100 = A.shipped_sweep_on("llama70b-decode", "h100")
display(Markdown(h100.banner()))
transfer = B.model_transfer(h100.df)
display(transfer.round(3))
fixed_size = int(transfer.fixed_partition_size.dropna().iloc[0])
P.show(P.default_vs_fixed(B.by_shape_choice(h100.df), B.fixed_choice(h100.df, "mfma16", fixed_size),
                          title=f"H100 (measured): the shipped shape rule against a fixed {fixed_size}, "
                                "time / per-shape best"))

# %% [markdown]
# The same H100 ran the four other grids (GQA ratios, head sizes, mixed lengths, fp8 caches;
# `data/sweeps/experiments/h100-*-a1f9c4d.parquet`): the shipped rule against each grid's
# per-shape best, beside the H200's tables (both **measured**, each on its own card).

# %%
GRIDS = ("llama70b-decode", "gqa-scan", "head-size-scan", "mixed-lengths", "kv-dtype-scan")
rule_rows = []
for grid in GRIDS:
    for card, data in (("H100", A.shipped_sweep_on(grid, "h100")), ("H200", A.sweep_results(grid, mode="shipped"))):
        t = B.by_shape_choice(data.df)
        rule_rows.append(dict(grid=grid, card=card, shapes=len(t), geomean_slowdown=B.geomean(t.slowdown),
                              worst_slowdown=t.slowdown.max()))
rule_on_cards = pd.DataFrame(rule_rows)
display(rule_on_cards.pivot(index="grid", columns="card", values=["geomean_slowdown", "worst_slowdown"]).round(3))

# %% [markdown]
# Read it as: the constants do not carry over (refitted on the H100, the per-wave cost is
# about 1 us instead of 1.7, and a reduce and a launch cost of about 4 us each appear that fit
# to zero on the H200), yet the choice does: the shipped model picks the refit's size at all
# but two shapes and lands within about 1% of the H100's per-shape best, as on the H200,
# against 8% for the best fixed size. The rule takes, in effect, the largest partition
# that keeps every SM busy in the fewest waves, and that is a matter of slots and SMs, not of
# the fixed costs (on the H100 any per-wave cost from 0.5 to 3 us picks the same sizes). The
# hardest shape is the same on both cards: 4 x 2k, where the rule picks 256 and 512 is faster.
# Over the other four grids the rule stays within 0.6% of the H100's per-shape best by
# geometric mean (worst 1.05x, head 256 at 16 x 2k), as within 0.5% of the H200's.
# That is the part of the model the MI300X lines lean on; what differs on MI300X is the slots
# (912 or 608 against 264), which are compiled, not assumed.
#
# ## Taking a tuned result to a production build
# `cpa export` writes such a choice as a JSON file and a C++ header that answer the same lookup
# (data/export/README.md). The one shipped for MI300X is the model above, restricted to the two
# sizes upstream's ROCm dispatch instantiates, 256 and 512 (**modeled**; an MI300 sweep fed to
# `cpa export --from` replaces it with measurements): the size it gives each shape, by (sequence,
# KV head) pairs and context length.

# %%
from cpa import export as E

tuned = E.load(A.ROOT / "data" / "export" / "mi300x-modeled-256-512.json")
(cfg,) = tuned["configs"]
print(tuned["provenance"]["evidence_detail"])
print(f"best single size {cfg['fixed_partition_size']}: {cfg['fixed_geomean_slowdown']:.3f}x the modeled "
      f"per-shape choice (geometric mean), worst {cfg['fixed_worst_slowdown']:.2f}x")
display(pd.DataFrame(cfg["entries"]).pivot(index="kv_seqs", columns="max_seq_len", values="partition_size"))

# %% [markdown]
# ## Explore the compiled tables

# %%
import ipywidgets as W

arch_w = W.Dropdown(options=list(static), description="arch")
head_w = W.Dropdown(options=[64, 128, 256], value=128, description="head")
kv_w = W.Dropdown(options=["auto", "fp8"], description="KV cache")
out = W.Output()


def redraw(*_):
    t = O.resource_table(arch_w.value, head_size=head_w.value, kv_cache_dtype=kv_w.value, block_size=16)
    with out:
        out.clear_output(wait=True)
        display(t[t.partition_size == 256].drop(columns=["symbol", "sources_digest"], errors="ignore"))


for w in (arch_w, head_w, kv_w):
    w.observe(redraw, names="value")
redraw()
display(W.VBox([W.HBox([arch_w, head_w, kv_w]), out]))
