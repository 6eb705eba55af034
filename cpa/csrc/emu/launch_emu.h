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

// cpa_emu_set_pdl(1): the next cpa_emu_attention is held, and the cpa_emu_reduce after it runs
// both as a PDL pair (attention_then_reduce); per calling thread, as the schedule.
struct HeldAttention {
  bool pdl = false, held = false;
  cpa::AttnParams p{};
  int num_kv_heads = 0;
};
inline HeldAttention& held_attention() {
  static thread_local HeldAttention h;
  return h;
}

#if CPA_CUDA
// The attention kernel (fixed partitions or shared steps) and, launched as its programmatic
// dependent, the reduce kernel (launch.h's sm_90 launch): run_pdl_pair.
template <class Cfg>
int attention_then_reduce(const cpa::AttnParams& a, int num_kv_heads, const cpa::ReduceParams& r, int num_seqs) {
  if (a.cluster > 1) {
    last_error() = "the cluster combine has no reduce kernel to launch as a dependent";
    return 2;
  }
  const GridSpec attn{num_seqs, a.max_num_partitions, num_kv_heads, Cfg::THREADS, [a] {
                        if (a.steal) cpa::paged_attention_kernel<Cfg, true>(a);
                        else cpa::paged_attention_kernel<Cfg>(a);
                      }};
  if (!run_pdl_pair(attn, reduce_grid<Cfg>(r, num_seqs))) {
    last_error() += " (PDL pair)";
    return 1;
  }
  return 0;
}
#endif

}  // namespace cpa_emu

#if CPA_CUDA
#define CPA_EMU_PDL_PAIR(a, kvh, r, n) cpa_emu::attention_then_reduce<CpaCfg>((a), (kvh), (r), (n))
#else
#define CPA_EMU_PDL_PAIR(a, kvh, r, n) 2
#endif

#define CPA_DEFINE_EMU_VARIANT(NAME, TAG, DTYPE, HEAD, BLOCK, FP8, PARTITION, CAP)                 \
  using CpaCfg = cpa::AttnConfig<TAG, DTYPE, HEAD, BLOCK, FP8, PARTITION, CAP>;                    \
  extern "C" const char* cpa_variant() { return NAME; }                                           \
  extern "C" const char* cpa_emu_error() { return cpa_emu::last_error().c_str(); }                \
  extern "C" long long cpa_emu_wave_ops() { return cpa_emu::group().wave_ops; }                   \
  extern "C" void cpa_emu_set_schedule(int workers, unsigned long long seed, int until_blocked) {  \
    cpa_emu::schedule().workers = workers;                                                         \
    cpa_emu::schedule().seed = seed;                                                               \
    cpa_emu::schedule().until_blocked = until_blocked != 0;                                        \
    cpa_emu::schedule().switches = 0;                                                              \
  }                                                                                                \
  extern "C" long long cpa_emu_switches() { return cpa_emu::schedule().switches; }               \
  extern "C" int cpa_emu_set_pdl(int on) {                                                         \
    cpa_emu::held_attention() = {};                                                                \
    if (on && !(cpa::kNvidia && CPA_PDL)) {                                                         \
      cpa_emu::last_error() = "programmatic dependent launch is CUDA's (sm_90+, CPA_PDL)";         \
      return 2;                                                                                    \
    }                                                                                              \
    cpa_emu::held_attention().pdl = on != 0;                                                       \
    return 0;                                                                                      \
  }                                                                                                \
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
    if (cpa_emu::held_attention().pdl) { /* (run by the reduce call, as the pair) */               \
      cpa_emu::held_attention().held = true;                                                       \
      cpa_emu::held_attention().p = p;                                                             \
      cpa_emu::held_attention().num_kv_heads = num_kv_heads;                                       \
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
    cpa_emu::HeldAttention& h = cpa_emu::held_attention();                                         \
    if (h.pdl) {                                                                                   \
      if (!h.held) {                                                                               \
        cpa_emu::last_error() = "a PDL reduce with no attention launch held before it";            \
        return 2;                                                                                  \
      }                                                                                            \
      h.held = false;                                                                              \
      return CPA_EMU_PDL_PAIR(h.p, h.num_kv_heads, p, num_seqs);                                   \
    }                                                                                              \
    return cpa_emu::reduce<CpaCfg>(p, num_seqs);                                                   \
  }
