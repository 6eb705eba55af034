// C entry points of one variant built for the wave emulator (CPA_EMU, wave_emu.h): the same
// kernels as launch.h, their grids walked workgroup by workgroup on the host. Host pointers.
#pragma once
#ifndef CPA_EMU
#error "launch_emu.h is the CPA_EMU build's launcher (compile with -DCPA_EMU)"
#endif
#include "../attention.h"

namespace cpa_emu {

template <class Kernel, class Params>
int walk_grid(Kernel kernel, int gx, int gy, int gz, int threads, const Params& p, int cluster = 0) {
  if (!run_grid(gx, gy, gz, threads, [&] { kernel(p); }, cluster)) {
    last_error() += " (grid " + std::to_string(gx) + " x " + std::to_string(gy) + " x " + std::to_string(gz) + ")";
    return 1;
  }
  return 0;
}

// The fixed-partition kernel, or with p.steal the shared-steps one. In grid order (the default
// schedule) the first workgroup of a sequence takes every ticket its waves reach and the others
// run their first steps only; set_schedule's concurrent workgroups spread the tickets.
template <class Cfg>
int attention(const cpa::AttnParams& p, int num_seqs, int num_kv_heads) {
  if (p.cluster > 1) {
#if CPA_CUDA
    return walk_grid(cpa::paged_attention_kernel<Cfg>, num_seqs, p.max_num_partitions, num_kv_heads, Cfg::THREADS,
                     p, p.cluster);
#else
    last_error() = "thread-block clusters are CUDA's (sm_90+)";
    return 2;
#endif
  }
  if (p.steal)
    return walk_grid(cpa::paged_attention_kernel<Cfg, true>, num_seqs, p.max_num_partitions, num_kv_heads,
                     Cfg::THREADS, p);
  return walk_grid(cpa::paged_attention_kernel<Cfg>, num_seqs, p.max_num_partitions, num_kv_heads, Cfg::THREADS, p);
}

// The reduce kernel's grid, as launch.h picks it (the few-partitions kernel or the general one).
template <class Cfg>
GridSpec reduce_grid(const cpa::ReduceParams& p, int num_seqs) {
  using T = typename Cfg::Dtype;
  constexpr int HEAD = Cfg::head_size;
  if (cpa::use_reduce_few(p.max_num_partitions, num_seqs, p.num_heads)) {
    using RF = cpa::ReduceFewConfig<T, HEAD>;
    return {(p.num_heads + RF::HEADS - 1) / RF::HEADS, num_seqs, 1, RF::THREADS,
            [p] { cpa::paged_attention_reduce_few_kernel<T, HEAD>(p); }};
  }
  return {p.num_heads, num_seqs, 1, cpa::ReduceConfig<T, HEAD>::THREADS,
          [p] { cpa::paged_attention_reduce_kernel<T, HEAD>(p); }};
}

template <class Cfg>
int reduce(const cpa::ReduceParams& p, int num_seqs) {
  const GridSpec g = reduce_grid<Cfg>(p, num_seqs);
  return walk_grid([&g](const cpa::ReduceParams&) { g.body(); }, g.gx, g.gy, g.gz, g.threads, p);
}

// cpa_emu_set_pdl: the launches of a call are held, and cpa_emu_run_pdl runs them as sm_90 does
// with PDL (launch.h): [a kernel writing the inputs, when asked,] the attention kernel as its
// dependent, [the reduce kernel as the attention kernel's dependent] (run_pdl_chain). Per
// calling thread, as the schedule.
struct HeldLaunches {
  bool pdl = false, attention = false, reduce = false;
  cpa::AttnParams a{};
  cpa::ReduceParams r{};
  int num_seqs = 0, num_kv_heads = 0;
  std::vector<std::array<uintptr_t, 3>> copies;  // the writer's (destination, source, bytes)
};
inline HeldLaunches& held() {
  static thread_local HeldLaunches h;
  return h;
}

// The kernel before the attention kernel, emulated: it writes the attention kernel's inputs
// (the K/V cache, the block tables, the sequence lengths and the query, copied from where the
// caller holds them into the buffers the launch reads, which start poisoned). Like a PDL-aware
// producer it lets its dependent launch at once, then copies the buffers in the order given
// (cpa/emu.py: the query last, written at the end) in 16-byte words, a pass of its 1024 threads
// covering 16 KB, with a wave barrier after every 8 passes and after each buffer (a turn may
// pass there), so the attention workgroups run beside it.
inline GridSpec input_writer(const std::vector<std::array<uintptr_t, 3>>& copies) {
  constexpr int kGroups = 8, kThreads = 128, kWord = 16;
  return {kGroups, 1, 1, kThreads, [copies] {
            launch_dependents();
            Group& g = group();
            const size_t me = (size_t)g.block[0] * kThreads + g.cur, all = (size_t)kGroups * kThreads;
            for (const auto& c : copies) {
              char* dst = reinterpret_cast<char*>(c[0]);
              const char* src = reinterpret_cast<const char*>(c[1]);
              const size_t bytes = c[2];
              for (size_t at = me * kWord, n = 0; at < bytes; at += all * kWord, ++n) {
                memcpy(dst + at, src + at, std::min<size_t>(kWord, bytes - at));
                if (n % 8 == 7) arrive(kWaveBarrier);  // (a turn may pass here)
              }
              arrive(kWaveBarrier);
            }
          }};
}

#if CPA_CUDA
// The held launches (HeldLaunches) as one chain of programmatic dependent launches.
template <class Cfg>
int run_held() {
  HeldLaunches& h = held();
  const cpa::AttnParams a = h.a;
  if (!h.attention) {
    last_error() = "no attention launch held";
    return 2;
  }
  std::vector<GridSpec> grids;
  if (!h.copies.empty()) grids.push_back(input_writer(h.copies));
  // (with a.cluster, launch_clustered's launch: clusters of the partitions, a dependent too)
  grids.push_back({h.num_seqs, a.max_num_partitions, h.num_kv_heads, Cfg::THREADS,
                   [a] {
                     if (a.steal) cpa::paged_attention_kernel<Cfg, true>(a);
                     else cpa::paged_attention_kernel<Cfg>(a);
                   },
                   a.cluster > 1 ? a.cluster : 0});
  if (h.reduce) grids.push_back(reduce_grid<Cfg>(h.r, h.num_seqs));
  h.attention = h.reduce = false;
  if (!run_pdl_chain(grids)) {
    last_error() += " (PDL chain of " + std::to_string(grids.size()) + " grids)";
    return 1;
  }
  return 0;
}
#endif

}  // namespace cpa_emu

#if CPA_CUDA
#define CPA_EMU_RUN_HELD() cpa_emu::run_held<CpaCfg>()
#else
#define CPA_EMU_RUN_HELD() 2
#endif

#define CPA_DEFINE_EMU_VARIANT(NAME, TAG, DTYPE, HEAD, BLOCK, FP8, PARTITION, CAP)                 \
  using CpaCfg = cpa::AttnConfig<TAG, DTYPE, HEAD, BLOCK, FP8, PARTITION, CAP>;                    \
  extern "C" const char* cpa_variant() { return NAME; }                                           \
  extern "C" const char* cpa_emu_error() { return cpa_emu::last_error().c_str(); }                \
  extern "C" long long cpa_emu_wave_ops() { return cpa_emu::group().wave_ops; }                   \
  extern "C" void cpa_emu_set_schedule(int workers, unsigned long long seed, int until_blocked,   \
                                       int memory_model) {                                         \
    cpa_emu::schedule().workers = workers;                                                         \
    cpa_emu::schedule().seed = seed;                                                               \
    cpa_emu::schedule().until_blocked = until_blocked != 0;                                        \
    /* (cpa.emu.MEMORY_MODELS: 0 sequential, 1 release, 2 acquire-release) */                     \
    cpa_emu::schedule().weak_stores = memory_model >= 1;                                           \
    cpa_emu::schedule().acquire_loads = memory_model >= 2;                                         \
    cpa_emu::schedule().switches = 0;                                                              \
  }                                                                                                \
  extern "C" long long cpa_emu_switches() { return cpa_emu::schedule().switches; }               \
  extern "C" int cpa_emu_set_pdl(int on, int ncopies, void* const* dst, const void* const* src,          \
                                 const long long* bytes) {                                         \
    cpa_emu::held() = {};                                                                          \
    if (on && !(cpa::kNvidia && CPA_PDL)) {                                                        \
      cpa_emu::last_error() = "programmatic dependent launch is CUDA's (sm_90+, CPA_PDL)";         \
      return 2;                                                                                    \
    }                                                                                              \
    cpa_emu::held().pdl = on != 0;                                                                 \
    for (int i = 0; on && i < ncopies; ++i)                                                        \
      cpa_emu::held().copies.push_back({(uintptr_t)dst[i], (uintptr_t)src[i], (uintptr_t)bytes[i]}); \
    return 0;                                                                                      \
  }                                                                                                \
  extern "C" int cpa_emu_run_pdl() { return CPA_EMU_RUN_HELD(); }                                  \
  extern "C" int cpa_emu_attention(void* out, float* exp_sums, float* max_logits, float* tmp_out, \
                                   const void* query, const void* key_cache, const void* value_cache, \
                                   const int* block_tables, const int* seq_lens, const float* alibi, \
                                   int num_seqs, int num_heads, int num_kv_heads,                  \
                                   int max_blocks_per_seq, int max_num_partitions,                 \
                                   long long kv_block_stride, long long kv_head_stride,           \
                                   float scale_log2, float out_scale, int out_direct, int* counters, \
                                   int cluster, int* steal) {                                      \
    cpa::AttnParams p{out, exp_sums, max_logits, tmp_out, (const uint16_t*)query,                 \
                      (const uint8_t*)key_cache, (const uint8_t*)value_cache, block_tables,      \
                      seq_lens, alibi, num_heads, num_heads / num_kv_heads, max_blocks_per_seq,   \
                      max_num_partitions, kv_block_stride, kv_head_stride, scale_log2, out_scale,\
                      out_direct, counters, num_kv_heads, cluster, steal,                        \
                      cpa::launch_tokens(max_num_partitions, CpaCfg::partition_size,              \
                                         max_blocks_per_seq, CpaCfg::block_size)};                \
    if (cpa_emu::held().pdl) { /* (run by cpa_emu_run_pdl) */                                      \
      cpa_emu::held().attention = true;                                                            \
      cpa_emu::held().a = p;                                                                       \
      cpa_emu::held().num_seqs = num_seqs;                                                         \
      cpa_emu::held().num_kv_heads = num_kv_heads;                                                 \
      return 0;                                                                                    \
    }                                                                                              \
    return cpa_emu::attention<CpaCfg>(p, num_seqs, num_kv_heads);                                  \
  }                                                                                                \
  extern "C" int cpa_emu_reduce(void* out, const float* exp_sums, const float* max_logits,         \
                                const float* tmp_out, const int* seq_lens, int num_seqs,           \
                                int num_heads, int max_num_partitions, int max_blocks_per_seq) {   \
    cpa::ReduceParams p{out, exp_sums, max_logits, tmp_out, seq_lens, num_heads,                   \
                        max_num_partitions, PARTITION,                                             \
                        cpa::launch_tokens(max_num_partitions, PARTITION, max_blocks_per_seq,      \
                                           CpaCfg::block_size)};                                            \
    if (cpa_emu::held().pdl) { /* (run by cpa_emu_run_pdl) */                                      \
      cpa_emu::held().reduce = true;                                                               \
      cpa_emu::held().r = p;                                                                       \
      return 0;                                                                                    \
    }                                                                                              \
    return cpa_emu::reduce<CpaCfg>(p, num_seqs);                                                   \
  }
