// Self-tests of the wave emulator's CUDA side (cpa/csrc/emu/wave_emu.h, built with -DCPA_EMU
// -DCPA_EMU_CUDA by tests/test_emu.py): one warp runs the platform layer's mma.sync,
// movmatrix and shuffles on registers the test lays out with the PTX ISA's fragment tables
// (its own transcription, in Python), and the errors the emulator must report.
#include "platform.h"

extern "C" const char* emu_error() { return cpa_emu::last_error().c_str(); }

// k = 16: cpa::mma_m16n8k16 (a: 4 registers per lane, b: 2); k = 8: cpa::mma_m16n8k8 (a: 2,
// b: 1). c holds 4 accumulators per lane in and D out; all per lane, row-major [32][...].
extern "C" int mma(int k, int bf16, const uint32_t* a, const uint32_t* b, float* c) {
  const bool ok = cpa_emu::run_group(32, 0, 0, 0, [&] {
    const int l = cpa::lane_id();
    float acc[4] = {c[4 * l], c[4 * l + 1], c[4 * l + 2], c[4 * l + 3]};
    if (k == 16) {
      const uint32_t ra[4] = {a[4 * l], a[4 * l + 1], a[4 * l + 2], a[4 * l + 3]};
      const uint32_t rb[2] = {b[2 * l], b[2 * l + 1]};
      if (bf16) cpa::mma_m16n8k16<cpa::BF16>(acc, ra, rb);
      else cpa::mma_m16n8k16<cpa::F16>(acc, ra, rb);
    } else {
      if (bf16) cpa::mma_m16n8k8<cpa::BF16>(acc, a[2 * l], a[2 * l + 1], b[l]);
      else cpa::mma_m16n8k8<cpa::F16>(acc, a[2 * l], a[2 * l + 1], b[l]);
    }
    for (int i = 0; i < 4; ++i) c[4 * l + i] = acc[i];
  });
  return ok ? 0 : 1;
}

// op 0: movmatrix_trans; 1: quad_transpose4 (4 registers per lane in x and out);
// 2: shfl_xor(x, arg); 3: shfl_idx_i32(x, (lane + arg) % 32); 4: like 2 with half the warp
// returned first; 5: like 2 with half the warp at a workgroup barrier instead.
extern "C" int lanes(int op, int arg, uint32_t* x) {
  const bool ok = cpa_emu::run_group(32, 0, 0, 0, [&] {
    const int l = cpa::lane_id();
    if (op == 0) {
      x[l] = cpa::movmatrix_trans(x[l]);
    } else if (op == 1) {
      uint32_t r[4] = {x[4 * l], x[4 * l + 1], x[4 * l + 2], x[4 * l + 3]};
      cpa::quad_transpose4(r);
      for (int i = 0; i < 4; ++i) x[4 * l + i] = r[i];
    } else if (op == 2 || (op >= 4 && l < 16)) {
      x[l] = (uint32_t)cpa::shfl_xor((int)x[l], arg);
    } else if (op == 3) {
      x[l] = (uint32_t)cpa::shfl_idx_i32((int)x[l], (l + arg) % 32);
    } else if (op == 5) {
      cpa::barrier();
    }
  });
  return ok ? 0 : 1;
}
