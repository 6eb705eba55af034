// cpa platform layer: the only file that knows whether it is compiled as HIP (AMD,
// wave64, MFMA) or CUDA (NVIDIA, warp32, mma.sync). Everything above it is written once.
//
// What it provides:
//   CPA_WAVE                      lanes per wave/warp (64 on CDNA, 32 on NVIDIA)
//   cpa::lane_id()                lane within the wave
//   cpa::shfl_xor(v, mask)        butterfly shuffle within the wave
//   cpa::barrier()                workgroup barrier
//   cpa::exp2f_fast(x)            hardware 2^x (v_exp_f32 / ex2.approx)
//   cpa::load16 / load8 / load4   16/8/4-byte vector loads (uint4 / uint2 / uint32)
//   cpa::lds16 / lds8, cp_async16 shared-memory loads; async global -> shared copies (NVIDIA)
//   mbar_*, bulk_copy_to_shared   mbarriers and TMA bulk copies (NVIDIA sm_90, the ring loop)
//   cpa::F16 / cpa::BF16          16-bit storage tags with pack/unpack of bit pairs
//   cpa::fp8x4_to_16bit<T>        four e4m3fn bytes -> two packed 16-bit values (value / 256)
//   matrix-core calls             cpa::mma_* (NVIDIA) and cpa::mfma_* (AMD), operands as
//                                 packed 32-bit registers so tiles can be written portably.
//
// Kernel headers never include torch: each variant also compiles alone with clang or nvcc.
#pragma once

#include <stdint.h>

#if defined(CPA_EMU)
// The HIP side (or with CPA_EMU_CUDA the CUDA side) on the host CPU, for tests without that
// GPU (emu/wave_emu.h): the builtins below are emulated there, wave by wave; the CUDA side's
// PTX asm has CPA_EMU branches.
#if defined(CPA_EMU_CUDA)
#define CPA_CUDA 1
#define CPA_WAVE 32
#else
#define CPA_HIP 1
#define CPA_WAVE 64
#endif
#include "emu/wave_emu.h"
#elif defined(__HIPCC__) || defined(__HIP__)
#define CPA_HIP 1
#define CPA_WAVE 64
#ifndef __HIP_DEVICE_COMPILE__
#include <hip/hip_runtime.h>
#else
// Device-only compiles (-nogpulib) use the clang builtins below; the runtime header is
// still needed for __global__/threadIdx and friends.
#include <hip/hip_runtime.h>
#endif
#else
#define CPA_CUDA 1
#define CPA_WAVE 32
#include <cuda_runtime.h>
#endif

#define CPA_DEVICE __device__ __forceinline__

namespace cpa {

constexpr int kWave = CPA_WAVE;
#if CPA_CUDA
constexpr bool kNvidia = true;  // (for compile-time choices in C++ expressions: CPA_CUDA is a macro)
#else
constexpr bool kNvidia = false;
#endif

// Work-item ids and the barrier through compiler builtins on AMD: HIP's threadIdx and
// __syncthreads call into the device libraries (ockl), which a device-only compile with
// -nogpulib cannot resolve (and an unresolved call skews the reported register counts).
#if CPA_HIP
CPA_DEVICE int thread_idx() { return (int)__builtin_amdgcn_workitem_id_x(); }
CPA_DEVICE int block_idx_x() { return (int)__builtin_amdgcn_workgroup_id_x(); }
CPA_DEVICE int block_idx_y() { return (int)__builtin_amdgcn_workgroup_id_y(); }
CPA_DEVICE int block_idx_z() { return (int)__builtin_amdgcn_workgroup_id_z(); }
CPA_DEVICE void barrier() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}
#else
CPA_DEVICE int thread_idx() { return (int)threadIdx.x; }
CPA_DEVICE int block_idx_x() { return (int)blockIdx.x; }
CPA_DEVICE int block_idx_y() { return (int)blockIdx.y; }
CPA_DEVICE int block_idx_z() { return (int)blockIdx.z; }
CPA_DEVICE void barrier() { __syncthreads(); }
#endif
CPA_DEVICE int lane_id() { return thread_idx() & (CPA_WAVE - 1); }
CPA_DEVICE int wave_id() { return thread_idx() / CPA_WAVE; }
// Keeps the compiler from moving memory accesses across this point (no instruction).
CPA_DEVICE void compiler_fence() { asm volatile("" ::: "memory"); }
// Orders shared-memory traffic among the lanes of one wave.
CPA_DEVICE void wave_sync() {
#if CPA_HIP
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
#else
  __syncwarp();
#endif
}

CPA_DEVICE float shfl_xor(float v, int mask) {
#if CPA_HIP
  // ds_bpermute addresses lanes in bytes.
  int src = (lane_id() ^ mask) << 2;
  return __int_as_float(__builtin_amdgcn_ds_bpermute(src, __float_as_int(v)));
#else
  return __shfl_xor_sync(0xffffffffu, v, mask);
#endif
}

CPA_DEVICE int shfl_xor(int v, int mask) {
#if CPA_HIP
  return __builtin_amdgcn_ds_bpermute((lane_id() ^ mask) << 2, v);
#else
  return __shfl_xor_sync(0xffffffffu, v, mask);
#endif
}

CPA_DEVICE float exp2f_fast(float x) {
#if CPA_HIP
  return __builtin_amdgcn_exp2f(x);
#elif defined(CPA_EMU)
  return ::exp2f(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

CPA_DEVICE float fmaxf_(float a, float b) { return a > b ? a : b; }

// Device-scope ordering and a counter, for the fused reduce (the last workgroup of a
// sequence combines its partitions).
CPA_DEVICE void fence_device() {
#if CPA_HIP
  __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "agent");
#else
  __threadfence();
#endif
}
CPA_DEVICE int atomic_add_i32(int* p, int v) {
#if CPA_HIP
  return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
#else
  return atomicAdd(p, v);
#endif
}
// The count of the one-round fused combine: an acquire-release RMW at device scope. Its
// release covers the workgroup's stores ordered before it by a barrier (cumulativity), its
// acquire the stores released by the earlier counts (they form one release sequence), so
// neither side needs a separate fence (which the CUDA fence, fence.sc, makes heavier).
CPA_DEVICE int atomic_add_acq_rel_i32(int* p, int v) {
#if CPA_HIP
  return __hip_atomic_fetch_add(p, v, __ATOMIC_ACQ_REL, __HIP_MEMORY_SCOPE_AGENT);
#elif defined(CPA_EMU)
  return ::cpa_emu::fetch_add(p, v, __ATOMIC_ACQ_REL);
#else
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
#endif
}
CPA_DEVICE void atomic_store_i32(int* p, int v) {
#if CPA_HIP
  __hip_atomic_store(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
#else
  atomicExch(p, v);
#endif
}

// ---------------------------------------------------------------- vector loads
struct u32x4 { uint32_t x, y, z, w; };
struct u32x2 { uint32_t x, y; };

CPA_DEVICE u32x4 load16(const void* p) {
#if CPA_HIP
  typedef uint32_t v4u __attribute__((ext_vector_type(4)));
  v4u v = *reinterpret_cast<const v4u*>(p);
  return {v.x, v.y, v.z, v.w};
#else
  uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
  return {v.x, v.y, v.z, v.w};
#endif
}
CPA_DEVICE u32x2 load8(const void* p) {
#if CPA_HIP
  typedef uint32_t v2u __attribute__((ext_vector_type(2)));
  v2u v = *reinterpret_cast<const v2u*>(p);
  return {v.x, v.y};
#else
  uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
  return {v.x, v.y};
#endif
}
// Loads of the KV cache, read once per launch. CPA_KV_LOAD_HINT (NVIDIA) picks the PTX cache
// hints: 0 __ldg; 1 .L1::no_allocate (default: the lines are used once, by the load that
// brings them; measured 0.987x the time of 0, notes/kernel-notes.md); 2 .L2::256B (the L2
// fetches the whole 256-byte chunk from DRAM: 1.07x slower at 8 x 32k); 3 both; 4 .L2::128B;
// 5 1 + 2 + an L2 evict_first policy. No-op on HIP. (Plain ld.global, as Triton's streaming
// readers load, with and without .L1::no_allocate: level or 0.1-0.5% slower, 189802f, removed.)
#ifndef CPA_KV_LOAD_HINT
#define CPA_KV_LOAD_HINT 1
#endif
#if CPA_CUDA && CPA_KV_LOAD_HINT && !defined(CPA_EMU)
#if CPA_KV_LOAD_HINT == 1
#define CPA_KV_LD "ld.global.nc.L1::no_allocate"
#elif CPA_KV_LOAD_HINT == 2
#define CPA_KV_LD "ld.global.nc.L2::256B"
#elif CPA_KV_LOAD_HINT == 3
#define CPA_KV_LD "ld.global.nc.L1::no_allocate.L2::256B"
#elif CPA_KV_LOAD_HINT == 4
#define CPA_KV_LD "ld.global.nc.L2::128B"
#else
#define CPA_KV_LD "ld.global.nc.L1::no_allocate.L2::cache_hint.L2::256B"
#endif
CPA_DEVICE uint64_t kv_l2_policy() {
  uint64_t pol = 0;
#if CPA_KV_LOAD_HINT == 5
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
#endif
  return pol;
}
#endif
CPA_DEVICE u32x4 load16_kv(const void* p) {
#if CPA_CUDA && CPA_KV_LOAD_HINT && !defined(CPA_EMU)
  u32x4 v;
#if CPA_KV_LOAD_HINT == 5
  asm(CPA_KV_LD ".v4.u32 {%0, %1, %2, %3}, [%4], %5;" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(kv_l2_policy()));
#else
  asm(CPA_KV_LD ".v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#endif
  return v;
#else
  return load16(p);
#endif
}
CPA_DEVICE u32x2 load8_kv(const void* p) {
#if CPA_CUDA && CPA_KV_LOAD_HINT && !defined(CPA_EMU)
  u32x2 v;
#if CPA_KV_LOAD_HINT == 5
  asm(CPA_KV_LD ".v2.u32 {%0, %1}, [%2], %3;" : "=r"(v.x), "=r"(v.y) : "l"(p), "l"(kv_l2_policy()));
#else
  asm(CPA_KV_LD ".v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
#endif
  return v;
#else
  return load8(p);
#endif
}
// A store that other workgroups of this launch read before it ends (the fused combine's
// partials). The emulator holds it back until the workgroup's next release (emu/wave_emu.h).
CPA_DEVICE void store_partial(float* p, float v) {
#if defined(CPA_EMU)
  ::cpa_emu::store_partial(p, v);
#else
  *p = v;
#endif
}
// Loads of data other workgroups wrote during this launch: served by the L2, not a
// possibly stale L1 line (NVIDIA ld.global.cg; on AMD the agent-scope acquire fence
// before them invalidates the vector L1).
CPA_DEVICE float load_f32_l2(const float* p) {
#if defined(CPA_EMU)
  return ::cpa_emu::load_partial(p);
#elif CPA_HIP
  return *p;
#else
  return __ldcg(p);
#endif
}
CPA_DEVICE u32x4 load16_l2(const void* p) {
#if defined(CPA_EMU)
  float x[4];
  for (int i = 0; i < 4; ++i) x[i] = ::cpa_emu::load_partial(static_cast<const float*>(p) + i);
  u32x4 v;
  memcpy(&v, x, sizeof v);
  return v;
#elif CPA_HIP
  return load16(p);
#else
  uint4 v = __ldcg(reinterpret_cast<const uint4*>(p));
  return {v.x, v.y, v.z, v.w};
#endif
}
CPA_DEVICE uint32_t load4(const void* p) {
#if CPA_HIP
  return *reinterpret_cast<const uint32_t*>(p);
#else
  return __ldg(reinterpret_cast<const unsigned int*>(p));
#endif
}
// A load the compiler keeps where it is written (volatile asm on NVIDIA: it is not sunk past
// a later branch), so that it is in flight before a branch that does not need it resolves.
CPA_DEVICE int load_i32_early(const int* p) {
#if CPA_HIP || defined(CPA_EMU)
  return *p;
#else
  int x;
  asm volatile("ld.global.nc.b32 %0, [%1];" : "=r"(x) : "l"(p));
  return x;
#endif
}
CPA_DEVICE int load_i32(const int* p) {
#if CPA_HIP
  return *p;
#else
  return __ldg(p);
#endif
}

// Asynchronous 16-byte global -> shared copies (NVIDIA cp.async, L1 bypassed): the loads stay
// in flight without holding registers; lds16 / lds8 read them back. Only the staged main loop
// (-DCPA_KV_ASYNC=1) uses them.
CPA_DEVICE u32x4 lds16(const void* p) {
#if CPA_HIP
  typedef uint32_t v4u __attribute__((ext_vector_type(4)));
  const v4u v = *reinterpret_cast<const v4u*>(p);
#else
  const uint4 v = *reinterpret_cast<const uint4*>(p);
#endif
  return {v.x, v.y, v.z, v.w};
}
CPA_DEVICE u32x2 lds8(const void* p) {
#if CPA_HIP
  typedef uint32_t v2u __attribute__((ext_vector_type(2)));
  const v2u v = *reinterpret_cast<const v2u*>(p);
#else
  const uint2 v = *reinterpret_cast<const uint2*>(p);
#endif
  return {v.x, v.y};
}
// Programmatic dependent launch (sm_90+, CPA_PDL): the reduce kernel is launched while the
// attention kernel's last workgroups still run, so its launch latency and prologue overlap
// them; it waits in wait_prior_grid() until the attention kernel has finished and its writes
// are visible. No-ops elsewhere (HIP has no such launch; before sm_90 the kernels serialize).
#ifndef CPA_PDL
#define CPA_PDL 1
#endif
// The attention kernel is launched the same way after whatever kernel precedes it: its
// launch overlaps that kernel's tail, and it waits before its first memory access, so it
// sees every earlier write (H200: 0.3-0.6 us less per call at batch 1; -DCPA_PDL_ATTENTION=0
// for the A/B).
#ifndef CPA_PDL_ATTENTION
#define CPA_PDL_ATTENTION 1
#endif
// (The wave emulator's CUDA side runs them in its PDL chain: emu/wave_emu.h, run_pdl_chain.)
CPA_DEVICE void allow_dependent_launch() {
#if defined(CPA_EMU) && CPA_CUDA && CPA_PDL
  ::cpa_emu::launch_dependents();
#elif CPA_CUDA && CPA_PDL && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
CPA_DEVICE void wait_prior_grid() {
#if defined(CPA_EMU) && CPA_CUDA && CPA_PDL
  ::cpa_emu::grid_dependency_wait();
#elif CPA_CUDA && CPA_PDL && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Thread-block clusters (sm_90+): the partitions of one (sequence, KV head), launched as one
// cluster, combine their partial results through distributed shared memory instead of a
// second kernel. Only reached when the launch set a cluster (the host checks the device);
// elsewhere these compile to nothing.
// (The wave emulator's CUDA side runs them: its clusters' workgroups run at once, emu/wave_emu.h.)
#if CPA_CUDA && ((defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900) || defined(CPA_EMU))
#define CPA_CLUSTER_CODE 1
#else
#define CPA_CLUSTER_CODE 0
#endif
// Every thread of every workgroup of the cluster: release this workgroup's shared-memory
// writes, acquire the others'.
CPA_DEVICE void cluster_sync() {
#if CPA_CLUSTER_CODE && defined(CPA_EMU)
  ::cpa_emu::arrive(::cpa_emu::kClusterBarrier);
#elif CPA_CLUSTER_CODE
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
CPA_DEVICE int cluster_rank() {
#if CPA_CLUSTER_CODE && defined(CPA_EMU)
  return ::cpa_emu::group().cluster_rank;
#elif CPA_CLUSTER_CODE
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return (int)r;
#else
  return 0;
#endif
}
#if CPA_CLUSTER_CODE && !defined(CPA_EMU)
// The shared::cluster address of `p` (this workgroup's shared memory) in workgroup `rank`.
CPA_DEVICE unsigned cluster_addr(const float* p, int rank) {
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"((unsigned)__cvta_generic_to_shared(p)), "r"(rank));
  return r;
}
#endif
// The word / 16 bytes at `p` (this workgroup's shared memory) in workgroup `rank` of the cluster.
CPA_DEVICE float ld_cluster_f32(const float* p, int rank) {
#if CPA_CLUSTER_CODE && defined(CPA_EMU)
  return *::cpa_emu::cluster_ptr(p, rank);
#elif CPA_CLUSTER_CODE
  float x;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(x) : "r"(cluster_addr(p, rank)) : "memory");
  return x;
#else
  return *p;
#endif
}
CPA_DEVICE u32x4 ld_cluster16(const float* p, int rank) {
#if CPA_CLUSTER_CODE && defined(CPA_EMU)
  return lds16(::cpa_emu::cluster_ptr(p, rank));
#elif CPA_CLUSTER_CODE
  u32x4 v;
  asm volatile("ld.shared::cluster.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(cluster_addr(p, rank)) : "memory");
  return v;
#else
  return lds16(p);
#endif
}
#if CPA_CUDA
// How the staged loops' 16-byte copies go: 1 (default) `.ca` (LDGSTS through L1, which merges
// a warp's copies into whole-line L2 requests); 0 `.cg` (LDGSTS.BYPASS: the L2 is asked for every
// 32-byte sector twice -- 2.00x the K/V sectors, 50% of them hits, tag lookups 42% -> 74% of
// peak); 2 `.cg` + `.L2::128B` (still 2.00x); 3 `.ca` + `.L2::128B`. H200, ncu of the slot loop
// (-DCPA_KV_ASYNC=2) at 8 x 32k, P 2048 (bd1e4a3): 287.1 us with 0, 249.2 with 1, 247.1 with 3,
// against 250.5-250.9 for the direct loop (notes/kernel-notes.md). An A/B knob of the knob loops.
#ifndef CPA_CP_ASYNC_MODE
#define CPA_CP_ASYNC_MODE 1
#endif
#if CPA_CP_ASYNC_MODE < 0 || CPA_CP_ASYNC_MODE > 3
#error "CPA_CP_ASYNC_MODE is 0-3 (bit 0: .ca instead of .cg, bit 1: the .L2::128B hint)"
#endif
#if CPA_CP_ASYNC_MODE & 1
#define CPA_CP_ASYNC_CACHE ".ca"
#else
#define CPA_CP_ASYNC_CACHE ".cg"
#endif
#if CPA_CP_ASYNC_MODE & 2
#define CPA_CP_ASYNC_HINT ".L2::128B"
#else
#define CPA_CP_ASYNC_HINT ""
#endif
CPA_DEVICE void cp_async16(void* smem, const void* g) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async" CPA_CP_ASYNC_CACHE ".shared.global" CPA_CP_ASYNC_HINT " [%0], [%1], 16;" ::"r"(s), "l"(g)
               : "memory");
}
CPA_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
CPA_DEVICE void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }
CPA_DEVICE void cp_async_wait_but_newest() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }

// Bulk copies (the TMA engine, sm_90) into shared memory, completing on an mbarrier: one lane
// moves a whole contiguous run without registers or per-16-byte instructions. Only the
// ring main loop (-DCPA_KV_ASYNC=3) uses them.
CPA_DEVICE unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
CPA_DEVICE void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
// Makes initialized mbarriers visible to the async proxy (the bulk copies' completions).
CPA_DEVICE void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// Arrive once and expect `bytes` of bulk-copy completions in the current phase.
CPA_DEVICE void mbar_arrive_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
// Wait until the phase of parity `parity` has completed.
CPA_DEVICE void mbar_wait(uint64_t* bar, int parity) {
  asm volatile("{ .reg .pred done;\n"
               "WAIT:\n"
               "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
               "@!done bra WAIT; }" ::"r"(smem_u32(bar)), "r"(parity) : "memory");
}
CPA_DEVICE void bulk_copy_to_shared(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}
// Orders this thread's earlier shared-memory accesses before later bulk copies (async proxy).
CPA_DEVICE void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
#endif
// v of lane `lane` (any lane of the wave; each lane may name a different one).
CPA_DEVICE int shfl_idx_i32(int v, int lane) {
#if CPA_HIP
  return __builtin_amdgcn_ds_bpermute(lane << 2, v);
#else
  return __shfl_sync(0xffffffffu, v, lane);
#endif
}

// ---------------------------------------------------------------- 16-bit types
// Storage is raw 16-bit; arithmetic happens in fp32 or on the matrix cores.
CPA_DEVICE float half_bits_to_float(uint16_t h) {
#if CPA_HIP || defined(CPA_EMU)
  _Float16 v = __builtin_bit_cast(_Float16, h);
  return (float)v;
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#endif
}
CPA_DEVICE uint16_t float_to_half_bits(float f) {
#if CPA_HIP || defined(CPA_EMU)
  _Float16 v = (_Float16)f;
  return __builtin_bit_cast(uint16_t, v);
#else
  uint16_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#endif
}
CPA_DEVICE float bf16_bits_to_float(uint16_t b) { return __uint_as_float(((uint32_t)b) << 16); }
CPA_DEVICE uint16_t float_to_bf16_bits(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu)) return 0x7fc0;  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return (uint16_t)(u >> 16);
}

struct F16 {
  static constexpr bool is_bf16 = false;
  CPA_DEVICE static float to_float(uint16_t h) { return half_bits_to_float(h); }
  CPA_DEVICE static uint16_t from_float(float f) { return float_to_half_bits(f); }
  CPA_DEVICE static uint32_t pack(float lo, float hi) {
#if CPA_CUDA && !defined(CPA_EMU)
    uint32_t r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return (uint32_t)from_float(lo) | ((uint32_t)from_float(hi) << 16);
#endif
  }
};
struct BF16 {
  static constexpr bool is_bf16 = true;
  CPA_DEVICE static float to_float(uint16_t h) { return bf16_bits_to_float(h); }
  CPA_DEVICE static uint16_t from_float(float f) { return float_to_bf16_bits(f); }
  CPA_DEVICE static uint32_t pack(float lo, float hi) {
#if CPA_CUDA && !defined(CPA_EMU)
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return (uint32_t)from_float(lo) | ((uint32_t)from_float(hi) << 16);
#endif
  }
};

CPA_DEVICE float lo_to_float_f16(uint32_t w) { return half_bits_to_float((uint16_t)(w & 0xffff)); }
CPA_DEVICE float hi_to_float_f16(uint32_t w) { return half_bits_to_float((uint16_t)(w >> 16)); }

template <class T> CPA_DEVICE float lo_f(uint32_t w) { return T::to_float((uint16_t)(w & 0xffffu)); }
template <class T> CPA_DEVICE float hi_f(uint32_t w) { return T::to_float((uint16_t)(w >> 16)); }

// ---------------------------------------------------------------- fp8 e4m3fn
// Two e4m3fn bytes (b0 in bits 0-7, b1 in bits 8-15 of w) -> two fp16 bit patterns whose
// values are exactly the fp8 values / 256 (fp8 subnormals land on fp16 subnormals). The
// factor 256 is folded into the k/v scales by the host (cpa.ops). NaN bytes become finite
// values: a KV cache never holds NaN in slots a sequence uses.
CPA_DEVICE uint32_t fp8x2_to_half2_div256(uint32_t w) {
  uint32_t x = ((w & 0xffu) << 8) | ((w & 0xff00u) << 16);  // b0 -> bits 8-15, b1 -> 24-31
  return (x & 0x80008000u) | ((x >> 1) & 0x3f803f80u);
}
// 1 (the default; NVIDIA sm_89+ only): e4m3 pairs decode with the hardware conversion
// (cvt.rn.f16x2.e4m3x2, exact) and one multiply by 2^-8 (exact: e4m3 values have <= 4
// significant bits and fp16 arithmetic keeps subnormals): the same value / 256 as the bit
// trick above in about a third of the instructions (H200, 8 x 32k fp8 cache: 1.4x faster
// with fp16 queries, 1.6x with bf16). NaN bytes decode to NaN here; the kernel masks unused
// slots either way. 0: the bit trick (always on AMD and before sm_89).
#ifndef CPA_FP8_CVT
#define CPA_FP8_CVT 1
#endif
#if CPA_CUDA && CPA_FP8_CVT && ((defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890) || defined(CPA_EMU))
#define CPA_FP8_HW 1  // (device pass of an sm_89+ build; the emulator's CUDA side emulates it)
#else
#define CPA_FP8_HW 0
#endif
// Four bytes -> two packed 16-bit registers of type T (fp16 or bf16), value / 256.
template <class T> CPA_DEVICE u32x2 fp8x4_to_16bit(uint32_t w) {
#if CPA_FP8_HW && defined(CPA_EMU)
  const uint32_t h01 = ::cpa_emu::cvt_f16x2_e4m3x2_div256(w & 0xffffu);
  const uint32_t h23 = ::cpa_emu::cvt_f16x2_e4m3x2_div256(w >> 16);
#elif CPA_FP8_HW
  uint32_t h01, h23;
  asm("{ .reg .b16 lo, hi;\n"
      "  mov.b32 {lo, hi}, %2;\n"
      "  cvt.rn.f16x2.e4m3x2 %0, lo;\n"
      "  cvt.rn.f16x2.e4m3x2 %1, hi;\n"
      "  mul.rn.f16x2 %0, %0, %3;\n"
      "  mul.rn.f16x2 %1, %1, %3; }"
      : "=r"(h01), "=r"(h23) : "r"(w), "r"(0x1c001c00u));  // 0x1c00: fp16 2^-8
#else
  uint32_t h01 = fp8x2_to_half2_div256(w & 0xffffu);
  uint32_t h23 = fp8x2_to_half2_div256(w >> 16);
#endif
  if constexpr (!T::is_bf16) {
    return {h01, h23};
  } else {
    // fp16 -> fp32 is exact; these values have <= 4 significant bits, so truncating fp32
    // to bf16 is exact too.
#if CPA_FP8_HW
    // (the high halves of two fp32 in one byte permute)
    return {__byte_perm(__float_as_uint(lo_to_float_f16(h01)), __float_as_uint(hi_to_float_f16(h01)), 0x7632),
            __byte_perm(__float_as_uint(lo_to_float_f16(h23)), __float_as_uint(hi_to_float_f16(h23)), 0x7632)};
#else
    uint32_t a = __float_as_uint(lo_to_float_f16(h01)) >> 16;
    uint32_t b = __float_as_uint(hi_to_float_f16(h01)) & 0xffff0000u;
    uint32_t c = __float_as_uint(lo_to_float_f16(h23)) >> 16;
    uint32_t d = __float_as_uint(hi_to_float_f16(h23)) & 0xffff0000u;
    return {a | b, c | d};
#endif
  }
}

// ---------------------------------------------------------------- matrix cores
#if CPA_CUDA
// mma.sync.m16n8k16, fp32 accumulate. a: 4 regs (rows g/g+8 x k pairs), b: 2 regs.
#if defined(CPA_EMU)
// The host emulator's warp-wide instructions (emu/wave_emu.h): the same fragment layouts.
template <class T>
CPA_DEVICE void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  ::cpa_emu::mma<::cpa_emu::kMma16816>(c, a, b, T::is_bf16);
}
template <class T>
CPA_DEVICE void mma_m16n8k8(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
  const uint32_t a[2] = {a0, a1}, b[1] = {b0};
  ::cpa_emu::mma<::cpa_emu::kMma1688>(c, a, b, T::is_bf16);
}
CPA_DEVICE uint32_t movmatrix_trans(uint32_t x) { return ::cpa_emu::movmatrix_trans(x); }
#else
template <class T>
CPA_DEVICE void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  if constexpr (T::is_bf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}
// mma.sync.m16n8k8, fp32 accumulate. a: 2 regs (rows g, g+8), b: 1 reg.
template <class T>
CPA_DEVICE void mma_m16n8k8(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
  if constexpr (T::is_bf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(b0));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(b0));
  }
}
// Transpose an 8x8 b16 matrix held in mma fragment layout (lane g*4+t holds row g,
// columns 2t, 2t+1) so that each lane holds row g of the transpose.
CPA_DEVICE uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}
#endif  // CPA_EMU
// 4x4 transpose of 32-bit registers across the four lanes of a quad (lane bits 0-1):
// lane t's r[j] becomes what lane j held in r[t]. Two butterfly rounds (lane ^ 2 swaps the
// off-diagonal 2x2 blocks, lane ^ 1 the off-diagonal elements): 4 shuffles, no memory.
CPA_DEVICE void quad_transpose4(uint32_t (&r)[4]) {
  const int t = lane_id() & 3;
  const bool hi = t & 2, odd = t & 1;
  uint32_t x0 = hi ? r[0] : r[2], x1 = hi ? r[1] : r[3];
  x0 = __shfl_xor_sync(0xffffffffu, x0, 2);
  x1 = __shfl_xor_sync(0xffffffffu, x1, 2);
  if (hi) { r[0] = x0; r[1] = x1; } else { r[2] = x0; r[3] = x1; }
  x0 = odd ? r[0] : r[1];
  x1 = odd ? r[2] : r[3];
  x0 = __shfl_xor_sync(0xffffffffu, x0, 1);
  x1 = __shfl_xor_sync(0xffffffffu, x1, 1);
  if (odd) { r[0] = x0; r[2] = x1; } else { r[1] = x0; r[3] = x1; }
}
#endif  // CPA_CUDA

#if CPA_HIP
typedef _Float16 cpa_half4 __attribute__((ext_vector_type(4)));
typedef short cpa_short4 __attribute__((ext_vector_type(4)));
typedef float cpa_float4 __attribute__((ext_vector_type(4)));

// v_mfma_f32_16x16x16{f16,bf16} (one 16x16x16 block) and v_mfma_f32_4x4x4{f16,bf16} with
// 16 blocks (lane l in block l/4). a, b: four 16-bit values as two packed registers.
enum class MfmaShape { k16x16x16, k4x4x4_16b };

template <MfmaShape S, class T>
CPA_DEVICE void mfma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t b0, uint32_t b1) {
  typedef uint32_t v2u __attribute__((ext_vector_type(2)));
  cpa_float4 acc = {c[0], c[1], c[2], c[3]};
  const v2u av = {a0, a1}, bv = {b0, b1};
  const cpa_short4 as = __builtin_bit_cast(cpa_short4, av), bs = __builtin_bit_cast(cpa_short4, bv);
  const cpa_half4 ah = __builtin_bit_cast(cpa_half4, av), bh = __builtin_bit_cast(cpa_half4, bv);
  if constexpr (S == MfmaShape::k16x16x16) {
    if constexpr (T::is_bf16) acc = __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(as, bs, acc, 0, 0, 0);
    else acc = __builtin_amdgcn_mfma_f32_16x16x16f16(ah, bh, acc, 0, 0, 0);
  } else {
    if constexpr (T::is_bf16) acc = __builtin_amdgcn_mfma_f32_4x4x4bf16_1k(as, bs, acc, 0, 0, 0);
    else acc = __builtin_amdgcn_mfma_f32_4x4x4f16(ah, bh, acc, 0, 0, 0);
  }
  c[0] = acc[0]; c[1] = acc[1]; c[2] = acc[2]; c[3] = acc[3];
}
#endif  // CPA_HIP

}  // namespace cpa
