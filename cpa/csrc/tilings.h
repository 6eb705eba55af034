// Tilings: how one wave maps a step of TOKENS context tokens x the GQA query heads of one
// KV head onto matrix-core fragments (or plain lanes). The attention kernel is written
// once against this interface:
//
//   TOKENS            tokens one wave handles per step
//   HEADS_CAP         query heads per KV head the tiling holds (GQA ratio <= HEADS_CAP)
//   NS, NO, LH        scores, output accumulators and distinct query heads per lane
//   Q, KV             register state: the query fragment, one step of loaded K and V
//   load_q            the group's query into Q (zero for heads >= gqa)
//   load_kv<PARTS>    one step of K and/or V through the block table (V past seq_len zeroed)
//   Staged            (optional) the shared-memory copy of a step that load_kv can also read:
//                     tilings that define it run the staged loop under -DCPA_KV_ASYNC=1
//   qk                S = K q^T for the step (fp32, unscaled)
//   pv                O += V P^T for the step, P given in the S layout
//   s_token(e)        token (within the step) of score element e of this lane
//   s_lhead(e), o_lhead(e)   local head of score / output element e
//   lhead(lh)         query head (within the group) of local head lh of this lane
//   o_coord(e, h, d)  query head and dimension of output element e
//   reduce_max/sum    over the lanes that hold the same head (the token lanes)
//   writer / lh_writer       which lanes store outputs / per-head statistics
//
// Contraction dimensions (head_size in QK, tokens in PV) may be permuted freely as long as
// both operands agree; every tiling uses that to turn 16-byte loads straight into fragments.
#pragma once
#include "paged_kv.h"
#if CPA_CUDA
#include <type_traits>
#endif

namespace cpa {

// Which half of a step load_kv loads (the kernel can load V only after QK: CPA_V_AFTER_QK).
constexpr int kLoadK = 1, kLoadV = 2, kLoadKV = 3;

struct TilingMfma16 {};  // 16x16x16 MFMA on AMD; mma.sync.m16n8k16 on NVIDIA
struct TilingMfma4 {};   // 4x4x4 16-block MFMA on AMD; mma.sync.m16n8k8 on NVIDIA
struct TilingScalar {};  // no matrix cores: per-lane dot products

// ============================================================== NVIDIA: mma.sync
#if CPA_CUDA
// 1: K tile rows are consecutive tokens, so the eight lanes of a quad column read one whole
// 128-byte line of the key cache per load (a warp load = 4 full lines, 4 L2 requests), and
// P is transposed across each quad (4 shuffles per 8 heads) to meet V's token order.
// 0: K rows in V's token order, so movmatrix alone turns S into P's fragment, but a warp's K
// load touches 16 lines for one 32-byte sector each. H200 (notes/kernel-notes.md): 1 halves
// the L2 tag lookups (71% -> 41% of peak at 8 x 32k, L2 hits 18% -> 3%) and is 3.4% faster
// (geomean; 4% at batch >= 8), so it is the default; -DCPA_K_WHOLE_LINES=0 for the A/B.
#ifndef CPA_K_WHOLE_LINES
#define CPA_K_WHOLE_LINES 1
#endif

// Heads in the n = 8 dimension (NT tiles of 8 for GQA up to 16), tokens in m = 16.
// Lane = 4 * g + t. A step is 32 tokens = two m16 tiles. Thread (g, t) loads
//   K rows:  tokens 16 i + g + {0, 8}  (tile i; CPA_K_WHOLE_LINES=0: 8 (g >> 1) + (g & 1) +
//            {0, 2} + 4 i), head dims (4p + t) X + [0, X)
//   V rows:  head dims 16 m + g + {0, 8},  tokens 8 t + [0, 8)
// With CPA_K_WHOLE_LINES=0 the token order inside each m16 tile is the k-slot order that the
// transposed (movmatrix) score fragment has as the B operand of P x V; with 1, movmatrix
// leaves lane t the token pairs 4 j + t (j = 2 i + half) where V has 4 t + j: a quad
// transpose of the four P registers fixes that.
template <class T, int HEAD, int BLOCK, bool FP8, int NT, bool K8>
struct MmaTiles {
  using KV_ = PagedKV<HEAD, BLOCK, FP8>;
  static constexpr int NTILE = 2;           // m16 token tiles per step
  static constexpr int TOKENS = 16 * NTILE;
  static constexpr int HEADS_CAP = 8 * NT;
  static constexpr int X = KV_::X;          // head dims per 16-byte key load
  static constexpr int KR = X / 2;          // packed registers per key load
  static constexpr int KG = HEAD / (4 * X); // key loads per token row
  static constexpr int MT = HEAD / 16;      // m16 tiles of head dims in P x V
  static constexpr int VR = 2 * NTILE;      // packed registers per V row and lane
  static constexpr int NS = NTILE * NT * 4;
  static constexpr int NO = MT * NT * 4;
  static constexpr int LH = 2 * NT;
  static_assert(HEAD % (4 * X) == 0, "head size must be a multiple of 4 key chunks");

  struct Q { uint32_t r[NT][KG][KR]; };
  struct KV {
    uint32_t k[NTILE][2][KG][KR];  // [tile][row g, g+8][load][reg]
    uint32_t v[MT][2][VR];         // [d tile][row g, g+8][reg]: tokens 8 t + 2 reg + {0,1}
  };

  CPA_DEVICE static int g_() { return lane_id() >> 2; }
  CPA_DEVICE static int t_() { return lane_id() & 3; }
  // One k16 step: A rows g / g + 8 as pairs (r0 lo, r1 lo, r0 hi, r1 hi), B (b0, b1): one
  // m16n8k16, or (K8, mfma4) two m16n8k8 in k order.
  CPA_DEVICE static void kstep16(float (&acc)[4], uint32_t r0lo, uint32_t r1lo, uint32_t r0hi, uint32_t r1hi,
                                 uint32_t b0, uint32_t b1) {
    if constexpr (K8) {
      mma_m16n8k8<T>(acc, r0lo, r1lo, b0);
      mma_m16n8k8<T>(acc, r0hi, r1hi, b1);
    } else {
      const uint32_t a[4] = {r0lo, r1lo, r0hi, r1hi};
      const uint32_t b[2] = {b0, b1};
      mma_m16n8k16<T>(acc, a, b);
    }
  }

  CPA_DEVICE static void load_q(Q& q, const uint16_t* qg, int gqa, void*) {
    const int g = g_(), t = t_();
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int h = nt * 8 + g;
#pragma unroll
      for (int p = 0; p < KG; ++p) {
#pragma unroll
        for (int c = 0; c < KR; c += 4) {
          u32x4 w = {0u, 0u, 0u, 0u};
          if (h < gqa) w = load16(qg + h * HEAD + (4 * p + t) * X + 2 * c);
          q.r[nt][p][c] = w.x; q.r[nt][p][c + 1] = w.y;
          q.r[nt][p][c + 2] = w.z; q.r[nt][p][c + 3] = w.w;
        }
      }
    }
  }

  CPA_DEVICE static int s_token(int e) {  // e = (tile * NT + nt) * 4 + c
    const int g = g_(), tile = e / (4 * NT), c = e & 3;
    if constexpr (CPA_K_WHOLE_LINES) return 16 * tile + g + 8 * (c >> 1);
    return 8 * (g >> 1) + (g & 1) + 2 * (c >> 1) + 4 * tile;
  }
  CPA_DEVICE static constexpr int s_lhead(int e) { return ((e / 4) % NT) * 2 + (e & 1); }
  CPA_DEVICE static constexpr int o_lhead(int e) { return ((e / 4) % NT) * 2 + (e & 1); }
  CPA_DEVICE static int lhead(int lh) { return (lh >> 1) * 8 + 2 * t_() + (lh & 1); }
  CPA_DEVICE static void o_coord(int e, int& h, int& d) {  // e = (mt * NT + nt) * 4 + c
    const int c = e & 3, nt = (e / 4) % NT, mt = e / (4 * NT);
    h = nt * 8 + 2 * t_() + (c & 1);
    d = 16 * mt + g_() + 8 * (c >> 1);
  }
  CPA_DEVICE static bool writer() { return true; }
  CPA_DEVICE static bool lh_writer() { return g_() == 0; }

  CPA_DEVICE static float reduce_max(float x) {
    x = fmaxf_(x, shfl_xor(x, 4)); x = fmaxf_(x, shfl_xor(x, 8)); return fmaxf_(x, shfl_xor(x, 16));
  }
  CPA_DEVICE static float reduce_sum(float x) {
    x += shfl_xor(x, 4); x += shfl_xor(x, 8); return x + shfl_xor(x, 16);
  }

  // The step's K and V from the cache (Src = KV_) or from its staged copy in shared memory
  // (Src = Staged): the same lane mapping either way.
  using Staged = typename std::conditional<CPA_KV_ASYNC == 3, RingKV<HEAD, BLOCK, FP8, TOKENS>,
                                           StagedKV<HEAD, BLOCK, FP8, TOKENS>>::type;
  template <int PARTS = kLoadKV, class Src>
  CPA_DEVICE static void load_kv(KV& kv, const Src& c, int tok0, bool partial) {
    constexpr bool S = Src::kShared;
    const int g = g_(), t = t_();
    if constexpr (PARTS & kLoadK) {
      if constexpr (CPA_K_WHOLE_LINES) {
#pragma unroll
        for (int i = 0; i < NTILE; ++i) {
          static_assert(BLOCK % 16 == 0, "a tile's 16 tokens lie in one block");
          const int ktok = tok0 + 16 * i + g;
          const int64_t kb = c.block_offset(ktok);
#pragma unroll
          for (int rr = 0; rr < 2; ++rr)
#pragma unroll
            for (int p = 0; p < KG; ++p)
              load_chunk<T, FP8, S>(kv.k[i][rr][p], c.k_ptr(kb, ktok + 8 * rr, (4 * p + t) * X));
        }
      } else {
        const int ktok = tok0 + 8 * (g >> 1) + (g & 1);
        const int64_t kb = c.block_offset(ktok);
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int rr = 0; rr < 2; ++rr)
#pragma unroll
            for (int p = 0; p < KG; ++p)
              load_chunk<T, FP8, S>(kv.k[i][rr][p], c.k_ptr(kb, ktok + 2 * rr + 4 * i, (4 * p + t) * X));
      }
    }
    if constexpr (!(PARTS & kLoadV)) return;
    const int vtok = tok0 + 8 * t;
    const int64_t vb = c.block_offset(vtok);
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) load8_elems<T, FP8, S>(kv.v[m][rr], c.v_ptr(vb, 16 * m + g + 8 * rr, vtok));
    if (partial) {
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int rr = 0; rr < 2; ++rr)
#pragma unroll
          for (int u = 0; u < VR; ++u) kv.v[m][rr][u] = mask_pair(kv.v[m][rr][u], vtok + 2 * u, c.seq_len);
    }
  }

  CPA_DEVICE static void qk(float (&s)[NS], const Q& q, const KV& kv, void*) {
#pragma unroll
    for (int e = 0; e < NS; ++e) s[e] = 0.f;
#pragma unroll
    for (int i = 0; i < NTILE; ++i)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        float(&acc)[4] = *reinterpret_cast<float(*)[4]>(&s[(i * NT + nt) * 4]);
#pragma unroll
        for (int p = 0; p < KG; ++p)
#pragma unroll
          for (int j = 0; j < KR / 2; ++j)
            kstep16(acc, kv.k[i][0][p][2 * j], kv.k[i][1][p][2 * j], kv.k[i][0][p][2 * j + 1], kv.k[i][1][p][2 * j + 1],
                    q.r[nt][p][2 * j], q.r[nt][p][2 * j + 1]);
      }
  }

  CPA_DEVICE static void pv(float (&o)[NO], const float (&pf)[NS], const KV& kv, void*) {
    // Scores are [token row][head col]; P x V needs [head][token] per lane: transpose the
    // two 8x8 halves of each m16 tile with movmatrix.
    uint32_t pb[NTILE][NT][2];
#pragma unroll
    for (int i = 0; i < NTILE; ++i)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const float* sc = &pf[(i * NT + nt) * 4];
        pb[i][nt][0] = movmatrix_trans(T::pack(sc[0], sc[1]));
        pb[i][nt][1] = movmatrix_trans(T::pack(sc[2], sc[3]));
      }
    if constexpr (CPA_K_WHOLE_LINES) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        uint32_t r[4] = {pb[0][nt][0], pb[0][nt][1], pb[1][nt][0], pb[1][nt][1]};
        quad_transpose4(r);
        pb[0][nt][0] = r[0]; pb[0][nt][1] = r[1]; pb[1][nt][0] = r[2]; pb[1][nt][1] = r[3];
      }
    }
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        float(&acc)[4] = *reinterpret_cast<float(*)[4]>(&o[(m * NT + nt) * 4]);
#pragma unroll
        for (int i = 0; i < NTILE; ++i)
          kstep16(acc, kv.v[m][0][2 * i], kv.v[m][1][2 * i], kv.v[m][0][2 * i + 1], kv.v[m][1][2 * i + 1],
                  pb[i][nt][0], pb[i][nt][1]);
      }
  }
  static constexpr int SMEM_BYTES = 0;
};
#endif  // CPA_CUDA

// ============================================================== AMD: MFMA
#if CPA_HIP
// v_mfma_f32_16x16x16: lane l = 16 q + r. A[i = r][k = 4q + 0..3], B[k = 4q + 0..3][j = r],
// D[i = 4q + 0..3][j = r]. Tokens in i (QK) and k (PV), heads in j: the QK result is
// already the B operand of P x V, so no data moves between lanes. Step = 32 tokens.
//   K rows: token 8 (r >> 2) + 4 i + (r & 3) of tile i, head dims (4p + q) X + [0, X)
//   V rows: head dims 16 m + r, tokens 8 q + [0, 8)
template <class T, int HEAD, int BLOCK, bool FP8>
struct Mfma16Tiles {
  using KV_ = PagedKV<HEAD, BLOCK, FP8>;
  static constexpr int TOKENS = 32;
  static constexpr int HEADS_CAP = 16;
  static constexpr int X = KV_::X;
  static constexpr int KR = X / 2;
  static constexpr int KG = HEAD / (4 * X);
  static constexpr int MT = HEAD / 16;
  static constexpr int NS = 8;
  static constexpr int NO = MT * 4;
  static constexpr int LH = 1;
  static_assert(HEAD % (4 * X) == 0, "head size must be a multiple of 4 key chunks");

  struct Q { uint32_t r[KG][KR]; };
  struct KV { uint32_t k[2][KG][KR]; uint32_t v[MT][4]; };

  CPA_DEVICE static int r_() { return lane_id() & 15; }
  CPA_DEVICE static int q_() { return lane_id() >> 4; }

  CPA_DEVICE static void load_q(Q& q, const uint16_t* qg, int gqa, void*) {
    const int h = r_(), qq = q_();
#pragma unroll
    for (int p = 0; p < KG; ++p)
#pragma unroll
      for (int c = 0; c < KR; c += 4) {
        u32x4 w = {0u, 0u, 0u, 0u};
        if (h < gqa) w = load16(qg + h * HEAD + (4 * p + qq) * X + 2 * c);
        q.r[p][c] = w.x; q.r[p][c + 1] = w.y; q.r[p][c + 2] = w.z; q.r[p][c + 3] = w.w;
      }
  }
  CPA_DEVICE static int s_token(int e) { return 8 * q_() + 4 * (e >> 2) + (e & 3); }
  CPA_DEVICE static constexpr int s_lhead(int) { return 0; }
  CPA_DEVICE static constexpr int o_lhead(int) { return 0; }
  CPA_DEVICE static int lhead(int) { return r_(); }
  CPA_DEVICE static void o_coord(int e, int& h, int& d) { h = r_(); d = 16 * (e >> 2) + 4 * q_() + (e & 3); }
  CPA_DEVICE static bool writer() { return true; }
  CPA_DEVICE static bool lh_writer() { return q_() == 0; }
  CPA_DEVICE static float reduce_max(float x) { x = fmaxf_(x, shfl_xor(x, 16)); return fmaxf_(x, shfl_xor(x, 32)); }
  CPA_DEVICE static float reduce_sum(float x) { x += shfl_xor(x, 16); return x + shfl_xor(x, 32); }

  template <int PARTS = kLoadKV, class Src = KV_>
  CPA_DEVICE static void load_kv(KV& kv, const Src& c, int tok0, bool partial) {
    const int r = r_(), qq = q_();
    if constexpr (PARTS & kLoadK) {
    const int ktok = tok0 + 8 * (r >> 2) + (r & 3);
    const int64_t kb = c.block_offset(ktok);
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int p = 0; p < KG; ++p) load_chunk<T, FP8>(kv.k[i][p], c.k_ptr(kb, ktok + 4 * i, (4 * p + qq) * X));
    }
    if constexpr (!(PARTS & kLoadV)) return;
    const int vtok = tok0 + 8 * qq;
    const int64_t vb = c.block_offset(vtok);
#pragma unroll
    for (int m = 0; m < MT; ++m) load8_elems<T, FP8>(kv.v[m], c.v_ptr(vb, 16 * m + r, vtok));
    if (partial) {
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int u = 0; u < 4; ++u) kv.v[m][u] = mask_pair(kv.v[m][u], vtok + 2 * u, c.seq_len);
    }
  }
  CPA_DEVICE static void qk(float (&s)[NS], const Q& q, const KV& kv, void*) {
#pragma unroll
    for (int e = 0; e < NS; ++e) s[e] = 0.f;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float(&acc)[4] = *reinterpret_cast<float(*)[4]>(&s[4 * i]);
#pragma unroll
      for (int p = 0; p < KG; ++p)
#pragma unroll
        for (int j = 0; j < KR / 2; ++j)
          mfma<MfmaShape::k16x16x16, T>(acc, kv.k[i][p][2 * j], kv.k[i][p][2 * j + 1], q.r[p][2 * j], q.r[p][2 * j + 1]);
    }
  }
  CPA_DEVICE static void pv(float (&o)[NO], const float (&pf)[NS], const KV& kv, void*) {
    uint32_t pb[2][2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      pb[i][0] = T::pack(pf[4 * i], pf[4 * i + 1]);
      pb[i][1] = T::pack(pf[4 * i + 2], pf[4 * i + 3]);
    }
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      float(&acc)[4] = *reinterpret_cast<float(*)[4]>(&o[4 * m]);
#pragma unroll
      for (int i = 0; i < 2; ++i) mfma<MfmaShape::k16x16x16, T>(acc, kv.v[m][2 * i], kv.v[m][2 * i + 1], pb[i][0], pb[i][1]);
    }
  }
  static constexpr int SMEM_BYTES = 0;
};

// v_mfma_f32_4x4x4_16b: 16 independent 4x4x4 blocks, lane l = 4 b + c in block b.
// A_b[i = c][k], B_b[k][j = c], D_b[i = 0..3][j = c]. Each block takes 4 tokens in QK, so a
// step is 64 tokens with lane = token there, heads (GQA <= 4) in j: lane 4 b + c ends QK with
// P[head c][tokens 4 b + 0..3]. In P x V each block takes 4 head dims instead (dims
// 64 p + 4 b + i in i, tokens in k, heads in j), so a lane's output is 4 dims x one head per
// 64 dims -- 8 accumulators at head 128, where summing partial outputs over the token blocks
// held 128 per lane (459 registers: 1 wave per SIMD) and cost 512 permutes per partition.
// Every block then needs P of all 64 tokens: each lane puts its 4 values in a per-wave LDS
// row per head (512 bytes) and reads its head's row back (8 x 16 bytes, a broadcast).
template <class T, int HEAD, int BLOCK, bool FP8, int NW>
struct Mfma4Tiles {
  using KV_ = PagedKV<HEAD, BLOCK, FP8>;
  static constexpr int TOKENS = 64;
  static constexpr int HEADS_CAP = 4;
  static constexpr int X = KV_::X;
  static constexpr int KR = X / 2;
  static constexpr int KL = HEAD / X;   // key loads per token
  static constexpr int MP = HEAD / 64;  // 64-dim passes of P x V
  static constexpr int NS = 4;
  static constexpr int NO = MP * 4;
  static constexpr int LH = 1;
  static constexpr int ROW_BYTES = HEADS_CAP * TOKENS * 2;  // P of one step, [head][token] 16-bit
  static constexpr int SMEM_BYTES = NW * ROW_BYTES;
  static_assert(HEAD % 64 == 0, "mfma4 takes head dims 64 at a time in P x V");

  struct Q { uint32_t r[KL][KR]; };
  // v[p][j]: head dim 64 p + lane, tokens 8 j + 0..7 of the step (two 4-token k groups)
  struct KV { uint32_t k[KL][KR]; uint32_t v[MP][TOKENS / 8][4]; };

  CPA_DEVICE static int b_() { return lane_id() >> 2; }
  CPA_DEVICE static int c_() { return lane_id() & 3; }

  CPA_DEVICE static void load_q(Q& q, const uint16_t* qg, int gqa, void*) {
    const int h = c_();
#pragma unroll
    for (int p = 0; p < KL; ++p)
#pragma unroll
      for (int c = 0; c < KR; c += 4) {
        u32x4 w = {0u, 0u, 0u, 0u};
        if (h < gqa) w = load16(qg + h * HEAD + p * X + 2 * c);
        q.r[p][c] = w.x; q.r[p][c + 1] = w.y; q.r[p][c + 2] = w.z; q.r[p][c + 3] = w.w;
      }
  }
  CPA_DEVICE static int s_token(int e) { return 4 * b_() + e; }
  CPA_DEVICE static constexpr int s_lhead(int) { return 0; }
  CPA_DEVICE static constexpr int o_lhead(int) { return 0; }
  CPA_DEVICE static int lhead(int) { return c_(); }
  CPA_DEVICE static void o_coord(int e, int& h, int& d) { h = c_(); d = 64 * (e >> 2) + 4 * b_() + (e & 3); }
  CPA_DEVICE static bool writer() { return true; }
  CPA_DEVICE static bool lh_writer() { return b_() == 0; }
  CPA_DEVICE static float reduce_max(float x) {
#pragma unroll
    for (int m = 4; m < 64; m <<= 1) x = fmaxf_(x, shfl_xor(x, m));
    return x;
  }
  CPA_DEVICE static float reduce_sum(float x) {
#pragma unroll
    for (int m = 4; m < 64; m <<= 1) x += shfl_xor(x, m);
    return x;
  }
  template <int PARTS = kLoadKV, class Src = KV_>
  CPA_DEVICE static void load_kv(KV& kv, const Src& c, int tok0, bool partial) {
    if constexpr (PARTS & kLoadK) {
    const int ktok = tok0 + lane_id();
    const int64_t kb = c.block_offset(ktok);
#pragma unroll
    for (int p = 0; p < KL; ++p) load_chunk<T, FP8>(kv.k[p], c.k_ptr(kb, ktok, p * X));
    }
    if constexpr (!(PARTS & kLoadV)) return;
    // every lane reads all 64 tokens of its dims: the step's blocks, one table entry each
    constexpr int NB = TOKENS / BLOCK > 0 ? TOKENS / BLOCK : 1, CH = BLOCK / 8 < 8 ? BLOCK / 8 : 8;
#pragma unroll
    for (int bi = 0; bi < NB; ++bi) {
      const int64_t vb = c.block_offset(tok0 + bi * BLOCK);
#pragma unroll
      for (int j = 0; j < CH; ++j) {
        const int tok = tok0 + bi * BLOCK + 8 * j;
#pragma unroll
        for (int p = 0; p < MP; ++p) load8_elems<T, FP8>(kv.v[p][bi * CH + j], c.v_ptr(vb, 64 * p + lane_id(), tok));
      }
    }
    if (partial) {
#pragma unroll
      for (int p = 0; p < MP; ++p)
#pragma unroll
        for (int j = 0; j < TOKENS / 8; ++j)
#pragma unroll
          for (int u = 0; u < 4; ++u) kv.v[p][j][u] = mask_pair(kv.v[p][j][u], tok0 + 8 * j + 2 * u, c.seq_len);
    }
  }
  CPA_DEVICE static void qk(float (&s)[NS], const Q& q, const KV& kv, void*) {
#pragma unroll
    for (int e = 0; e < NS; ++e) s[e] = 0.f;
#pragma unroll
    for (int p = 0; p < KL; ++p)
#pragma unroll
      for (int j = 0; j < KR / 2; ++j) mfma<MfmaShape::k4x4x4_16b, T>(s, kv.k[p][2 * j], kv.k[p][2 * j + 1], q.r[p][2 * j], q.r[p][2 * j + 1]);
  }
  CPA_DEVICE static void pv(float (&o)[NO], const float (&pf)[NS], const KV& kv, void* smem) {
    uint8_t* rows = reinterpret_cast<uint8_t*>(smem) + wave_id() * ROW_BYTES;
    wave_sync();  // the previous step's reads of the rows are done
    uint32_t* mine = reinterpret_cast<uint32_t*>(rows + (c_() * TOKENS + 4 * b_()) * 2);
    mine[0] = T::pack(pf[0], pf[1]);
    mine[1] = T::pack(pf[2], pf[3]);
    wave_sync();
    uint32_t pb[TOKENS / 2];  // P[head c][tokens 0..63], packed pairs
#pragma unroll
    for (int i = 0; i < TOKENS / 8; ++i) {
      const u32x4 w = lds16(rows + c_() * TOKENS * 2 + 16 * i);
      pb[4 * i] = w.x; pb[4 * i + 1] = w.y; pb[4 * i + 2] = w.z; pb[4 * i + 3] = w.w;
    }
#pragma unroll
    for (int p = 0; p < MP; ++p) {
      float(&acc)[4] = *reinterpret_cast<float(*)[4]>(&o[4 * p]);
#pragma unroll
      for (int g = 0; g < TOKENS / 4; ++g)  // tokens 4 g + 0..3: A = V[dims][tokens], B = P[tokens][heads]
        mfma<MfmaShape::k4x4x4_16b, T>(acc, kv.v[p][g >> 1][2 * (g & 1)], kv.v[p][g >> 1][2 * (g & 1) + 1],
                                       pb[2 * g], pb[2 * g + 1]);
    }
  }
};
#endif  // CPA_HIP

// ============================================================== portable: no matrix cores
// QK with lane = token (the full head row of K per lane, q broadcast from shared memory);
// P goes through shared memory; P x V with lane = head dims d = lane + WAVE j, eight
// tokens per 16-byte V load. Every lane holds every head of the group.
template <class T, int HEAD, int BLOCK, bool FP8, int CAP, int NUM_WAVES>
struct ScalarTiles {
  using KV_ = PagedKV<HEAD, BLOCK, FP8>;
  static constexpr int TOKENS = kWave;
  static constexpr int HEADS_CAP = CAP;
  static constexpr int X = KV_::X;
  static constexpr int KL = HEAD / X;      // 16-byte key loads per token
  static constexpr int DJ = HEAD / kWave;  // head dims per lane in P x V
  static constexpr int VL = kWave / 8;     // 8-token V loads per row per step
  static constexpr int NS = CAP;
  static constexpr int NO = CAP * DJ;
  static constexpr int LH = CAP;
  static_assert(HEAD % kWave == 0, "head size must be a multiple of the wave size");
  // shared memory: q as fp32 [CAP][HEAD], then P as fp32 [NUM_WAVES][CAP][TOKENS]
  static constexpr int SMEM_BYTES = (CAP * HEAD + NUM_WAVES * CAP * kWave) * 4;

  struct Q { int gqa; };
  struct KV { uint32_t k[KL][X / 2]; uint32_t v[DJ][VL][4]; };

  CPA_DEVICE static void load_q(Q& q, const uint16_t* qg, int gqa, void* smem) {
    float* qs = reinterpret_cast<float*>(smem);
    for (int i = thread_idx(); i < CAP * HEAD; i += NUM_WAVES * kWave)
      qs[i] = (i / HEAD) < gqa ? T::to_float(qg[i]) : 0.f;
    q.gqa = gqa;
    barrier();
  }
  CPA_DEVICE static int s_token(int) { return lane_id(); }
  CPA_DEVICE static constexpr int s_lhead(int e) { return e; }
  CPA_DEVICE static constexpr int o_lhead(int e) { return e / DJ; }
  CPA_DEVICE static int lhead(int lh) { return lh; }
  CPA_DEVICE static void o_coord(int e, int& h, int& d) { h = e / DJ; d = lane_id() + kWave * (e % DJ); }
  CPA_DEVICE static bool writer() { return true; }
  CPA_DEVICE static bool lh_writer() { return lane_id() == 0; }
  CPA_DEVICE static float reduce_max(float x) {
#pragma unroll
    for (int m = 1; m < kWave; m <<= 1) x = fmaxf_(x, shfl_xor(x, m));
    return x;
  }
  CPA_DEVICE static float reduce_sum(float x) {
#pragma unroll
    for (int m = 1; m < kWave; m <<= 1) x += shfl_xor(x, m);
    return x;
  }

  template <int PARTS = kLoadKV, class Src = KV_>
  CPA_DEVICE static void load_kv(KV& kv, const Src& c, int tok0, bool partial) {
    if constexpr (PARTS & kLoadK) {
    const int ktok = tok0 + lane_id();
    const int64_t kb = c.block_offset(ktok);
#pragma unroll
    for (int p = 0; p < KL; ++p) load_chunk<T, FP8>(kv.k[p], c.k_ptr(kb, ktok, p * X));
    }
    if constexpr (!(PARTS & kLoadV)) return;
#pragma unroll
    for (int u = 0; u < VL; ++u) {
      const int vtok = tok0 + 8 * u;
      const int64_t vb = c.block_offset(vtok);
#pragma unroll
      for (int j = 0; j < DJ; ++j) load8_elems<T, FP8>(kv.v[j][u], c.v_ptr(vb, lane_id() + kWave * j, vtok));
      if (partial) {
#pragma unroll
        for (int j = 0; j < DJ; ++j)
#pragma unroll
          for (int w = 0; w < 4; ++w) kv.v[j][u][w] = mask_pair(kv.v[j][u][w], vtok + 2 * w, c.seq_len);
      }
    }
  }
  CPA_DEVICE static void qk(float (&s)[NS], const Q& q, const KV& kv, void* smem) {
    const float* qs = reinterpret_cast<const float*>(smem);
#pragma unroll
    for (int h = 0; h < CAP; ++h) s[h] = 0.f;
#pragma unroll
    for (int p = 0; p < KL; ++p) {
      float kf[X];
#pragma unroll
      for (int r = 0; r < X / 2; ++r) { kf[2 * r] = lo_f<T>(kv.k[p][r]); kf[2 * r + 1] = hi_f<T>(kv.k[p][r]); }
#pragma unroll
      for (int h = 0; h < CAP; ++h) {
        if (h < q.gqa) {
          const float* qh = qs + h * HEAD + p * X;
#pragma unroll
          for (int r = 0; r < X; ++r) s[h] += qh[r] * kf[r];
        }
      }
    }
  }
  CPA_DEVICE static void pv(float (&o)[NO], const float (&pf)[NS], const KV& kv, void* smem) {
    // this wave's P tile [CAP][TOKENS]: lane = token writes, every lane reads all tokens
    float* ps = reinterpret_cast<float*>(smem) + CAP * HEAD + wave_id() * CAP * kWave;
#pragma unroll
    for (int h = 0; h < CAP; ++h) ps[h * kWave + lane_id()] = pf[h];
    wave_sync();
#pragma unroll
    for (int j = 0; j < DJ; ++j)
#pragma unroll
      for (int u = 0; u < VL; ++u) {
        float vf[8];
#pragma unroll
        for (int r = 0; r < 4; ++r) { vf[2 * r] = lo_f<T>(kv.v[j][u][r]); vf[2 * r + 1] = hi_f<T>(kv.v[j][u][r]); }
#pragma unroll
        for (int h = 0; h < CAP; ++h) {
          const float* ph = ps + h * kWave + 8 * u;
          float acc = o[h * DJ + j];
#pragma unroll
          for (int r = 0; r < 8; ++r) acc += ph[r] * vf[r];
          o[h * DJ + j] = acc;
        }
      }
    wave_sync();
  }
};

// ---------------------------------------------------------------- tiling selection
template <class Tag, class T, int HEAD, int BLOCK, bool FP8, int CAP, int NUM_WAVES>
struct TilingFor;

#if CPA_CUDA
template <class T, int HEAD, int BLOCK, bool FP8, int CAP, int NW>
struct TilingFor<TilingMfma16, T, HEAD, BLOCK, FP8, CAP, NW> {
  static_assert(CAP == 8 || CAP == 16, "mma tilings hold 8 or 16 heads");
  using type = MmaTiles<T, HEAD, BLOCK, FP8, CAP / 8, false>;
};
template <class T, int HEAD, int BLOCK, bool FP8, int CAP, int NW>
struct TilingFor<TilingMfma4, T, HEAD, BLOCK, FP8, CAP, NW> {
  static_assert(CAP == 8 || CAP == 16, "mma tilings hold 8 or 16 heads");
  using type = MmaTiles<T, HEAD, BLOCK, FP8, CAP / 8, true>;
};
#else
template <class T, int HEAD, int BLOCK, bool FP8, int CAP, int NW>
struct TilingFor<TilingMfma16, T, HEAD, BLOCK, FP8, CAP, NW> {
  static_assert(CAP == 16, "mfma16 holds 16 heads");
  using type = Mfma16Tiles<T, HEAD, BLOCK, FP8>;
};
template <class T, int HEAD, int BLOCK, bool FP8, int CAP, int NW>
struct TilingFor<TilingMfma4, T, HEAD, BLOCK, FP8, CAP, NW> {
  static_assert(CAP == 4, "mfma4 holds 4 heads");
  using type = Mfma4Tiles<T, HEAD, BLOCK, FP8, NW>;
};
#endif
template <class T, int HEAD, int BLOCK, bool FP8, int CAP, int NW>
struct TilingFor<TilingScalar, T, HEAD, BLOCK, FP8, CAP, NW> {
  using type = ScalarTiles<T, HEAD, BLOCK, FP8, CAP, NW>;
};

}  // namespace cpa
