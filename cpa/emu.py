"""The kernels executed on the host CPU: a wave emulator for the HIP code path (and the CUDA one).

No AMD GPU is available to this project, so the HIP side of ``cpa/csrc`` -- wave64, the
``ds_bpermute`` shuffles, the ``v_mfma_f32_16x16x16`` and ``v_mfma_f32_4x4x4`` (16 blocks)
operand layouts, LDS and barriers -- would otherwise only ever be compiled. Here the same
kernel source is compiled for the host with ``-DCPA_EMU`` (``cpa/csrc/emu/``): every HIP
builtin the kernels call is emulated, each lane is a fiber, and a wave-wide operation is
computed once every live lane of the wave has reached it (lanes of one wave waiting at
different ones are reported as a divergent collective). The grid is walked one workgroup at
a time. It checks the AMD lane mappings, control flow and results against ``cpa.reference``;
it says nothing about MI300 timing or ISA scheduling. Of the memory model it checks the release
and acquire of the fused combine's partials: a workgroup's partials are hidden from the others
until it releases them, and from each thread of another workgroup until that thread has acquired
the release (``memory_model="acquire-release"``, the default).

A ``cuda`` variant runs the CUDA side the same way (``-DCPA_EMU_CUDA``: warp32, the shuffles,
``mma.sync.m16n8k16`` / ``m16n8k8`` and ``movmatrix`` with the PTX fragment layouts), so the
NVIDIA tilings' lane mappings are checked on a machine without a GPU too (the sm_89+ hardware
fp8 decode is emulated as well, the sm_90 cluster combine, ``cluster_reduce=True``, and the
programmatic dependent launches, ``pdl=True``); cache hints and the staged loops are not.

``paged_attention(...)`` takes CPU tensors and the same arguments as ``cpa.paged_attention``
(validated by the same function), with an explicit ``partition_size`` and ``tiling``. Slow
(a few thousand wave operations per second): small shapes only.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from . import variants as V
from .jit import CSRC, cache_root, sources_digest
from .ops import cluster_refusal, fp8_format_unsupported, kernel_scalars, shared_steps_refusal
from .static import check_knob_flags, find_clang
from .validation import validate_paged_attention_args

# `#pragma unroll` is for the GPU's registers; on the host it only multiplies the code clang
# optimizes (-pragma-unroll-threshold=0: a build 0.5 s shorter, the emulated run as fast).
# -fpch-validate-input-files-content: a checkout that only touches the headers keeps the PCH.
FLAGS = ("-std=c++17", "-O1", "-mllvm", "-pragma-unroll-threshold=0", "-fPIC", "-pthread", "-DCPA_EMU",
         "-fpch-validate-input-files-content")
PLATFORM_FLAGS = {"hip": (), "cuda": ("-DCPA_EMU_CUDA",)}
# knobs whose builds the emulator cannot run (the rest -- CPA_K_WHOLE_LINES, CPA_V_AFTER_QK,
# CPA_BT_PREFETCH, CPA_FUSED_REDUCE, CPA_REDUCE_FEW_* ... -- change code it runs)
UNEMULATED = {"CPA_KV_ASYNC": "the staged / ring main loops (cp.async, TMA) are not emulated",
              "CPA_LOAD_ONLY": "a load-only build computes nothing to check"}


# how the emulated workgroups of a concurrent launch take turns (wave_emu.h's Baton)
TURNS = ("random", "until_blocked")
# when a workgroup's partial stores become visible to the other workgroups of its launch
# (wave_emu.h): "acquire-release" -- released at its next release (an acquire-release RMW or a
# device-scope fence) or when its grid ends, and seen by another workgroup's thread once that
# thread has acquired (an acquiring RMW or fence, griddepcontrol.wait, or a barrier after a
# thread of its workgroup did); "release" -- released so, seen at once; "sequential" -- at once
MEMORY_MODELS = ("acquire-release", "release", "sequential")


def check_schedule(workgroups_at_once, turns, memory_model="acquire-release") -> None:
    """ValueError unless `workgroups_at_once` (1-64), `turns` (TURNS) and `memory_model`
    (MEMORY_MODELS) name a schedule the emulator runs; paged_attention and `cpa emu` ask it
    before any build."""
    if not (isinstance(workgroups_at_once, int) and 1 <= workgroups_at_once <= 64):
        raise ValueError(f"workgroups_at_once must be an int from 1 to 64, got {workgroups_at_once!r}")
    if turns not in TURNS:
        raise ValueError(f"turns must be one of {', '.join(TURNS)}, got {turns!r}")
    if memory_model not in MEMORY_MODELS:
        raise ValueError(f"memory_model must be one of {', '.join(MEMORY_MODELS)}, got {memory_model!r}")


def check_flags(flags) -> tuple:
    """A knob build's -DNAME[=VALUE] flags as a tuple, refused before any compile where the
    emulator cannot run that build (UNEMULATED, set to anything but 0)."""
    flags = check_knob_flags(flags)
    for f in flags:
        name, _, value = f[2:].partition("=")
        if name in UNEMULATED and value.strip() != "0":
            raise ValueError(f"{f}: {UNEMULATED[name]}")
        if name.startswith("CPA_EMU"):
            raise ValueError(f"{f}: the platform is chosen by the variant (platform='hip' or 'cuda')")
    return flags


def _sha(*parts: str) -> str:
    return hashlib.sha256(" ".join(parts).encode()).hexdigest()[:16]


def _headers_digest() -> str:
    """The kernel headers and the emulator's, of CSRC as it is now (a test swaps in a mutated
    copy of CSRC, emu/ included)."""
    return _sha(sources_digest(CSRC), sources_digest(CSRC / "emu"))


def _digest(compiler: str, variant: V.Variant, flags, headers: str) -> str:
    # (clang++ on the host: ext_vector_type, _Float16)
    return _sha(headers, compiler, *FLAGS, *PLATFORM_FLAGS[variant.platform], source(variant), *flags)


def source(variant: V.Variant) -> str:
    """The translation unit of one variant, compiled with `-include-pch` of header_pch: the PCH is
    its emu/launch_emu.h (an #include of it here would be a second copy once the headers' mtimes
    differ from the PCH's: `#pragma once` does not match them then)."""
    return f'CPA_DEFINE_EMU_VARIANT("{variant.name}", {variant.cpp_config()})\n'


def _compile(args: list, out: Path, what: str, source_text: str | None = None) -> None:
    """clang++ ARGS [tu.cpp holding SOURCE_TEXT] -o OUT, written through a temporary name in OUT's
    folder: a concurrent build of the same key writes the same bytes, and os.replace is atomic."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as work:
        tmp = Path(work) / out.name
        if source_text is not None:
            (Path(work) / "tu.cpp").write_text(source_text)
            args = [*args, "tu.cpp"]
        p = subprocess.run([*args, "-o", str(tmp)], capture_output=True, text=True, timeout=600, cwd=work)
        if p.returncode:
            raise RuntimeError(f"emulator build of {what} failed:\n{p.stderr[-4000:]}")
        os.replace(tmp, out)


_pch_locks: dict[str, threading.Lock] = {}


@functools.lru_cache(maxsize=None)
def _compiler_version(compiler: str) -> str:
    # a PCH is refused by any other build of clang ("built from a different branch")
    return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout


def header_pch(compiler: str, platform: str, flags=(), headers: str | None = None) -> Path:
    """emu/launch_emu.h precompiled for one platform and knob build: what every variant's build
    includes, parsed once (about 0.4 s of each build; the variant only instantiates templates).
    ``headers``: _headers_digest(), where the caller has it already."""
    # A PCH names the files it was made from and clang checks them (by content, FLAGS), so the
    # path is part of its slot; a slot keeps only the PCH of the headers' latest bytes (12 MB
    # each: an edit would pile them up).
    header = CSRC.resolve() / "emu" / "launch_emu.h"
    slot = _sha(str(header), _compiler_version(compiler), *FLAGS, *PLATFORM_FLAGS[platform], *flags)
    out = cache_root() / "emu" / f"launch_emu-{platform}-{slot}-{headers or _headers_digest()}.pch"
    with _pch_locks.setdefault(str(out), threading.Lock()):  # one build per process; then every thread's
        if not out.exists():
            _compile([compiler, *FLAGS, *PLATFORM_FLAGS[platform], *flags, f"-I{CSRC}", "-x", "c++-header",
                      str(header)], out, " ".join([f"{header} for {platform}", *flags]))
            for old in out.parent.glob(f"launch_emu-{platform}-{slot}-*.pch"):
                if old != out:
                    old.unlink(missing_ok=True)
    return out


@dataclass
class EmuKernel:
    variant: V.Variant
    path: Path
    lib: ctypes.CDLL

    def __post_init__(self) -> None:
        L = self.lib
        vp, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float
        L.cpa_variant.restype = ctypes.c_char_p
        L.cpa_emu_error.restype = ctypes.c_char_p
        L.cpa_emu_wave_ops.restype = i64
        L.cpa_emu_attention.restype = i32
        L.cpa_emu_attention.argtypes = [vp] * 10 + [i32] * 5 + [i64, i64, f32, f32, i32, vp, i32, vp]
        L.cpa_emu_reduce.restype = i32
        L.cpa_emu_reduce.argtypes = [vp] * 5 + [i32] * 4
        L.cpa_emu_set_schedule.restype = None
        L.cpa_emu_set_schedule.argtypes = [i32, ctypes.c_ulonglong, i32, i32]
        L.cpa_emu_switches.restype = i64
        L.cpa_emu_set_pdl.restype = i32
        L.cpa_emu_set_pdl.argtypes = [i32, i32, ctypes.POINTER(vp), ctypes.POINTER(vp), ctypes.POINTER(i64)]
        L.cpa_emu_run_pdl.restype = i32
        if L.cpa_variant().decode() != self.variant.name:
            raise RuntimeError(f"{self.path} holds {L.cpa_variant().decode()}, not {self.variant.name}")

    def check(self, err: int, what: str) -> None:
        if err:
            raise RuntimeError(f"{what} of {self.variant.name} in the wave emulator: {self.lib.cpa_emu_error().decode()}")

    @property
    def wave_ops(self) -> int:
        """Wave-wide operations (matrix instructions, permutes, wave barriers) emulated so far."""
        return int(self.lib.cpa_emu_wave_ops())

    @property
    def switches(self) -> int:
        """Turns handed from one workgroup's host thread to another's in the launches of the last
        paged_attention call (0 with workgroups_at_once=1: they never interleave)."""
        return int(self.lib.cpa_emu_switches())


_loaded: dict[str, EmuKernel] = {}


def build(variant: V.Variant, flags=()) -> EmuKernel:
    """Compile (or load from the disk cache) the host build of one variant (its HIP or CUDA
    side); ``flags``: -D knob definitions of a knob's build (check_flags)."""
    flags = check_flags(flags)
    cxx = find_clang()
    headers = _headers_digest()
    key = _digest(cxx, variant, flags, headers)
    if key in _loaded:
        return _loaded[key]
    out = cache_root() / "emu" / f"{variant.name}-{key}.so"
    if not out.exists():
        pch = header_pch(cxx, variant.platform, flags, headers)
        _compile([cxx, *FLAGS, *PLATFORM_FLAGS[variant.platform], *flags, "-shared", f"-I{CSRC}", "-include-pch",
                  str(pch)], out, variant.name, source(variant))
    k = _loaded[key] = EmuKernel(variant, out, ctypes.CDLL(str(out)))
    return k


def _ptr(t):
    return ctypes.c_void_p(t.data_ptr()) if t is not None else None


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, *, partition_size: int,
                    tiling: str, alibi_slopes=None, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0,
                    fused_reduce: bool = False, return_intermediates: bool = False, max_seq_len=None,
                    check_values: bool = True, fp8_format: str | None = None, platform: str = "hip",
                    shared_steps: bool = False, cluster_reduce: bool = False, flags=(), workgroups_at_once: int = 1,
                    schedule_seed: int = 0, turns: str = "random", pdl: bool = False,
                    memory_model: str = "acquire-release"):
    """The HIP (or, ``platform="cuda"``, the CUDA) kernel of (tiling, partition_size) on CPU
    tensors, through the wave emulator:
    the attention kernel, then the reduce kernel (or, with ``fused_reduce``, the last workgroup
    of each sequence and KV head combines). Outputs start NaN-poisoned. ``max_seq_len`` and
    ``check_values`` as for ``cpa.paged_attention``: the grid is sized from max_seq_len.
    ``shared_steps``: the shared-steps kernel (ops.prepare(shared_steps=True)), then the reduce;
    its counters must return to zero. ``flags``: the -D knobs of the build (e.g.
    ``("-DCPA_K_WHOLE_LINES=0",)``; check_flags).
    ``workgroups_at_once``: 1 runs the workgroups one after another in grid order (then the first
    workgroup of a sequence takes every shared-steps ticket its waves reach, and the last
    partition is the last to arrive at the fused reduce's count); more dispatches them in an order
    shuffled by ``schedule_seed`` to that many host threads taking turns after every wave-wide
    operation (wave_emu.h), so that workgroups sharing a counter interleave; ``turns="until_blocked"``
    lets the running workgroup go on until it waits at a cluster barrier or ends instead (one that
    runs ahead of the rest of its cluster).
    ``cluster_reduce`` (``platform="cuda"``): the partitions of each (sequence, KV head) run as one
    thread-block cluster and combine through distributed shared memory (the sm_90 launch of
    ``cpa.paged_attention(cluster_reduce=True)``); a cluster's workgroups run at once, so
    ``workgroups_at_once`` is rounded up to whole clusters.
    ``pdl`` (``platform="cuda"``): the launches chained as sm_90 makes them (launch.h): a kernel
    writing the K/V cache, the block tables, the sequence lengths and the query first (emulated:
    it copies them in that order into buffers that start poisoned, NaN or 0, and lets its
    dependent launch at once), the attention kernel
    as its programmatic dependent (CPA_PDL_ATTENTION; not with ``-DCPA_PDL_ATTENTION=0``), and the
    reduce kernel, where one runs, as the attention kernel's. A dependent grid's workgroups start
    once every workgroup of the grid before it has run ``griddepcontrol.launch_dependents`` (or
    ended), interleaved with those still running (``workgroups_at_once`` > 1), and pass
    ``griddepcontrol.wait`` only once they have all ended: what a kernel reads before its wait it
    reads beside the kernel before it (poisoned or half-written inputs, partials). With
    ``cluster_reduce`` the attention kernel is a cluster launch in the chain, as launch.h makes it
    (its clusters taken up whole, ``workgroups_at_once`` rounded up to whole clusters).
    ``memory_model``: "acquire-release" (the default) holds each workgroup's partial stores (the
    fused combine's inputs) back from the other workgroups until that workgroup releases them (an
    acquire-release count or a device-scope fence) or its grid ends, and a thread of another
    workgroup sees a release only once it has acquired (an acquiring count or fence,
    griddepcontrol.wait, or a barrier passed after a thread of its workgroup acquired), so a
    combine that reads them unreleased or unacquired reads the NaN poison; "release" holds the
    stores so but lets every thread see a release at once; "sequential" makes every store
    visible at once."""
    flags = check_flags(flags)
    check_schedule(workgroups_at_once, turns, memory_model)
    shape = validate_paged_attention_args(
        query, key_cache, value_cache, block_tables, seq_lens, scale, alibi_slopes=alibi_slopes,
        kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale, partition_size=partition_size,
        head_sizes=V.HEAD_SIZES, block_sizes=V.BLOCK_SIZES, query_dtypes=(torch.float16, torch.bfloat16),
        max_seq_len=max_seq_len, check_values=check_values, fp8_format=fp8_format)
    if shape.max_seq_len is None:
        raise ValueError("max_seq_len must be given when check_values=False")
    if query.device.type != "cpu":
        raise ValueError("the wave emulator runs on CPU tensors")
    variant = V.variant_for(tiling=tiling, partition_size=partition_size, head_size=shape.head_size,
                            block_size=shape.block_size, dtype=shape.query_dtype,
                            kv_cache_dtype=shape.kv_cache_dtype, gqa_ratio=shape.gqa_ratio, platform=platform)
    why = fp8_format_unsupported(platform, shape.fp8_format) if shape.kv_cache_dtype == "fp8" else None
    if shared_steps:
        why = why or shared_steps_refusal(variant, return_intermediates=return_intermediates,
                                          fused_reduce=fused_reduce)
    parts = -(-shape.max_seq_len // partition_size)
    if cluster_reduce and why is None:
        why = (f"thread-block clusters are CUDA's (sm_90+), not {platform}'s" if platform != "cuda"
               else cluster_refusal("sm_90", parts, fused=fused_reduce, return_intermediates=return_intermediates))
        why = why or ("shared steps are not combined with the cluster combine" if shared_steps else None)
        why = why and f"cluster_reduce=True: {why}"
    if why is None and pdl:
        why = (f"pdl=True: programmatic dependent launch is CUDA's (sm_90+), not {platform}'s" if platform != "cuda"
               else "pdl=True, but the flags compile PDL out (-DCPA_PDL=0)" if "-DCPA_PDL=0" in flags else None)
    if why is None and fused_reduce and "-DCPA_FUSED_REDUCE=0" in flags:
        why = "fused_reduce=True, but the flags compile the fused reduce out (-DCPA_FUSED_REDUCE=0)"
    if why:
        raise ValueError(why)
    k = build(variant, flags)
    S, H, D = shape.num_seqs, shape.num_heads, shape.head_size
    cluster = parts if cluster_reduce else 0
    nan = float("nan")
    out = torch.full_like(query, nan)
    exp_sums = torch.full((S, H, parts), nan, dtype=torch.float32)
    max_logits = torch.full_like(exp_sums, nan)
    # (as ops.prepare: the cluster combine keeps its partials in shared memory, none in global)
    tmp_out = torch.full((S, H, parts, D), nan, dtype=torch.float32) \
        if (parts > 1 and not cluster) or return_intermediates else None
    scale_log2, out_scale, block_stride, head_stride = kernel_scalars(shape, scale, k_scale, v_scale,
                                                                      key_cache.element_size())
    fused = fused_reduce and parts > 1
    counters = torch.zeros(S * shape.num_kv_heads, dtype=torch.int32) if fused else None
    steal = torch.zeros(S * shape.num_kv_heads * 2, dtype=torch.int32) if shared_steps else None
    query = query.contiguous()
    copies = []  # (destination, source): what the emulated kernel before the attention kernel writes
    if pdl and "-DCPA_PDL_ATTENTION=0" not in flags:
        # (NaN in every float dtype the kernels read, 0x7f being e4m3fn's NaN; the block tables
        # and lengths, which a serving loop's previous kernel writes too (vLLM's advance_step),
        # start at 0: in bounds, and a sequence of length 0 writes nothing)
        def poisoned(t):
            return (torch.full_like(t, 0x7F) if t.dtype == torch.uint8 else torch.zeros_like(t)
                    if t.dtype == torch.int32 else torch.full_like(t, nan))
        given = [key_cache, value_cache, block_tables.contiguous(), seq_lens.contiguous(), query]
        runs = [poisoned(t) for t in given]
        copies = list(zip(runs, given))
        key_cache, value_cache, block_tables, seq_lens, query = runs
    tensors = [query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes]
    reduce = parts > 1 and not fused and not cluster
    # (launch_emu.h numbers the models by strength: sequential 0, release 1, acquire-release 2)
    k.lib.cpa_emu_set_schedule(workgroups_at_once, schedule_seed, int(turns == "until_blocked"),
                               MEMORY_MODELS[::-1].index(memory_model))
    # (with pdl the launches below are held, then run as one chain by cpa_emu_run_pdl)
    n = len(copies)
    k.check(k.lib.cpa_emu_set_pdl(int(pdl), n, (ctypes.c_void_p * n)(*(d.data_ptr() for d, _ in copies)),
                                  (ctypes.c_void_p * n)(*(s_.data_ptr() for _, s_ in copies)),
                                  (ctypes.c_longlong * n)(*(d.numel() * d.element_size() for d, _ in copies))),
            "PDL")
    try:
        k.check(k.lib.cpa_emu_attention(
            _ptr(out), _ptr(exp_sums), _ptr(max_logits), _ptr(tmp_out), *(_ptr(t) for t in tensors),
            S, H, shape.num_kv_heads, shape.max_blocks_per_seq, parts, block_stride, head_stride,
            scale_log2, out_scale, int(parts == 1), _ptr(counters), cluster, _ptr(steal)), "attention kernel")
        if reduce:
            k.check(k.lib.cpa_emu_reduce(_ptr(out), _ptr(exp_sums), _ptr(max_logits), _ptr(tmp_out),
                                         _ptr(seq_lens), S, H, parts, shape.max_blocks_per_seq),
                    "reduce kernel")
        if pdl:
            chain = ["input writer"] * bool(copies) + ["attention kernel"] + ["reduce kernel"] * reduce
            k.check(k.lib.cpa_emu_run_pdl(), "PDL chain (" + ", ".join(chain) + ")")
    finally:
        k.lib.cpa_emu_set_pdl(0, 0, None, None, None)
    if fused and int(counters.abs().sum()) != 0:
        raise RuntimeError("the fused reduce left its counters non-zero")
    if shared_steps and int(steal.abs().sum()) != 0:
        raise RuntimeError("the shared steps left their counters non-zero")
    if return_intermediates:
        return out, exp_sums, max_logits, tmp_out
    return out


def check(tiling: str, partition_size: int, *, dtype: str = "fp16", kv_cache_dtype: str = "auto",
          head_size: int = 128, block_size: int = 16, gqa: int | None = None, seq_lens=(1, 17, 300, 1000),
          num_kv_heads: int = 2, fused_reduce: bool = False, seed: int | None = None,
          fp8_format: str | None = None, platform: str = "hip", flags=(), shared_steps: bool = False,
          workgroups_at_once: int = 1, schedule_seed: int = 0, turns: str = "random",
          cluster_reduce: bool = False, pdl: bool = False, memory_model: str = "acquire-release") -> dict:
    """One HIP (or CUDA) variant on one random batch through the emulator against cpa.reference: a row
    with the variant, the wave operations emulated, the seconds taken, the relative error and
    whether it is within the GPU tests' tolerance (``ok``). Raises ValueError for a
    combination that is not a variant of ``platform``. An fp8 cache is in ``fp8_format`` (on
    AMD by default MI300's e4m3fnuz, as vLLM writes it on gfx94x; e4m3fn as on gfx950; NVIDIA
    reads e4m3fn only). ``shared_steps``, ``cluster_reduce``, ``pdl``, ``workgroups_at_once``,
    ``schedule_seed``, ``turns``, ``memory_model``: as for paged_attention (the row's
    ``switches``: turns handed between workgroups)."""
    import time

    from . import reference
    from .inputs import make_paged_inputs

    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    g = gqa or (4 if tiling == "mfma4" and platform == "hip" else 8)
    fp8_format = fp8_format or ("e4m3fnuz" if platform == "hip" else "e4m3fn")
    v = V.variant_for(tiling=tiling, partition_size=partition_size, head_size=head_size, block_size=block_size,
                      dtype=dtype, kv_cache_dtype=kv_cache_dtype, gqa_ratio=g, platform=platform)
    lens = list(seq_lens)
    inp = make_paged_inputs(len(lens), g * num_kv_heads, num_kv_heads, head_size, block_size, lens, dtype=dt,
                            kv_cache_dtype=kv_cache_dtype, seed=partition_size if seed is None else seed,
                            fp8_format=fp8_format)
    kw = inp.as_kwargs()
    k = build(v, flags)
    ops0, t0 = k.wave_ops, time.perf_counter()
    out = paged_attention(**kw, partition_size=partition_size, tiling=tiling, fused_reduce=fused_reduce,
                          platform=platform, flags=flags, shared_steps=shared_steps,
                          workgroups_at_once=workgroups_at_once, schedule_seed=schedule_seed, turns=turns,
                          cluster_reduce=cluster_reduce, pdl=pdl, memory_model=memory_model)
    secs = time.perf_counter() - t0
    err = reference.relative_error(out, reference.paged_attention(**kw), per_seq=True)
    return dict(variant=v.name, tiling=tiling, partition_size=partition_size, dtype=dtype,
                kv_cache_dtype=kv_cache_dtype, head_size=head_size, gqa=g, wave_ops=k.wave_ops - ops0,
                switches=k.switches,
                seconds=secs, rel_err=err, ok=bool(err <= reference.REL_ERR_TOL[dt]))
