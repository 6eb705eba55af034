"""The NVIDIA mma tilings' lane mapping (cpa/csrc/tilings.h, MmaTiles), replayed on the CPU
with the fragment layouts PTX documents for mma.sync.m16n8k16 / m16n8k8 (f16) and
movmatrix.m8n8.trans, so that an index change in the tiling is checked before a GPU sees it:
the K rows and V rows each lane loads in a 32-token step (whole-line K rows), the QK and P x V
fragments, and the quad transpose that moves P into V's token order must give S = K q^T and
O = P V exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

W = 32
HEAD, X = 128, 8  # 16-bit cache: 8 elements per 16-byte key chunk
KR, KG, MT = X // 2, HEAD // (4 * X), HEAD // 16


def lanes():
    return [(lane >> 2, lane & 3) for lane in range(W)]


def mma(a, b, c, k8):
    """D = A B + C for one warp. a[l]: A's registers of lane l (pairs of b16 values), b[l]: B's,
    c[l]: 4 fp32 accumulators (PTX ISA, "Matrix Fragments for mma.m16n8k16 / m16n8k8", f16)."""
    K = 8 if k8 else 16
    A, B = np.zeros((16, K)), np.zeros((K, 8))
    for lane, (g, t) in enumerate(lanes()):
        A[g, 2 * t:2 * t + 2] = a[lane][0]
        A[g + 8, 2 * t:2 * t + 2] = a[lane][1]
        B[2 * t:2 * t + 2, g] = b[lane][0]
        if not k8:
            A[g, 2 * t + 8:2 * t + 10] = a[lane][2]
            A[g + 8, 2 * t + 8:2 * t + 10] = a[lane][3]
            B[2 * t + 8:2 * t + 10, g] = b[lane][1]
    C = A @ B
    return [[c[lane][0] + C[g, 2 * t], c[lane][1] + C[g, 2 * t + 1], c[lane][2] + C[g + 8, 2 * t],
             c[lane][3] + C[g + 8, 2 * t + 1]] for lane, (g, t) in enumerate(lanes())]


def movmatrix_trans(x):
    """Lane (g, t) holds row g, columns 2t, 2t + 1 of an 8x8 b16 matrix; afterwards those of its
    transpose."""
    M = np.zeros((8, 8))
    for lane, (g, t) in enumerate(lanes()):
        M[g, 2 * t:2 * t + 2] = x[lane]
    return [M.T[g, 2 * t:2 * t + 2].copy() for g, t in lanes()]


def quad_transpose4(r):
    """platform.h: lane t's r[j] becomes what lane j of its quad held in r[t]."""
    return [[r[(lane & ~3) | j][lane & 3] for j in range(4)] for lane in range(W)]


def _step(k8, transpose=True):
    """One 32-token step as the tiling computes it: S = K q^T checked here; returns (o, O), the
    P x V fragments of every d tile (o[m][lane][c]) and P V. transpose=False leaves P in
    movmatrix's order (the replay's own check)."""
    tokens, ntile = 32, 2  # 8 query heads: one n8 tile
    rng = np.random.default_rng(k8)
    K = rng.integers(-4, 5, (tokens, HEAD)).astype(float)  # [token][dim] of the step
    V = rng.integers(-4, 5, (HEAD, tokens)).astype(float)  # [dim][token]
    Q = rng.integers(-4, 5, (8, HEAD)).astype(float)
    P = rng.integers(-4, 5, (8, tokens)).astype(float)  # [head][token]: the softmax numerators

    # load_q / load_kv (whole-line K rows): lane (g, t), register c holds a pair of elements
    q = [[[Q[g, (4 * p + t) * X + 2 * c:(4 * p + t) * X + 2 * c + 2] for c in range(KR)] for p in range(KG)]
         for g, t in lanes()]
    k = [[[[K[16 * i + g + 8 * rr, (4 * p + t) * X + 2 * c:(4 * p + t) * X + 2 * c + 2] for c in range(KR)]
           for p in range(KG)] for rr in range(2)] for i in range(ntile) for g, t in lanes()]
    k = [[k[i * W + lane] for i in range(ntile)] for lane in range(W)]  # k[lane][i][rr][p][c]
    v = [[[[V[16 * m + g + 8 * rr, 8 * t + 2 * u:8 * t + 2 * u + 2] for u in range(4)] for rr in range(2)]
          for m in range(MT)] for g, t in lanes()]

    # qk
    s = [[0.0] * (ntile * 4) for _ in range(W)]
    for i in range(ntile):
        acc = [[0.0] * 4 for _ in range(W)]
        for p in range(KG):
            if k8:
                for j in range(KR):
                    acc = mma([(k[lane][i][0][p][j], k[lane][i][1][p][j]) for lane in range(W)],
                              [(q[lane][p][j],) for lane in range(W)], acc, True)
            else:
                for j in range(KR // 2):
                    acc = mma([(k[lane][i][0][p][2 * j], k[lane][i][1][p][2 * j], k[lane][i][0][p][2 * j + 1],
                                k[lane][i][1][p][2 * j + 1]) for lane in range(W)],
                              [(q[lane][p][2 * j], q[lane][p][2 * j + 1]) for lane in range(W)], acc, False)
        for lane in range(W):
            s[lane][i * 4:i * 4 + 4] = acc[lane]
    S = K @ Q.T
    for lane, (g, t) in enumerate(lanes()):
        for e in range(ntile * 4):
            token, head = 16 * (e // 4) + g + 8 * ((e & 3) >> 1), 2 * t + (e & 1)  # s_token, lhead
            assert s[lane][e] == S[token, head], (lane, e)

    # pv: the scores' layout carries P; movmatrix, then the quad transpose to V's token order
    pf = [[P[2 * t + (e & 1), 16 * (e // 4) + g + 8 * ((e & 3) >> 1)] for e in range(ntile * 4)] for g, t in lanes()]
    pb = [[movmatrix_trans([np.array(pf[lane][i * 4 + 2 * h:i * 4 + 2 * h + 2]) for lane in range(W)])
           for h in range(2)] for i in range(ntile)]  # pb[i][h][lane]
    if transpose:
        r = quad_transpose4([[pb[0][0][lane], pb[0][1][lane], pb[1][0][lane], pb[1][1][lane]] for lane in range(W)])
        pb = [[[r[lane][2 * i + h] for lane in range(W)] for h in range(2)] for i in range(2)]
    o = []
    for m in range(MT):
        acc = [[0.0] * 4 for _ in range(W)]
        for i in range(ntile):
            if k8:
                acc = mma([(v[lane][m][0][2 * i], v[lane][m][1][2 * i]) for lane in range(W)],
                          [(pb[i][0][lane],) for lane in range(W)], acc, True)
                acc = mma([(v[lane][m][0][2 * i + 1], v[lane][m][1][2 * i + 1]) for lane in range(W)],
                          [(pb[i][1][lane],) for lane in range(W)], acc, True)
            else:
                acc = mma([(v[lane][m][0][2 * i], v[lane][m][1][2 * i], v[lane][m][0][2 * i + 1],
                            v[lane][m][1][2 * i + 1]) for lane in range(W)],
                          [(pb[i][0][lane], pb[i][1][lane]) for lane in range(W)], acc, False)
        o.append(acc)
    return o, P @ V.T  # O: [head][dim]


def _o_matches(o, O):
    return all(o[m][lane][c] == O[2 * t + (c & 1), 16 * m + g + 8 * (c >> 1)]  # o_coord
               for m in range(MT) for lane, (g, t) in enumerate(lanes()) for c in range(4))


@pytest.mark.parametrize("k8", [False, True], ids=["m16n8k16", "m16n8k8"])
def test_mma_step_computes_scores_and_output(k8):
    assert _o_matches(*_step(k8))


def test_replay_catches_a_wrong_token_order():
    """The replay can fail: P left in movmatrix's token order (no quad transpose) does not give O."""
    assert not _o_matches(*_step(False, transpose=False))
