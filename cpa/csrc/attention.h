// The CPA kernels, written once on the tiling interface (tilings.h):
//   paged_attention_kernel  one workgroup of 4 waves per (sequence, partition, KV head);
//                           writes each partition's max logit, exp sum and normalized
//                           partial output (or the final output when one partition
//                           covers every sequence of the batch).
//   paged_attention_reduce_kernel   rescales and combines any number of partitions.
#pragma once
#include "tilings.h"

namespace cpa {

// Resident workgroups per SM/CU the compiler must allow (the second __launch_bounds__
// argument; HIP turns it into amdgpu_waves_per_eu, which for 4-wave workgroups is the same
// number). N > 0: N for every variant, a research knob (CPA_NVCC_FLAGS=-DCPA_MIN_BLOCKS=3).
// 0 (default): 1, the compiler's choice, except AMD mfma16 at head <= 128, which asks for 2:
// left alone, clang puts the output accumulators in AGPRs and allocates VGPRs and AGPRs apart
// (gfx942 head 128: 145 + 32 = 2 waves per SIMD); asked for 2, it keeps them in VGPRs (146,
// no spills) and the kernel fits 3 waves per SIMD (head 64: 4 -> 5). Compiled only (clang 19,
// gfx942 and gfx90a; data/static): no MI300 has run it. scalar and head 256 gain nothing
// there (LDS- or register-bound), NVIDIA spilled at 3 (1.5-1.9x slower). (mfma4 reaches 2
// waves per SIMD at head 128 unasked since its P x V holds 4 dims per block: tilings.h.)
#ifndef CPA_MIN_BLOCKS
#define CPA_MIN_BLOCKS 0
#endif
// 0 compiles the fused-reduce epilogue out (then only the two-kernel path exists): an A/B knob
// for its cost to the attention kernel when it is not used.
#ifndef CPA_FUSED_REDUCE
#define CPA_FUSED_REDUCE 1
#endif

// V after QK: load a step's V only after its QK (a compiler fence keeps the loads there), so
// K and V are never live together: fewer registers, V's latency exposed per wave.
// -1 (default): on NVIDIA, for the mma tilings at head >= 256 (fixed-partition loop), where a
// 32-token step's K and V alone are 256 registers and the kernel spilled ~500 bytes per thread
// each way: H200, 8 x 8k / 32k, 16-bit and fp8 caches, 0.63-0.93x the time per variant, best
// per shape 0.70-0.79x (16-bit 8 x 32k: 334.8 -> 244.3 us, 71% -> 95% of the read ceiling;
// notes/kernel-notes.md). Elsewhere off: at head 128 it was up to 1.12x slower (16-bit), and
// 0.95-1.19x with fp8. 1: everywhere (where the block-table entries per lane are
// on, ptxas moves V's loads back above QK: the fence binds the compiler's IR, not ptxas's
// schedule; -DCPA_BT_PREFETCH=0 for the A/B). 0: never.
#ifndef CPA_V_AFTER_QK
#define CPA_V_AFTER_QK -1
#endif
// 1: an experiment, never a variant: the main loop loads every step and folds its registers
// with XORs instead of QK / softmax / PV, so the bench times the loads alone (output wrong).
// 2: the same, holding the real kernel's register count. (A cp.async arm, 3, was measured and
// removed: about 40% of its copies never reached DRAM, notes/kernel-notes.md.)
#ifndef CPA_LOAD_ONLY
#define CPA_LOAD_ONLY 0
#endif
#if CPA_LOAD_ONLY > 2
#error "CPA_LOAD_ONLY is 0, 1 or 2"
#endif

// 1 (default): bf16 queries with an fp8 cache run their matrix-core tiles in fp16. The cache
// decodes to fp16 directly (on sm_89+ one hardware conversion per pair), where bf16 needs two
// more conversions and a permute per pair; the query is converted once per workgroup, scaled
// by a power of two (query_to_half), and the output is still written as bf16. Exact for the
// cache, and for every query element within 2^-28 of the group's largest; P is rounded to
// fp16 (finer than bf16 on [0, 1]). H200, 8-32 x 8k-32k: 0.79-0.92x the time of bf16 tiles,
// level with fp16 queries (notes/kernel-notes.md). 0: bf16 tiles throughout. The scalar
// tiling is unchanged. AMD: the same code (gfx942 mfma16 head 128: 161 -> 146 VGPRs, compiled).
#ifndef CPA_FP8_F16_MMA
#define CPA_FP8_F16_MMA 1
#endif

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// The tokens of a sequence a launch attends to are at most its grid's and its block-table
// row's (AttnParams / ReduceParams::max_seq_tokens, launch_tokens). Validation refuses longer
// sequences before a checked launch; an unchecked one, or a graph replayed after seq_lens grew
// past the length it was sized for, is truncated to its grid and its row: the attention kernel
// and every reduce agree on the partitions written, so no partial is read unwritten.
inline int launch_tokens(int max_num_partitions, int partition_size, int max_blocks_per_seq, int block_size) {
  const int64_t grid = (int64_t)max_num_partitions * partition_size, table = (int64_t)max_blocks_per_seq * block_size;
  const int64_t n = grid < table ? grid : table;
  return n < INT32_MAX ? (int)n : INT32_MAX;
}
// The partitions the attention kernel wrote for a sequence (its tokens clamped to the launch's,
// which the grid's partitions cover): what the reduce kernels combine.
CPA_DEVICE int num_partitions_of(int seq_len, int partition_size, int max_seq_tokens) {
  const int n = seq_len < max_seq_tokens ? seq_len : max_seq_tokens;
  return (n + partition_size - 1) / partition_size;
}

struct AttnParams {
  void* out;              // [num_seqs, num_heads, HEAD] query dtype (written when out_direct)
  float* exp_sums;        // [num_seqs, num_heads, max_num_partitions]
  float* max_logits;      // [num_seqs, num_heads, max_num_partitions]
  float* tmp_out;         // [num_seqs, num_heads, max_num_partitions, HEAD] or null
  const uint16_t* query;  // [num_seqs, num_heads, HEAD]
  const uint8_t* key_cache;
  const uint8_t* value_cache;
  const int* block_tables;  // [num_seqs, max_blocks_per_seq]
  const int* seq_lens;      // [num_seqs]
  const float* alibi_slopes;  // [num_heads] or null
  int num_heads;
  int gqa;                  // query heads per KV head
  int max_blocks_per_seq;
  int max_num_partitions;
  int64_t kv_block_stride;  // bytes between physical blocks
  int64_t kv_head_stride;   // bytes between KV heads inside a block
  float scale_log2;         // scale * log2(e) (* k_scale * 256 for fp8)
  float out_scale;          // 1 (or v_scale * 256 for fp8)
  int out_direct;           // 1: a single partition covers each sequence, write `out`
  int* counters;            // [num_seqs * num_kv_heads] zeros, or null: fused reduce when set
  int num_kv_heads;
  int cluster;              // > 1: the launch's clusters are the max_num_partitions (= cluster)
                            // partitions of one (sequence, KV head); they combine in the kernel
  int* steal;               // [num_seqs * num_kv_heads][2] zeros, or null: shared steps (below)
  int max_seq_tokens;       // launch_tokens(): the most tokens of a sequence the launch covers
};

struct ReduceParams {
  void* out;
  const float* exp_sums;
  const float* max_logits;
  const float* tmp_out;
  const int* seq_lens;
  int num_heads;
  int max_num_partitions;
  int partition_size;
  int max_seq_tokens;  // launch_tokens(), as the attention launch's
};

template <bool C, class A, class B> struct Pick { using type = A; };
template <class A, class B> struct Pick<false, A, B> { using type = B; };
template <class A, class B> struct Same { static constexpr bool value = false; };
template <class A> struct Same<A, A> { static constexpr bool value = true; };

// Tilings that stage steps in shared memory (define Staged), when CPA_KV_ASYNC is on.
template <class Tl, class = void>
struct StagesKV { static constexpr bool value = false; };
#if CPA_KV_ASYNC
template <class Tl>
struct StagesKV<Tl, decltype(void(Tl::Staged::BYTES))> { static constexpr bool value = true; };
#endif

template <class Tl, bool STAGED>
struct StagedBytes { static constexpr int value = 0; };
template <class Tl>
struct StagedBytes<Tl, true> { static constexpr int value = Tl::Staged::BYTES; };
template <class Tl, bool STAGED>
struct StagedBlocks { static constexpr int value = 0; };
template <class Tl>
struct StagedBlocks<Tl, true> { static constexpr int value = Tl::Staged::NBLK; };

// One compile-time variant. Tag: TilingMfma16 / TilingMfma4 / TilingScalar.
template <class Tag, class T, int HEAD, int BLOCK, bool FP8, int PARTITION, int CAP>
struct AttnConfig {
  // 4 waves, as upstream (8 measured 1.05x slower at batch >= 8, b4581ed; cpa.variants.NUM_WAVES)
  static constexpr int NUM_WAVES = 4;
  static constexpr int THREADS = NUM_WAVES * kWave;
  using Dtype = T;  // query and output
  using Tiling = Tag;
  // the tiles' operand type: fp16 for bf16 queries with an fp8 cache (CPA_FP8_F16_MMA)
  static constexpr bool half_math = CPA_FP8_F16_MMA && FP8 && T::is_bf16 && !Same<Tag, TilingScalar>::value;
  // load V after QK (CPA_V_AFTER_QK): forced, or by default the NVIDIA mma tilings at head >= 256
  static constexpr bool v_after_qk =
      CPA_V_AFTER_QK > 0 || (CPA_V_AFTER_QK < 0 && kNvidia && HEAD >= 256 && !Same<Tag, TilingScalar>::value);
  // resident workgroups the register budget must allow (CPA_MIN_BLOCKS)
  static constexpr int min_blocks =
      CPA_MIN_BLOCKS > 0 ? CPA_MIN_BLOCKS : (!kNvidia && Same<Tag, TilingMfma16>::value && HEAD <= 128 ? 2 : 1);
  using MathT = typename Pick<half_math, F16, T>::type;
  using Tiles = typename TilingFor<Tag, MathT, HEAD, BLOCK, FP8, CAP, NUM_WAVES>::type;
  static constexpr int head_size = HEAD, block_size = BLOCK, partition_size = PARTITION;
  static constexpr bool fp8 = FP8;
  static_assert(PARTITION % Tiles::TOKENS == 0, "partition must be whole wave steps");
  static_assert(PARTITION % BLOCK == 0, "partition must be whole KV blocks");
  static_assert(Tiles::TOKENS % 8 == 0 && BLOCK % 8 == 0, "8-token groups must not straddle blocks");
  // cross-wave combine slot: O [CAP][HEAD], then max and sum [CAP]
  static constexpr int SLOT = Tiles::HEADS_CAP * HEAD + 2 * Tiles::HEADS_CAP;
  static constexpr int COMBINE_FLOATS = (NUM_WAVES / 2) * SLOT;
  static constexpr int TILE_FLOATS = (Tiles::SMEM_BYTES + 3) / 4;
  // (a stage that would not fit the SM's shared memory, e.g. the ring at head 256 block 32,
  // leaves the variant on direct loads)
  // (the ring holds one block-table entry per lane: longer partitions stay on direct loads)
  static constexpr bool staged = StagesKV<Tiles>::value &&
                                 NUM_WAVES * StagedBytes<Tiles, StagesKV<Tiles>::value>::value <= 220 * 1024 &&
                                 (CPA_KV_ASYNC != 3 || PARTITION / (NUM_WAVES * Tiles::TOKENS) *
                                                           StagedBlocks<Tiles, StagesKV<Tiles>::value>::value <= kWave);
  // staged: one 16-byte aligned slot per wave after the tiling's own shared memory (the
  // cross-wave combine reuses it after the loop)
  static constexpr int STAGE_AT = (TILE_FLOATS + 3) / 4 * 4;
  static constexpr int LOOP_FLOATS = staged ? STAGE_AT + NUM_WAVES * StagedBytes<Tiles, staged>::value / 4 : TILE_FLOATS;
  static constexpr int SMEM_FLOATS = COMBINE_FLOATS > LOOP_FLOATS ? COMBINE_FLOATS : LOOP_FLOATS;
};

// 1: before its loop each lane of a wave reads one entry of the block table -- lane l the
// physical block of the wave's l-th block -- and each step takes its blocks' offsets from those
// lanes by shuffles, so no block-table read (an L2 round trip) sits in front of a step's K and
// V loads. Partitions whose waves touch more blocks than a wave has lanes read the table per
// step. 0: every step reads its block-table entries first. H200 (mma tilings, fp16 cache,
// head 128, GQA 8): 2.4% faster at batch 1, neutral elsewhere (geomean 0.993). Elsewhere it
// raises register pressure (ptxas hoists loads whose addresses no longer wait on a table
// read): fp8 caches +22-48 registers and new spills at head 128 bf16, 16 heads per tile
// spill, head 256 spills 1.5x, scalar +30-60. So it applies by default only where it was
// measured (kTabled below), on NVIDIA only (AMD: unmeasured, +2 VGPRs on gfx942).
// -DCPA_BT_PREFETCH=0|1 for the A/B.
#ifndef CPA_BT_PREFETCH
#if CPA_CUDA
#define CPA_BT_PREFETCH 1
#else
#define CPA_BT_PREFETCH 0
#endif
#endif

// Block-table entries one lane holds at most (4: a wave's 128 blocks, the partition of 8192
// tokens at block 16 with 32-token steps); longer waves read the table per step.
constexpr int kMaxEntries = 4;

// (<type_traits> is not available to the device-only HIP compiles: -nogpulib)

// The paged cache, with the physical blocks of the wave's steps held one per lane: entry[i] of
// lane l is the wave's block i kWave + l (NE sets; entry[0] is the current one):
// block_offset(token) of the step at tok0 is a shuffle from the lane of that block.
template <class Cache, int BLOCK, int NBLK, int NE>
struct TabledKV : Cache {
  int entry[NE];
  int j0;    // the wave's block index of the current step's first block, within entry[0]
  int tok0;  // the current step's first token
  CPA_DEVICE void advance(int tok) {
    j0 += NBLK;
    if constexpr (NE > 1) {
      if (j0 == kWave) {  // NBLK divides kWave: the step's blocks are all in the next set
#pragma unroll
        for (int i = 0; i + 1 < NE; ++i) entry[i] = entry[i + 1];
        j0 = 0;
      }
    }
    tok0 = tok;
  }
  CPA_DEVICE int64_t block_offset(int token) const {
    return (int64_t)shfl_idx_i32(entry[0], j0 + (token - tok0) / BLOCK) * this->block_stride;
  }
};

// Where a wave's steps of K and V come from. Direct: straight from the paged cache into
// registers. Staged: from the wave's shared-memory slot, which holds the step copied there
// one step earlier; once read, the slot takes the next step's copies, so those loads are in
// flight during this step's math without holding registers.
template <class Cfg, bool STAGED = Cfg::staged>
struct KVSteps {
  using Tl = typename Cfg::Tiles;
  using Cache = PagedKV<Cfg::head_size, Cfg::block_size, Cfg::fp8>;
  static constexpr int BLOCK = Cfg::block_size;
  static constexpr int STRIDE = Cfg::NUM_WAVES * Tl::TOKENS;
  static constexpr int NBLK = Tl::TOKENS >= BLOCK ? Tl::TOKENS / BLOCK : 1;  // blocks per step
  // (matrix-core tilings, 16-bit cache, head <= 128, <= 8 heads per tile: see CPA_BT_PREFETCH)
  static constexpr int WAVE_BLOCKS = (Cfg::partition_size + STRIDE - 1) / STRIDE * NBLK;
  static constexpr bool kTabled = CPA_BT_PREFETCH && !Same<typename Cfg::Tiling, TilingScalar>::value &&
                                  !Cfg::fp8 && Cfg::head_size <= 128 && Tl::HEADS_CAP <= 8 &&
                                  WAVE_BLOCKS <= kMaxEntries * kWave && kWave % NBLK == 0;
  static constexpr int NE = (WAVE_BLOCKS + kWave - 1) / kWave;  // entries per lane
  using Src = typename Pick<kTabled, TabledKV<Cache, BLOCK, NBLK, NE>, Cache>::type;
  Src c;

  // The block-table entries of the wave's blocks (lane l: block l, then kWave + l), read before
  // seq_len is known -- so that this L2/DRAM round trip overlaps the seq_lens load instead of
  // following it -- clamped to the table row only: entries past the sequence may be garbage
  // until the constructor replaces them.
  struct Table {
    int raw[kTabled ? NE : 1] = {};
  };
  CPA_DEVICE static int block_index(int first, int l) { return (first + l / NBLK * STRIDE + l % NBLK * BLOCK) / BLOCK; }
  CPA_DEVICE static Table read_table(const int* row, int max_blocks, int first) {
    Table t;
    if constexpr (kTabled) {
#pragma unroll
      for (int e = 0; e < NE; ++e) {
        const int b = block_index(first, e * kWave + lane_id());
        t.raw[e] = load_i32_early(row + (b < max_blocks ? b : max_blocks - 1));
      }
    }
    return t;
  }
  // A block past the sequence can only be a later block of the sequence's last step, whose
  // first block is valid: it takes the sequence's last block from the lane of the same step
  // that holds it (PagedKV::physical_block clamps the same way). Lanes of steps the wave does
  // not run keep whatever they read.
  CPA_DEVICE static int fix_tail(int raw, int first, int l0, int num_seq_blocks) {
    const int over = block_index(first, l0 + lane_id()) - (num_seq_blocks - 1);
    const int src = over > 0 ? lane_id() - over : lane_id();
    return shfl_idx_i32(raw, src > 0 ? src : 0);
  }

  CPA_DEVICE KVSteps(float*, const Cache& cache, int first, int, const Table& t) {
    if constexpr (kTabled) {
      c = Src{cache, {}, -NBLK, first};  // load() advances j0 before the first step
#pragma unroll
      for (int e = 0; e < NE; ++e) c.entry[e] = fix_tail(t.raw[e], first, e * kWave, cache.num_seq_blocks);
    } else {
      c = cache;
    }
  }
  CPA_DEVICE void load(typename Tl::KV& kv, int tok0, bool partial, int) {
    if constexpr (kTabled) c.advance(tok0);
    Tl::template load_kv<Cfg::v_after_qk ? kLoadK : kLoadKV>(kv, c, tok0, partial);
  }
  CPA_DEVICE void after_qk(typename Tl::KV& kv, int tok0, bool partial) {
    if constexpr (Cfg::v_after_qk) {
      compiler_fence();
      Tl::template load_kv<kLoadV>(kv, c, tok0, partial);
    }
  }
};
#if CPA_CUDA && CPA_KV_ASYNC == 3
// Ring: each lane first reads one block-table entry of the wave's blocks (so no block-table
// read waits inside the loop), the wave issues its first RING blocks, and every step waits for
// its blocks, reads them into registers and refills the freed slots RING blocks ahead.
template <class Cfg>
struct KVSteps<Cfg, true> {
  using Tl = typename Cfg::Tiles;
  using Ring = typename Tl::Staged;
  using Cache = typename Ring::Cache;
  static constexpr int STRIDE = Cfg::NUM_WAVES * Tl::TOKENS;
  static_assert(Cfg::partition_size / STRIDE * Ring::NBLK <= kWave, "one block-table entry per lane");
  static_assert(Cfg::COMBINE_FLOATS * 4 <= Ring::RING * Ring::SLOT, "the combine stays clear of the mbarriers");
  const Cache& c;
  Ring ring;
  int nblk;   // blocks of the wave's steps
  int entry;  // lane l: physical block of wave block l
  int j0 = 0;
  struct Table {};
  CPA_DEVICE static Table read_table(const int*, int, int) { return {}; }
  CPA_DEVICE KVSteps(float* smem, const Cache& c, int first, int end, const Table&) : c(c) {
    uint8_t* mine = reinterpret_cast<uint8_t*>(smem + Cfg::STAGE_AT) + wave_id() * Ring::BYTES;
    ring = Ring{mine, reinterpret_cast<uint64_t*>(mine + Ring::RING * Ring::SLOT), first, 0, c.seq_len};
    nblk = c.template wave_blocks<Ring::NBLK, STRIDE>(first, end, entry);
    if (lane_id() == 0) {
      for (int r = 0; r < Ring::RING; ++r) mbar_init(ring.bars + r, 1);
      mbar_init_fence();
    }
    wave_sync();
    for (int j = 0; j < Ring::RING && j < nblk; ++j) ring.issue(c, j, shfl_idx_i32(entry, j));
  }
  // K for QK, then V (a shared-memory read: no latency worth hiding, and K and V are never
  // live together), then the freed slots take the blocks RING ahead.
  CPA_DEVICE void load(typename Tl::KV& kv, int tok0, bool partial, int) {
#pragma unroll
    for (int b = 0; b < Ring::NBLK; ++b) ring.wait(j0 + b);
    ring.tok0 = tok0;
    ring.j0 = j0;
    Tl::template load_kv<kLoadK>(kv, ring, tok0, partial);
  }
  CPA_DEVICE void after_qk(typename Tl::KV& kv, int tok0, bool partial) {
    compiler_fence();
    Tl::template load_kv<kLoadV>(kv, ring, tok0, partial);
    fence_proxy_async_shared();  // this lane's slot reads come before the refill's writes
    wave_sync();
#pragma unroll
    for (int b = 0; b < Ring::NBLK; ++b) {
      const int j = j0 + b + Ring::RING;
      if (j < nblk) ring.issue(c, j, shfl_idx_i32(entry, j));
    }
    j0 += Ring::NBLK;
  }
};
#elif CPA_CUDA
// Slot (arms 1, 2): a step's K and V are one cp.async group; a step waits for its group, reads
// the slot, then the slot takes the next step's copies.
// Split (arm 4): K and V of a step are separate groups in the slot, and each half is refilled
// with the next step's as soon as it is read into registers -- K before QK, V after it -- so
// about one step per wave is always in flight, no register holds a load in flight, and K and
// V are never live together. Outstanding groups at a step's start: [K(n), V(n)].
template <class Cfg>
struct KVSteps<Cfg, true> {
  using Tl = typename Cfg::Tiles;
  using St = typename Tl::Staged;
  using Cache = typename St::Cache;
  static constexpr bool kSplit = CPA_KV_ASYNC == 4;
  const Cache& c;
  St st;
  int end;
  bool more = false;                 // (split) a next step exists: its K was issued in load()
  int64_t next_boff[St::NBLK] = {};  // (split) its cache offsets
  struct Table {};
  CPA_DEVICE static Table read_table(const int*, int, int) { return {}; }
  CPA_DEVICE KVSteps(float* smem, const Cache& c, int first, int end, const Table&)
      : c(c), st{reinterpret_cast<uint8_t*>(smem + Cfg::STAGE_AT) + wave_id() * St::BYTES, first, c.seq_len},
        end(end) {
    if (first < end) {
      int64_t boff[St::NBLK];
      St::offsets(boff, c, first);
      if constexpr (kSplit) {
        st.template issue<kLoadK>(c, boff);
        st.template issue<kLoadV>(c, boff);
      } else {
        st.issue(c, boff);
      }
    }
  }
  CPA_DEVICE void load(typename Tl::KV& kv, int tok0, bool partial, int next) {
    if constexpr (kSplit) {
      more = next < end;
      if (more) St::offsets(next_boff, c, next);  // block-table reads first: they overlap the wait
      cp_async_wait_but_newest();  // K(n); V(n) may still be in flight
      wave_sync();
      st.tok0 = tok0;
      Tl::template load_kv<kLoadK>(kv, st, tok0, partial);
      if (more) {
        wave_sync();  // every lane has read K(n)
        st.template issue<kLoadK>(c, next_boff);  // groups: [V(n), K(n+1)]
      }
    } else {
      const bool more = next < end;
      int64_t boff[St::NBLK];
      if (more) St::offsets(boff, c, next);  // block-table reads first: they overlap the wait
      cp_async_wait_all();
      wave_sync();  // every lane's copies of this step are visible
      st.tok0 = tok0;
      Tl::load_kv(kv, st, tok0, partial);
      if (more) {
        wave_sync();  // every lane has read the slot
        st.tok0 = next;
        st.issue(c, boff);
      }
    }
  }
  CPA_DEVICE void after_qk(typename Tl::KV& kv, int tok0, bool partial) {
    if constexpr (kSplit) {
      if (more) cp_async_wait_but_newest(); else cp_async_wait_all();  // V(n)
      wave_sync();
      Tl::template load_kv<kLoadV>(kv, st, tok0, partial);
      if (more) {
        wave_sync();  // every lane has read V(n)
        st.template issue<kLoadV>(c, next_boff);  // groups: [K(n+1), V(n+1)]
      }
    }  // (slot: V came with K)
  }
};
#endif

// Max (is_max) or sum of x over every lane of the wave, returned to every lane.
CPA_DEVICE float wave_reduce(float x, bool is_max) {
#pragma unroll
  for (int mk = 1; mk < kWave; mk <<= 1) {
    const float y = shfl_xor(x, mk);
    x = is_max ? fmaxf_(x, y) : x + y;
  }
  return x;
}

// out[h][:] = sum_p w_p tmp_out[h][p][:] / sum_p w_p over the np partitions of one
// sequence, for the gqa heads from row0 (the fused reduce; partials come from the L2).
// The combine is the critical path of the last workgroup, so it is built as one L2 round trip
// per 8 partitions: each thread takes two float4 columns of the output at once and
// loads, for each, the max logits, the exp sums and the partial columns of a round's
// partitions together (indices clamped, weight 0 past np), then rescales online from round to
// round. No shared memory and no barrier: the chain is the loads, a few exponentials and the
// store. (Against the earlier combine -- weights through shared memory, a round trip each
// for the max logits, the exp sums and the columns -- the fused launches took 0.969x the time
// on an H100 and 0.991x on an H200, best per shape over batch 1-8 x 8k-32k; that combine was
// removed after the H200 A/B: git has it at 4ebd31f, notes/kernel-notes.md.)
template <class Cfg>
CPA_DEVICE void combine_partitions(const AttnParams& p, int64_t row0, int np, float* smem) {
  using T = typename Cfg::Dtype;
  constexpr int HEAD = Cfg::head_size, THREADS = Cfg::THREADS, C4 = HEAD / 4;
  (void)smem;
  // Where a wave's columns all belong to one head (HEAD / 4 a multiple of the wave), lane l
  // loads the max logit and exp sum of the round's partition l % K and the weights reach the
  // other lanes by shuffles: 2 scalar loads per column instead of 2 K. Otherwise every lane
  // loads all K of them. K = 8: the loads in flight (2 x 8 float4 = 64 registers) must fit
  // under the main loop's own count, or the whole kernel takes more registers (16 per round
  // raised the V-after-QK build from 162 to 202).
  constexpr bool LANE_W = C4 % kWave == 0;
  constexpr int K = 8;  // partitions per round trip
  // float4 columns per thread per round trip: two where a group of 8 heads has more columns
  // than the workgroup has threads (NVIDIA head >= 128), else one, so that the loads in flight
  // do not raise the kernel's registers where its main loop needs fewer (AMD head 64 at 5
  // waves per SIMD)
  constexpr int NCOL = 8 * C4 > THREADS ? 2 : 1;
  const int ncols = p.gqa * C4;
  const int64_t mnp = p.max_num_partitions;
  for (int idx0 = thread_idx(); idx0 < ncols; idx0 += NCOL * THREADS) {
    int hh[NCOL], cc[NCOL];
    float M[NCOL], L[NCOL], a[NCOL][4];
#pragma unroll
    for (int q = 0; q < NCOL; ++q) {
      // (a clamped column loads, never stores; with LANE_W a whole wave is clamped or none)
      const int idx = idx0 + q * THREADS < ncols ? idx0 + q * THREADS : ncols - 1;
      hh[q] = idx / C4;
      cc[q] = idx - hh[q] * C4;
      M[q] = -INFINITY;
      L[q] = 0.f;
      a[q][0] = a[q][1] = a[q][2] = a[q][3] = 0.f;
    }
    for (int j0 = 0; j0 < np; j0 += K) {
      constexpr int NS = LANE_W ? 1 : K;  // scalar loads per column
      float mx[NCOL][NS], es[NCOL][NS];
      u32x4 v[NCOL][K];
#pragma unroll
      for (int q = 0; q < NCOL; ++q) {
        const int64_t base = (row0 + hh[q]) * mnp;
#pragma unroll
        for (int k = 0; k < NS; ++k) {
          const int jk = j0 + (LANE_W ? lane_id() % K : k);
          const int j = jk < np ? jk : np - 1;
          mx[q][k] = load_f32_l2(p.max_logits + base + j);
          es[q][k] = load_f32_l2(p.exp_sums + base + j);
        }
#pragma unroll
        for (int k = 0; k < K; ++k) {
          const int j = j0 + k < np ? j0 + k : np - 1;
          v[q][k] = load16_l2(p.tmp_out + (base + j) * HEAD + 4 * cc[q]);
        }
      }
#pragma unroll
      for (int q = 0; q < NCOL; ++q) {
        float mn = M[q], w[K];
        if constexpr (LANE_W) {
          float m = mx[q][0];  // (clamped repeats change nothing)
#pragma unroll
          for (int s = 1; s < K; s <<= 1) m = fmaxf_(m, shfl_xor(m, s));
          mn = fmaxf_(mn, m);
          const float wl = j0 + lane_id() % K < np ? es[q][0] * exp2f_fast((mx[q][0] - mn) * kLog2e) : 0.f;
#pragma unroll
          for (int k = 0; k < K; ++k) w[k] = __int_as_float(shfl_idx_i32(__float_as_int(wl), k));
        } else {
#pragma unroll
          for (int k = 0; k < K; ++k) mn = fmaxf_(mn, mx[q][k]);
#pragma unroll
          for (int k = 0; k < K; ++k) w[k] = j0 + k < np ? es[q][k] * exp2f_fast((mx[q][k] - mn) * kLog2e) : 0.f;
        }
        const float r = exp2f_fast((M[q] - mn) * kLog2e);  // 0 on the first round (M = -inf)
        L[q] *= r;
#pragma unroll
        for (int i = 0; i < 4; ++i) a[q][i] *= r;
#pragma unroll
        for (int k = 0; k < K; ++k) {
          L[q] += w[k];
          a[q][0] += w[k] * __uint_as_float(v[q][k].x);
          a[q][1] += w[k] * __uint_as_float(v[q][k].y);
          a[q][2] += w[k] * __uint_as_float(v[q][k].z);
          a[q][3] += w[k] * __uint_as_float(v[q][k].w);
        }
        M[q] = mn;
      }
    }
#pragma unroll
    for (int q = 0; q < NCOL; ++q) {
      if (idx0 + q * THREADS < ncols) {
        const float inv = 1.f / L[q];
        uint32_t* o = reinterpret_cast<uint32_t*>(reinterpret_cast<uint16_t*>(p.out) + (row0 + hh[q]) * HEAD + 4 * cc[q]);
        o[0] = T::pack(a[q][0] * inv, a[q][1] * inv);
        o[1] = T::pack(a[q][2] * inv, a[q][3] * inv);
      }
    }
  }
}

// Shared steps (p.steal, direct loads only): the partitions of one (sequence, KV head) share
// its steps instead of owning fixed ranges. Wave w of workgroup `part` first runs step
// part * NUM_WAVES + w (its block-table entries read before seq_len is known, as the static
// loop's are), then takes tickets from one counter per (sequence, KV head): ticket t is step
// np * NUM_WAVES + t (np: the sequence's workgroups). A wave that runs faster -- alone on its
// SM, or nearer its data -- takes more steps, so the workgroups of a sequence finish together
// instead of waiting for the slowest. A ticket is taken one step before it is needed (its
// latency hides behind a step) and the block-table entries of the next step are read during the
// current one. A workgroup's partial is of whatever steps its waves ran (the combine does not
// care which); every active workgroup runs at least its wave 0's first step, so its exp sum is
// positive. Each wave's last ticket is past the sequence: the wave that counts the last such
// ticket resets both counters for the next launch.
template <class Cfg>
struct SharedSteps {
  using Tl = typename Cfg::Tiles;
  using Cache = PagedKV<Cfg::head_size, Cfg::block_size, Cfg::fp8>;
  static constexpr int BLOCK = Cfg::block_size, T = Tl::TOKENS, NW = Cfg::NUM_WAVES;
  static constexpr int NBLK = T >= BLOCK ? T / BLOCK : 1;  // blocks per step
  static_assert(NBLK <= kWave, "one block-table entry per lane");
  TabledKV<Cache, BLOCK, NBLK, 1> src;  // the current step's blocks, lane b: block b
  int* ctr;        // (next ticket, waves done) of this (sequence, KV head)
  int nq, q_pool;  // the sequence's steps; the first step that tickets hand out
  int l_blk;       // this lane's block offset in tokens inside a step (lanes past NBLK: 0)
  int ticket;      // lane 0: the ticket taken a step ago
  int nxt, ent_next;

  // Lane l < NBLK: the table entry of block l of step q, clamped to the row only (garbage past
  // the sequence until fix()). Read before seq_len is known.
  CPA_DEVICE static int read_raw(const int* row, int max_blocks, int q) {
    const int b = q * T / BLOCK + (lane_id() < NBLK ? lane_id() : 0);
    return load_i32_early(row + (b < max_blocks ? b : max_blocks - 1));
  }
  // The entries of step q (< the sequence's steps): blocks past the sequence's last take it.
  CPA_DEVICE static int fix(int raw, int q, int num_seq_blocks) {
    const int b0 = q * T / BLOCK, over = b0 + lane_id() - (num_seq_blocks - 1);
    return shfl_idx_i32(raw, over > 0 ? num_seq_blocks - 1 - b0 : lane_id());
  }
  CPA_DEVICE int take() { return lane_id() == 0 ? atomic_add_i32(ctr, 1) : 0; }
  // The next step is the ticket taken a step ago (nq: none); while there are steps, take the
  // ticket after it and read the next step's table entries.
  CPA_DEVICE void advance() {
    nxt = q_pool + shfl_idx_i32(ticket, 0);
    if (nxt < nq) {
      ticket = take();
      ent_next = src.physical_block(nxt * T + l_blk);
    } else {
      nxt = nq;
    }
  }

  CPA_DEVICE SharedSteps(float*, const Cache& cache, int, int, const typename KVSteps<Cfg>::Table&,
                         const AttnParams& p, int seq, int kvh, int part, int raw0) {
    const int seq_len = cache.seq_len;
    nq = (seq_len + T - 1) / T;
    q_pool = (seq_len + Cfg::partition_size - 1) / Cfg::partition_size * NW;
    ctr = p.steal + 2 * ((int64_t)seq * p.num_kv_heads + kvh);
    l_blk = (lane_id() < NBLK ? lane_id() : 0) * BLOCK;
    static_cast<Cache&>(src) = cache;
    src.j0 = 0;
    ticket = take();  // the step after the first
    nxt = part * NW + wave_id();
    ent_next = nxt < nq ? fix(raw0, nxt, cache.num_seq_blocks) : 0;
    if (nxt >= nq) advance();  // no first step of its own (a short sequence): start from the ticket
  }
  CPA_DEVICE int begin(int) const { return nxt * T; }
  CPA_DEVICE int stop(int) const { return nq * T; }
  CPA_DEVICE int next(int) const { return nxt * T; }
  // This step's loads, then -- with them in flight -- the next step (the ticket taken a step
  // ago), its table entries, and the ticket after it.
  CPA_DEVICE void load(typename Tl::KV& kv, int tok0, bool partial, int) {
    src.entry[0] = ent_next;
    src.tok0 = tok0;
    Tl::template load_kv<(CPA_V_AFTER_QK > 0) ? kLoadK : kLoadKV>(kv, src, tok0, partial);
    advance();
  }
  CPA_DEVICE void after_qk(typename Tl::KV& kv, int tok0, bool partial) {
    if constexpr (CPA_V_AFTER_QK > 0) {  // (forced only: the head-256 default is the fixed loop's)
      compiler_fence();
      Tl::template load_kv<kLoadV>(kv, src, tok0, partial);
    }
  }
  // Every wave of the sequence's workgroups has drawn its one ticket past the end: the wave that
  // counts the last of them resets the counters for the next launch.
  CPA_DEVICE void finish() {
    if (lane_id() == 0 && atomic_add_i32(ctr + 1, 1) == q_pool - 1) {
      atomic_store_i32(ctr, 0);
      atomic_store_i32(ctr + 1, 0);
    }
  }
};

// The fixed partitions' step sources (direct, staged or ring) with SharedSteps' interface:
// the partition's steps, from `first`, STRIDE apart, below `end`.
template <class Cfg>
struct FixedSteps : KVSteps<Cfg> {
  using Base = KVSteps<Cfg>;
  static constexpr int STRIDE = Cfg::NUM_WAVES * Cfg::Tiles::TOKENS;
  CPA_DEVICE FixedSteps(float* smem, const typename Base::Cache& cache, int first, int end,
                        const typename Base::Table& t, const AttnParams&, int, int, int, int)
      : Base(smem, cache, first, end, t) {}
  CPA_DEVICE int begin(int first) const { return first; }
  CPA_DEVICE int stop(int end) const { return end; }
  CPA_DEVICE int next(int tok0) const { return tok0 + STRIDE; }
  CPA_DEVICE void finish() {}
};

// A wave's partition result into a combine slot (in (head, dim) coordinates): O [CAPH][HEAD],
// then max and sum [CAPH] -- the layout the pairwise wave combine and cluster_combine read.
template <class Cfg>
CPA_DEVICE void store_slot(float* so, const float* o, const float* m, const float* l) {
  using Tl = typename Cfg::Tiles;
  constexpr int HEAD = Cfg::head_size, CAPH = Tl::HEADS_CAP;
  if (Tl::writer()) {
#pragma unroll
    for (int e = 0; e < Tl::NO; ++e) {
      int h, d;
      Tl::o_coord(e, h, d);
      so[h * HEAD + d] = o[e];
    }
  }
  if (Tl::lh_writer()) {
#pragma unroll
    for (int lh = 0; lh < Tl::LH; ++lh) {
      so[CAPH * HEAD + Tl::lhead(lh)] = m[lh];
      so[CAPH * HEAD + CAPH + Tl::lhead(lh)] = l[lh];
    }
  }
}

// Cluster combine (sm_90, p.cluster > 1): the workgroups of one (sequence, KV head) are one
// thread-block cluster, one per partition. Each leaves its partition's (max, sum, unnormalized
// output) in its own shared memory; after a cluster barrier, workgroup r computes its share of
// the final rows from every workgroup's copy (distributed shared memory loads: no global
// partials, no device fence, no second launch); a second barrier keeps every copy alive
// until all are read. `slot` layout: O [CAPH][HEAD], then max and sum [CAPH] (log2 units).
// One float4 of output per group of G lanes, each lane reading up to MAXR of the n copies
// (few registers: this epilogue must not raise the kernel's count), merged by shuffles; at
// GQA 8, head 128 every lane's loads are one round trip for any n.
template <class Cfg>
CPA_DEVICE void cluster_combine(const AttnParams& p, int64_t row0, const float* slot) {
  using T = typename Cfg::Dtype;
  constexpr int HEAD = Cfg::head_size, C4 = HEAD / 4, CAPH = Cfg::Tiles::HEADS_CAP, MAXR = 4;
  cluster_sync();
  const int n = p.cluster, r = cluster_rank();
  const int G = n <= MAXR ? 1 : n <= 2 * MAXR ? 2 : 4;  // lanes per output (n <= 16)
  const int total = p.gqa * C4, per_wg = (total + n - 1) / n;
  const int lo = r * per_wg, hi = lo + per_wg < total ? lo + per_wg : total;
  const int sub = lane_id() % G, step = Cfg::THREADS / G;
  for (int base = lo; base < lo + per_wg; base += step) {  // the same trip count in every lane
    const int idx = base + thread_idx() / G;
    const bool valid = idx < hi;
    const int h = valid ? idx / C4 : 0, c = valid ? idx % C4 : 0;
    float mj[MAXR], lj[MAXR];
    u32x4 oj[MAXR];
#pragma unroll
    for (int k = 0; k < MAXR; ++k) {
      if (valid && sub + k * G < n) {  // every load first: one round trip
        mj[k] = ld_cluster_f32(slot + CAPH * HEAD + h, sub + k * G);
        lj[k] = ld_cluster_f32(slot + CAPH * HEAD + CAPH + h, sub + k * G);
        oj[k] = ld_cluster16(slot + h * HEAD + 4 * c, sub + k * G);
      }
    }
    // (-1e30, not -inf: a lane with no copies merges as weight 0 without inf - inf)
    float mx = -1e30f;
#pragma unroll
    for (int k = 0; k < MAXR; ++k)
      if (valid && sub + k * G < n) mx = fmaxf_(mx, mj[k]);
    float den = 0.f, a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma unroll
    for (int k = 0; k < MAXR; ++k) {
      if (valid && sub + k * G < n) {  // an empty partition has l = 0 and o = 0
        const float w = exp2f_fast(mj[k] - mx);
        den += w * lj[k];
        a0 += w * __uint_as_float(oj[k].x); a1 += w * __uint_as_float(oj[k].y);
        a2 += w * __uint_as_float(oj[k].z); a3 += w * __uint_as_float(oj[k].w);
      }
    }
    for (int off = 1; off < G; off <<= 1) {  // merge the G lanes' partial sums
      const float mo = shfl_xor(mx, off), mn = fmaxf_(mx, mo);
      const float sa = exp2f_fast(mx - mn), sb = exp2f_fast(mo - mn);
      den = den * sa + shfl_xor(den, off) * sb;
      a0 = a0 * sa + shfl_xor(a0, off) * sb; a1 = a1 * sa + shfl_xor(a1, off) * sb;
      a2 = a2 * sa + shfl_xor(a2, off) * sb; a3 = a3 * sa + shfl_xor(a3, off) * sb;
      mx = mn;
    }
    if (valid && sub == 0) {
      const float inv = p.out_scale / den;
      uint32_t* o = reinterpret_cast<uint32_t*>(reinterpret_cast<uint16_t*>(p.out) + (row0 + h) * HEAD + 4 * c);
      o[0] = T::pack(a0 * inv, a1 * inv);
      o[1] = T::pack(a2 * inv, a3 * inv);
    }
  }
  cluster_sync();
}

// The bf16 query fragment of a wave (every mma tiling holds the whole group's query in each
// wave, as packed pairs) -> fp16 pairs times 2^k, k chosen from the group's largest |q| so
// that it lands in [2^14, 2^15): no overflow (fp16 max 65504), and bf16's 8-bit significand
// fits fp16's 11 bits for every element down to 2^-28 of the largest (smaller ones, whose
// share of a logit is below that, round to fp16 subnormals). Returns 2^-k, the logit factor.
template <class Q>
CPA_DEVICE float query_to_half(Q& q) {
  constexpr int N = sizeof(Q) / 4;
  uint32_t* w = reinterpret_cast<uint32_t*>(&q);
  int mx = 0;  // largest magnitude as bits: bf16 bit patterns order like their magnitudes
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int lo = (int)(w[i] & 0x7fffu), hi = (int)((w[i] >> 16) & 0x7fffu);
    mx = max(mx, max(lo, hi));
  }
#pragma unroll
  for (int m = 1; m < kWave; m <<= 1) mx = max(mx, shfl_xor(mx, m));
  int k = 14 - ((mx >> 7) - 127);  // 14 - exponent of the largest (zero: the clamp)
  k = k < -126 ? -126 : (k > 126 ? 126 : k);
  const float f = __int_as_float((127 + k) << 23);
#pragma unroll
  for (int i = 0; i < N; ++i) w[i] = F16::pack(BF16::to_float((uint16_t)(w[i] & 0xffffu)) * f,
                                               BF16::to_float((uint16_t)(w[i] >> 16)) * f);
  return __int_as_float((127 - k) << 23);
}

// STEAL: the shared-steps kernel (p.steal set; direct loads only), a separate instantiation so
// that the fixed-partition kernel is compiled exactly as without it.
template <class Cfg, bool STEAL = false>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::min_blocks) paged_attention_kernel(const AttnParams p) {
  using Tl = typename Cfg::Tiles;
  using T = typename Cfg::Dtype;
  constexpr int HEAD = Cfg::head_size, BLOCK = Cfg::block_size, PARTITION = Cfg::partition_size;
  constexpr int NS = Tl::NS, NO = Tl::NO, LH = Tl::LH, CAPH = Tl::HEADS_CAP;
#if CPA_KV_ASYNC
  extern __shared__ __attribute__((aligned(16))) float smem[];  // Cfg::SMEM_FLOATS, set at launch
#else
  __shared__ __attribute__((aligned(16))) float smem[Cfg::SMEM_FLOATS];
#endif

  if (CPA_PDL_ATTENTION) wait_prior_grid();  // before any access: the previous kernel's writes
  allow_dependent_launch();  // the reduce kernel may be scheduled once every workgroup is running
  const int seq = block_idx_x(), part = block_idx_y(), kvh = block_idx_z();
  // (clamped: the fused reduce's and shared steps' counts then stay those of the grid)
  const int seq_len_given = p.seq_lens[seq];
  const int seq_len = seq_len_given < p.max_seq_tokens ? seq_len_given : p.max_seq_tokens;
  const int start = part * PARTITION;
  const int first = start + wave_id() * Tl::TOKENS;  // the wave's first step
  const int* table_row = p.block_tables + (int64_t)seq * p.max_blocks_per_seq;
  constexpr bool kShared = STEAL && !CPA_KV_ASYNC;
  const auto table = kShared ? typename KVSteps<Cfg>::Table{}
                             : KVSteps<Cfg>::read_table(table_row, p.max_blocks_per_seq, first);
  int steal_raw = 0;
  if constexpr (kShared)
    steal_raw = SharedSteps<Cfg>::read_raw(table_row, p.max_blocks_per_seq, part * Cfg::NUM_WAVES + wave_id());
  const int head0 = kvh * p.gqa;
  if (start >= seq_len) {  // whole workgroup: no barrier is skipped by part of it
    if (CPA_CLUSTER_CODE && p.cluster > 1) {  // still one of its cluster's partitions: empty
      constexpr int CAPH = Tl::HEADS_CAP, SLOT = CAPH * HEAD + 2 * CAPH;
      for (int i = thread_idx(); i < SLOT; i += Cfg::THREADS) smem[i] = i < CAPH * HEAD + CAPH && i >= CAPH * HEAD ? -1e30f : 0.f;
      cluster_combine<Cfg>(p, (int64_t)seq * p.num_heads + head0, smem);
    }
    return;
  }
  const int end = start + PARTITION < seq_len ? start + PARTITION : seq_len;

  PagedKV<HEAD, BLOCK, Cfg::fp8> cache{p.key_cache + kvh * p.kv_head_stride,
                                       p.value_cache + kvh * p.kv_head_stride,
                                       p.kv_block_stride,
                                       p.block_tables + (int64_t)seq * p.max_blocks_per_seq,
                                       (seq_len + BLOCK - 1) / BLOCK,
                                       seq_len};
  typename Tl::Q q;
  Tl::load_q(q, p.query + ((int64_t)seq * p.num_heads + head0) * HEAD, p.gqa, smem);
  float scale_log2 = p.scale_log2;
  if constexpr (Cfg::half_math) scale_log2 *= query_to_half(q);

  float m[LH], l[LH], slope[LH], o[NO];
#pragma unroll
  for (int lh = 0; lh < LH; ++lh) {
    m[lh] = -1e30f;  // finite: exp2(m_old - m_new) stays 0 or 1, never NaN
    l[lh] = 0.f;
    const int h = Tl::lhead(lh);
    slope[lh] = (p.alibi_slopes && h < p.gqa) ? p.alibi_slopes[head0 + h] * kLog2e : 0.f;
  }
#pragma unroll
  for (int e = 0; e < NO; ++e) o[e] = 0.f;

  // Waves take steps of the partition round-robin (or, shared, from the sequence's counter);
  // online softmax inside the wave.
  constexpr int STRIDE = Cfg::NUM_WAVES * Tl::TOKENS;
  typename Pick<kShared, SharedSteps<Cfg>, FixedSteps<Cfg>>::type steps(smem, cache, first, end, table, p, seq, kvh,
                                                                        part, steal_raw);
  // (the fixed loop is spelled out: through the methods, clang's loop passes see another
  // shape and gfx942 allocates differently)
#if CPA_LOAD_ONLY
  constexpr int LOAD_ACC = CPA_LOAD_ONLY == 2 ? 64 : 1;
  uint32_t load_acc[LOAD_ACC] = {};
#endif
  const int loop_end = steps.stop(end);
  for (int tok0 = kShared ? steps.begin(first) : first; tok0 < (kShared ? steps.stop(end) : loop_end);
       tok0 = kShared ? steps.next(tok0) : tok0 + STRIDE) {
    const bool partial = tok0 + Tl::TOKENS > seq_len;
    typename Tl::KV kv;
    steps.load(kv, tok0, partial, tok0 + STRIDE);
#if CPA_LOAD_ONLY
    {  // memory-side experiment: fold the step's registers with XORs, no math (wrong output);
       // 2: into LOAD_ACC loop-carried registers, to hold the real kernel's register count
      const uint32_t* w = reinterpret_cast<const uint32_t*>(&kv);
#pragma unroll
      for (int i = 0; i < int(sizeof(kv) / 4); ++i) load_acc[i % LOAD_ACC] ^= w[i];
      continue;
    }
#endif
    float s[NS];
    Tl::qk(s, q, kv, smem);
    steps.after_qk(kv, tok0, partial);

    float mt[LH];
#pragma unroll
    for (int lh = 0; lh < LH; ++lh) mt[lh] = -INFINITY;
#pragma unroll
    for (int e = 0; e < NS; ++e) {
      const int lh = Tl::s_lhead(e);
      const int tok = tok0 + Tl::s_token(e);
      float x = s[e] * scale_log2 + slope[lh] * (float)(tok - seq_len + 1);
      if (partial && tok >= seq_len) x = -INFINITY;
      s[e] = x;
      mt[lh] = fmaxf_(mt[lh], x);
    }
    float alpha[LH];
#pragma unroll
    for (int lh = 0; lh < LH; ++lh) {
      const float mn = fmaxf_(m[lh], Tl::reduce_max(mt[lh]));
      alpha[lh] = exp2f_fast(m[lh] - mn);
      l[lh] *= alpha[lh];
      m[lh] = mn;
    }
#pragma unroll
    for (int e = 0; e < NO; ++e) o[e] *= alpha[Tl::o_lhead(e)];
#pragma unroll
    for (int e = 0; e < NS; ++e) {
      const int lh = Tl::s_lhead(e);
      s[e] = exp2f_fast(s[e] - m[lh]);
      l[lh] += s[e];
    }
    Tl::pv(o, s, kv, smem);
  }
  steps.finish();
#if CPA_LOAD_ONLY
#pragma unroll
  for (int i = 0; i < LOAD_ACC; ++i) o[0] += (float)(load_acc[i] & 1u);
#endif

#pragma unroll
  for (int lh = 0; lh < LH; ++lh) l[lh] = Tl::reduce_sum(l[lh]);

  // Combine the waves pairwise through shared memory, in (head, dim) coordinates.
  barrier();  // the tiling's own shared memory is free from here on
  for (int half = Cfg::NUM_WAVES / 2; half >= 1; half >>= 1) {
    const int w = wave_id();
    if (w >= half && w < 2 * half) store_slot<Cfg>(smem + (w - half) * Cfg::SLOT, o, m, l);
    barrier();
    if (w < half) {
      const float* so = smem + w * Cfg::SLOT;
      float a[LH], b[LH];
#pragma unroll
      for (int lh = 0; lh < LH; ++lh) {
        const float mb = so[CAPH * HEAD + Tl::lhead(lh)], lb = so[CAPH * HEAD + CAPH + Tl::lhead(lh)];
        const float mn = fmaxf_(m[lh], mb);
        a[lh] = exp2f_fast(m[lh] - mn);
        b[lh] = exp2f_fast(mb - mn);
        l[lh] = l[lh] * a[lh] + lb * b[lh];
        m[lh] = mn;
      }
#pragma unroll
      for (int e = 0; e < NO; ++e) {
        int h, d;
        Tl::o_coord(e, h, d);
        o[e] = o[e] * a[Tl::o_lhead(e)] + so[h * HEAD + d] * b[Tl::o_lhead(e)];
      }
    }
    barrier();
  }
  const int64_t row0 = (int64_t)seq * p.num_heads + head0;
  if (CPA_CLUSTER_CODE && p.cluster > 1) {
    // wave 0 holds the partition's result; slot 0 is free after the last pairwise round
    if (wave_id() == 0) store_slot<Cfg>(smem, o, m, l);
    cluster_combine<Cfg>(p, row0, smem);  // (its first cluster barrier orders the writes above)
    return;
  }
  if (wave_id() == 0) {
    if (Tl::lh_writer()) {
#pragma unroll
      for (int lh = 0; lh < LH; ++lh) {
        const int h = Tl::lhead(lh);
        if (h < p.gqa) {
          const int64_t idx = (row0 + h) * p.max_num_partitions + part;
          const float max_logit = m[lh] * kLn2;  // (before the address, as the assignment was)
          store_partial(p.max_logits + idx, max_logit);
          store_partial(p.exp_sums + idx, l[lh]);
        }
      }
    }
    if (Tl::writer()) {
      float inv[LH];
#pragma unroll
      for (int lh = 0; lh < LH; ++lh) inv[lh] = p.out_scale / l[lh];
#pragma unroll
      for (int e = 0; e < NO; ++e) o[e] *= inv[Tl::o_lhead(e)];
      // One test per destination, outside the unrolled stores: tested per element, the
      // compiler kept 32 null checks and branches here, ~6% of the kernel at partition 256.
      if (p.tmp_out) {
        float* dst = p.tmp_out + (row0 * p.max_num_partitions + part) * HEAD;
        const int64_t head_stride = (int64_t)p.max_num_partitions * HEAD;
#pragma unroll
        for (int e = 0; e < NO; ++e) {
          int h, d;
          Tl::o_coord(e, h, d);
          if (h < p.gqa) store_partial(dst + h * head_stride + d, o[e]);
        }
      }
      if (p.out_direct) {
        uint16_t* dst = reinterpret_cast<uint16_t*>(p.out) + row0 * HEAD;
#pragma unroll
        for (int e = 0; e < NO; ++e) {
          int h, d;
          Tl::o_coord(e, h, d);
          if (h < p.gqa) dst[h * HEAD + d] = T::from_float(o[e]);
        }
      }
    }
  }
#if CPA_FUSED_REDUCE
  if (p.counters == nullptr) return;

  // Fused reduce: the last workgroup of this (sequence, KV head) to finish combines its
  // partitions, saving the second launch (and its latency) that dominates small batches.
  __shared__ int is_last;
  const int np_seq = (seq_len + PARTITION - 1) / PARTITION;
  int* ctr = p.counters + (int64_t)seq * p.num_kv_heads + kvh;
  // One acquire-release count by one thread: the barrier orders wave 0's partial stores
  // before it (its release makes them visible device-wide with the count), and the last
  // workgroup's acquire orders every other workgroup's partials before its loads (the second
  // barrier passes that on to its other threads). The counter is reset after the combine,
  // off the critical path (the next launch's workgroups count only after this grid).
  barrier();
  if (thread_idx() == 0) is_last = atomic_add_acq_rel_i32(ctr, 1) == np_seq - 1;
  barrier();
  if (!is_last) return;
  combine_partitions<Cfg>(p, row0, np_seq, smem);
  if (thread_idx() == 0) *ctr = 0;  // every other workgroup has counted: ready for the next launch
#endif
}

// ---------------------------------------------------------------- reduce
constexpr int kReduceThreads = 128;  // (a plain name: HIP's __launch_bounds__ is a macro)
template <class T, int HEAD>
struct ReduceConfig {
  // 128 threads x 64 registers fit beside two attention workgroups on an H200 SM, so a
  // programmatic dependent launch can make the reduce resident before the attention ends
  static constexpr int THREADS = kReduceThreads;
  static constexpr int COLS = HEAD / 4;         // float4 columns of a partial output row
  static constexpr int ROWS = THREADS / COLS;   // partitions combined in parallel
  static constexpr int ROWS_PER_THREAD = 8;     // partitions one thread loads at once
  static_assert(THREADS % COLS == 0, "head size / 4 must divide the reduce workgroup");
};

// Few partitions (2 .. CPA_REDUCE_FEW_MAX per sequence): HEAD / 4 threads per head, several
// heads per workgroup, one pass of online rescaling in registers -- no shared memory and no
// barriers. The block-wide kernel below spends most of its time in its four barriers when
// a head has only a handful of partials to combine. But one head's partials are combined
// serially here, so with few heads in flight (small batch) and 8+ partials the block-wide
// kernel, which combines ROWS partials at once, is faster. H200 A/B (notes/kernel-notes.md):
// always faster up to 4 partials; up to 16 at 2048+ heads (num_seqs x num_heads); slower
// at 512 heads with 8-16. CPA_REDUCE_FEW_MIN_HEADS sits between the two measured counts.
// -DCPA_REDUCE_FEW_MAX=0 compiles the choice out (block-wide kernel always).
#ifndef CPA_REDUCE_FEW_MAX
#define CPA_REDUCE_FEW_MAX 16
#endif
#ifndef CPA_REDUCE_FEW_ALWAYS
#define CPA_REDUCE_FEW_ALWAYS 4
#endif
#ifndef CPA_REDUCE_FEW_MIN_HEADS
#define CPA_REDUCE_FEW_MIN_HEADS 1024
#endif

// Which reduce kernel a launch uses (cpa.variants.reduce_kernel mirrors this).
inline bool use_reduce_few(int max_num_partitions, int num_seqs, int num_heads) {
  if (max_num_partitions > CPA_REDUCE_FEW_MAX) return false;
  return max_num_partitions <= CPA_REDUCE_FEW_ALWAYS ||
         (long long)num_seqs * num_heads >= (long long)CPA_REDUCE_FEW_MIN_HEADS;
}

constexpr int kReduceFewThreads = 256;  // (a plain name for __launch_bounds__, as kReduceThreads)
template <class T, int HEAD>
struct ReduceFewConfig {
  static constexpr int THREADS = kReduceFewThreads;
  static constexpr int GROUP = HEAD / 4;              // threads per head: one float4 column each
  static constexpr int HEADS = THREADS / GROUP;       // heads per workgroup
  static_assert(THREADS % GROUP == 0, "head size / 4 must divide the reduce workgroup");
};

// grid (ceil(num_heads / HEADS), num_seqs)
template <class T, int HEAD>
__global__ void __launch_bounds__(kReduceFewThreads) paged_attention_reduce_few_kernel(const ReduceParams p) {
  using RC = ReduceFewConfig<T, HEAD>;
  const int tid = thread_idx();
  const int head = block_idx_x() * RC::HEADS + tid / RC::GROUP, col = tid % RC::GROUP, seq = block_idx_y();
  if (head >= p.num_heads) return;
  const int np = num_partitions_of(p.seq_lens[seq], p.partition_size, p.max_seq_tokens);
  const int64_t base = ((int64_t)seq * p.num_heads + head) * p.max_num_partitions;
  wait_prior_grid();  // the partials below are the attention kernel's
  float m = -INFINITY, wsum = 0.f, a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma unroll 4
  for (int i = 0; i < np; ++i) {
    const float mi = p.max_logits[base + i], ei = p.exp_sums[base + i];
    const u32x4 v = load16(p.tmp_out + (base + i) * HEAD + 4 * col);
    const float mn = fmaxf_(m, mi);
    const float c = exp2f_fast((m - mn) * kLog2e), w = ei * exp2f_fast((mi - mn) * kLog2e);
    wsum = wsum * c + w;
    a0 = a0 * c + w * __uint_as_float(v.x); a1 = a1 * c + w * __uint_as_float(v.y);
    a2 = a2 * c + w * __uint_as_float(v.z); a3 = a3 * c + w * __uint_as_float(v.w);
    m = mn;
  }
  const float inv = 1.f / wsum;
  uint32_t* o = reinterpret_cast<uint32_t*>(reinterpret_cast<uint16_t*>(p.out) +
                                            ((int64_t)seq * p.num_heads + head) * HEAD + 4 * col);
  o[0] = T::pack(a0 * inv, a1 * inv);
  o[1] = T::pack(a2 * inv, a3 * inv);
}

// grid (num_heads, num_seqs): out = sum_p w_p tmp_out_p / sum_p w_p,
// w_p = exp_sums_p * exp(max_logits_p - max_q max_logits_q).
// Latency bounds this kernel (a few KB per head, mostly L2 hits), so it has one round of
// loads and one barrier: ROWS row groups take the partitions side by side, each thread issues
// the loads of up to RPT of its partitions at once and rescales them online in registers,
// and the row groups' (max, weight sum, partial sums) are combined once in shared memory.
// (The previous kernel -- two block reductions, then one dependent load per ROWS partitions --
// cost 2.6-3.4 us at batch 1 with 32-64 partitions on the H200.)
template <class T, int HEAD>
__global__ void __launch_bounds__(kReduceThreads) paged_attention_reduce_kernel(const ReduceParams p) {
  using RC = ReduceConfig<T, HEAD>;
  constexpr int RPT = RC::ROWS_PER_THREAD, ROWS = RC::ROWS;
  __shared__ float max_s[ROWS], sum_s[ROWS];
  __shared__ __attribute__((aligned(16))) float acc_s[ROWS][HEAD];
  const int head = block_idx_x(), seq = block_idx_y(), tid = thread_idx();
  const int np = num_partitions_of(p.seq_lens[seq], p.partition_size, p.max_seq_tokens);
  const int64_t base = ((int64_t)seq * p.num_heads + head) * p.max_num_partitions;
  const int col = tid % RC::COLS, row = tid / RC::COLS;
  wait_prior_grid();  // the partials below are the attention kernel's

  // A row group past np keeps m = -inf and zero sums: its weight below is exp(-inf) = 0.
  float m = -INFINITY, wsum = 0.f, a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
  for (int r0 = row; r0 < np; r0 += RPT * ROWS) {
    float ml[RPT], es[RPT];
    u32x4 v[RPT];
#pragma unroll
    for (int k = 0; k < RPT; ++k) {
      // rows past np load the last partition again (no branch around the loads: all RPT are
      // issued before the first use) and get zero weight
      const int i = r0 + k * ROWS < np ? r0 + k * ROWS : np - 1;
      ml[k] = p.max_logits[base + i];
      const float e = p.exp_sums[base + i];
      es[k] = r0 + k * ROWS < np ? e : 0.f;
      v[k] = load16(p.tmp_out + (base + i) * HEAD + 4 * col);
    }
    float mn = m;
#pragma unroll
    for (int k = 0; k < RPT; ++k) mn = fmaxf_(mn, ml[k]);  // finite: row r0 < np is valid
    const float c = exp2f_fast((m - mn) * kLog2e);
    wsum *= c; a0 *= c; a1 *= c; a2 *= c; a3 *= c;
#pragma unroll
    for (int k = 0; k < RPT; ++k) {
      const float w = es[k] * exp2f_fast((ml[k] - mn) * kLog2e);
      wsum += w;
      a0 += w * __uint_as_float(v[k].x); a1 += w * __uint_as_float(v[k].y);
      a2 += w * __uint_as_float(v[k].z); a3 += w * __uint_as_float(v[k].w);
    }
    m = mn;
  }
  if (col == 0) {
    max_s[row] = m;
    sum_s[row] = wsum;
  }
  acc_s[row][4 * col] = a0; acc_s[row][4 * col + 1] = a1;
  acc_s[row][4 * col + 2] = a2; acc_s[row][4 * col + 3] = a3;
  barrier();
  float mx = max_s[0];
#pragma unroll
  for (int r = 1; r < ROWS; ++r) mx = fmaxf_(mx, max_s[r]);  // row group 0 always has partitions
  for (int d = tid; d < HEAD; d += RC::THREADS) {
    float s = 0.f, w = 0.f;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const float f = exp2f_fast((max_s[r] - mx) * kLog2e);
      s += acc_s[r][d] * f;
      w += sum_s[r] * f;
    }
    reinterpret_cast<uint16_t*>(p.out)[((int64_t)seq * p.num_heads + head) * HEAD + d] = T::from_float(s / w);
  }
}

}  // namespace cpa
