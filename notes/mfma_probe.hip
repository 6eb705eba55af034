// mfma_probe.hip -- minimal, self-contained MFMA probe for gfx942 (MI300X) / gfx90a (MI250X).
// Compile-only on a CPU box with Debian clang-19 + libamdhip64-dev (HIP 5.2 headers, no device libs):
//
//   clang++-19 -x hip --offload-arch=gfx942 --cuda-device-only -O3 -nogpulib \
//       -Rpass-analysis=kernel-resource-usage -S mfma_probe.hip -o mfma_probe.s
//   # link check (fails on any unresolved __ockl_*/__ocml_* symbol):
//   clang++-19 -x hip --offload-arch=gfx942 --cuda-device-only -O3 -nogpulib \
//       --no-gpu-bundle-output -c mfma_probe.hip -o mfma_probe.co
//
// Every kernel is launched with ONE wave64 (blockDim = 64). All matrices are row-major in memory.
// The lane layouts used below are those written up in amd-mfma.md (verified against the
// AMD Matrix Instruction Calculator placement rules and vLLM / composable_kernel usage).
//
// Deliberately avoids threadIdx/blockIdx/blockDim/__syncthreads: with the HIP 5.2 headers in
// /usr/include/hip those call __ockl_* / __atomic_work_item_fence, which only exist in the ROCm
// device libraries (absent here, -nogpulib) -> unresolved symbols. Builtins are used instead.

#include <hip/hip_runtime.h>  // works (found as "HIP installation: /usr, version 5.2.21153")

typedef _Float16 half4_t  __attribute__((ext_vector_type(4)));  // A/B of *_f16 MFMAs (clang: v4 __fp16)
typedef short    short4_t __attribute__((ext_vector_type(4)));  // A/B of *_bf16_1k MFMAs (raw bf16 bits)
typedef float    float4_t __attribute__((ext_vector_type(4)));  // C/D accumulator of all four MFMAs

#define LANE() ((int)__builtin_amdgcn_workitem_id_x())  // == lane id for a 64-thread block

// ---------------------------------------------------------------------------------------------
// v_mfma_f32_16x16x16_f16  (gfx90a spelling: v_mfma_f32_16x16x16f16)
//   lane l, vector element r (r = 0..3):
//     a[r] = A[i = l%16][k = 4*(l/16) + r]
//     b[r] = B[k = 4*(l/16) + r][j = l%16]
//     d[r] = D[i = 4*(l/16) + r][j = l%16]
// ---------------------------------------------------------------------------------------------
__global__ __launch_bounds__(64) void mfma16x16x16_f16(const _Float16* __restrict__ A,  // 16x16
                                                        const _Float16* __restrict__ B,  // 16x16
                                                        float* __restrict__ D) {         // 16x16
  const int l = LANE(), row = l % 16, kq = 4 * (l / 16);
  half4_t a, b;
  for (int r = 0; r < 4; ++r) {
    a[r] = A[row * 16 + kq + r];
    b[r] = B[(kq + r) * 16 + row];
  }
  float4_t acc = {0.f, 0.f, 0.f, 0.f};
  acc = __builtin_amdgcn_mfma_f32_16x16x16f16(a, b, acc, /*cbsz*/ 0, /*abid*/ 0, /*blgp*/ 0);
  for (int r = 0; r < 4; ++r) D[(kq + r) * 16 + row] = acc[r];
}

// v_mfma_f32_16x16x16_bf16 (gfx90a spelling: v_mfma_f32_16x16x16bf16_1k) -- same layout, bf16 bits.
__global__ __launch_bounds__(64) void mfma16x16x16_bf16(const unsigned short* __restrict__ A,
                                                         const unsigned short* __restrict__ B,
                                                         float* __restrict__ D) {
  const int l = LANE(), row = l % 16, kq = 4 * (l / 16);
  short4_t a, b;
  for (int r = 0; r < 4; ++r) {
    a[r] = (short)A[row * 16 + kq + r];
    b[r] = (short)B[(kq + r) * 16 + row];
  }
  float4_t acc = {0.f, 0.f, 0.f, 0.f};
  acc = __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(a, b, acc, 0, 0, 0);
  for (int r = 0; r < 4; ++r) D[(kq + r) * 16 + row] = acc[r];
}

// ---------------------------------------------------------------------------------------------
// v_mfma_f32_4x4x4_16b_f16 (gfx90a spelling: v_mfma_f32_4x4x4f16): 16 independent 4x4x4 blocks.
//   lane l, block b = l/4, vector element r:
//     a[r] = A_b[i = l%4][k = r]
//     b[r] = B_b[k = r][j = l%4]
//     d[r] = D_b[i = r][j = l%4]
//   Here A_b/B_b/D_b are 4x4 row-major tiles stored back to back (16 floats/halves apart).
// ---------------------------------------------------------------------------------------------
__global__ __launch_bounds__(64) void mfma4x4x4_f16_16blocks(const _Float16* __restrict__ A,  // 16 x (4x4)
                                                              const _Float16* __restrict__ B,  // 16 x (4x4)
                                                              float* __restrict__ D) {         // 16 x (4x4)
  const int l = LANE(), blk = l / 4, c = l % 4;
  half4_t a, b;
  for (int r = 0; r < 4; ++r) {
    a[r] = A[blk * 16 + c * 4 + r];  // A_blk[c][r]
    b[r] = B[blk * 16 + r * 4 + c];  // B_blk[r][c]
  }
  float4_t acc = {0.f, 0.f, 0.f, 0.f};
  acc = __builtin_amdgcn_mfma_f32_4x4x4f16(a, b, acc, 0, 0, 0);
  for (int r = 0; r < 4; ++r) D[blk * 16 + r * 4 + c] = acc[r];  // D_blk[r][c]
}

// Broadcast of A across blocks: cbsz=4 (2^4 = 16 receiving blocks), abid=x -> every block uses
// A_x (the A values held by lanes 4x..4x+3). Result: D_b = A_x * B_b for all b, i.e. one 4x4
// A tile times a 4x64 B panel ("4x64" mode used by composable_kernel and vLLM paged attention).
// There is no equivalent single-block broadcast for B: BLGP only moves whole 16-lane groups
// (= 4 blocks). To broadcast B, swap roles (compute D^T = B^T A^T) so B becomes src0.
__global__ __launch_bounds__(64) void mfma4x4x4_f16_bcastA(const _Float16* __restrict__ A,  // one 4x4 tile
                                                            const _Float16* __restrict__ B,  // 4 x 64
                                                            float* __restrict__ D) {         // 4 x 64
  const int l = LANE(), blk = l / 4, c = l % 4;
  half4_t a, b;
  for (int r = 0; r < 4; ++r) {
    a[r] = (blk == 0) ? A[c * 4 + r] : (_Float16)0.f;  // only block 0's lanes (0..3) matter
    b[r] = B[r * 64 + l];                               // B_blk[r][c] = B[r][4*blk + c] = B[r][l]
  }
  float4_t acc = {0.f, 0.f, 0.f, 0.f};
  acc = __builtin_amdgcn_mfma_f32_4x4x4f16(a, b, acc, /*cbsz*/ 4, /*abid*/ 0, /*blgp*/ 0);
  for (int r = 0; r < 4; ++r) D[r * 64 + l] = acc[r];  // D[r][l] = sum_k A[r][k] * B[k][l]
}

// bf16 twin: v_mfma_f32_4x4x4_16b_bf16 (gfx90a: v_mfma_f32_4x4x4bf16_1k), same layout.
__global__ __launch_bounds__(64) void mfma4x4x4_bf16_16blocks(const unsigned short* __restrict__ A,
                                                               const unsigned short* __restrict__ B,
                                                               float* __restrict__ D) {
  const int l = LANE(), blk = l / 4, c = l % 4;
  short4_t a, b;
  for (int r = 0; r < 4; ++r) {
    a[r] = (short)A[blk * 16 + c * 4 + r];
    b[r] = (short)B[blk * 16 + r * 4 + c];
  }
  float4_t acc = {0.f, 0.f, 0.f, 0.f};
  acc = __builtin_amdgcn_mfma_f32_4x4x4bf16_1k(a, b, acc, 0, 0, 0);
  for (int r = 0; r < 4; ++r) D[blk * 16 + r * 4 + c] = acc[r];
}

// ---------------------------------------------------------------------------------------------
// Misc. device features that DO work with -nogpulib (no ocml/ockl needed).
// ---------------------------------------------------------------------------------------------
__global__ __launch_bounds__(64) void misc_features(float* __restrict__ out, const float* __restrict__ in) {
  extern __shared__ float smem[];  // dynamic LDS (size given at launch); HIP_DYNAMIC_SHARED(float, smem) also works
  const int l = LANE();
  float v = __builtin_nontemporal_load(&in[l]);
  v = fmaxf(v, __shfl_xor(v, 1));                               // header version: ds_bpermute, inline
  v += __int_as_float(__builtin_amdgcn_ds_bpermute((l ^ 2) << 2, __float_as_int(v)));
  v = __builtin_amdgcn_exp2f(v);                                 // bare v_exp_f32
  v += __expf(v);                                                // v_mul (log2e) + v_exp_f32
  smem[l] = v;
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");         // == __syncthreads() without ockl
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
  v = smem[63 - l];
  const int first = __builtin_amdgcn_readfirstlane(__float_as_int(v));
  __builtin_nontemporal_store(v + __int_as_float(first), &out[l]);
}
