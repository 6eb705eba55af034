"""Device specifications the occupancy and roofline models need: MI300X (gfx942), MI250X
(gfx90a, one GCD = one device), H100 SXM and H200 (sm_90).

Every value carries its source in a comment. Abbreviations:

* [ROCm-specs]  ROCm docs ``docs/reference/gpu-arch-specs.rst`` ("GPU hardware
  specifications", Instinct table: CUs, wavefront size, LDS, L2/L3, VGPR/SGPR file sizes).
* [ROCm-MI300]  ROCm docs ``docs/conceptual/gpu-arch/mi300.md`` (XCD layout, peak FLOPS per
  clock per CU and peak TFLOPS table, 5.3 TB/s).
* [ROCm-MI250]  ROCm docs ``docs/conceptual/gpu-arch/mi250.md`` (1.7 GHz, FLOPS per clock per
  CU, 1.6 TB/s per GCD).
* [LLVM-BI]     LLVM ``llvm/lib/Target/AMDGPU/Utils/AMDGPUBaseInfo.cpp`` (IsaInfo:
  getTotalNumVGPRs = 512 and getVGPRAllocGranule = 8 with FeatureGFX90AInsts,
  getAddressableNumArchVGPRs = 256, getMaxWavesPerEU = 8 on gfx90a/gfx94x, getEUsPerCU = 4,
  getMaxWorkGroupsPerCU = min(32 / waves_per_group, 16 barriers), getTotalNumSGPRs = 800,
  getAddressableNumSGPRs = 102, getOccupancyWithNumSGPRs).
* [LLVM-Usage]  LLVM ``llvm/docs/AMDGPUUsage.rst``: COMPUTE_PGM_RSRC2.LDS_SIZE granularity on
  GFX7-GFX10 (GFX9 included) ``roundup(lds-size / (128 * 4))`` = 512-byte blocks;
  ``.amdhsa_accum_offset`` (AGPRs start at a multiple of 4 arch VGPRs).
* [CUDA-occ]    ``cuda_occupancy.h`` of the CUDA 13.0 toolkit (NVIDIA's occupancy calculator
  header): compute capability 9: register allocation unit 256 per warp, 4 sub-partitions,
  32 blocks per SM, shared memory granule 128 B, carveouts up to 228 KiB, reserved shared
  memory per block added on compute capability >= 8.
* [CUDA-CC9]    CUDA C++ Programming Guide, "Technical Specifications per Compute Capability"
  (9.0): 64 K 32-bit registers per SM, 255 registers per thread, 64 warps / 2048 threads /
  32 blocks per SM, 228 KB shared memory per SM, 227 KB per block, 1 KB reserved per block.
* [Hopper-TG]   NVIDIA Hopper Tuning Guide (shared memory carveouts 0..228 KB per SM, up to
  227 KB per block, 50 MB L2 on H100).
* [DS-*]        vendor datasheet (marketing) numbers: peak, not measured. Labelled "datasheet".
* [measured-H200] ``/work/shared/README.md``: measured on this project's H200 (132 SMs,
  60 MiB L2 as the device reports it, 4.56 TB/s read-only ceiling). torch's device
  properties there (2026-12-02, driver 580.159.04) also read: 65536 registers per SM,
  233472 B (228 KiB) shared memory per SM, 232448 B (227 KiB) opt-in per block, 62914560 B L2.

Nothing here is measured on an MI300 or MI250.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """Fields shared by both vendors. 'CU' means CU (AMD) or SM (NVIDIA) throughout."""

    name: str
    arch: str
    vendor: str  # "amd" | "nvidia"
    compute_units: int  # CUs (AMD) / SMs (NVIDIA) of one device
    simds_per_cu: int  # SIMDs per CU (AMD) / SM sub-partitions (NVIDIA)
    wave_size: int  # lanes per wave / warp
    hbm_bytes: int  # device memory capacity
    hbm_bandwidth_bytes_per_s: float  # datasheet peak (not measured)
    l2_bytes: int
    last_level_cache_bytes: int  # Infinity Cache (MALL / "L3") on AMD; 0 when there is none
    clock_mhz: float  # peak engine / boost clock
    matrix_fp16_flops_per_clk_per_cu: int  # dense fp16/bf16 matrix-core FLOP per clock per CU/SM
    matrix_fp16_tflops: float  # dense peak, datasheet
    matrix_fp8_tflops: float | None  # dense peak, datasheet (None: no fp8 matrix cores)
    sources: dict = field(default_factory=dict, compare=False, repr=False)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("sources")
        return d


@dataclass(frozen=True, kw_only=True)
class CdnaSpec(DeviceSpec):
    """AMD CDNA2/CDNA3 compute-unit resources (gfx90a, gfx942)."""

    vgprs_per_lane: int  # unified arch VGPR + AGPR file per SIMD lane
    arch_vgprs_max: int  # addressable arch VGPRs per wave
    agprs_max: int  # addressable AGPRs per wave
    vgpr_granule: int  # allocation granule of the unified total
    agpr_offset_align: int  # AGPRs start at alignTo(arch VGPRs, this)
    sgprs_per_simd: int
    sgprs_max_per_wave: int  # addressable (without VCC / flat-scratch / XNACK extras)
    max_waves_per_simd: int
    max_waves_per_cu: int
    max_workgroups_per_cu: int  # multi-wave workgroups: one barrier each, 16 barriers per CU
    lds_per_cu: int
    lds_per_workgroup_max: int
    lds_granule: int


@dataclass(frozen=True, kw_only=True)
class HopperSpec(DeviceSpec):
    """NVIDIA Hopper SM resources (sm_90)."""

    regs_per_sm: int  # 32-bit registers
    regs_per_block_max: int
    regs_per_thread_max: int
    reg_alloc_unit: int  # registers per warp are rounded up to this (= 8 per thread x 32)
    max_warps_per_sm: int
    max_threads_per_block: int
    max_blocks_per_sm: int
    smem_per_sm: int  # largest carveout
    smem_carveouts: tuple[int, ...]  # selectable shared-memory capacities per SM
    smem_per_block_max: int  # opt-in maximum
    smem_per_block_static_max: int  # without opt-in (static __shared__)
    smem_reserved_per_block: int  # driver reservation, added to every block
    smem_granule: int


MI300X = CdnaSpec(
    name="AMD Instinct MI300X",
    arch="gfx942",
    vendor="amd",
    compute_units=304,  # [ROCm-specs] "304 (38 per XCD)"; [ROCm-MI300] 8 XCDs x 38 active CUs
    simds_per_cu=4,  # [LLVM-BI] getEUsPerCU = 4 before gfx10; [ROCm-MI250]/CDNA whitepapers: 4 SIMDs per CU
    wave_size=64,  # [ROCm-specs] wavefront size 64
    vgprs_per_lane=512,  # [LLVM-BI] getTotalNumVGPRs = 512 (FeatureGFX90AInsts); [ROCm-specs] VGPR file 512 KiB
    #                      per CU = 512 regs x 4 B x 64 lanes x 4 SIMDs
    arch_vgprs_max=256,  # [LLVM-BI] getAddressableNumArchVGPRs = 256
    agprs_max=256,  # [LLVM-BI] getAddressableNumVGPRs = 512 total on gfx90a+, of which 256 AGPRs
    vgpr_granule=8,  # [LLVM-BI] getVGPRAllocGranule = 8 (FeatureGFX90AInsts)
    agpr_offset_align=4,  # [LLVM-Usage] .amdhsa_accum_offset: multiple of 4; LLVM total = alignTo(v, 4) + a
    sgprs_per_simd=800,  # [LLVM-BI] getTotalNumSGPRs = 800 (gfx8+); [ROCm-specs] SGPR file 12.5 KiB per CU
    sgprs_max_per_wave=102,  # [LLVM-BI] getAddressableNumSGPRs = 102 (gfx8/gfx9)
    max_waves_per_simd=8,  # [LLVM-BI] getMaxWavesPerEU = 8 for gfx90a/gfx94x (isGFX90A)
    max_waves_per_cu=32,  # 8 x 4 SIMDs ([LLVM-BI] getMaxWorkGroupsPerCU: MaxWaves = 8 * EUs)
    max_workgroups_per_cu=16,  # [LLVM-BI] getMaxWorkGroupsPerCU: 16 barriers per CU (multi-wave groups)
    lds_per_cu=64 * KiB,  # [ROCm-specs] LDS 64 KiB; [LLVM-BI] getLocalMemorySize = 65536
    lds_per_workgroup_max=64 * KiB,  # [LLVM-BI] getAddressableLocalMemorySize = 65536
    lds_granule=512,  # [LLVM-Usage] LDS_SIZE granularity roundup(lds-size / (128 * 4)) on GFX7-GFX10
    hbm_bytes=192 * GiB,  # [ROCm-specs] VRAM 192 GiB
    hbm_bandwidth_bytes_per_s=5.3e12,  # datasheet; [ROCm-MI300] "theoretical aggregated peak memory bandwidth 5.3 TB/s"
    l2_bytes=32 * MiB,  # [ROCm-specs] "32 (4 per XCD)" MiB
    last_level_cache_bytes=256 * MiB,  # [ROCm-specs] L3 (Infinity Cache) 256 MiB
    clock_mhz=2100.0,  # datasheet peak engine clock; = [ROCm-MI300] 1307.4 TFLOPS / (304 CUs x 2048 FLOP/clk)
    matrix_fp16_flops_per_clk_per_cu=2048,  # [ROCm-MI300] Matrix FP16 / BF16: 2048 FLOPS/clock/CU
    matrix_fp16_tflops=1307.4,  # [ROCm-MI300] peak TFLOPS, dense (datasheet figure)
    matrix_fp8_tflops=2614.9,  # [ROCm-MI300] Matrix FP8: 4096 FLOPS/clock/CU, 2614.9 TFLOPS (datasheet)
    sources={"doc": "ROCm gpu-arch-specs.rst, mi300.md; LLVM AMDGPUBaseInfo.cpp, AMDGPUUsage.rst"},
)

# One GCD of an MI250X: the OS and ROCm see each GCD as a separate device.
MI250X_GCD = CdnaSpec(
    name="AMD Instinct MI250X (one GCD)",
    arch="gfx90a",
    vendor="amd",
    compute_units=110,  # [ROCm-specs] "220 (110 per GCD)"
    simds_per_cu=4,  # [ROCm-MI250] "each compute unit is further subdivided into four SIMD units"
    wave_size=64,  # [ROCm-specs]
    vgprs_per_lane=512,  # [LLVM-BI] getTotalNumVGPRs = 512 (FeatureGFX90AInsts); [ROCm-specs] VGPR file 512 KiB
    arch_vgprs_max=256,  # [LLVM-BI]
    agprs_max=256,  # [LLVM-BI]
    vgpr_granule=8,  # [LLVM-BI]
    agpr_offset_align=4,  # [LLVM-Usage]
    sgprs_per_simd=800,  # [LLVM-BI]; [ROCm-specs] SGPR file 12.5 KiB
    sgprs_max_per_wave=102,  # [LLVM-BI]
    max_waves_per_simd=8,  # [LLVM-BI] getMaxWavesPerEU = 8 (isGFX90A)
    max_waves_per_cu=32,  # [LLVM-BI]
    max_workgroups_per_cu=16,  # [LLVM-BI]
    lds_per_cu=64 * KiB,  # [ROCm-specs] LDS 64 KiB
    lds_per_workgroup_max=64 * KiB,  # [LLVM-BI]
    lds_granule=512,  # [LLVM-Usage]
    hbm_bytes=64 * GiB,  # [ROCm-specs] 128 GiB per MI250X = 64 GiB per GCD
    hbm_bandwidth_bytes_per_s=1.6e12,  # datasheet; [ROCm-MI250] "1.6 TB/sec per GCD" (3.2 TB/s per OAM)
    l2_bytes=8 * MiB,  # [ROCm-specs] "16 (8 per GCD)" MiB
    last_level_cache_bytes=0,  # [ROCm-specs] no L3 / Infinity Cache on CDNA2
    clock_mhz=1700.0,  # [ROCm-MI250] "peak clock frequency of 1.7 GHz"
    matrix_fp16_flops_per_clk_per_cu=1024,  # [ROCm-MI250] Matrix FP16 / BF16: 1024 FLOPS/clock/CU
    matrix_fp16_tflops=191.5,  # derived: 110 CUs x 1024 x 1.7 GHz (datasheet 383 TFLOPS per 2-GCD MI250X)
    matrix_fp8_tflops=None,  # CDNA2 has no fp8 matrix instructions (notes/amd-mfma.md section 3)
    sources={"doc": "ROCm gpu-arch-specs.rst, mi250.md; LLVM AMDGPUBaseInfo.cpp, AMDGPUUsage.rst"},
)

_HOPPER_SM = dict(
    arch="sm_90",
    vendor="nvidia",
    simds_per_cu=4,  # [CUDA-occ] cudaOccSubPartitionsPerMultiprocessor = 4 for compute capability 9
    wave_size=32,  # [CUDA-CC9] warp size 32
    regs_per_sm=64 * 1024,  # [CUDA-CC9] 64 K 32-bit registers per SM
    regs_per_block_max=64 * 1024,  # [CUDA-CC9] 64 K per block
    regs_per_thread_max=255,  # [CUDA-CC9] 255 registers per thread
    reg_alloc_unit=256,  # [CUDA-occ] cudaOccRegAllocationGranularity = 256 (per warp; 8 per thread)
    max_warps_per_sm=64,  # [CUDA-CC9] 64 resident warps (2048 threads) per SM
    max_threads_per_block=1024,  # [CUDA-CC9]
    max_blocks_per_sm=32,  # [CUDA-CC9]; [CUDA-occ] cudaOccMaxBlocksPerMultiprocessor = 32 for major 9
    smem_per_sm=228 * KiB,  # [CUDA-CC9] 228 KB per SM; [Hopper-TG]
    smem_carveouts=tuple(k * KiB for k in (0, 8, 16, 32, 64, 100, 132, 164, 196, 228)),  # [Hopper-TG]; [CUDA-occ]
    smem_per_block_max=227 * KiB,  # [CUDA-CC9] 227 KB per block (opt-in); [Hopper-TG]
    smem_per_block_static_max=48 * KiB,  # [CUDA-CC9] static shared memory per block: 48 KB
    smem_reserved_per_block=1 * KiB,  # [CUDA-CC9] 1 KB reserved per block; [CUDA-occ] added on cc >= 8
    smem_granule=128,  # [CUDA-occ] cudaOccSMemAllocationGranularity = 128 for major 8..12
    matrix_fp16_flops_per_clk_per_cu=4096,  # derived: datasheet 989.4 dense TFLOPS / (132 SMs x 1830 MHz)
)

H100_SXM = HopperSpec(
    name="NVIDIA H100 SXM",
    compute_units=132,  # datasheet / [Hopper-TG] H100 SXM5: 132 SMs
    hbm_bytes=80 * 10**9,  # datasheet 80 GB HBM3
    hbm_bandwidth_bytes_per_s=3.35e12,  # datasheet 3.35 TB/s
    l2_bytes=50 * MiB,  # [Hopper-TG] / whitepaper: 50 MB L2
    last_level_cache_bytes=0,
    clock_mhz=1830.0,  # clock of the datasheet TFLOPS (989.4 = 132 x 4096 x 1.83 GHz); nvidia-smi max is higher
    matrix_fp16_tflops=989.4,  # datasheet dense fp16/bf16 tensor (1979 with sparsity)
    matrix_fp8_tflops=1978.9,  # datasheet dense fp8 tensor (3958 with sparsity)
    sources={"doc": "CUDA programming guide CC 9.0 table, cuda_occupancy.h (CUDA 13.0), Hopper tuning guide, "
                    "H100 datasheet"},
    **_HOPPER_SM,
)

H200 = HopperSpec(
    name="NVIDIA H200",
    compute_units=132,  # datasheet: same GH100 configuration as H100 SXM; [measured-H200] 132 SMs
    hbm_bytes=141 * 10**9,  # datasheet 141 GB HBM3e
    hbm_bandwidth_bytes_per_s=4.8e12,  # datasheet 4.8 TB/s ([measured-H200]: 4.56 TB/s read-only ceiling)
    l2_bytes=60 * MiB,  # [measured-H200] as the device reports it (H100 documentation says 50 MB)
    last_level_cache_bytes=0,
    clock_mhz=1830.0,  # same SM and datasheet compute figures as H100 SXM
    matrix_fp16_tflops=989.4,  # datasheet dense fp16/bf16 tensor (1979 with sparsity)
    matrix_fp8_tflops=1978.9,  # datasheet dense fp8 tensor (3958 with sparsity)
    sources={"doc": "as H100_SXM; H200 datasheet; /work/shared/README.md measurements"},
    **_HOPPER_SM,
)

SPECS: dict[str, DeviceSpec] = {"mi300x": MI300X, "mi250x": MI250X_GCD, "h100": H100_SXM, "h200": H200}
BY_ARCH: dict[str, DeviceSpec] = {"gfx942": MI300X, "gfx90a": MI250X_GCD, "sm_90": H200}


def spec_for(arch_or_name: str) -> DeviceSpec:
    """'gfx942' / 'gfx90a' / 'sm_90' (-> H200, the device this project measures) or a SPECS key."""
    key = arch_or_name.lower()
    if key in SPECS:
        return SPECS[key]
    if arch_or_name in BY_ARCH:
        return BY_ARCH[arch_or_name]
    raise ValueError(f"no device spec for {arch_or_name!r}; known: {', '.join([*BY_ARCH, *SPECS])}")
