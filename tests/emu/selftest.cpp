// Self-tests of the wave emulator (cpa/csrc/emu/wave_emu.h), built with -DCPA_EMU by
// tests/test_emu.py: its matrix instructions against the operand layouts of AMD's own
// matrix-core examples (amd-lab-notes, matrix-cores: a 16x16x16 product in a dim3(16, 4) wave,
// 16 4x4x4 products in a dim3(4, 16) wave, row-major A, B and D), its permute, and the errors
// it must report.
#include "platform.h"

namespace {
uint32_t pack2(uint16_t lo, uint16_t hi) { return (uint32_t)lo | ((uint32_t)hi << 16); }
}  // namespace

extern "C" const char* emu_error() { return cpa_emu::last_error().c_str(); }

// shape 16: A, B [16][16], D [16][16]; shape 4: A, B, D [16 blocks][4][4]. 16-bit inputs
// (fp16 or bf16 bits), D = A B in fp32.
extern "C" int mfma_product(int shape, int bf16, const uint16_t* A, const uint16_t* B, float* D) {
  const bool ok = cpa_emu::run_group(64, 0, 0, 0, [&] {
    const int lane = cpa::lane_id();
    uint16_t a[4], b[4];
    int x, y;
    if (shape == 16) {
      x = lane % 16, y = lane / 16;  // threadIdx.x, threadIdx.y of dim3(16, 4)
      for (int i = 0; i < 4; ++i) {
        a[i] = A[x * 16 + i + y * 4];       // rows by lane, 4 consecutive columns per register set
        b[i] = B[x + i * 16 + y * 4 * 16];  // columns by lane, 4 consecutive rows
      }
    } else {
      x = lane % 4, y = lane / 4;  // dim3(4, 16): y is the block
      for (int i = 0; i < 4; ++i) {
        a[i] = A[x * 4 + i + y * 16];
        b[i] = B[x + i * 4 + y * 16];
      }
    }
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    const uint32_t a0 = pack2(a[0], a[1]), a1 = pack2(a[2], a[3]), b0 = pack2(b[0], b[1]), b1 = pack2(b[2], b[3]);
    if (shape == 16) {
      if (bf16) cpa::mfma<cpa::MfmaShape::k16x16x16, cpa::BF16>(d, a0, a1, b0, b1);
      else cpa::mfma<cpa::MfmaShape::k16x16x16, cpa::F16>(d, a0, a1, b0, b1);
      for (int i = 0; i < 4; ++i) D[x + i * 16 + y * 4 * 16] = d[i];
    } else {
      if (bf16) cpa::mfma<cpa::MfmaShape::k4x4x4_16b, cpa::BF16>(d, a0, a1, b0, b1);
      else cpa::mfma<cpa::MfmaShape::k4x4x4_16b, cpa::F16>(d, a0, a1, b0, b1);
      for (int i = 0; i < 4; ++i) D[x + i * 4 + y * 16] = d[i];
    }
  });
  return ok ? 0 : 1;
}

// mode 0: every lane shuffles (out[l] = lane l ^ mask's value); 1: half the wave shuffles and
// the other half has returned; 2: half shuffles, the other half waits at a workgroup barrier.
extern "C" int shuffle(int mode, int mask, float* out) {
  const bool ok = cpa_emu::run_group(64, 0, 0, 0, [&] {
    const int lane = cpa::lane_id();
    if (mode == 0 || lane < 32) {
      out[lane] = cpa::shfl_xor((float)(100 + lane), mask);
    } else if (mode == 2) {
      cpa::barrier();
    }
  });
  return ok ? 0 : 1;
}
