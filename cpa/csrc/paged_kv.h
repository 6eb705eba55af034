// The paged KV cache as one workgroup sees it: one sequence, one KV head.
//   key_cache   [num_blocks, num_kv_heads, head_size / X, block_size, X]  (X = 16 bytes / elem)
//   value_cache [num_blocks, num_kv_heads, head_size, block_size]
// Addresses are in bytes so fp16/bf16 and fp8 (uint8) caches share one code path.
#pragma once
#include "platform.h"

// 1: the staged main loop on the tilings that can stage (Tiles::Staged; the NVIDIA mma
// tilings): each wave's next step of K and V is copied into its shared-memory slot with
// cp.async while it computes the current one (kernel shared memory becomes dynamic).
// 2: the same with the slot XOR-swizzled so its reads are free of bank conflicts.
// 3: a ring of several block slots per wave, filled by bulk copies (TMA, sm_90) that complete
// on mbarriers: each slot is refilled, RING blocks ahead, as soon as the wave has read it, so
// about 1.5 steps per wave stay in flight during the math (RingKV).
// 4: the slot of 2, with K and V as separate cp.async groups, each refilled with the next
// step's as soon as it is read into registers (K before QK, V after it): about one step per
// wave always in flight, K and V never live together (attention.h, KVSteps).
// (6, a ring for the whole workgroup with barrier hand-offs, cuDNN's form, measured 1.015-1.017x
// slower on an H200 and 1.009-1.013x on an H100, was removed: git has it at 4ebd31f.)
// 0: each step loads K and V straight into registers. An A/B knob: CPA_NVCC_FLAGS=-DCPA_KV_ASYNC=1.
#ifndef CPA_KV_ASYNC
#define CPA_KV_ASYNC 0
#endif
#if CPA_KV_ASYNC < 0 || CPA_KV_ASYNC > 4
#error "CPA_KV_ASYNC is 0 (direct loads) or one of the staged loops 1-4 above"
#endif
// Shared memory a wave's ring may take (-DCPA_KV_ASYNC=3): 4 waves x 27.5 KB keeps two
// workgroups per SM on Hopper (227 KB).
#ifndef CPA_RING_BYTES_PER_WAVE
#define CPA_RING_BYTES_PER_WAVE 28160
#endif
#if CPA_KV_ASYNC && !CPA_CUDA
#undef CPA_KV_ASYNC
#define CPA_KV_ASYNC 0  // only the NVIDIA mma tilings stage (cp.async)
#endif

namespace cpa {

template <int HEAD, int BLOCK, bool FP8>
struct PagedKV {
  static constexpr int ELEM = FP8 ? 1 : 2;  // bytes per cached element
  static constexpr int X = 16 / ELEM;       // elements per 16-byte key chunk
  static_assert(HEAD % X == 0, "head size must be a multiple of the key chunk");

  static constexpr bool kShared = false;  // loads go to global memory

  const uint8_t* k;          // key_cache  + kv_head offset
  const uint8_t* v;          // value_cache + kv_head offset
  int64_t block_stride;      // bytes between physical blocks (num_kv_heads * HEAD * BLOCK * ELEM)
  const int* block_table;    // this sequence's row
  int num_seq_blocks;        // ceil(seq_len / BLOCK): entries past it may be garbage
  int seq_len;

  // Byte offset of the physical block holding `token`. Tokens past the sequence are
  // clamped into its last block: the loads stay in bounds and the kernel masks them.
  CPA_DEVICE int physical_block(int token) const {
    int lb = token / BLOCK;
    lb = lb < num_seq_blocks ? lb : num_seq_blocks - 1;
    return load_i32(block_table + lb);
  }
  CPA_DEVICE int64_t block_offset(int token) const { return (int64_t)physical_block(token) * block_stride; }
  // The physical blocks of a wave's steps -- NBLK blocks from each step start first, first +
  // STRIDE, ... below end -- one per lane: lane l gets the wave's block l (0 past them), the
  // return value is their count. One block-table read per lane, before any step.
  template <int NBLK, int STRIDE>
  CPA_DEVICE int wave_blocks(int first, int end, int& entry) const {
    const int n = first < end ? (end - first + STRIDE - 1) / STRIDE * NBLK : 0;
    const int l = lane_id();
    entry = l < n ? physical_block(first + l / NBLK * STRIDE + l % NBLK * BLOCK) : 0;
    return n;
  }
  // K[token][d .. d + X) for d a multiple of X, or the half chunk at d % X == X / 2.
  CPA_DEVICE const uint8_t* k_ptr(int64_t boff, int token, int d) const {
    return k + boff + ((d / X) * BLOCK + token % BLOCK) * 16 + (d % X) * ELEM;
  }
  // V[d][token ..]: tokens of one block are contiguous for each d.
  CPA_DEVICE const uint8_t* v_ptr(int64_t boff, int d, int token) const {
    return v + boff + (d * BLOCK + token % BLOCK) * ELEM;
  }
};

// One wave's shared-memory copy of one step (TOKENS tokens = NBLK whole blocks) of the cache:
// the NBLK key blocks, then the NBLK value blocks, each in the cache's own layout, so that
// k_ptr / v_ptr address it exactly as they address the cache. Filled with cp.async (NVIDIA)
// by the staged main loop (-DCPA_KV_ASYNC=1).
//
// SWIZZLE: 16-byte chunk positions are XOR-permuted (the same permutation at copy and at read)
// so that the eight lanes of each shared-memory phase of the mma lane mapping hit distinct
// banks: K chunk (row r = head chunk, column = token) goes to column ^ 2 (r & 3), and the
// second block's V chunks move by 4 chunks (bytes ^ 64).
template <int HEAD, int BLOCK, bool FP8, int TOKENS, bool SWIZZLE = (CPA_KV_ASYNC >= 2)>
struct StagedKV {
  using Cache = PagedKV<HEAD, BLOCK, FP8>;
  static constexpr bool kShared = true;
  static constexpr int ELEM = Cache::ELEM, X = Cache::X;
  static constexpr int NBLK = TOKENS / BLOCK;
  static constexpr int SLAB = HEAD * BLOCK * ELEM;  // one block of K (or of V) of one KV head
  static constexpr int BYTES = 2 * NBLK * SLAB;
  static_assert(TOKENS % BLOCK == 0, "a staged step holds whole blocks");
  static_assert(SLAB % (16 * kWave) == 0, "a block's K is whole 16-byte chunks per lane");
  static_assert(!SWIZZLE || (BLOCK >= 8 && NBLK <= 2 && SLAB >= 128), "the swizzle stays inside a block");

  uint8_t* k;   // this wave's slot: K blocks at k, V blocks at k + NBLK * SLAB
  int tok0;     // first token of the step the slot holds (a multiple of BLOCK)
  int seq_len;

  CPA_DEVICE int64_t block_offset(int token) const { return (int64_t)((token - tok0) / BLOCK) * SLAB; }
  // Byte position in a K block of the chunk at (head chunk row, token column), and of V byte
  // `at` of block b.
  CPA_DEVICE static constexpr int k_pos(int row, int col) {
    return (row * BLOCK + (SWIZZLE ? col ^ ((2 * row) & 6) : col)) * 16;
  }
  CPA_DEVICE static constexpr int v_pos(int b, int at) { return SWIZZLE ? at ^ (64 * b) : at; }
  CPA_DEVICE const uint8_t* k_ptr(int64_t boff, int token, int d) const {
    return k + boff + k_pos(d / X, token % BLOCK) + (d % X) * ELEM;
  }
  CPA_DEVICE const uint8_t* v_ptr(int64_t boff, int d, int token) const {
    return k + NBLK * SLAB + boff + v_pos((int)(boff / SLAB), (d * BLOCK + token % BLOCK) * ELEM);
  }
  // The cache offsets of the step at tok0 (block-table reads: issue them early).
  CPA_DEVICE static void offsets(int64_t (&boff)[NBLK], const Cache& c, int tok0) {
#pragma unroll
    for (int b = 0; b < NBLK; ++b) boff[b] = c.block_offset(tok0 + b * BLOCK);
  }
#if CPA_CUDA
  // Copy the step whose block offsets are boff into the slot: one commit group per step
  // (PARTS = kLoadKV), or K or V alone as its own group (the split loop, -DCPA_KV_ASYNC=4).
  template <int PARTS = 3>
  CPA_DEVICE void issue(const Cache& c, const int64_t (&boff)[NBLK]) const {
    constexpr int PER_LANE = SLAB / (16 * kWave);
    const int lane16 = 16 * lane_id();
#pragma unroll
    for (int b = 0; b < NBLK; ++b)
#pragma unroll
      for (int j = 0; j < PER_LANE; ++j) {
        const int at = j * 16 * kWave + lane16;
        if (PARTS & 1) cp_async16(k + b * SLAB + k_pos(at / (16 * BLOCK), (at / 16) % BLOCK), c.k + boff[b] + at);
        if (PARTS & 2) cp_async16(k + (NBLK + b) * SLAB + v_pos(b, at), c.v + boff[b] + at);
      }
    cp_async_commit();
  }
#endif
};

// One wave's ring (-DCPA_KV_ASYNC=3): RING slots, each holding one cache block of K and V
// copied by bulk copies (one per 16-byte-chunk row of K, one for V), and RING mbarriers.
// Wave block j (its j-th block: step j / NBLK, block j % NBLK of the step) lives in slot
// j % RING, its (j / RING)-th use of that slot. The copies pad the layout so that the mma lane
// mapping reads it without bank conflicts: K rows at a pitch of 32 bytes mod 128 (the four
// rows 4p + t of a phase on distinct banks), and a step's second block shifted by 64 bytes
// (its V reads share a phase with the first block's).
template <int HEAD, int BLOCK, bool FP8, int TOKENS>
struct RingKV {
  using Cache = PagedKV<HEAD, BLOCK, FP8>;
  static constexpr bool kShared = true;
  static constexpr int ELEM = Cache::ELEM, X = Cache::X;
  static constexpr int NBLK = TOKENS / BLOCK;  // blocks per step
  static constexpr int KROWS = HEAD / X;       // 16-byte-chunk rows of one key block
  static constexpr int KROW = BLOCK * 16;      // bytes of such a row, contiguous in the cache
  static constexpr int KPITCH = KROW + 32;
  static constexpr int VBYTES = HEAD * BLOCK * ELEM;  // one value block, contiguous
  static constexpr int V_AT = KROWS * KPITCH;
  static constexpr int SLOT = (64 * (NBLK - 1) + V_AT + VBYTES + 127) / 128 * 128;
  static constexpr int FIT = CPA_RING_BYTES_PER_WAVE / SLOT;
  static constexpr int RING = FIT > NBLK + 1 ? (FIT < 8 ? FIT : 8) : NBLK + 1;
  static constexpr int BYTES = RING * SLOT + (RING * 8 + 127) / 128 * 128;  // slots, then mbarriers
  static_assert(TOKENS % BLOCK == 0 && KROW % 128 == 0, "a step is whole blocks of whole 128-byte rows");

  uint8_t* base;   // this wave's slots
  uint64_t* bars;  // this wave's mbarriers
  int tok0, j0;    // the step being read: first token, first wave block
  int seq_len;

  CPA_DEVICE static int slot_offset(int j) { return (j % RING) * SLOT + 64 * (j % NBLK); }
  CPA_DEVICE int64_t block_offset(int token) const { return slot_offset(j0 + (token - tok0) / BLOCK); }
  CPA_DEVICE const uint8_t* k_ptr(int64_t boff, int token, int d) const {
    return base + boff + (d / X) * KPITCH + (token % BLOCK) * 16 + (d % X) * ELEM;
  }
  CPA_DEVICE const uint8_t* v_ptr(int64_t boff, int d, int token) const {
    return base + boff + V_AT + (d * BLOCK + token % BLOCK) * ELEM;
  }
#if CPA_CUDA
  // Copy wave block j (physical block `pblock` of the cache) into its slot; warp-uniform.
  CPA_DEVICE void issue(const Cache& c, int j, int pblock) const {
    uint8_t* dst = base + slot_offset(j);
    uint64_t* bar = bars + j % RING;
    const int64_t off = (int64_t)pblock * c.block_stride;
    const int l = lane_id();
    if (l == 0) mbar_arrive_expect_tx(bar, KROWS * KROW + VBYTES);
    for (int r = l; r <= KROWS; r += kWave) {
      if (r < KROWS) bulk_copy_to_shared(dst + r * KPITCH, c.k + off + r * KROW, KROW, bar);
      else bulk_copy_to_shared(dst + V_AT, c.v + off, VBYTES, bar);
    }
  }
  CPA_DEVICE void wait(int j) const { mbar_wait(bars + j % RING, (j / RING) & 1); }
#endif
};

// Eight cached elements as four packed 16-bit registers of type T. For 16-bit caches
// this is one 16-byte load; for fp8 one 8-byte load converted in registers (value / 256).
// SMEM: p points into a shared-memory copy of the cache (the staged main loop).
template <class T, bool FP8, bool SMEM = false>
CPA_DEVICE void load8_elems(uint32_t (&r)[4], const uint8_t* p) {
  if constexpr (FP8) {
    u32x2 w = SMEM ? lds8(p) : load8_kv(p);
    u32x2 a = fp8x4_to_16bit<T>(w.x), b = fp8x4_to_16bit<T>(w.y);
    r[0] = a.x; r[1] = a.y; r[2] = b.x; r[3] = b.y;
  } else {
    u32x4 w = SMEM ? lds16(p) : load16_kv(p);
    r[0] = w.x; r[1] = w.y; r[2] = w.z; r[3] = w.w;
  }
}
// 16 bytes of cache as packed 16-bit registers: 4 registers (8 elements) for 16-bit
// caches, 8 registers (16 elements) for fp8. N must be 16 / ELEM / 2 * ... = X / 2.
template <class T, bool FP8, bool SMEM = false>
CPA_DEVICE void load_chunk(uint32_t (&r)[FP8 ? 8 : 4], const uint8_t* p) {
  u32x4 w = SMEM ? lds16(p) : load16_kv(p);
  if constexpr (FP8) {
    u32x2 a = fp8x4_to_16bit<T>(w.x), b = fp8x4_to_16bit<T>(w.y);
    u32x2 c = fp8x4_to_16bit<T>(w.z), d = fp8x4_to_16bit<T>(w.w);
    r[0] = a.x; r[1] = a.y; r[2] = b.x; r[3] = b.y;
    r[4] = c.x; r[5] = c.y; r[6] = d.x; r[7] = d.y;
  } else {
    r[0] = w.x; r[1] = w.y; r[2] = w.z; r[3] = w.w;
  }
}
// Four cached elements (8 or 4 bytes) as two packed registers.
template <class T, bool FP8>
CPA_DEVICE void load4_elems(uint32_t (&r)[2], const uint8_t* p) {
  if constexpr (FP8) {
    u32x2 a = fp8x4_to_16bit<T>(load4(p));
    r[0] = a.x; r[1] = a.y;
  } else {
    u32x2 w = load8(p);
    r[0] = w.x; r[1] = w.y;
  }
}

// Zero the 16-bit halves of packed register `w` (tokens tok, tok + 1) past seq_len, so
// that stale or NaN cache slots cannot leak into P x V (0 * NaN = NaN).
CPA_DEVICE uint32_t mask_pair(uint32_t w, int tok, int seq_len) {
  if (tok >= seq_len) return 0u;
  if (tok + 1 >= seq_len) return w & 0xffffu;
  return w;
}

}  // namespace cpa
