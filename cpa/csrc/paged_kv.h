// The paged KV cache as one workgroup sees it: one sequence, one KV head.
//   key_cache   [num_blocks, num_kv_heads, head_size / X, block_size, X]  (X = 16 bytes / elem)
//   value_cache [num_blocks, num_kv_heads, head_size, block_size]
// Addresses are in bytes so fp16/bf16 and fp8 (uint8) caches share one code path.
#pragma once
#include "platform.h"

namespace cpa {

template <int HEAD, int BLOCK, bool FP8>
struct PagedKV {
  static constexpr int ELEM = FP8 ? 1 : 2;  // bytes per cached element
  static constexpr int X = 16 / ELEM;       // elements per 16-byte key chunk
  static_assert(HEAD % X == 0, "head size must be a multiple of the key chunk");

  const uint8_t* k;          // key_cache  + kv_head offset
  const uint8_t* v;          // value_cache + kv_head offset
  int64_t block_stride;      // bytes between physical blocks (num_kv_heads * HEAD * BLOCK * ELEM)
  const int* block_table;    // this sequence's row
  int num_seq_blocks;        // ceil(seq_len / BLOCK): entries past it may be garbage
  int seq_len;

  // Byte offset of the physical block holding `token`. Tokens past the sequence are
  // clamped into its last block: the loads stay in bounds and the kernel masks them.
  CPA_DEVICE int64_t block_offset(int token) const {
    int lb = token / BLOCK;
    lb = lb < num_seq_blocks ? lb : num_seq_blocks - 1;
    return (int64_t)load_i32(block_table + lb) * block_stride;
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

// Eight cached elements as four packed 16-bit registers of type T. For 16-bit caches
// this is one 16-byte load; for fp8 one 8-byte load converted in registers (value / 256).
template <class T, bool FP8>
CPA_DEVICE void load8_elems(uint32_t (&r)[4], const uint8_t* p) {
  if constexpr (FP8) {
    u32x2 w = load8(p);
    u32x2 a = fp8x4_to_16bit<T>(w.x), b = fp8x4_to_16bit<T>(w.y);
    r[0] = a.x; r[1] = a.y; r[2] = b.x; r[3] = b.y;
  } else {
    u32x4 w = load16(p);
    r[0] = w.x; r[1] = w.y; r[2] = w.z; r[3] = w.w;
  }
}
// 16 bytes of cache as packed 16-bit registers: 4 registers (8 elements) for 16-bit
// caches, 8 registers (16 elements) for fp8. N must be 16 / ELEM / 2 * ... = X / 2.
template <class T, bool FP8>
CPA_DEVICE void load_chunk(uint32_t (&r)[FP8 ? 8 : 4], const uint8_t* p) {
  u32x4 w = load16(p);
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
