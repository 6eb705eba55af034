// C entry points of one compiled variant. No torch headers: a variant builds in seconds
// and the Python side (cpa/build.py, cpa/ops.py) calls these through ctypes with raw
// device pointers and the current stream.
#pragma once
#include <atomic>

#include "attention.h"

#if CPA_HIP
#define CPA_RT(x) hip##x
#else
#define CPA_RT(x) cuda##x
#endif

namespace cpa {

// Function attributes and device properties belong to one device, and the launcher launches on
// the calling thread's current device (cpa.ops switches to the tensors' one): each such set-up
// runs once per device, its answer kept (one slot per call site and kernel).
template <class Ask>
int once_per_device(Ask ask) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> answer[kMaxDevices];  // 0: not asked on that device yet, else answer + 1
  int dev = 0;
  if (CPA_RT(GetDevice)(&dev) != CPA_RT(Success) || dev < 0 || dev >= kMaxDevices) return ask();
  int a = answer[dev].load(std::memory_order_relaxed);
  if (a == 0) {
    a = ask() + 1;  // (two threads may both ask: the answers agree)
    answer[dev].store(a, std::memory_order_relaxed);
  }
  return a - 1;
}

// Dynamic shared memory of the attention kernel: all of it with the staged loop, else none.
template <class Cfg>
constexpr int dynamic_smem_bytes() { return CPA_KV_ASYNC ? Cfg::SMEM_FLOATS * 4 : 0; }
// Above the 48 KiB default a kernel must opt in to its dynamic shared memory -- counted with
// its static shared memory (the fused reduce's flag), so a kernel with any dynamic shared
// memory opts in: the workgroup ring (a staged loop since removed) at fp8 head 128 asked for
// exactly 48 KiB, and its launch failed (invalid value) without it (H100, notes/kernel-notes.md).
template <class Cfg>
int allow_dynamic_smem() {
  const int dyn = dynamic_smem_bytes<Cfg>();
  if (dyn == 0) return 0;
  return (int)CPA_RT(FuncSetAttribute)((const void*)paged_attention_kernel<Cfg>,
                                       CPA_RT(FuncAttributeMaxDynamicSharedMemorySize), dyn);
}

// A kernel launched, when `dependent` and the device has it (sm_90+, CPA_PDL), as a
// programmatic dependent of the kernel before it on the stream: it may be scheduled while that
// kernel's last workgroups run and waits in wait_prior_grid() (platform.h) before touching
// memory the previous kernel may write or read. Otherwise an ordinary launch.
template <class Kernel, class Params>
int launch_dependent(Kernel kernel, dim3 grid, int threads, int smem, const Params& p, void* stream,
                     bool dependent = true) {
#if CPA_CUDA && CPA_PDL
  const bool pdl = once_per_device([] {
    int dev = 0, major = 0;
    return int(cudaGetDevice(&dev) == cudaSuccess &&
               cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 9);
  }) == 1;
  if (pdl && dependent) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = (cudaStream_t)stream;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return (int)cudaLaunchKernelEx(&cfg, kernel, p);
  }
#endif
  kernel<<<grid, threads, smem, (CPA_RT(Stream_t))stream>>>(p);
  return (int)CPA_RT(GetLastError)();
}

// Clusters of more than 8 workgroups (the portable size) need the kernel's opt-in.
template <class Cfg>
int allow_large_clusters() {
#if CPA_CUDA
  return (int)cudaFuncSetAttribute((const void*)paged_attention_kernel<Cfg>,
                                   cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
#else
  return 0;
#endif
}

// The attention kernel with clusters of `cluster` partitions (sm_90: the cluster combine),
// as a programmatic dependent when CPA_PDL_ATTENTION.
template <class Cfg>
int launch_clustered(const AttnParams& p, dim3 grid, void* stream) {
#if CPA_CUDA
  const int opt_in = once_per_device([] { return allow_large_clusters<Cfg>(); });
  if (opt_in) return opt_in;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = p.cluster;
  attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(Cfg::THREADS);
  cfg.dynamicSmemBytes = dynamic_smem_bytes<Cfg>();
  cfg.stream = (cudaStream_t)stream;
  cfg.attrs = attr;
  cfg.numAttrs = (CPA_PDL && CPA_PDL_ATTENTION) ? 2 : 1;
  return (int)cudaLaunchKernelEx(&cfg, paged_attention_kernel<Cfg>, p);
#else
  return (int)CPA_RT(ErrorNotSupported);
#endif
}

template <class Cfg>
int launch_attention(const AttnParams& p, int num_seqs, int num_kv_heads, void* stream) {
  const dim3 grid(num_seqs, p.max_num_partitions, num_kv_heads);
  const int opt_in = once_per_device([] { return allow_dynamic_smem<Cfg>(); });
  if (opt_in) return opt_in;
  if (p.cluster > 1) return launch_clustered<Cfg>(p, grid, stream);
  if (p.steal) {  // shared steps: direct loads, no cluster (the Python side refuses the rest)
    if (CPA_KV_ASYNC || p.cluster > 1) return (int)CPA_RT(ErrorInvalidValue);
    return launch_dependent(paged_attention_kernel<Cfg, true>, grid, Cfg::THREADS, 0, p, stream,
                            CPA_PDL_ATTENTION != 0);
  }
  return launch_dependent(paged_attention_kernel<Cfg>, grid, Cfg::THREADS, dynamic_smem_bytes<Cfg>(), p, stream,
                          CPA_PDL_ATTENTION != 0);
}

// How many clusters of `cluster` attention workgroups the device can hold at once (0: such a
// cluster cannot be launched at all), or minus a runtime error. HIP: 0 (no clusters).
template <class Cfg>
int max_active_clusters(int cluster) {
#if CPA_CUDA
  int err = allow_dynamic_smem<Cfg>();
  if (!err) err = allow_large_clusters<Cfg>();
  if (err) return -err;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = cluster;
  attr[0].val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(1, cluster, 1);
  cfg.blockDim = dim3(Cfg::THREADS);
  cfg.dynamicSmemBytes = dynamic_smem_bytes<Cfg>();
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int n = 0;
  err = (int)cudaOccupancyMaxActiveClusters(&n, (const void*)paged_attention_kernel<Cfg>, &cfg);
  if (err) {
    cudaGetLastError();  // (clear it: a refused size is an answer, not a sticky error)
    return -err;
  }
  return n;
#else
  (void)cluster;
  return 0;
#endif
}

template <class Cfg>
int launch_reduce(const ReduceParams& p, int num_seqs, void* stream) {
  using T = typename Cfg::Dtype;
  if (use_reduce_few(p.max_num_partitions, num_seqs, p.num_heads)) {  // a handful of partials per head
    using RF = ReduceFewConfig<T, Cfg::head_size>;
    return launch_dependent(paged_attention_reduce_few_kernel<T, Cfg::head_size>,
                            dim3((p.num_heads + RF::HEADS - 1) / RF::HEADS, num_seqs), RF::THREADS, 0, p, stream);
  }
  return launch_dependent(paged_attention_reduce_kernel<T, Cfg::head_size>, dim3(p.num_heads, num_seqs),
                          ReduceConfig<T, Cfg::head_size>::THREADS, 0, p, stream);
}

// which = 0: attention kernel, 1: reduce kernel, 2: few-partitions reduce kernel,
// 3: the shared-steps attention kernel (its own registers: it holds fewer blocks per SM at some shapes).
// out[0..5] = registers per thread,
// shared bytes (static + dynamic), local (stack) bytes per thread, max threads per block,
// threads per block launched, resident blocks per SM/CU for that launch.
template <class Cfg>
int kernel_attributes(int which, int* out) {
  CPA_RT(FuncAttributes) a;
  int blocks = 0, threads = 0, err = 0, dyn = 0;
  if (which == 0) {
    threads = Cfg::THREADS;
    dyn = dynamic_smem_bytes<Cfg>();
    err = (int)CPA_RT(FuncGetAttributes)(&a, (const void*)paged_attention_kernel<Cfg>);
    if (!err) err = allow_dynamic_smem<Cfg>();
    if (!err) err = (int)CPA_RT(OccupancyMaxActiveBlocksPerMultiprocessor)(&blocks, paged_attention_kernel<Cfg>, threads, dyn);
  } else if (which == 3) {  // launched without dynamic shared memory (launch_attention)
    threads = Cfg::THREADS;
    auto k = paged_attention_kernel<Cfg, true>;
    err = (int)CPA_RT(FuncGetAttributes)(&a, (const void*)k);
    if (!err) err = (int)CPA_RT(OccupancyMaxActiveBlocksPerMultiprocessor)(&blocks, k, threads, 0);
  } else if (which == 1) {
    using RC = ReduceConfig<typename Cfg::Dtype, Cfg::head_size>;
    threads = RC::THREADS;
    auto k = paged_attention_reduce_kernel<typename Cfg::Dtype, Cfg::head_size>;
    err = (int)CPA_RT(FuncGetAttributes)(&a, (const void*)k);
    if (!err) err = (int)CPA_RT(OccupancyMaxActiveBlocksPerMultiprocessor)(&blocks, k, threads, 0);
  } else {
    using RF = ReduceFewConfig<typename Cfg::Dtype, Cfg::head_size>;
    threads = RF::THREADS;
    auto k = paged_attention_reduce_few_kernel<typename Cfg::Dtype, Cfg::head_size>;
    err = (int)CPA_RT(FuncGetAttributes)(&a, (const void*)k);
    if (!err) err = (int)CPA_RT(OccupancyMaxActiveBlocksPerMultiprocessor)(&blocks, k, threads, 0);
  }
  if (err) return err;
  out[0] = a.numRegs; out[1] = (int)a.sharedSizeBytes + dyn; out[2] = (int)a.localSizeBytes;
  out[3] = a.maxThreadsPerBlock; out[4] = threads; out[5] = blocks;
  return 0;
}

}  // namespace cpa

// One variant's exported symbols. The Python side checks cpa_variant() against the
// variant it asked for, so a stale or mismatched library is never used.
#define CPA_DEFINE_VARIANT(NAME, TAG, DTYPE, HEAD, BLOCK, FP8, PARTITION, CAP)                     \
  using CpaCfg = cpa::AttnConfig<TAG, DTYPE, HEAD, BLOCK, FP8, PARTITION, CAP>;                    \
  extern "C" const char* cpa_variant() { return NAME; }                                           \
  extern "C" int cpa_tokens_per_step() { return CpaCfg::Tiles::TOKENS; }                           \
  extern "C" int cpa_heads_cap() { return CpaCfg::Tiles::HEADS_CAP; }                              \
  extern "C" int cpa_attention(void* out, float* exp_sums, float* max_logits, float* tmp_out,      \
                               const void* query, const void* key_cache, const void* value_cache,  \
                               const int* block_tables, const int* seq_lens, const float* alibi,   \
                               int num_seqs, int num_heads, int num_kv_heads,                      \
                               int max_blocks_per_seq, int max_num_partitions,                     \
                               long long kv_block_stride, long long kv_head_stride,               \
                               float scale_log2, float out_scale, int out_direct, int* counters,   \
                               int cluster, int* steal, void* stream) {                            \
    cpa::AttnParams p{out, exp_sums, max_logits, tmp_out, (const uint16_t*)query,                 \
                      (const uint8_t*)key_cache, (const uint8_t*)value_cache, block_tables,      \
                      seq_lens, alibi, num_heads, num_heads / num_kv_heads, max_blocks_per_seq,   \
                      max_num_partitions, kv_block_stride, kv_head_stride, scale_log2, out_scale,\
                      out_direct, counters, num_kv_heads, cluster, steal,                        \
                      cpa::launch_tokens(max_num_partitions, CpaCfg::partition_size,              \
                                         max_blocks_per_seq, CpaCfg::block_size)};                \
    return cpa::launch_attention<CpaCfg>(p, num_seqs, num_kv_heads, stream);                      \
  }                                                                                                \
  extern "C" int cpa_reduce(void* out, const float* exp_sums, const float* max_logits,             \
                            const float* tmp_out, const int* seq_lens, int num_seqs,               \
                            int num_heads, int max_num_partitions, int max_blocks_per_seq,        \
                            void* stream) {                                                        \
    cpa::ReduceParams p{out, exp_sums, max_logits, tmp_out, seq_lens, num_heads,                   \
                        max_num_partitions, PARTITION,                                             \
                        cpa::launch_tokens(max_num_partitions, PARTITION, max_blocks_per_seq,      \
                                           CpaCfg::block_size)};                                            \
    return cpa::launch_reduce<CpaCfg>(p, num_seqs, stream);                                        \
  }                                                                                                \
  extern "C" int cpa_kernel_attributes(int which, int* out) {                                      \
    return cpa::kernel_attributes<CpaCfg>(which, out);                                             \
  }                                                                                                \
  extern "C" int cpa_max_active_clusters(int cluster) {                                            \
    return cpa::max_active_clusters<CpaCfg>(cluster);                                              \
  }
