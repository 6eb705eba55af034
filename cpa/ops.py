"""`cpa.paged_attention`: the CPA kernel behind vLLM's ROCm paged_attention contract."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass

import torch

from . import variants as V
from .jit import BuiltKernel, build, device_arch, device_info, extra_flags, staged_loops_flagged
from .validation import PagedAttentionShape, validate_paged_attention_args

LOG2E = 1.4426950408889634
# The kernel decodes an e4m3 byte to a 16-bit float by moving its bits (platform.h): e4m3fn's
# value / 256, e4m3fnuz's (exponent bias 8, one more than e4m3fn's) value / 128. The host folds
# the factor into the scales, so one kernel binary reads either encoding.
FP8_DECODE_FACTORS = {"e4m3fn": 256.0, "e4m3fnuz": 128.0}


def select_variant(shape: PagedAttentionShape, *, tiling: str | None, partition_size: int | None,
                   platform: str, arch: str, resident_per_sm=None, compute_units: int | None = None,
                   allowed=None) -> V.Variant:
    """The variant for a validated call; None picks the per-device default of cpa.variants.

    Where that default's partition size is V.BY_SHAPE, it is the size the device's wave model
    (cpa.occupancy.partition_by_wave_model) predicts fastest for this shape, among
    V.partition_candidates that `allowed(variant)` accepts (None: all).
    `resident_per_sm(variant)` says how many workgroups of a variant one SM holds (ops builds
    it and asks the runtime); it is asked once, for the size a guess of RESIDENT_GUESS picks,
    and the choice is made again with its answer. `compute_units`: the device's SMs."""
    if tiling is not None:  # the caller's tiling, refused for what it is (not as "no partition size fits")
        V.heads_cap_for(tiling, platform, shape.gqa_ratio)
    fixed_default = False
    if tiling is None or partition_size is None:
        d_tiling, d_partition, _ = V.default_choice(arch, shape.gqa_ratio, shape.query_dtype, shape.kv_cache_dtype)
        tiling = tiling or d_tiling
        fixed_default = partition_size is None and d_partition != V.BY_SHAPE
        partition_size = partition_size or d_partition

    def variant_at(p: int) -> V.Variant:
        return V.variant_for(tiling=tiling, partition_size=p, head_size=shape.head_size,
                             block_size=shape.block_size, dtype=shape.query_dtype, kv_cache_dtype=shape.kv_cache_dtype,
                             gqa_ratio=shape.gqa_ratio, platform=platform)

    if partition_size == V.BY_SHAPE:
        partition_size = _by_shape(shape, variant_at, tiling=tiling, platform=platform, arch=arch,
                                   resident_per_sm=resident_per_sm, compute_units=compute_units, allowed=allowed)
    elif fixed_default and allowed is not None and not allowed(variant_at(partition_size)):
        # a device's fixed default the launch's options cannot take (shared steps need longer
        # partitions than gfx942's 256 with mfma4): the next size up that they can (the sizes
        # partition_candidates lists: those the variant builds with)
        every = _candidates(tiling, shape.head_size, shape.block_size, shape.query_dtype, shape.kv_cache_dtype,
                            shape.gqa_ratio, platform, max(V.PARTITION_SIZES))
        partition_size = next((p for p in every if p > partition_size and allowed(variant_at(p))), partition_size)
    return variant_at(partition_size)


RESIDENT_GUESS = 2  # workgroups per SM of the 16-bit head-128 variants on the H200 (data/static/sm_90.csv)


def _by_shape(shape: PagedAttentionShape, variant_at, *, tiling, platform, arch, resident_per_sm, compute_units,
              allowed) -> int:
    from . import occupancy as O

    model = O.shape_model(arch)
    if model is None:
        raise ValueError(f"no wave model for arch {arch!r} (cpa.variants.SHAPE_MODELS): give a partition_size")
    if shape.max_seq_len is None:
        raise ValueError("partition_size=None chooses the partition size by the launch's shape on this device: "
                         "give max_seq_len (or check_values=True), or a partition_size")
    if resident_per_sm is None or compute_units is None:
        raise ValueError("a shape-chosen partition size needs resident_per_sm and compute_units")
    cands = list(_candidates(tiling, shape.head_size, shape.block_size, shape.query_dtype, shape.kv_cache_dtype,
                             shape.gqa_ratio, platform, shape.max_seq_len))
    if allowed is not None:
        # e.g. shared steps need longer partitions than a short context's candidates: then the
        # shortest size they accept
        ok = [p for p in cands if allowed(variant_at(p))]
        every = _candidates(tiling, shape.head_size, shape.block_size, shape.query_dtype, shape.kv_cache_dtype,
                            shape.gqa_ratio, platform, max(V.PARTITION_SIZES))
        cands = ok or [p for p in every if allowed(variant_at(p))][:1]
    if not cands:
        raise ValueError(f"no partition size of {V.PARTITION_SIZES} fits this launch with tiling {tiling!r}")
    kv_elem = 1 if shape.kv_cache_dtype == "fp8" else 2

    def choose(per_sm: int) -> int:
        return _choose(model, tuple(cands), shape.num_seqs, shape.num_heads, shape.num_kv_heads, shape.head_size,
                       shape.max_seq_len, kv_elem, max(per_sm, 1) * compute_units, compute_units)

    guess = variant_at(choose(RESIDENT_GUESS))
    per_sm = int(resident_per_sm(guess))
    if per_sm < 1:
        raise ValueError(f"no workgroup of {guess.name} fits an SM of this device")
    return choose(per_sm)


# A decode loop asks for the same few shapes over and over: both steps of the choice are pure
# functions of hashable arguments, kept (from ~120 us to a few us per call).
@functools.lru_cache(maxsize=4096)
def _candidates(tiling, head_size, block_size, dtype, kv_cache_dtype, gqa_ratio, platform, max_seq_len) -> tuple:
    return tuple(V.partition_candidates(tiling=tiling, head_size=head_size, block_size=block_size, dtype=dtype,
                                        kv_cache_dtype=kv_cache_dtype, gqa_ratio=gqa_ratio, platform=platform,
                                        max_seq_len=max_seq_len))


@functools.lru_cache(maxsize=8192)
def _choose(model, cands: tuple, num_seqs, num_heads, num_kv_heads, head_size, max_seq_len, kv_elem, slots,
            compute_units) -> int:
    from . import occupancy as O

    return O.partition_by_wave_model(model, cands, num_seqs=num_seqs, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                     head_size=head_size, max_seq_len=max_seq_len, kv_elem_bytes=kv_elem,
                                     slots=slots, compute_units=compute_units)


@dataclass
class Launch:
    """Everything one call needs, resolved once: benchmarks replay `attention()`/`reduce()`."""

    kernel: BuiltKernel
    shape: PagedAttentionShape
    out: torch.Tensor
    exp_sums: torch.Tensor
    max_logits: torch.Tensor
    tmp_out: torch.Tensor | None
    attn_args: tuple
    reduce_args: tuple | None

    def __post_init__(self):
        # read once: each Tensor.device builds a new object, and a call needs the index 2-3 times
        self.device_index: int = self.out.device.index

    @property
    def num_partitions(self) -> int:
        return self.shape.max_num_partitions

    def _stream(self) -> int:
        return current_raw_stream(self.device_index)

    def _attention(self, stream: int) -> None:
        self.kernel.check(self.kernel.attention(*self.attn_args, stream), "attention")

    def _reduce(self, stream: int) -> None:
        if self.reduce_args is not None:
            self.kernel.check(self.kernel.reduce(*self.reduce_args, stream), "reduce")

    def attention(self, stream: int | None = None) -> None:
        with on_device(self.device_index):
            self._attention(self._stream() if stream is None else stream)

    def reduce(self, stream: int | None = None) -> None:
        with on_device(self.device_index):
            self._reduce(self._stream() if stream is None else stream)

    def __call__(self) -> torch.Tensor:
        with on_device(self.device_index):  # (one switch check for both kernels)
            stream = self._stream()
            self._attention(stream)
            self._reduce(stream)
        return self.out


_SAME_DEVICE = contextlib.nullcontext()
# (torch's raw query: a fraction of a microsecond, where torch.cuda.current_device() adds its
# lazy-init check to every launch of the eager and prepared paths)
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def on_device(device_index: int):
    """The launcher launches on the calling thread's current device: a Launch of tensors on
    another GPU switches to theirs for the call (as torch's own ops do), else nothing."""
    if device_index == _current_device():
        return _SAME_DEVICE
    return torch.cuda.device(device_index)


def current_raw_stream(device_index: int) -> int:
    """The current stream of a device as the launcher takes it (cudaStream_t / hipStream_t).
    torch's raw-stream query costs well under a microsecond where building a Stream object
    costs ~8 us (cpa host-profile); the public route stays as the fallback."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


GRID_YZ_MAX = 65535  # a launch grid's y and z extents (CUDA and HIP alike)
FLOAT32_MAX = 3.4028234663852886e38


def grid_limit_error(shape: PagedAttentionShape, num_partitions: int, partition_size: int, *,
                     reduce_launch: bool) -> str | None:
    """Why a launch's grids would exceed the y / z limit, or None: the attention grid is
    (num_seqs, num_partitions, num_kv_heads), the reduce's (heads, num_seqs)."""
    if num_partitions > GRID_YZ_MAX:
        return (f"max_seq_len={shape.max_seq_len} needs {num_partitions} partitions of {partition_size} tokens; "
                f"the grid allows at most {GRID_YZ_MAX}")
    if shape.num_kv_heads > GRID_YZ_MAX:
        return f"key_cache: num_kv_heads {shape.num_kv_heads} exceeds the grid's {GRID_YZ_MAX}"
    if reduce_launch and shape.num_seqs > GRID_YZ_MAX:
        return (f"query: num_seqs {shape.num_seqs} exceeds the reduce grid's {GRID_YZ_MAX} at {num_partitions} "
                f"partitions; split the batch, or use a partition size that covers max_seq_len")
    return None


def _folded_overflow(*folded: tuple[str, float]) -> ValueError:
    """The error for the first (name, factor) that is not a finite float32."""
    name, value = next((n, v) for n, v in folded if not abs(v) <= FLOAT32_MAX)
    return ValueError(f"{name}: folded into the kernel's float32 factor it overflows ({value:.3g} > {FLOAT32_MAX:.3g})")


def kernel_scalars(shape: PagedAttentionShape, scale, k_scale, v_scale, kv_elem: int) -> tuple:
    """(scale_log2, out_scale, kv_block_stride, kv_head_stride) as the attention kernel takes them:
    logits in log2 units with k_scale folded in, the output factor with v_scale, and the cache
    strides in bytes. The kernel decodes fp8 to value / FP8_DECODE_FACTORS[shape.fp8_format] (256
    for e4m3fn, 128 for e4m3fnuz), so both scales carry that factor back.
    Raises ValueError where a folded factor is not a finite float32 (the kernel's type)."""
    fp8 = shape.kv_cache_dtype == "fp8"
    factor = FP8_DECODE_FACTORS[shape.fp8_format or "e4m3fn"] if fp8 else 1.0
    scale_log2 = float(scale) * LOG2E * (float(k_scale) * factor if fp8 else 1.0)
    out_scale = float(v_scale) * factor if fp8 else 1.0
    if not (abs(scale_log2) <= FLOAT32_MAX and abs(out_scale) <= FLOAT32_MAX):  # (NaN fails too)
        raise _folded_overflow(("scale x k_scale" if fp8 else "scale", scale_log2), ("v_scale", out_scale))
    kv_head_stride = shape.head_size * shape.block_size * kv_elem
    return scale_log2, out_scale, shape.num_kv_heads * kv_head_stride, kv_head_stride


def fp8_format_unsupported(platform: str, fp8_format: str | None) -> str | None:
    """Why the kernels of `platform` cannot read caches of `fp8_format` (None: they can). The
    NVIDIA build decodes e4m3 with cvt.rn.f16x2.e4m3x2 (sm_89+), which reads e4m3fn: e4m3fnuz's
    largest bytes (0x7F, 0xFF: +-240) would decode as NaN. The AMD kernels move bits and read both."""
    if fp8_format == "e4m3fnuz" and platform == "cuda":
        return ("fp8_format='e4m3fnuz' (MI300's encoding) is not read by the NVIDIA kernels, which decode e4m3fn "
                "with the hardware conversion; store the cache as e4m3fn (vLLM does on NVIDIA)")
    return None


def prepare(query, key_cache, value_cache, block_tables, seq_lens, scale, *, partition_size=None, tiling=None,
            alibi_slopes=None, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0, out=None,
            return_intermediates=False, max_seq_len=None, check_values=True, fused_reduce=None,
            cluster_reduce=None, shared_steps=False, fp8_format=None, _stream_counters=False) -> Launch:
    """Validate, pick and build the variant, allocate buffers; launch nothing.

    fused_reduce: the last workgroup of each (sequence, KV head) combines the partitions
    itself instead of a second (reduce) launch; the intermediates are written either way.
    True requires it, False never, None picks (cpa.variants.fused_default; never where
    shared steps or the cluster combine run).
    cluster_reduce: the partitions of each (sequence, KV head) run as one thread-block
    cluster and combine through distributed shared memory (sm_90+, 2-16 partitions; no
    intermediates are written). True requires it, False never, None picks
    (cpa.variants.cluster_default).
    shared_steps: the workgroups of each (sequence, KV head) take its 32-token steps from a
    shared counter after one each of their own, instead of a fixed range of partition_size
    tokens each, so that the sequence's workgroups finish together; the reduce is unchanged.
    A partial is then of whichever steps its workgroup ran (so no return_intermediates),
    and the summation order -- hence the rounding of the output -- can differ between
    launches. Not with the fused reduce or the cluster combine.
    fp8_format: the e4m3 encoding of uint8 fp8 caches (cpa.validation; None: the device's --
    e4m3fnuz on gfx94x, e4m3fn elsewhere). e4m3fnuz is refused on NVIDIA, whose kernel decodes
    e4m3 with the hardware conversion (e4m3fn only)."""
    if not isinstance(query, torch.Tensor) or query.device.type != "cuda":
        raise ValueError(f"query must be a GPU tensor for the CPA kernel (got "
                         f"{getattr(query, 'device', type(query).__name__)}); use cpa.reference on the CPU")
    shape = validate_paged_attention_args(
        query, key_cache, value_cache, block_tables, seq_lens, scale, alibi_slopes=alibi_slopes,
        kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale,
        partition_size=partition_size, out=out, check_values=check_values, max_seq_len=max_seq_len, head_sizes=V.HEAD_SIZES,
        block_sizes=V.BLOCK_SIZES, query_dtypes=(torch.float16, torch.bfloat16), fp8_format=fp8_format)
    platform, arch = device_arch(query.device)
    why = fp8_format_unsupported(platform, shape.fp8_format)
    if why:
        raise ValueError(why)
    if shape.max_seq_len is None:
        raise ValueError("max_seq_len must be given when check_values=False")
    kv_async = staged_loops_flagged() if shared_steps else False  # (reads the flags: only where needed)
    allowed = (lambda v: V.shared_steps_unsupported(v, kv_async=kv_async) is None) if shared_steps else None
    variant = select_variant(shape, tiling=tiling, partition_size=partition_size, platform=platform, arch=arch,
                             resident_per_sm=lambda v: resident_per_sm(v, query.device, shared_steps=shared_steps),
                             compute_units=_num_sms(query.device), allowed=allowed)
    num_partitions = -(-shape.max_seq_len // variant.partition_size)
    why = grid_limit_error(shape, num_partitions, variant.partition_size, reduce_launch=False)
    if why:
        raise ValueError(why)
    shape = dataclasses.replace(shape, partition_size=variant.partition_size, max_num_partitions=num_partitions)
    fused = bool(fused_reduce) and num_partitions > 1
    if fused and "-DCPA_FUSED_REDUCE=0" in extra_flags():
        raise ValueError("fused_reduce=True, but CPA_NVCC_FLAGS compiles the fused reduce out (-DCPA_FUSED_REDUCE=0)")
    if shared_steps:
        why = shared_steps_refusal(variant, kv_async=kv_async, return_intermediates=return_intermediates,
                                   fused_reduce=fused_reduce, cluster_reduce=cluster_reduce)
        if why:
            raise ValueError(why)
        cluster_reduce = False
    kernel = build(variant, query.device)  # (after every refusal: a refused call costs no compile)
    cluster = _cluster_size(cluster_reduce, kernel, arch, shape, fused=fused,
                            return_intermediates=return_intermediates, query_device=query.device)
    if fused_reduce is None:
        # the device's rule (cpa.variants.fused_default) where no other combine runs: the cluster
        # combine's own rule was asked first (it wins at small grids)
        fused = (V.fused_default(arch, num_partitions) and not shared_steps and not cluster
                 and "-DCPA_FUSED_REDUCE=0" not in extra_flags())

    why = grid_limit_error(shape, num_partitions, variant.partition_size,
                           reduce_launch=num_partitions > 1 and not fused and not cluster)
    if why:
        raise ValueError(why)

    S, H, D = shape.num_seqs, shape.num_heads, shape.head_size
    dev = query.device
    if out is None:
        out = torch.empty_like(query)
    exp_sums = torch.empty(S, H, num_partitions, dtype=torch.float32, device=dev)
    max_logits = torch.empty_like(exp_sums)
    need_tmp = (num_partitions > 1 and not cluster) or return_intermediates
    tmp_out = torch.empty(S, H, num_partitions, D, dtype=torch.float32, device=dev) if need_tmp else None

    scale_log2, out_scale, kv_block_stride, kv_head_stride = kernel_scalars(shape, scale, k_scale, v_scale,
                                                                            key_cache.element_size())
    # per-Launch counters: zeroed once, reset by the kernel itself, so graph replays reuse them
    # (paged_attention's one-shot launches share one buffer per stream instead: no memset per call)
    counters = None
    if fused:
        counters = stream_counters(S * shape.num_kv_heads, dev) if _stream_counters else \
            torch.zeros(S * shape.num_kv_heads, dtype=torch.int32, device=dev)
    # shared steps: (next ticket, waves done) per (sequence, KV head), reset the same way
    steal = torch.zeros(S * shape.num_kv_heads * 2, dtype=torch.int32, device=dev) if shared_steps else None
    ptr = lambda t: t.data_ptr() if t is not None else None  # noqa: E731
    attn_args = (ptr(out), ptr(exp_sums), ptr(max_logits), ptr(tmp_out), ptr(query), ptr(key_cache),
                 ptr(value_cache), ptr(block_tables), ptr(seq_lens), ptr(alibi_slopes),
                 S, H, shape.num_kv_heads, shape.max_blocks_per_seq, num_partitions,
                 kv_block_stride, kv_head_stride, scale_log2, out_scale, int(num_partitions == 1),
                 ptr(counters), cluster, ptr(steal))
    reduce_args = None
    if num_partitions > 1 and not fused and not cluster:
        reduce_args = (ptr(out), ptr(exp_sums), ptr(max_logits), ptr(tmp_out), ptr(seq_lens), S, H, num_partitions,
                       shape.max_blocks_per_seq)
    # keep the tensors the raw pointers point into alive for as long as the Launch
    launch = Launch(kernel, shape, out, exp_sums, max_logits, tmp_out, attn_args, reduce_args)
    launch._inputs = (query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes, counters)
    launch.fused_reduce = fused
    launch.cluster = cluster
    launch.shared_steps = steal is not None
    launch.fused_counters = counters
    launch.steal_counters = steal
    return launch


def _num_sms(device) -> int:
    return device_info(torch.device(device))[2]  # (cached per device: ~8 us per eager call)


# The fused reduce's counters for launches that are made and run at once (paged_attention): one
# zeroed buffer per (device, stream), grown as needed. Every launch that completes leaves its
# counters at zero (the last workgroup resets them), and the launches of one stream never count
# at once (stream order; with PDL the attention kernel waits for the previous grid before any
# access), so they can share it -- where a fresh torch.zeros would cost a fill kernel per call.
# A Launch from prepare() keeps counters of its own: it may be called on any stream. While a
# stream is being captured into a CUDA graph the launch gets its own zeroed counters too (the
# fill is captured with it): a graph may be replayed on any stream, beside any other.
_counter_pool: dict[tuple[int, int], torch.Tensor] = {}


def stream_counters(n: int, device) -> torch.Tensor:
    """n zeroed int32 counters from the current stream's shared buffer (see _counter_pool)."""
    device = torch.device(device)
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, dtype=torch.int32, device=device)
    key = (device.index if device.index is not None else torch.cuda.current_device(),
           torch.cuda.current_stream(device).cuda_stream)
    buf = _counter_pool.get(key)
    if buf is None or buf.numel() < n:
        buf = _counter_pool[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buf[:n]


_resident: dict[tuple, int] = {}


@functools.lru_cache(maxsize=1024)
def _sans_partition(variant: V.Variant) -> tuple:
    return tuple(getattr(variant, f.name) for f in dataclasses.fields(variant) if f.name != "partition_size")


def resident_per_sm(variant: V.Variant, device, *, shared_steps: bool = False) -> int:
    """Attention workgroups of `variant` one SM/CU of `device` holds at once (the runtime's
    occupancy query on the built kernel; with `shared_steps`, on its shared-steps
    instantiation, which holds a block per SM fewer at head 64 in some sm_90 variants,
    data/static/sm_90-shared-steps.csv). Every partition size of a variant has the same
    registers and shared memory to within a few registers (data/static/sm_90.csv), so the
    answer is kept per variant without its partition size, per device and compiler flags."""
    kname = "attention_shared_steps" if shared_steps else "attention"
    key = (_sans_partition(variant), str(torch.device(device)), tuple(extra_flags()), kname)
    if key not in _resident:
        _resident[key] = int(build(variant, device).attributes()[kname]["blocks_per_sm"])
    return _resident[key]


def shared_steps_refusal(variant: V.Variant, *, kv_async: bool = False, return_intermediates: bool = False,
                         fused_reduce=None, cluster_reduce=None) -> str | None:
    """Why a shared_steps=True launch of `variant` with these options is refused (None: it is
    not), as ``shared_steps=True: <reason>``; prepare and the wave emulator (cpa.emu) ask it."""
    why = V.shared_steps_unsupported(variant, kv_async=kv_async)
    why = why or ("return_intermediates=True compares partials of fixed token ranges, which shared steps do "
                  "not keep" if return_intermediates else None)
    why = why or ("fused_reduce=True is not combined with shared steps" if fused_reduce else None)
    why = why or ("cluster_reduce=True is not combined with shared steps" if cluster_reduce else None)
    return f"shared_steps=True: {why}" if why else None


def cluster_refusal(arch: str, num_partitions: int, *, fused: bool = False,
                    return_intermediates: bool = False) -> str | None:
    """Why the cluster combine cannot run a launch of `num_partitions` partitions with these
    options, the device's capacity aside (None: it can); _cluster_size and the wave emulator
    (cpa.emu) ask it."""
    why = V.cluster_unsupported(arch, num_partitions)
    why = why or ("fused_reduce=True is the other in-kernel combine" if fused else None)
    return why or ("return_intermediates=True needs the partials in global memory, which the cluster combine "
                   "never writes" if return_intermediates else None)


def _cluster_size(cluster_reduce, kernel: BuiltKernel, arch: str, shape: PagedAttentionShape, *, fused: bool,
                  return_intermediates: bool, query_device) -> int:
    """The cluster size of the launch (0: no cluster combine); raises when cluster_reduce=True
    cannot be honoured."""
    if cluster_reduce is False:
        return 0
    np_ = shape.max_num_partitions
    if cluster_reduce is None and (np_ < 2 or fused or return_intermediates or
                                   not V.cluster_default(arch, np_, shape.num_seqs, shape.num_kv_heads,
                                                         _num_sms(query_device))):
        return 0
    why = cluster_refusal(arch, np_, fused=fused, return_intermediates=return_intermediates)
    if why is None and kernel.max_active_clusters(np_) < 1:
        why = f"the device cannot hold a cluster of {np_} workgroups of this variant"
    if why is None:
        return np_
    if cluster_reduce is None:
        return 0
    raise ValueError(f"cluster_reduce=True: {why}")


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, *, partition_size=None,
                    tiling=None, alibi_slopes=None, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0, out=None,
                    return_intermediates=False, max_seq_len=None, check_values=True, fused_reduce=None,
                    cluster_reduce=None, shared_steps=False, fp8_format=None):
    """Paged attention decode with the CPA kernel (vLLM ROCm paged_attention contract).

    query [num_seqs, num_heads, head_size] fp16/bf16; key_cache [num_blocks, num_kv_heads,
    head_size // x, block_size, x]; value_cache [num_blocks, num_kv_heads, head_size,
    block_size]; block_tables [num_seqs, max_blocks_per_seq] int32; seq_lens [num_seqs]
    int32. `partition_size` / `tiling` None pick the device default (cpa.variants.DEFAULTS; on
    sm_90 the partition size is chosen for the launch's shape, see `select_variant`; the launch
    uses `cpa.ops.prepare(...).shape.partition_size`).
    Launches the attention kernel and, when a sequence spans several partitions, the reduce
    kernel, on the current stream. fused_reduce / cluster_reduce / shared_steps: see
    `prepare`. With return_intermediates, also returns exp_sums,
    max_logits [num_seqs, num_heads, partitions] and tmp_out [..., head_size] (fp32; entries
    of partitions past a sequence's end are not written).
    """
    launch = prepare(query, key_cache, value_cache, block_tables, seq_lens, scale, partition_size=partition_size,
                     tiling=tiling, alibi_slopes=alibi_slopes, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale,
                     v_scale=v_scale, out=out, return_intermediates=return_intermediates, max_seq_len=max_seq_len,
                     check_values=check_values, fused_reduce=fused_reduce, cluster_reduce=cluster_reduce,
                     shared_steps=shared_steps, fp8_format=fp8_format, _stream_counters=True)
    launch()
    if return_intermediates:
        return launch.out, launch.exp_sums, launch.max_logits, launch.tmp_out
    return launch.out

