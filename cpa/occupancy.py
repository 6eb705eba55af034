"""Occupancy models: CDNA (gfx942, gfx90a), Hopper (sm_90), and grid-level wave quantization.

* ``cdna_compiler_occupancy`` reproduces what clang/LLVM prints as ``Occupancy
  [waves/SIMD]`` (the ``waves_per_simd_compiler`` column of ``data/static/gfx*.csv``).
* ``cdna_occupancy`` is the model of the hardware: the same register and wave limits, but the
  LDS a workgroup takes is rounded up to the 512-byte allocation block first (LLVM's own
  occupancy code skips that rounding: "FIXME: Do we need to account for alignment requirement
  of LDS rounding the size up?"). The two differ only where that rounding changes the number
  of workgroups that fit in 64 KiB; ``compare_cdna`` lists those rows.
* ``hopper_occupancy`` follows the rules of NVIDIA's occupancy calculator for compute
  capability 9.0 (registers per warp in units of 256, 16 K registers per sub-partition,
  shared memory + 1 KiB per block in 128-byte units, 64 warps, 32 blocks); ``h200_check``
  compares it with ``cudaOccupancyMaxActiveBlocksPerMultiprocessor`` on a real H200.
* ``grid_occupancy`` turns a decode shape and a variant into workgroups launched, resident
  workgroups per CU/SM, full waves and the tail, plus the reduce kernel's share.

Sources of every constant: ``cpa/hardware.py``. Nothing here is measured on an MI300.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from . import hardware as hw
from . import variants as V

REDUCE_THREADS = V.REDUCE_THREADS  # cpa/csrc/attention.h ReduceConfig::THREADS
REDUCE_FEW_THREADS = V.REDUCE_FEW_THREADS  # ReduceFewConfig::THREADS
ATTN_WAVES = 4  # cpa/csrc/attention.h AttnConfig::NUM_WAVES


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(x: int, unit: int) -> int:
    return _ceil_div(x, unit) * unit


# ====================================================================================== CDNA
def cdna_total_vgprs(vgprs: int, agprs: int, spec: hw.CdnaSpec = hw.MI300X) -> int:
    """Unified VGPR count of one wave: AGPRs start at alignTo(arch VGPRs, 4) (LLVM
    AMDGPU::getTotalNumVGPRs with gfx90a instructions); without AGPRs, the arch VGPRs alone."""
    if agprs:
        return _round_up(vgprs, spec.agpr_offset_align) + agprs
    return vgprs


def cdna_waves_by_vgprs(total_vgprs: int, spec: hw.CdnaSpec = hw.MI300X) -> int:
    """Waves per SIMD the unified register file allows (0 when one wave does not fit)."""
    if total_vgprs > spec.vgprs_per_lane:
        return 0
    if total_vgprs < spec.vgpr_granule:
        return spec.max_waves_per_simd
    return min(spec.vgprs_per_lane // _round_up(total_vgprs, spec.vgpr_granule), spec.max_waves_per_simd)


def cdna_waves_by_sgprs(sgprs: int, spec: hw.CdnaSpec = hw.MI300X) -> int:
    """LLVM getOccupancyWithNumSGPRs for gfx8/gfx9 (800 SGPRs per SIMD), clamped to the wave
    limit: <= 80 -> 10, <= 88 -> 9, <= 100 -> 8, else 7. `sgprs` as the compiler reports it
    (VCC / flat scratch / XNACK included)."""
    if sgprs <= 80:
        w = 10
    elif sgprs <= 88:
        w = 9
    elif sgprs <= 100:
        w = 8
    else:
        w = 7
    return min(w, spec.max_waves_per_simd)


def cdna_max_workgroups_per_cu(waves_per_workgroup: int, spec: hw.CdnaSpec = hw.MI300X) -> int:
    """LLVM getMaxWorkGroupsPerCU: one-wave groups need no barrier; others take one of 16."""
    if waves_per_workgroup == 1:
        return spec.max_waves_per_cu
    return min(spec.max_waves_per_cu // waves_per_workgroup, spec.max_workgroups_per_cu)


@dataclass(frozen=True)
class CdnaOccupancy:
    """Waves per SIMD of one kernel on a CDNA CU, and what limits it."""

    waves_per_simd: int
    limit: str  # the first binding limit of: vgprs, sgprs, lds, workgroups, waves
    binding: tuple[str, ...]  # every limit at the minimum
    workgroups_per_cu: int  # resident workgroups of this kernel per CU
    waves_per_workgroup: int
    total_vgprs: int  # alignTo(vgprs, 4) + agprs
    allocated_vgprs: int  # rounded up to the 8-register granule
    lds_allocated: int  # bytes per workgroup as allocated (512-byte blocks; compiler: as declared)
    by_vgprs: int
    by_sgprs: int
    by_lds: int
    by_workgroups: int  # the 16-barrier (workgroups per CU) limit, in waves per SIMD
    by_waves: int  # max waves per SIMD

    def as_dict(self) -> dict:
        return asdict(self)


_CDNA_ORDER = ("vgprs", "sgprs", "lds", "workgroups", "waves")


def _cdna(vgprs, agprs, sgprs, lds_bytes, threads_per_block, spec, lds_granule) -> CdnaOccupancy:
    simds = spec.simds_per_cu
    w = _ceil_div(threads_per_block, spec.wave_size)
    total = cdna_total_vgprs(vgprs, agprs, spec)
    by_v = cdna_waves_by_vgprs(total, spec)
    by_s = cdna_waves_by_sgprs(sgprs, spec)
    wg_cap = cdna_max_workgroups_per_cu(w, spec)
    lds_alloc = _round_up(lds_bytes, lds_granule) if lds_bytes else 0
    groups_lds = spec.lds_per_cu // lds_alloc if lds_alloc else wg_cap
    # a workgroup's waves spread over the SIMDs as evenly as possible (LLVM divideCeil)
    by_l = min(_ceil_div(min(groups_lds, wg_cap) * w, simds), spec.max_waves_per_simd) if groups_lds else 0
    by_wg = min(_ceil_div(wg_cap * w, simds), spec.max_waves_per_simd)
    by_w = spec.max_waves_per_simd
    vals = {"vgprs": by_v, "sgprs": by_s, "lds": by_l, "workgroups": by_wg, "waves": by_w}
    waves = min(vals.values())
    binding = tuple(k for k in _CDNA_ORDER if vals[k] == waves)
    # resident workgroups: the register/wave budget of the 4 SIMDs and the LDS / barrier caps
    groups = min((waves * simds) // w, groups_lds, wg_cap) if waves else 0
    return CdnaOccupancy(waves, binding[0], binding, groups, w, total,
                         _round_up(total, spec.vgpr_granule) if total else 0, lds_alloc,
                         by_v, by_s, by_l, by_wg, by_w)


def cdna_occupancy(vgprs: int, agprs: int, sgprs: int, lds_bytes: int, threads_per_block: int = 256,
                   spec: hw.CdnaSpec = hw.MI300X) -> CdnaOccupancy:
    """Hardware model: LDS in 512-byte blocks; 0 waves when a workgroup does not fit."""
    if lds_bytes > spec.lds_per_workgroup_max or threads_per_block > 1024:
        raise ValueError(f"workgroup does not fit a CU: lds_bytes={lds_bytes}, threads={threads_per_block}")
    return _cdna(vgprs, agprs, sgprs, lds_bytes, threads_per_block, spec, spec.lds_granule)


def cdna_compiler_occupancy(vgprs: int, agprs: int, sgprs: int, lds_bytes: int, threads_per_block: int = 256,
                            spec: hw.CdnaSpec = hw.MI300X) -> int:
    """What LLVM 19 reports as ``Occupancy [waves/SIMD]`` (AMDGPUAsmPrinter: min of the wave
    limit, the LDS limit computed on the *declared* LDS bytes, the SGPR and the VGPR limits).
    `threads_per_block` is the kernel's maximum flat workgroup size (``__launch_bounds__``)."""
    w = _ceil_div(threads_per_block, spec.wave_size)
    wg_cap = cdna_max_workgroups_per_cu(w, spec)
    groups = spec.lds_per_cu // max(lds_bytes, 1)
    if groups == 0:  # more LDS than a CU has: LLVM assumes the worst, 1
        by_l = 1
    else:
        by_l = min(_ceil_div(min(groups, wg_cap) * w, spec.simds_per_cu), spec.max_waves_per_simd)
    by_v = max(cdna_waves_by_vgprs(cdna_total_vgprs(vgprs, agprs, spec), spec), 1)
    return min(spec.max_waves_per_simd, by_l, cdna_waves_by_sgprs(sgprs, spec), by_v)


def cdna_row_occupancy(row, spec: hw.CdnaSpec | None = None) -> CdnaOccupancy:
    """cdna_occupancy of one row of a ``cpa static`` table (a dict or a pandas row)."""
    spec = spec or hw.spec_for(row["arch"])
    return cdna_occupancy(int(row["vgprs"]), int(row["agprs"]), int(row["sgprs"]), int(row["lds_bytes"]),
                          int(row["threads_per_block"]), spec)


def cdna_row_compiler_occupancy(row, spec: hw.CdnaSpec | None = None) -> int:
    spec = spec or hw.spec_for(row["arch"])
    return cdna_compiler_occupancy(int(row["vgprs"]), int(row["agprs"]), int(row["sgprs"]), int(row["lds_bytes"]),
                                   int(row["threads_per_block"]), spec)


def compare_cdna(df):
    """Per row of a gfx942/gfx90a ``cpa static`` table: the compiler's number, this module's
    model of it, the hardware model and its binding limit. Returns a DataFrame."""
    import pandas as pd

    out = []
    for _, r in df.iterrows():
        occ = cdna_row_occupancy(r)
        out.append(dict(variant=r["variant"], kernel=r["kernel"], vgprs=r["vgprs"], agprs=r["agprs"],
                        sgprs=r["sgprs"], lds_bytes=r["lds_bytes"], compiler=int(r["waves_per_simd_compiler"]),
                        compiler_model=cdna_row_compiler_occupancy(r), hardware_model=occ.waves_per_simd,
                        limit=occ.limit, workgroups_per_cu=occ.workgroups_per_cu))
    return pd.DataFrame(out)


# ==================================================================================== Hopper
@dataclass(frozen=True)
class HopperOccupancy:
    """Resident blocks per SM of one kernel on Hopper, and what limits them."""

    blocks_per_sm: int
    limit: str  # first binding of: registers, shared, warps, blocks
    binding: tuple[str, ...]
    warps_per_block: int
    regs_per_warp: int  # allocated: registers x 32 rounded up to 256
    smem_per_block: int  # allocated: static + dynamic + 1 KiB reserved, rounded up to 128 B
    smem_per_sm: int  # the shared-memory carveout the count assumes
    by_registers: int
    by_shared: int
    by_warps: int
    by_blocks: int

    @property
    def warps_per_sm(self) -> int:
        return self.blocks_per_sm * self.warps_per_block

    @property
    def occupancy(self) -> float:
        """Theoretical occupancy: resident warps / 64."""
        return self.warps_per_sm / 64

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(warps_per_sm=self.warps_per_sm, occupancy=self.occupancy)
        return d


_HOPPER_ORDER = ("registers", "shared", "warps", "blocks")


def hopper_occupancy(registers: int, shared_bytes: int, threads_per_block: int, dynamic_shared_bytes: int = 0,
                     spec: hw.HopperSpec = hw.H200, carveout_bytes: int | None = None) -> HopperOccupancy:
    """Blocks per SM for `registers` per thread, static `shared_bytes` (+ dynamic) per block.

    Registers are allocated per warp in units of 256 (8 per thread) and per sub-partition
    (65536 / 4); shared memory per block gets the 1 KiB driver reservation and is rounded up
    to 128 B; the carveout is the largest (228 KiB) unless `carveout_bytes` asks for a
    preference, which (as the CUDA calculator does) is raised to the smallest carveout that
    holds one block."""
    warps = _ceil_div(threads_per_block, spec.wave_size)
    subp = spec.simds_per_cu
    # registers
    regs_per_warp = _round_up(registers * spec.wave_size, spec.reg_alloc_unit)
    if (threads_per_block > spec.max_threads_per_block or registers > spec.regs_per_thread_max
            or regs_per_warp * _round_up(warps, subp) > spec.regs_per_block_max):
        by_r = 0
    elif regs_per_warp == 0:
        by_r = spec.max_blocks_per_sm
    else:
        warps_per_subp = (spec.regs_per_sm // subp) // regs_per_warp
        by_r = (warps_per_subp * subp) // warps
    # shared memory
    smem = _round_up(shared_bytes + dynamic_shared_bytes + spec.smem_reserved_per_block, spec.smem_granule)
    per_sm = spec.smem_per_sm if carveout_bytes is None else carveout_bytes
    if per_sm < smem:
        per_sm = min((c for c in spec.smem_carveouts if c >= smem), default=0)
    if smem > spec.smem_per_block_max + spec.smem_reserved_per_block or per_sm == 0:
        by_s = 0
    else:
        by_s = per_sm // smem
    by_w = spec.max_warps_per_sm // warps if warps <= spec.max_warps_per_sm else 0
    by_b = spec.max_blocks_per_sm
    vals = {"registers": by_r, "shared": by_s, "warps": by_w, "blocks": by_b}
    blocks = min(vals.values())
    binding = tuple(k for k in _HOPPER_ORDER if vals[k] == blocks)
    return HopperOccupancy(blocks, binding[0], binding, warps, regs_per_warp, smem, per_sm, by_r, by_s, by_w, by_b)


def hopper_row_occupancy(row, spec: hw.HopperSpec = hw.H200) -> HopperOccupancy:
    """hopper_occupancy of one row of the sm_90 ``cpa static`` table."""
    return hopper_occupancy(int(row["registers"]), int(row["shared_bytes"]), int(row["threads_per_block"]),
                            spec=spec)


def h200_check(variants, device=None):
    """On an NVIDIA GPU (the H200): build each variant, read ``attributes()`` (registers,
    static shared bytes, and ``cudaOccupancyMaxActiveBlocksPerMultiprocessor`` for the
    launched block size) of its attention and reduce kernels, and run ``hopper_occupancy`` on
    the same registers / shared bytes / threads. One row per (variant, kernel) with both
    numbers, ``match``, the model's binding limit, and the device's SM count, registers and
    shared memory per SM / reserved per block (to check the spec constants too)."""
    import pandas as pd
    import torch

    from .jit import build, device_arch, sources_digest

    platform, arch = device_arch(device)
    if platform != "cuda":
        raise RuntimeError(f"h200_check needs an NVIDIA GPU; this device is {platform} {arch}")
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(dev)
    spec = hw.H200 if "H200" in props.name else hw.spec_for(arch)
    dev_info = dict(device_name=props.name, device_sms=props.multi_processor_count,
                    device_regs_per_sm=getattr(props, "regs_per_multiprocessor", None),
                    device_smem_per_sm=getattr(props, "shared_memory_per_multiprocessor", None),
                    device_smem_per_block_optin=getattr(props, "shared_memory_per_block_optin", None),
                    device_l2_bytes=getattr(props, "L2_cache_size", None))
    rows = []
    for v in variants:
        if v.platform != "cuda":
            continue
        k = build(v, dev)
        for kernel, a in k.attributes().items():
            occ = hopper_occupancy(a["registers"], a["shared_bytes"], a["threads_per_block"], spec=spec)
            rows.append(dict(variant=v.name, kernel=kernel, arch=arch, registers=a["registers"],
                             shared_bytes=a["shared_bytes"], local_bytes=a["local_bytes"],
                             threads_per_block=a["threads_per_block"],
                             max_threads_per_block=a["max_threads_per_block"],
                             blocks_per_sm_cuda=a["blocks_per_sm"], blocks_per_sm_model=occ.blocks_per_sm,
                             match=a["blocks_per_sm"] == occ.blocks_per_sm, model_limit=occ.limit,
                             model_smem_per_block=occ.smem_per_block, sources_digest=sources_digest()[:16],
                             **dev_info))
    from .provenance import provenance

    prov = provenance()
    return pd.DataFrame(rows).assign(**{k: prov[k] for k in ("driver_version", "torch_version", "git_commit",
                                                              "timestamp", "command")})


# ====================================================================================== grid
@dataclass(frozen=True)
class GridOccupancy:
    """One decode launch on a whole device: how many workgroups, how many fit at once, how
    many waves of them (the last one partly empty), and the reduce kernel's share."""

    device: str
    variant: str
    num_seqs: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    max_seq_len: int
    partition_size: int
    partitions: int  # ceil(max_seq_len / partition_size)
    workgroups: int  # num_seqs x partitions x num_kv_heads
    threads_per_workgroup: int
    resident_per_cu: int  # workgroups of the attention kernel per CU/SM
    limit: str  # what bounds resident_per_cu
    compute_units: int
    slots: int  # resident_per_cu x compute_units
    full_waves: int  # workgroups // slots
    tail_workgroups: int  # workgroups % slots (the last, partial wave)
    waves: int  # ceil(workgroups / slots)
    wave_efficiency: float  # workgroups / (waves x slots): 1.0 = no quantization loss
    cu_fill: float  # min(workgroups, slots) / slots: fraction of slots busy in the first wave
    reduce_launched: bool  # the reduce kernel runs only when partitions > 1
    reduce_kernel: str  # "reduce", "reduce_few" (cpa.variants.reduce_kernel) or "" when not launched
    reduce_workgroups: int  # that kernel's grid (0 when not launched)
    reduce_threads: int
    reduce_resident_per_cu: int
    reduce_waves: int
    partials_bytes_written: int  # attention -> tmp_out, max_logits, exp_sums (fp32)
    partials_bytes_read: int  # reduce reads them back
    partials_bytes: int  # written + read = 2 x num_seqs x num_heads x partitions x (head_size + 2) x 4
    kv_elem_bytes: int = 2  # bytes per cached K / V element: 1 with an fp8 cache

    def as_dict(self) -> dict:
        return asdict(self)


def resident_workgroups(arch: str, row, spec: hw.DeviceSpec | None = None) -> tuple[int, str]:
    """(resident workgroups per CU/SM, binding limit) of one ``cpa static`` row (or a dict
    with the same resource fields)."""
    spec = spec or hw.spec_for(arch)
    if isinstance(spec, hw.CdnaSpec):
        occ = cdna_row_occupancy(row, spec)
        return occ.workgroups_per_cu, occ.limit
    occ = hopper_row_occupancy(row, spec)
    return occ.blocks_per_sm, occ.limit


def grid_occupancy(*, variant: V.Variant, num_seqs: int, num_heads: int, num_kv_heads: int, max_seq_len: int,
                   attention: dict, reduce: dict | None = None, arch: str | None = None,
                   spec: hw.DeviceSpec | None = None, reduce_few: dict | None = None) -> GridOccupancy:
    """Grid-level occupancy of one decode step.

    `attention` / `reduce` / `reduce_few`: the kernels' resources, as a row of the ``cpa static``
    table for that arch (vgprs/agprs/sgprs/lds_bytes or registers/shared_bytes,
    threads_per_block). Which reduce kernel runs follows the launcher's rule
    (``cpa.variants.reduce_kernel``); its resources may be left out (no reduce occupancy then).
    `spec` defaults to the arch's device (gfx942: MI300X, 304 CUs; gfx90a: one MI250X GCD;
    sm_90: H200, 132 SMs)."""
    if arch is None:
        arch = {"hip": "gfx942", "cuda": "sm_90"}[variant.platform]
    spec = spec or hw.spec_for(arch)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if num_heads // num_kv_heads > variant.heads_cap:
        raise ValueError(f"GQA {num_heads // num_kv_heads} exceeds the variant's heads cap {variant.heads_cap}")
    parts = _ceil_div(max_seq_len, variant.partition_size)
    wg = num_seqs * parts * num_kv_heads
    per_cu, limit = resident_workgroups(arch, attention, spec)
    slots = per_cu * spec.compute_units
    if slots == 0:
        raise ValueError(f"{variant.name}: no workgroup of the attention kernel fits a CU/SM ({limit})")
    waves = _ceil_div(wg, slots)
    r_kernel = V.reduce_kernel(parts, num_seqs, num_heads)
    launched = r_kernel is not None
    r_wg = V.reduce_workgroups(r_kernel, num_seqs, num_heads, variant.head_size)
    r_res = reduce_few if r_kernel == "reduce_few" else reduce
    r_per_cu = resident_workgroups(arch, r_res, spec)[0] if (launched and r_res is not None) else 0
    # the launched kernel's workgroup size: from its resource row when given (the compiled kernel)
    r_threads = int(r_res["threads_per_block"]) if (launched and r_res is not None) else \
        (REDUCE_FEW_THREADS if r_kernel == "reduce_few" else REDUCE_THREADS)
    r_waves = _ceil_div(r_wg, r_per_cu * spec.compute_units) if (r_wg and r_per_cu) else 0
    one_way = num_seqs * num_heads * parts * (variant.head_size + 2) * 4 if launched else 0
    return GridOccupancy(
        device=spec.name, variant=variant.name, num_seqs=num_seqs, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_size=variant.head_size, max_seq_len=max_seq_len, partition_size=variant.partition_size,
        partitions=parts, workgroups=wg, threads_per_workgroup=int(attention["threads_per_block"]),
        resident_per_cu=per_cu, limit=limit, compute_units=spec.compute_units, slots=slots,
        full_waves=wg // slots, tail_workgroups=wg % slots, waves=waves, wave_efficiency=wg / (waves * slots),
        cu_fill=min(wg, slots) / slots, reduce_launched=launched, reduce_kernel=r_kernel or "", reduce_workgroups=r_wg,
        reduce_threads=r_threads, reduce_resident_per_cu=r_per_cu, reduce_waves=r_waves,
        partials_bytes_written=one_way, partials_bytes_read=one_way, partials_bytes=2 * one_way,
        kv_elem_bytes=1 if variant.kv_cache_dtype == "fp8" else 2)


def grid_from_table(df, variant: V.Variant, *, num_seqs: int, num_heads: int, num_kv_heads: int, max_seq_len: int,
                    arch: str | None = None, spec: hw.DeviceSpec | None = None) -> GridOccupancy:
    """grid_occupancy with the two kernels' resources looked up in a ``cpa static`` table."""
    rows = df[df.variant == variant.name]
    att = rows[rows.kernel == "attention"]
    red = rows[rows.kernel == "reduce"]
    few = rows[rows.kernel == "reduce_few"]
    if len(att) != 1:
        raise KeyError(f"{variant.name}: {len(att)} attention rows in the table")
    arch = arch or str(att.iloc[0]["arch"])
    return grid_occupancy(variant=variant, num_seqs=num_seqs, num_heads=num_heads, num_kv_heads=num_kv_heads,
                          max_seq_len=max_seq_len, attention=att.iloc[0].to_dict(),
                          reduce=red.iloc[0].to_dict() if len(red) else None, arch=arch, spec=spec,
                          reduce_few=few.iloc[0].to_dict() if len(few) else None)


def static_resident(arch: str, spec: hw.DeviceSpec | None = None):
    """resident_per_cu(variant) -> attention workgroups one CU/SM holds, from the variant's row of
    the shipped ``data/static/<arch>.csv`` (compiled registers and shared memory)."""
    spec = spec or hw.spec_for(arch)
    static = load_static_table(arch)
    att = static[static.kernel == "attention"].set_index("variant")
    return lambda v: resident_workgroups(arch, att.loc[v.name].to_dict(), spec)[0]


def load_static_table(arch: str, root=None):
    """The shipped ``data/static/<arch>.csv`` as a DataFrame."""
    from pathlib import Path

    import pandas as pd

    root = Path(root) if root is not None else Path(__file__).resolve().parent.parent / "data" / "static"
    return pd.read_csv(root / f"{arch}.csv")


# =============================================================================== notebook tables
def resource_table(arch: str, df=None, *, kernel: str = "attention", **where):
    """The ``cpa static`` rows of one arch (filtered by column values, e.g. head_size=128) with
    occupancy columns: AMD ``waves_per_simd`` (hardware model), its binding ``limit`` and
    ``workgroups_per_cu``; NVIDIA ``blocks_per_sm``, ``warps_per_sm``, ``limit``."""
    df = load_static_table(arch) if df is None else df
    d = df[df.kernel == kernel]
    for k, v in where.items():
        d = d[d[k] == v]
    d = d.copy()
    spec = hw.spec_for(arch)
    if isinstance(spec, hw.CdnaSpec):
        occ = [cdna_row_occupancy(r, spec) for _, r in d.iterrows()]
        d["total_vgprs"] = [o.total_vgprs for o in occ]
        d["waves_per_simd"] = [o.waves_per_simd for o in occ]
        d["workgroups_per_cu"] = [o.workgroups_per_cu for o in occ]
        d["limit"] = [o.limit for o in occ]
    else:
        occ = [hopper_row_occupancy(r, spec) for _, r in d.iterrows()]
        d["blocks_per_sm"] = [o.blocks_per_sm for o in occ]
        d["warps_per_sm"] = [o.warps_per_sm for o in occ]
        d["workgroups_per_cu"] = d["blocks_per_sm"]
        d["limit"] = [o.limit for o in occ]
    return d.reset_index(drop=True)


def grid_table(arch: str, shapes, *, tilings=None, partition_sizes=None, head_size: int = 128, block_size: int = 16,
               dtype: str = "fp16", kv_cache_dtype: str = "auto", df=None):
    """Grid-level occupancy (:func:`grid_occupancy`) for every shape x tiling x partition size.

    `shapes`: dicts with num_seqs, num_heads, num_kv_heads, max_seq_len. Variants missing from
    the shipped table (or invalid for the platform) are skipped."""
    import pandas as pd

    df = load_static_table(arch) if df is None else df
    platform = V.platform_of_arch(arch)
    rows = []
    for shape in shapes:
        gqa = shape["num_heads"] // shape["num_kv_heads"]
        for t in tilings or V.TILINGS:
            for p in partition_sizes or V.PARTITION_SIZES:
                try:
                    v = V.variant_for(tiling=t, partition_size=p, head_size=head_size, block_size=block_size,
                                      dtype=dtype, kv_cache_dtype=kv_cache_dtype, gqa_ratio=gqa, platform=platform)
                    g = grid_from_table(df, v, arch=arch, **shape)
                except (ValueError, KeyError):
                    continue
                rows.append({"arch": arch, "tiling": t, **g.as_dict()})
    return pd.DataFrame(rows)


# ============================================================================ a wave-time model
@dataclass(frozen=True)
class WaveModel:
    """A modeled decode time from grid occupancy: every wave of resident workgroups pays a
    fixed cost, the bytes stream at the device's bandwidth times the fraction of compute
    units busy, wave by wave, and a launched reduce pays its own fixed cost plus reading the
    partials back::

        t = t_wave x waves + per_wg x (full_wgs / fill(slots) + last_wgs / fill(last_wgs)) / bw
            + [partitions > 1] x (t_reduce + partials_read / bw) + t_launch

    with per_wg = (kv_bytes + partials_written) / workgroups, the full waves' workgroups
    (waves - 1) x slots, the last wave's the rest, and fill(w) = min(w, compute units) /
    compute units: what streams is a busy compute unit, however many of its slots are taken
    (on the H200 one workgroup per SM reads about as fast as two: 1 x 8k at partition 512, 128
    workgroups, 13.3 us for the attention kernel against 13.4 at 256 with 256 workgroups;
    counting busy slots instead made the fit of partitions >= 2048 go negative). The last wave
    streams at its own fill: averaged over the waves (as until the sixth session of
    2026-12-05), 3 x 128k at partition 8192, 384 workgroups on the H200's 264 slots, counted as
    two waves of 192 with every SM busy, where it is a full wave and one of 120; measured
    391.7 us against 363.7 at 4096 (data/bench/experiments/h200-target2-odd-2ae03da.csv).
    The three times are fitted (non-negative least squares) to measured times of one device
    (:func:`fit_wave_model`); on another device they are an assumption, to be varied, never a
    measurement."""

    bw_bytes_per_s: float
    t_wave_us: float
    t_reduce_us: float
    t_launch_us: float
    source: str

    def predict(self, g) -> "object":
        """Modeled µs for each row of a :func:`grid_table` (adds no columns; returns a Series)."""
        return self.time_us(workgroups=g.workgroups, waves=g.waves, compute_units=g.compute_units,
                            partitions=g.partitions, kv_bytes=kv_bytes_of(g),
                            partials_written=g.partials_bytes_written, partials_read=g.partials_bytes_read,
                            slots=g.slots)

    def time_us(self, *, workgroups, waves, compute_units, partitions, kv_bytes, partials_written, partials_read,
                slots):
        """The model's µs for numbers or arrays / Series of them (the formula of the class)."""
        import numpy as np

        last = workgroups - (waves - 1) * slots  # workgroups of the last wave (1..slots)
        per_wg = (kv_bytes + partials_written) / workgroups
        full_fill = np.minimum(slots, compute_units) / compute_units
        last_fill = np.minimum(last, compute_units) / compute_units
        multi = (partitions > 1) * 1.0
        stream = (per_wg * ((workgroups - last) / full_fill + last / last_fill) + partials_read) / self.bw_bytes_per_s
        return stream * 1e6 + self.t_wave_us * waves + multi * self.t_reduce_us + self.t_launch_us


def shape_model(arch: str) -> WaveModel | None:
    """The wave model the device's default partition size is chosen by (cpa.variants.SHAPE_MODELS;
    None where the arch has none)."""
    m = V.SHAPE_MODELS.get(arch)
    if m is None:
        return None
    return WaveModel(m["read_gbps"] * 1e9, m["t_wave_us"], m.get("t_reduce_us", 0.0), m.get("t_launch_us", 0.0),
                     m["source"])


def partition_by_wave_model(model: WaveModel, candidates, *, num_seqs: int, num_heads: int, num_kv_heads: int,
                            head_size: int, max_seq_len: int, kv_elem_bytes: int, slots: int,
                            compute_units: int) -> int:
    """The partition size of `candidates` (cpa.variants.partition_candidates) the wave model
    predicts fastest for one launch: `slots` attention workgroups resident at once on
    `compute_units` SMs/CUs, every sequence taken as max_seq_len long (the grid is). Ties go
    to the larger size (fewer partials to combine)."""
    if not candidates:
        raise ValueError("partition_by_wave_model: no candidate partition sizes")
    times = wave_model_times(model, candidates, num_seqs=num_seqs, num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_size=head_size, max_seq_len=max_seq_len, kv_elem_bytes=kv_elem_bytes, slots=slots,
                             compute_units=compute_units)
    best = None
    for p, t in times.items():
        if best is None or t <= best[0] * (1 + 1e-9):
            best = (t, p)
    return best[1]


def wave_model_times(model: WaveModel, candidates, *, num_seqs: int, num_heads: int, num_kv_heads: int,
                     head_size: int, max_seq_len: int, kv_elem_bytes: int, slots: int,
                     compute_units: int) -> dict[int, float]:
    """{partition size: modeled µs} of one launch for each of `candidates` (ascending), as
    :func:`partition_by_wave_model` compares them."""
    import math

    if slots < 1 or compute_units < 1:
        raise ValueError(f"partition_by_wave_model: slots={slots}, compute_units={compute_units}")
    kv = 2 * num_seqs * max_seq_len * num_kv_heads * head_size * kv_elem_bytes
    out = {}
    for p in sorted(candidates):
        parts = math.ceil(max_seq_len / p)
        wg = num_seqs * num_kv_heads * parts
        one_way = num_seqs * num_heads * parts * (head_size + 2) * 4 if parts > 1 else 0
        out[p] = float(model.time_us(workgroups=wg, waves=math.ceil(wg / slots), compute_units=compute_units,
                                     partitions=parts, kv_bytes=kv, partials_written=one_way,
                                     partials_read=one_way, slots=slots))
    return out


def kv_bytes_of(g, elem: int | None = None):
    """K and V read once for grid_table rows (equal lengths): 2 x seqs x len x kv heads x head x elem;
    elem None: each row's own ``kv_elem_bytes`` (1 for an fp8 cache; 2 for tables without the column)."""
    if elem is None:
        elem = g.kv_elem_bytes if "kv_elem_bytes" in getattr(g, "columns", ()) else 2
    return 2 * g.num_seqs * g.max_seq_len * g.num_kv_heads * g.head_size * elem


def fit_wave_model(grid, measured, bw_bytes_per_s: float, source: str) -> tuple[WaveModel, "object"]:
    """Fit t_wave, t_reduce, t_launch to measured times.

    `grid`: a :func:`grid_table`; `measured`: rows with num_seqs, max_seq_len, tiling,
    partition_size, time_us (e.g. a sweep). Returns (model, the joined table with `model_us`)."""
    import numpy as np

    keys = ["num_seqs", "max_seq_len", "tiling", "partition_size"]
    j = grid.merge(measured[keys + ["time_us"]], on=keys)
    if len(j) < 4:
        raise ValueError(f"fit_wave_model: {len(j)} matching rows; need at least 4")
    base = WaveModel(bw_bytes_per_s, 0.0, 0.0, 0.0, source)
    X = np.c_[j.waves, (j.partitions > 1).astype(float), np.ones(len(j))]
    coef = nonneg_lstsq(X, (j.time_us - base.predict(j)).to_numpy())
    model = WaveModel(bw_bytes_per_s, float(coef[0]), float(coef[1]), float(coef[2]), source)
    j = j.assign(model_us=model.predict(j))
    return model, j


def nonneg_lstsq(X, y):
    """argmin ||X c - y|| over c >= 0, for a few columns: the best least-squares fit over every
    subset of columns whose solution is non-negative (the others held at 0), which is the
    non-negative optimum (a cost cannot be negative)."""
    import itertools

    import numpy as np

    n = X.shape[1]
    best, best_r = np.zeros(n), float(np.sum(y * y))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            c, *_ = np.linalg.lstsq(X[:, cols], y, rcond=None)
            if (c < 0).any():
                continue
            full = np.zeros(n)
            full[list(cols)] = c
            r = float(np.sum((X @ full - y) ** 2))
            if r < best_r:
                best, best_r = full, r
    return best


def single_choice(table, time_col: str, by=("tiling", "partition_size")):
    """Geometric-mean slowdown of each fixed choice against the per-shape best of `time_col`."""
    import numpy as np

    shape = ["num_seqs", "max_seq_len"]
    t = table.assign(slowdown=table[time_col] / table.groupby(shape)[time_col].transform("min"))
    return (t.groupby(list(by)).slowdown.apply(lambda x: float(np.exp(np.log(x).mean())))
            .rename("geomean_slowdown").reset_index().sort_values("geomean_slowdown").reset_index(drop=True))
