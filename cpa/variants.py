"""The kernel's compile-time variants, their constraints, and the per-device defaults.

A variant is one instantiation of ``cpa/csrc``: tiling x partition size x head size x block
size x query dtype x KV-cache dtype x heads-per-tile capacity, for one platform (``cuda`` or
``hip``). Every constraint lives here so that an invalid combination raises before any
compiler runs.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import asdict, dataclass
from typing import Iterable, Iterator

TILINGS = ("mfma16", "mfma4", "scalar")
PARTITION_SIZES = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
HEAD_SIZES = (64, 128, 256)
BLOCK_SIZES = (16, 32)
DTYPES = ("fp16", "bf16")
KV_CACHE_DTYPES = ("auto", "fp8")
PLATFORMS = ("cuda", "hip")
MAX_GQA = 16


@dataclass(frozen=True)
class TilingInfo:
    """How a tiling maps onto one platform's matrix cores."""

    tokens_per_step: int  # context tokens one wave handles per step
    heads_caps: tuple[int, ...]  # query heads per KV head a compiled variant can hold
    instruction: str | None  # the matrix-core instruction (None: plain FMAs)
    isa_pattern: str | None  # regex its mnemonic has in the ISA (gfx) or PTX (sm)
    note: str


TILING_INFO: dict[tuple[str, str], TilingInfo] = {
    ("mfma16", "hip"): TilingInfo(
        32, (16,), "v_mfma_f32_16x16x16_{f16,bf16}", r"v_mfma_f32_16x16x16_?(f16|bf16)",
        "16x16x16 MFMA: tokens x 16 query heads; the QK result is P's B operand in place"),
    ("mfma4", "hip"): TilingInfo(
        64, (4,), "v_mfma_f32_4x4x4_16b_{f16,bf16}", r"v_mfma_f32_4x4x4_?16b_(f16|bf16)",
        "4x4x4 16-block MFMA: 16 blocks of 4 tokens x 4 query heads (GQA <= 4)"),
    ("scalar", "hip"): TilingInfo(
        64, (1, 2, 4, 8, 16), None, None, "no matrix cores: lane = token for QK, lane = head dim for PV"),
    ("mfma16", "cuda"): TilingInfo(
        32, (8, 16), "mma.sync.m16n8k16", r"mma\.sync\.aligned\.m16n8k16",
        "m16n8k16: 16 tokens x 8 query heads per tile (two n-tiles for GQA 9-16); movmatrix turns S into P's B operand"),
    ("mfma4", "cuda"): TilingInfo(
        32, (8, 16), "mma.sync.m16n8k8", r"mma\.sync\.aligned\.m16n8k8",
        "m16n8k8: the same data movement with the half-depth instruction; n = 8 is the smallest n of fp16 mma.sync, "
        "so the small-GQA move left on NVIDIA is a shallower k"),
    ("scalar", "cuda"): TilingInfo(
        32, (1, 2, 4, 8, 16), None, None, "no matrix cores: lane = token for QK, lane = head dim for PV"),
}

WAVE_SIZE = {"cuda": 32, "hip": 64}


def _choices(name: str, value, allowed: Iterable) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; allowed: {', '.join(map(repr, allowed))}")


def platform_of_arch(arch: str) -> str:
    if arch.startswith("gfx"):
        return "hip"
    if arch.startswith("sm_"):
        return "cuda"
    raise ValueError(f"arch={arch!r}: expected 'gfx...' (AMD) or 'sm_XX' (NVIDIA)")


@dataclass(frozen=True, order=True)
class Variant:
    tiling: str
    partition_size: int
    head_size: int
    block_size: int
    dtype: str  # query / output dtype: fp16 or bf16
    kv_cache_dtype: str  # auto (same as query) or fp8 (e4m3fn bytes)
    heads_cap: int  # query heads per KV head this instantiation holds
    platform: str  # cuda or hip

    def __post_init__(self) -> None:
        self.validate()

    # ---------------------------------------------------------------- constraints
    def validate(self) -> None:
        _choices("platform", self.platform, PLATFORMS)
        _choices("tiling", self.tiling, TILINGS)
        _choices("partition_size", self.partition_size, PARTITION_SIZES)
        _choices("head_size", self.head_size, HEAD_SIZES)
        _choices("block_size", self.block_size, BLOCK_SIZES)
        _choices("dtype", self.dtype, DTYPES)
        _choices("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        info = self.info
        if self.heads_cap not in info.heads_caps:
            raise ValueError(
                f"heads_cap={self.heads_cap} is not supported by tiling {self.tiling!r} on {self.platform}; "
                f"allowed: {info.heads_caps}")
        if self.partition_size % info.tokens_per_step:
            raise ValueError(
                f"partition_size={self.partition_size} is not a multiple of the {info.tokens_per_step} tokens "
                f"one wave of tiling {self.tiling!r} handles per step on {self.platform}")
        if self.partition_size % self.block_size:
            raise ValueError(f"partition_size={self.partition_size} is not a multiple of block_size={self.block_size}")
        if self.tiling == "scalar" and self.head_size % WAVE_SIZE[self.platform]:
            raise ValueError(f"tiling 'scalar' needs head_size a multiple of the wave size {WAVE_SIZE[self.platform]}")

    @property
    def info(self) -> TilingInfo:
        return TILING_INFO[(self.tiling, self.platform)]

    @property
    def tokens_per_step(self) -> int:
        return self.info.tokens_per_step

    @property
    def tile_dtype(self) -> str:
        """The matrix cores' operand dtype: bf16 queries with an fp8 cache run fp16 tiles (the
        cache decodes to fp16 in fewer instructions; cpa/csrc/attention.h CPA_FP8_F16_MMA, on
        by default), every other variant its query dtype. The scalar tiling has no tiles."""
        return tile_dtype(self.tiling, self.dtype, self.kv_cache_dtype)

    @property
    def name(self) -> str:
        return (f"{self.tiling}-p{self.partition_size}-h{self.head_size}-b{self.block_size}-{self.dtype}-"
                f"kv{self.kv_cache_dtype}-g{self.heads_cap}-{self.platform}")

    def as_dict(self) -> dict:
        return asdict(self)

    # ---------------------------------------------------------------- C++ spelling
    def cpp_config(self) -> str:
        tag = {"mfma16": "cpa::TilingMfma16", "mfma4": "cpa::TilingMfma4", "scalar": "cpa::TilingScalar"}[self.tiling]
        dt = {"fp16": "cpa::F16", "bf16": "cpa::BF16"}[self.dtype]
        fp8 = "true" if self.kv_cache_dtype == "fp8" else "false"
        return f"{tag}, {dt}, {self.head_size}, {self.block_size}, {fp8}, {self.partition_size}, {self.heads_cap}"

    def source(self) -> str:
        """The translation unit that instantiates exactly this variant (with its C entry points)."""
        return f'#include "launch.h"\nCPA_DEFINE_VARIANT("{self.name}", {self.cpp_config()})\n'

    def kernel_instantiation_source(self) -> str:
        """Kernels only (no host entry points): for compile-only analysis with clang or nvcc."""
        return (
            '#include "attention.h"\n'
            f"template __global__ void cpa::paged_attention_kernel<cpa::AttnConfig<{self.cpp_config()}>>"
            "(cpa::AttnParams);\n"
            f"template __global__ void cpa::paged_attention_reduce_kernel<"
            f"{ {'fp16': 'cpa::F16', 'bf16': 'cpa::BF16'}[self.dtype] }, {self.head_size}>(cpa::ReduceParams);\n"
            f"template __global__ void cpa::paged_attention_reduce_few_kernel<"
            f"{ {'fp16': 'cpa::F16', 'bf16': 'cpa::BF16'}[self.dtype] }, {self.head_size}>(cpa::ReduceParams);\n"
        )


def tile_dtype(tiling: str, dtype: str, kv_cache_dtype: str) -> str:
    """See Variant.tile_dtype."""
    return "fp16" if (dtype == "bf16" and kv_cache_dtype == "fp8" and tiling != "scalar") else dtype


# The reduce kernel a launch picks (cpa/csrc/attention.h use_reduce_few and its macros; a
# test checks these against the header). "reduce_few": HEAD / 4 threads per head combine a
# handful of partials serially without barriers; "reduce": one workgroup per head.
REDUCE_FEW_MAX = 16
REDUCE_FEW_ALWAYS = 4
REDUCE_FEW_MIN_HEADS = 1024
REDUCE_THREADS = 128  # workgroup size of "reduce" (ReduceConfig::THREADS)
REDUCE_FEW_THREADS = 256  # and of "reduce_few" (ReduceFewConfig::THREADS)


def reduce_kernel(max_num_partitions: int, num_seqs: int, num_heads: int) -> str | None:
    """'reduce_few', 'reduce', or None (one partition: the attention kernel writes `out`)."""
    if max_num_partitions <= 1:
        return None
    if max_num_partitions <= REDUCE_FEW_MAX and (max_num_partitions <= REDUCE_FEW_ALWAYS
                                                 or num_seqs * num_heads >= REDUCE_FEW_MIN_HEADS):
        return "reduce_few"
    return "reduce"


def reduce_workgroups(kernel: str | None, num_seqs: int, num_heads: int, head_size: int) -> int:
    """Workgroups of that reduce launch: (num_heads, num_seqs) for 'reduce', heads packed
    REDUCE_FEW_THREADS / (head_size / 4) to a workgroup for 'reduce_few'."""
    if kernel is None:
        return 0
    if kernel == "reduce":
        return num_heads * num_seqs
    per = REDUCE_FEW_THREADS // (head_size // 4)
    return -(-num_heads // per) * num_seqs


def dtype_name(dtype) -> str:
    """'fp16' / 'bf16' from a torch dtype or a string."""
    s = str(dtype).replace("torch.", "")
    table = {"float16": "fp16", "half": "fp16", "fp16": "fp16", "bfloat16": "bf16", "bf16": "bf16"}
    if s not in table:
        raise TypeError(f"query dtype {dtype} is not supported by the kernel; allowed: torch.float16, torch.bfloat16")
    return table[s]


def kv_name(kv_cache_dtype: str) -> str:
    s = str(kv_cache_dtype).lower()
    if s == "auto":
        return "auto"
    if s in ("fp8", "fp8_e4m3"):
        return "fp8"
    raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported; allowed: 'auto', 'fp8', 'fp8_e4m3'")


def heads_cap_for(tiling: str, platform: str, gqa_ratio: int) -> int:
    """The smallest heads-per-tile capacity of `tiling` that holds `gqa_ratio` query heads."""
    if not 1 <= gqa_ratio <= MAX_GQA:
        raise ValueError(f"GQA ratio num_heads/num_kv_heads={gqa_ratio} is not supported; allowed: 1..{MAX_GQA}")
    _choices("tiling", tiling, TILINGS)
    _choices("platform", platform, PLATFORMS)
    caps = TILING_INFO[(tiling, platform)].heads_caps
    for cap in caps:
        if cap >= gqa_ratio:
            return cap
    raise ValueError(
        f"tiling {tiling!r} on {platform} holds at most {max(caps)} query heads per KV head, "
        f"but the GQA ratio is {gqa_ratio}")


def variant_for(*, tiling: str, partition_size: int, head_size: int, block_size: int, dtype, kv_cache_dtype: str,
                gqa_ratio: int, platform: str) -> Variant:
    """The variant that serves a launch of these parameters (ValueError where none does)."""
    args = (tiling, partition_size, head_size, block_size, dtype, kv_cache_dtype, gqa_ratio, platform)
    try:
        return _variant_for(*args)
    except TypeError:  # an unhashable argument: not kept
        return _variant_for.__wrapped__(*args)


# the eager launch path asks per call (~12 us each to build and validate a Variant)
@functools.lru_cache(maxsize=4096)
def _variant_for(tiling, partition_size, head_size, block_size, dtype, kv_cache_dtype, gqa_ratio, platform) -> Variant:
    return Variant(tiling=tiling, partition_size=int(partition_size), head_size=int(head_size),
                   block_size=int(block_size), dtype=dtype_name(dtype), kv_cache_dtype=kv_name(kv_cache_dtype),
                   heads_cap=heads_cap_for(tiling, platform, gqa_ratio), platform=platform)


def all_variants(platform: str, *, tilings=TILINGS, partition_sizes=PARTITION_SIZES, head_sizes=HEAD_SIZES,
                 block_sizes=BLOCK_SIZES, dtypes=DTYPES, kv_cache_dtypes=KV_CACHE_DTYPES,
                 heads_caps=None) -> Iterator[Variant]:
    """Every valid variant of the cross product (invalid combinations are skipped)."""
    for t, p, h, b, d, kv in itertools.product(tilings, partition_sizes, head_sizes, block_sizes, dtypes,
                                               kv_cache_dtypes):
        for cap in TILING_INFO[(t, platform)].heads_caps:
            if heads_caps is not None and cap not in heads_caps:
                continue
            try:
                yield Variant(t, p, h, b, d, kv, cap, platform)
            except ValueError:
                continue


# The cluster combine (cpa/csrc/attention.h cluster_combine): on sm_90+ a launch with 2 to
# CLUSTER_MAX partitions per sequence may run each (sequence, KV head)'s partitions as one
# thread-block cluster that combines its partials through distributed shared memory inside
# the attention kernel -- no partials in global memory, no reduce launch. Above 8 (the
# portable cluster size) the kernel opts in to non-portable sizes; whether the device can
# hold such a cluster is asked at launch (BuiltKernel.max_active_clusters).
CLUSTER_MAX = 16  # cluster_combine's MAXC
CLUSTER_MIN_SM = 90


def cluster_unsupported(arch: str, max_num_partitions: int) -> str | None:
    """Why a launch cannot use the cluster combine (None: it can, device permitting)."""
    if not arch.startswith("sm_") or int(arch[3:]) < CLUSTER_MIN_SM:
        return f"thread-block clusters need sm_{CLUSTER_MIN_SM}+ (device arch {arch})"
    if max_num_partitions < 2:
        return "one partition per sequence: nothing to combine"
    if max_num_partitions > CLUSTER_MAX:
        return (f"{max_num_partitions} partitions per sequence; a cluster holds at most {CLUSTER_MAX} "
                f"(use a larger partition_size)")
    return None


# Measured (H200, commit 8ab7b8b, data/bench/experiments/h200-cluster-8ab7b8b.csv; h200-cluster-p8192-9c21a43.csv): the
# runtime holds 132 clusters of 2, 62 of 4, 30 of 8, 14 of 16 (2 workgroups per SM), and
# places a cluster's workgroups together in one GPC, so where a grid of at most one
# workgroup per SM would spread over every SM, its clusters fill about half of them. The
# combine then saves the reduce launch (5-15% at 16-64 workgroups: 1 x 512 .. 1 x 8k,
# 4 x 512, 4 x 2k) but costs bandwidth from 128 workgroups up (up to 1.33x slower at 256).
CLUSTER_AUTO_SM_FRACTION = 0.5


def cluster_default(arch: str, max_num_partitions: int, num_seqs: int, num_kv_heads: int, num_sms: int) -> bool:
    """Whether cluster_reduce=None picks the cluster combine for this launch: where it can, and
    the grid's workgroups are at most half the SMs (every measured such launch was faster)."""
    if cluster_unsupported(arch, max_num_partitions):
        return False
    return num_seqs * num_kv_heads * max_num_partitions <= CLUSTER_AUTO_SM_FRACTION * num_sms


# The fused reduce (`fused_reduce=True`, attention.h combine_partitions): the last workgroup of
# each (sequence, KV head) combines the partials, one L2 round trip per FUSED_ROUND partitions.
# fused_reduce=None picks it on sm_90 where a launch has FUSED_AUTO_PARTITIONS partitions and
# the cluster combine was not chosen. Measured on an H100 (one-round combine, f69733a / 74fe4ab,
# data/bench/experiments/h100-fused-combine-*.csv, mfma16, batch 1-8 x 8k-32k): time against
# the reduce launch, median 0.988-0.990 at 8 partitions (every row faster, in three calls),
# level at 2-4 and 16, 1.014 at 32 (two and four rounds).
FUSED_ROUND = 8  # partitions per round of combine_partitions (its K)
FUSED_AUTO_PARTITIONS = (5, FUSED_ROUND)
FUSED_AUTO_ARCHS = ("sm_90",)


def fused_default(arch: str, max_num_partitions: int) -> bool:
    """Whether fused_reduce=None picks the fused reduce for this launch (before the cluster
    combine's own choice, which wins where it is taken)."""
    lo, hi = FUSED_AUTO_PARTITIONS
    return arch in FUSED_AUTO_ARCHS and lo <= max_num_partitions <= hi


# Shared steps (`shared_steps=True`): the workgroups of one (sequence, KV head) take its steps
# from a common counter after one step each of their own, so a faster workgroup takes more.
# Each wave must own at least two steps of its partition for that to be worth a counter.
NUM_WAVES = 4  # waves per attention workgroup (attention.h AttnConfig)
SHARED_STEPS_MIN_STEPS_PER_WAVE = 2


def shared_steps_unsupported(variant: Variant, *, kv_async: bool = False) -> str | None:
    """Why a launch of `variant` cannot share its steps (None: it can)."""
    need = SHARED_STEPS_MIN_STEPS_PER_WAVE * NUM_WAVES * variant.tokens_per_step
    if variant.partition_size < need:
        return (f"partition_size={variant.partition_size}: shared steps need >= {need} tokens per partition "
                f"({SHARED_STEPS_MIN_STEPS_PER_WAVE} steps of {variant.tokens_per_step} per wave)")
    if kv_async:
        return "the staged / ring main loops (-DCPA_KV_ASYNC) keep fixed partitions"
    return None


# ---------------------------------------------------------------- per-device defaults
# One table: arch -> rules (max GQA ratio, tiling, partition size, where the choice comes from,
# and optionally the (query dtype, KV cache dtype) the rule is for); the first rule that fits wins.
# A partition size of BY_SHAPE means: chosen per launch, for its shape, by the device's wave model
# (SHAPE_MODELS; cpa.occupancy.partition_by_wave_model).
# gfx942 / gfx90a follow upstream's ROCm design (vLLM csrc/rocm/attention.cu: 256 tokens per
# partition; 4x4x4 MFMA for GQA 1-4, 16x16x16 for larger groups); it is compiled here, not
# measured. sm_90 is what cpa's own H200 bench and sweeps measured (data/bench, data/sweeps).
# (sm_90 had a bf16 + fp8 rule, mfma4, from 4887c51 until bf16 queries with an fp8 cache ran
# fp16 tiles, CPA_FP8_F16_MMA: since then mfma16 and mfma4 tie there as with fp16 queries.
# Its partition size was one fixed 512, the best single choice of the bench at 90fd147 (1.153x the
# per-shape best, geometric mean), until the shape rule replaced it on 2026-12-05.)
BY_SHAPE = "by_shape"
DEFAULTS: dict[str, list[tuple]] = {
    "gfx942": [(4, "mfma4", 256, "upstream ROCm design"), (16, "mfma16", 256, "upstream ROCm design")],
    "gfx90a": [(4, "mfma4", 256, "upstream ROCm design"), (16, "mfma16", 256, "upstream ROCm design")],
    "sm_90": [(16, "mfma16", BY_SHAPE,
               "measured on an H200: mfma16 and mfma4 tie (data/bench/h200-kernel.csv); the partition size "
               "is chosen per launch by the wave model fitted to the H200 sweep (SHAPE_MODELS): over the "
               "bench's 16 shapes 1.013x the per-shape best (geometric mean; worst 1.09x) against 1.146x "
               "(worst 2.01x) for the best fixed size (512), over the 56 shapes of "
               "data/sweeps/h200-llama70b-decode.parquet 1.004x (worst 1.13x) against 1.100x (1.76x); "
               "cpa.bench.by_shape_choice")],
}
# The wave model of cpa.occupancy (t = t_wave x waves + bytes / (read bandwidth x busy SMs) + ...)
# with the constants notebook 02 fits to the measured mfma16 rows of the H200 llama70b-decode sweep
# (non-negative least squares; t_reduce and t_launch fit to 0). The choice it makes is insensitive
# to t_wave: 1.5 to 3 us pick the same partition sizes over every shipped shape (below 1.5 us
# one shape moves: 256 x 32k of the llama70b-decode sweep, 8192 -> 4096, measured 0.9% slower).
SHAPE_MODELS: dict[str, dict] = {
    "sm_90": dict(t_wave_us=1.71, read_gbps=4605.0,
                  source="fitted to data/sweeps/h200-llama70b-decode.parquet (mfma16, 56 shapes x 8 partition "
                         "sizes; read ceiling of that sweep) by notebooks/02_occupancy.py"),
}
FALLBACK_DEFAULT = (16, "mfma16", 256, "no entry for this arch: mfma16 / 256")


def default_choice(arch: str, gqa_ratio: int, dtype=None, kv_cache_dtype: str | None = None) -> tuple[str, int | str, str]:
    """(tiling, partition_size, source) for a device arch and GQA ratio (and, where a rule asks
    for them, the query dtype and the KV cache dtype; left out, the 16-bit rules apply).
    partition_size is BY_SHAPE where the device picks it per launch (partition_candidates and
    cpa.occupancy.partition_by_wave_model)."""
    rules = DEFAULTS.get(arch, [FALLBACK_DEFAULT])
    want = (dtype_name(dtype) if dtype is not None else None, kv_name(kv_cache_dtype) if kv_cache_dtype else None)
    for max_gqa, tiling, partition_size, source, *only in rules:
        if only and tuple(only[0]) != want:
            continue
        if gqa_ratio <= max_gqa:
            return tiling, partition_size, source
    raise ValueError(f"GQA ratio {gqa_ratio} exceeds every default rule for arch {arch!r}")


def partition_candidates(*, tiling: str, head_size: int, block_size: int, dtype, kv_cache_dtype: str, gqa_ratio: int,
                         platform: str, max_seq_len: int, num_waves: int = NUM_WAVES) -> list[int]:
    """The partition sizes a shape-chosen default picks from: every size the variant builds
    with, at least one step for each wave of the workgroup (a shorter partition leaves waves
    idle: on the H200, mfma16 at 64 tokens took 1.04-1.62x the time of 128 at every shape of the
    llama70b-decode sweep, and 0.99-1.64x over the bench's, the 0.99 at 1 x 512), and at
    most the smallest one that covers `max_seq_len` (larger ones launch the same single
    partition). Empty only if the variant builds with no partition size at all."""
    sizes = []
    for p in PARTITION_SIZES:
        try:
            v = variant_for(tiling=tiling, partition_size=p, head_size=head_size, block_size=block_size, dtype=dtype,
                            kv_cache_dtype=kv_cache_dtype, gqa_ratio=gqa_ratio, platform=platform)
        except ValueError:
            continue
        sizes.append(v.partition_size)
    floor = [p for p in sizes if p >= num_waves * TILING_INFO[(tiling, platform)].tokens_per_step]
    sizes = floor or sizes[-1:]
    covering = [p for p in sizes if p >= max_seq_len]
    return [p for p in sizes if p < max_seq_len] + covering[:1]
