"""The kernels executed on the CPU by the wave emulator (cpa.emu), against cpa.reference: the
AMD (HIP) code path -- the only execution it gets here (no AMD GPU) -- and the NVIDIA (CUDA)
one, so that a lane-mapping change in either fails in CI before a GPU sees it. First the
emulator itself: its AMD matrix instructions against the operand layouts of AMD's own
matrix-core examples, its NVIDIA mma.sync / movmatrix against the PTX ISA's fragment tables
(transcribed here, independently of the emulator), its shuffles, and the errors it must raise.

Matrix, per platform: every tiling x partition sizes 64-1024 x {fp16, bf16} x {auto, fp8} at
head 128, block 16 (GQA 8; AMD's mfma4, its small-GQA tiling, at GQA 4); head 64 and 256,
block 32, GQA 1 / 4 / 16, ALiBi and the fused reduce at partition 256; the longest partitions
for mfma16. Each case runs one batch of the edge lengths {1, 17, P-1, P, P+1, 3P+7} with 2 KV
heads, outputs and intermediates NaN-poisoned. The CUDA side runs its default build without
the PTX-only paths it cannot emulate (cache hints, staged loops), which the GPU tests cover;
its cluster combine runs in test_cluster_combine_in_the_emulator, its launches chained by
programmatic dependent launch in test_pdl_chain_in_the_emulator and
test_cluster_launch_in_a_pdl_chain.
"""

from __future__ import annotations

import ctypes
import math
import subprocess
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from cpa import emu, reference
from cpa import variants as V
from cpa.static import find_clang

try:
    CXX = find_clang()
except RuntimeError as e:  # pragma: no cover - CI installs clang-19
    pytest.skip(str(e), allow_module_level=True)

TORCH_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}
GQA = {"hip": {"mfma16": 8, "mfma4": 4, "scalar": 8},  # mfma4 holds 4 heads on AMD
       "cuda": {"mfma16": 8, "mfma4": 8, "scalar": 8}}
PLATFORMS = ("hip", "cuda")


# ------------------------------------------------------------------ the emulator itself
def _selftest_lib(tmp_path_factory, name: str, platform: str):
    """tests/emu/<name>.cpp built for the emulator's `platform` side and loaded."""
    out = tmp_path_factory.mktemp("emu") / f"{name}.so"
    src = Path(__file__).parent / "emu" / f"{name}.cpp"
    subprocess.run([CXX, *emu.FLAGS, *emu.PLATFORM_FLAGS[platform], "-shared", f"-I{emu.CSRC}", str(src), "-o", str(out)],
                   check=True, capture_output=True)
    lib = ctypes.CDLL(str(out))
    lib.emu_error.restype = ctypes.c_char_p
    return lib


@pytest.fixture(scope="module")
def selftest(tmp_path_factory):
    return _selftest_lib(tmp_path_factory, "selftest", "hip")


def _bits(x: np.ndarray, bf16: bool) -> np.ndarray:
    t = torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16 if bf16 else torch.float16)
    return t.view(torch.int16).numpy().view(np.uint16).copy(), t.float().numpy()


@pytest.mark.parametrize("shape", [16, 4])
@pytest.mark.parametrize("bf16", [False, True])
def test_emulated_mfma_is_the_documented_product(selftest, shape, bf16):
    rng = np.random.default_rng(shape + bf16)
    dims = (16, 16) if shape == 16 else (16, 4, 4)
    a, af = _bits(rng.standard_normal(dims), bf16)
    b, bf = _bits(rng.standard_normal(dims), bf16)
    d = np.full(dims, np.nan, dtype=np.float32)
    ptr = lambda x: x.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    assert selftest.mfma_product(shape, int(bf16), ptr(a), ptr(b), ptr(d)) == 0, selftest.emu_error()
    np.testing.assert_allclose(d, af @ bf, rtol=1e-5, atol=1e-5)


def test_emulated_permute_and_its_errors(selftest):
    out = np.full(64, np.nan, dtype=np.float32)
    p = out.ctypes.data_as(ctypes.c_void_p)
    assert selftest.shuffle(0, 5, p) == 0
    assert out.tolist() == [100.0 + (lane ^ 5) for lane in range(64)]
    assert selftest.shuffle(1, 1, p) == 1
    assert b"ds_bpermute with 32 exited lanes" in selftest.emu_error()
    assert selftest.shuffle(2, 1, p) == 1
    assert b"divergent collective" in selftest.emu_error()


# ------------------------------------------------------------------ the emulator's CUDA side
@pytest.fixture(scope="module")
def selftest_cuda(tmp_path_factory):
    return _selftest_lib(tmp_path_factory, "selftest_cuda", "cuda")


WARP = [(lane >> 2, lane & 3) for lane in range(32)]  # lane 4 g + t: (groupID g, threadID_in_group t)


def _ptr(x):
    return x.ctypes.data_as(ctypes.c_void_p)


def _pack(lo, hi):
    return np.uint32(lo) | (np.uint32(hi) << np.uint32(16))


@pytest.mark.parametrize("k", [16, 8])
@pytest.mark.parametrize("bf16", [False, True])
def test_emulated_mma_is_the_ptx_fragment_product(selftest_cuda, k, bf16):
    """mma.sync.aligned.m16n8k{16,8}.row.col.f32.{f16,bf16}.f32 with the PTX ISA's fragment
    layouts ("Matrix Fragments for mma.m16n8k16 / mma.m16n8k8"): lane 4 g + t holds A[g][2t,
    2t+1] and A[g+8][2t, 2t+1] (then, for k16, the same at columns 2t+8, 2t+9), B[2t, 2t+1][g]
    (then rows 2t+8, 2t+9), and C / D [g][2t, 2t+1], [g+8][2t, 2t+1]; the lower column or row
    in the low half of a register."""
    rng = np.random.default_rng(k + 2 * bf16)
    a, af = _bits(rng.standard_normal((16, k)), bf16)
    b, bf = _bits(rng.standard_normal((k, 8)), bf16)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    na, nb = k // 4, k // 8
    ra, rb = np.zeros((32, na), np.uint32), np.zeros((32, nb), np.uint32)
    cl = np.zeros((32, 4), np.float32)
    for lane, (g, t) in enumerate(WARP):
        for j in range(na):  # a[0]: row g, a[1]: row g + 8, a[2] / a[3]: the same 8 columns on
            row, col = g + 8 * (j & 1), 2 * t + 8 * (j >> 1)
            ra[lane, j] = _pack(a[row, col], a[row, col + 1])
        for j in range(nb):
            rb[lane, j] = _pack(b[2 * t + 8 * j, g], b[2 * t + 8 * j + 1, g])
        cl[lane] = [c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1]]
    assert selftest_cuda.mma(k, int(bf16), _ptr(ra), _ptr(rb), _ptr(cl)) == 0, selftest_cuda.emu_error()
    d = np.zeros((16, 8), np.float32)
    for lane, (g, t) in enumerate(WARP):
        d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1] = cl[lane]
    np.testing.assert_allclose(d, af @ bf + c, rtol=1e-5, atol=1e-5)


def test_emulated_movmatrix_quad_transpose_and_shuffles(selftest_cuda):
    # movmatrix.m8n8.trans.b16: lane 4 g + t holds row g, columns 2t, 2t + 1 -- afterwards
    # those of the transpose
    m = np.arange(64, dtype=np.uint32).reshape(8, 8) + 1000
    x = np.array([_pack(m[g, 2 * t], m[g, 2 * t + 1]) for g, t in WARP], np.uint32)
    assert selftest_cuda.lanes(0, 0, _ptr(x)) == 0, selftest_cuda.emu_error()
    assert x.tolist() == [int(_pack(m[2 * t, g], m[2 * t + 1, g])) for g, t in WARP]
    # quad_transpose4 (platform.h): lane t's r[j] becomes what lane j of its quad held in r[t]
    r = np.arange(128, dtype=np.uint32).reshape(32, 4)
    q = r.copy()
    assert selftest_cuda.lanes(1, 0, _ptr(q)) == 0, selftest_cuda.emu_error()
    assert all(q[lane, j] == r[(lane & ~3) | j, lane & 3] for lane in range(32) for j in range(4))
    for op, arg, want in ((2, 5, [100 + (lane ^ 5) for lane in range(32)]),
                          (3, 7, [100 + (lane + 7) % 32 for lane in range(32)])):
        v = np.arange(100, 132, dtype=np.uint32)
        assert selftest_cuda.lanes(op, arg, _ptr(v)) == 0
        assert v.tolist() == want
    v = np.arange(32, dtype=np.uint32)
    assert selftest_cuda.lanes(4, 1, _ptr(v)) == 1 and b"shfl.sync with 16 exited lanes" in selftest_cuda.emu_error()
    assert selftest_cuda.lanes(5, 1, _ptr(v)) == 1 and b"divergent collective" in selftest_cuda.emu_error()


# ------------------------------------------------------------------ the kernels
def case_id(c):
    return (f"{c['tiling']}-p{c['partition_size']}-{c['dtype']}-{c['kv']}-h{c['head_size']}-b{c['block_size']}"
            f"-g{c['gqa']}{'-alibi' if c['alibi'] else ''}{'-fused' if c['fused'] else ''}-{c['platform']}")


def _cases(platform):
    cases = []
    for t in V.TILINGS:
        for p in (64, 128, 256, 512, 1024):
            for dt in V.DTYPES:
                for kv in V.KV_CACHE_DTYPES:
                    cases.append(dict(tiling=t, partition_size=p, dtype=dt, kv=kv))
        for i, ax in enumerate([dict(head_size=64), dict(head_size=256), dict(block_size=32), dict(gqa=1),
                                dict(gqa=4), dict(gqa=16), dict(alibi=True), dict(fused=True)]):
            cases.append(dict(tiling=t, partition_size=256, dtype=V.DTYPES[i % 2],
                              kv=V.KV_CACHE_DTYPES[(i // 2) % 2], **ax))
    for p in (2048, 4096):
        cases.append(dict(tiling="mfma16", partition_size=p, dtype="bf16", kv="auto"))
    out, seen = [], set()
    for c in cases:
        c = dict(dict(head_size=128, block_size=16, gqa=GQA[platform][c["tiling"]], alibi=False, fused=False,
                      platform=platform), **c)
        if case_id(c) in seen:  # (mfma4's GQA-4 axis case is its base case)
            continue
        seen.add(case_id(c))
        try:
            c["variant"] = V.variant_for(tiling=c["tiling"], partition_size=c["partition_size"],
                                         head_size=c["head_size"], block_size=c["block_size"], dtype=c["dtype"],
                                         kv_cache_dtype=c["kv"], gqa_ratio=c["gqa"], platform=platform)
        except ValueError:
            continue  # not a variant of the platform (e.g. AMD mfma4 above 4 heads, P 64 with 64-token steps)
        out.append(c)
    return out


CASES = _cases("hip") + _cases("cuda")


def _knob_builds():
    """(variant, flags) of test_knob_builds_in_the_emulator's builds, as emu.check picks them."""
    for platform, flag in KNOBS:
        for tiling in V.TILINGS:
            for kv in V.KV_CACHE_DTYPES:
                yield V.variant_for(tiling=tiling, partition_size=256, head_size=128, block_size=16, dtype="bf16",
                                    kv_cache_dtype=kv, gqa_ratio=GQA[platform][tiling], platform=platform), (flag,)


@pytest.fixture(scope="module", autouse=True)
def _prebuilt():
    # the matrix's, the random cases' and the knob builds' variants compiled up front, on all
    # cores (a build is 1.5-2 s of clang on the precompiled header; one after another they were
    # most of CI's time)
    builds = {(c["variant"], ()) for c in CASES + RANDOM_CASES} | set(_knob_builds())
    with ThreadPoolExecutor() as pool:
        list(pool.map(lambda b: emu.build(*b), builds))


@pytest.mark.parametrize("platform", PLATFORMS)
def test_matrix_covers_every_tiling_and_the_axes(platform):
    cases = [c for c in CASES if c["platform"] == platform]
    assert {c["tiling"] for c in cases} == set(V.TILINGS)
    assert {c["kv"] for c in cases} == set(V.KV_CACHE_DTYPES) and {c["dtype"] for c in cases} == set(V.DTYPES)
    assert {c["head_size"] for c in cases} >= {64, 128, 256} and {c["gqa"] for c in cases} >= {1, 4, 8, 16}
    assert any(c["fused"] for c in cases) and any(c["alibi"] for c in cases)
    assert len(cases) >= 60


@pytest.mark.parametrize("c", CASES, ids=[case_id(c) for c in CASES])
def test_kernel_in_the_emulator(c):
    P = c["partition_size"]
    lens = [1, 17, P - 1, P, P + 1, 3 * P + 7]
    seed = zlib.crc32(case_id(c).encode()) % 10_000
    from cpa.inputs import make_paged_inputs

    inp = make_paged_inputs(len(lens), c["gqa"] * 2, 2, c["head_size"], c["block_size"], lens,
                            dtype=TORCH_DTYPE[c["dtype"]], kv_cache_dtype=c["kv"], seed=seed, alibi=c["alibi"])
    kw = inp.as_kwargs()
    out, es, ml, tmp = emu.paged_attention(**kw, partition_size=P, tiling=c["tiling"], fused_reduce=c["fused"],
                                           return_intermediates=True, platform=c["platform"])
    ref_out, ref_es, ref_ml, ref_tmp = reference.paged_attention(**kw, partition_size=P, return_intermediates=True)
    assert not torch.isnan(out).any(), "output has unwritten (NaN) elements"
    tol = reference.REL_ERR_TOL[inp.query.dtype]
    err = reference.relative_error(out, ref_out, per_seq=True)
    assert err <= tol, f"output relative error {err:.3g} > {tol:g}"
    parts = torch.tensor([math.ceil(s / P) for s in lens])
    valid = (torch.arange(ml.shape[-1])[None, :] < parts[:, None])[:, None, :].expand_as(ml)
    torch.testing.assert_close(ml[valid], ref_ml[valid], rtol=1e-3, atol=2e-3)
    torch.testing.assert_close(es[valid], ref_es[valid], rtol=2e-3, atol=1e-4)
    terr = reference.relative_error(tmp[valid], ref_tmp[valid], per_seq=True)
    assert terr <= tol, f"tmp_out relative error {terr:.3g} > {tol:g}"


@pytest.mark.parametrize("fused", [False, True], ids=["reduce", "fused"])
def test_a_launch_sized_for_shorter_sequences_truncates_in_bounds(fused):
    """A grid sized by max_seq_len for shorter sequences than seq_lens holds (check_values=False,
    or a graph replayed after the lengths grew): each sequence is attended to over the tokens
    the grid covers -- the reference with its length clamped there -- the reduce reads no other
    row's partials, and the fused reduce's counters return to zero (the emulator raises if not).
    Before the kernel clamped its counts, the reduce combined the next head's partials and the
    fused reduce never fired, leaving NaN and counters that broke every later launch on them."""
    from cpa.inputs import make_paged_inputs

    P, grid_tokens = 64, 128
    inp = make_paged_inputs(2, 8, 2, 64, 16, [256, 100], dtype=torch.float16, seed=11)
    kw = inp.as_kwargs()
    out = emu.paged_attention(**kw, partition_size=P, tiling="mfma16", fused_reduce=fused,
                              max_seq_len=grid_tokens, check_values=False)
    ref = reference.paged_attention(**dict(kw, seq_lens=kw["seq_lens"].clamp(max=grid_tokens)))
    err = reference.relative_error(out, ref, per_seq=True)
    assert err <= reference.REL_ERR_TOL[torch.float16], f"relative error {err:.3g}"


@pytest.mark.parametrize("fused,P", [(False, 64), (False, 128), (True, 64)], ids=["reduce", "reduce_few", "fused"])
def test_a_sequence_longer_than_its_block_table_row_is_truncated_to_the_row(fused, P):
    """seq_lens past the block-table row (invalid input that check_values=False lets through):
    the attention kernel and the reduce both clamp the sequence to the row's tokens, so the
    output is the reference over the row and no partial is read unwritten (the emulator's
    partials start NaN; before the reduce clamped to the row it combined them)."""
    from cpa.inputs import make_paged_inputs

    row_tokens = 128
    inp = make_paged_inputs(2, 8, 2, 64, 16, [row_tokens, 100], dtype=torch.float16, seed=12)
    kw = inp.as_kwargs()
    assert kw["block_tables"].shape[1] * 16 == row_tokens
    longer = dict(kw, seq_lens=torch.tensor([300, 100], dtype=torch.int32))
    if not fused:  # 5 partitions: the reduce kernel; 3: reduce_few
        assert V.reduce_kernel(-(-300 // P), 2, 8) == ("reduce" if P == 64 else "reduce_few")
    out = emu.paged_attention(**longer, partition_size=P, tiling="mfma16", fused_reduce=fused,
                              max_seq_len=300, check_values=False)
    assert not torch.isnan(out).any(), "the reduce combined unwritten partials"
    err = reference.relative_error(out, reference.paged_attention(**kw), per_seq=True)
    assert err <= reference.REL_ERR_TOL[torch.float16], f"relative error {err:.3g}"


SHARED = [(pf, t, P, dt, kv) for pf in PLATFORMS for t in V.TILINGS for P, dt, kv in
          ((512, "fp16", "auto"), (1024, "bf16", "fp8"))]


@pytest.mark.parametrize("platform,tiling,P,dtype,kv", SHARED, ids=["-".join(map(str, c)) for c in SHARED])
def test_shared_steps_kernel_in_the_emulator(platform, tiling, P, dtype, kv):
    """The shared-steps kernel (ops.prepare(shared_steps=True): the workgroups of a sequence take
    its 32- / 64-token steps from one ticket counter), then the reduce: right against the
    reference, counters back at zero (the emulator raises otherwise). Workgroups run one after
    another here, so the first of a sequence takes every ticket its four waves reach and the
    others run only their first steps (test_concurrent_workgroups_in_the_emulator interleaves
    them). The AMD instantiation has no other execution."""
    from cpa.inputs import make_paged_inputs

    g = GQA[platform][tiling]
    lens = [1, 17, P - 1, P, P + 1, 3 * P + 7, 9 * P + 5]
    inp = make_paged_inputs(len(lens), g * 2, 2, 128, 16, lens, dtype=TORCH_DTYPE[dtype], kv_cache_dtype=kv,
                            seed=P + len(tiling), alibi=tiling == "scalar")
    kw = inp.as_kwargs()
    out = emu.paged_attention(**kw, partition_size=P, tiling=tiling, platform=platform, shared_steps=True)
    assert not torch.isnan(out).any()
    err = reference.relative_error(out, reference.paged_attention(**kw), per_seq=True)
    assert err <= reference.REL_ERR_TOL[inp.query.dtype], f"relative error {err:.3g}"


CONCURRENT = [(pf, t) for pf in PLATFORMS for t in ("mfma16", "scalar")]


@pytest.mark.parametrize("platform,tiling", CONCURRENT, ids=["-".join(c) for c in CONCURRENT])
def test_concurrent_workgroups_in_the_emulator(platform, tiling):
    """Workgroups that share a counter, interleaved (workgroups_at_once=4: a seeded random
    dispatch order, turns handed on after every wave-wide operation; wave_emu.h). Shared steps:
    right, counters back at zero, and two schedules give bitwise different outputs (the tickets
    went to other workgroups: in grid order the first workgroup of a sequence takes them all).
    The fused reduce: whichever workgroup arrives last combines, bitwise the same output as in
    grid order. Deciding the combiner by its partition index instead of the count passes in grid
    order and fails here (checked by mutation, 2026-12-06)."""
    from cpa.inputs import make_paged_inputs

    g, P = GQA[platform][tiling], 512
    lens = [1, 17, P + 1, 3 * P + 7, 9 * P + 5]
    inp = make_paged_inputs(len(lens), g * 2, 2, 128, 16, lens, dtype=torch.float16, seed=97)
    kw = inp.as_kwargs()
    ref = reference.paged_attention(**kw)
    k = emu.build(V.variant_for(tiling=tiling, partition_size=P, head_size=128, block_size=16, dtype="fp16",
                                kv_cache_dtype="auto", gqa_ratio=g, platform=platform))
    outs = []
    for seed in (1, 2):
        out = emu.paged_attention(**kw, partition_size=P, tiling=tiling, platform=platform, shared_steps=True,
                                  workgroups_at_once=4, schedule_seed=seed)
        assert k.switches > 100, k.switches  # (the reduce's workgroups alone hand on far fewer turns)
        err = reference.relative_error(out, ref, per_seq=True)
        assert err <= reference.REL_ERR_TOL[torch.float16], f"seed {seed}: relative error {err:.3g}"
        outs.append(out)
    assert not torch.equal(outs[0], outs[1]), "two schedules ran the same steps in the same workgroups"
    grid_order = emu.paged_attention(**kw, partition_size=P, tiling=tiling, platform=platform, fused_reduce=True)
    assert k.switches == 0
    fused = emu.paged_attention(**kw, partition_size=P, tiling=tiling, platform=platform, fused_reduce=True,
                                workgroups_at_once=4, schedule_seed=3)
    assert k.switches > 100, k.switches
    assert torch.equal(fused, grid_order)
    with pytest.raises(ValueError, match="workgroups_at_once"):
        emu.paged_attention(**kw, partition_size=P, tiling=tiling, platform=platform, workgroups_at_once=0)


# Changes to the fused combine's hand-off, each with the memory models that catch it (file,
# text, its replacement). Hardware may run the first four wrong: the count made relaxed (no
# release of the partials), the barrier before the count removed (thread 0 counts before the
# other threads of its workgroup have stored theirs), the count made release-only (the last
# workgroup's loads are not ordered after the others' releases), the barrier after the count
# removed (only thread 0 has acquired). The last is right: a relaxed count between two
# device-scope fences (the classic threadfence reduction), which no model may flag.
HANDOFF = {
    "relaxed count": ({"release", "acquire-release"}, [
        ("attention.h", "is_last = atomic_add_acq_rel_i32(ctr, 1) == np_seq - 1;",
         "is_last = atomic_add_i32(ctr, 1) == np_seq - 1;")]),
    "count before the stores": ({"release", "acquire-release"}, [
        ("attention.h", "  barrier();\n  if (thread_idx() == 0) is_last", "  if (thread_idx() == 0) is_last")]),
    "release-only count": ({"acquire-release"}, [
        ("platform.h", "__ATOMIC_ACQ_REL, __HIP_MEMORY_SCOPE_AGENT", "__ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_AGENT"),
        ("platform.h", "fetch_add(p, v, __ATOMIC_ACQ_REL)", "fetch_add(p, v, __ATOMIC_RELEASE)")]),
    "no barrier after the count": ({"acquire-release"}, [
        ("attention.h", "  barrier();\n  if (!is_last) return;", "  if (!is_last) return;")]),
    "fenced relaxed count": (set(), [
        ("attention.h", "is_last = atomic_add_acq_rel_i32(ctr, 1) == np_seq - 1;",
         "{ fence_device(); is_last = atomic_add_i32(ctr, 1) == np_seq - 1; fence_device(); }")]),
}


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("mutation", [None, *HANDOFF])
def test_fused_combine_reads_only_released_and_acquired_partials(platform, mutation, tmp_path, monkeypatch):
    """memory_model="acquire-release" (the emulator's default): a workgroup's partials stay hidden
    from the others until its acquire-release count (or its grid's end), and from each thread of
    the last workgroup until it has acquired (its own count, or thread 0's passed on by the
    barrier after it). The kernel as written is right under every model, in grid order and
    interleaved; each wrong change of HANDOFF makes the last workgroup combine poisoned partials
    under the models that name it and is hidden under the weaker ones -- so the model, not the
    schedule, is what catches it -- and the right one passes under all."""
    from cpa.inputs import make_paged_inputs

    caught = set()
    if mutation is not None:
        import shutil

        csrc = tmp_path / "csrc"
        shutil.copytree(emu.CSRC, csrc)
        caught, edits = HANDOFF[mutation]
        for name, old, new in edits:
            text = (csrc / name).read_text()
            assert text.count(old) == 1, f"{name} no longer holds {old!r}: update HANDOFF"
            (csrc / name).write_text(text.replace(old, new))
        monkeypatch.setattr(emu, "CSRC", csrc)
        # (a PCH is kept per headers' path: one for this temporary copy stays with it)
        monkeypatch.setenv("CPA_CACHE_DIR", str(tmp_path / "cache"))
    g, P, lens = GQA[platform]["mfma16"], 256, [300, 700, 1000]
    inp = make_paged_inputs(len(lens), g * 2, 2, 128, 16, lens, dtype=torch.float16, seed=5)
    kw = inp.as_kwargs()
    ref = reference.paged_attention(**kw)
    tol = reference.REL_ERR_TOL[torch.float16]

    def err(model, at_once):
        out = emu.paged_attention(**kw, partition_size=P, tiling="mfma16", platform=platform, fused_reduce=True,
                                  memory_model=model, workgroups_at_once=at_once, schedule_seed=3)
        return reference.relative_error(out, ref, per_seq=True)

    import inspect

    assert emu.MEMORY_MODELS[0] == "acquire-release"
    assert inspect.signature(emu.paged_attention).parameters["memory_model"].default == "acquire-release"
    for at_once in (1, 4):
        for model in emu.MEMORY_MODELS:
            e = err(model, at_once)
            if model in caught:
                assert not e <= tol, f"{mutation}, {model}: the combine read unpublished partials and got them right"
            else:
                assert e <= tol, f"{mutation}, {model}, {at_once} at once: relative error {e:.3g}"
    with pytest.raises(ValueError, match="memory_model"):
        emu.paged_attention(**kw, partition_size=P, tiling="mfma16", platform=platform, memory_model="tso")


def test_one_precompiled_header_per_platform_kept_across_touched_headers(tmp_path, monkeypatch):
    """The variants of a platform share one precompiled emu/launch_emu.h, and a checkout that
    only touches the headers (new mtimes, same bytes) builds against it still: clang compares
    their content, not their mtimes (-fpch-validate-input-files-content), and the build is right.
    An edit of a header replaces it (the old one is deleted: 12 MB each)."""
    import os
    import shutil
    import time

    from cpa.inputs import make_paged_inputs

    csrc = tmp_path / "csrc"
    shutil.copytree(emu.CSRC, csrc)
    monkeypatch.setattr(emu, "CSRC", csrc)
    monkeypatch.setattr(emu, "_loaded", {})
    monkeypatch.setenv("CPA_CACHE_DIR", str(tmp_path / "cache"))
    pchs = lambda: sorted((tmp_path / "cache" / "emu").glob("launch_emu-*.pch"))  # noqa: E731
    first, second = (V.variant_for(tiling=t, partition_size=256, head_size=64, block_size=16, dtype="fp16",
                                   kv_cache_dtype="auto", gqa_ratio=4, platform="hip") for t in ("scalar", "mfma4"))
    emu.build(first)
    assert [p.name.split("-")[1] for p in pchs()] == ["hip"]
    built = pchs()
    later = time.time() + 3600
    for h in csrc.rglob("*.h"):
        os.utime(h, (later, later))
    emu.build(second)
    assert pchs() == built
    inp = make_paged_inputs(2, 8, 2, 64, 16, [70, 300], dtype=torch.float16, seed=11)
    out = emu.paged_attention(**inp.as_kwargs(), partition_size=256, tiling="mfma4")
    assert reference.relative_error(out, reference.paged_attention(**inp.as_kwargs())) <= \
        reference.REL_ERR_TOL[torch.float16]
    platform_h = csrc / "platform.h"
    platform_h.write_text(platform_h.read_text() + "// an edit\n")
    emu.build(first)
    assert len(pchs()) == 1 and pchs() != built


CLUSTER = [("mfma16", 256, (1, 17, 255, 256, 257, 700)), ("mfma4", 512, (5, 600, 1800, 3000)),
           ("scalar", 256, (40, 2100, 4000))]


@pytest.mark.parametrize("tiling,P,lens", CLUSTER, ids=[c[0] for c in CLUSTER])
def test_cluster_combine_in_the_emulator(tiling, P, lens):
    """The sm_90 cluster combine (cluster_reduce=True: each (sequence, KV head)'s partitions are
    one thread-block cluster, combined through distributed shared memory) on the CUDA side of
    the emulator: a cluster's workgroups run at once, cluster barriers wait for all of them, and
    `ld.shared::cluster` reads the other rank's `__shared__` copy. Cluster sizes 3, 6 and 16
    cover every lane grouping of cluster_combine (1, 2 and 4 lanes per output); the empty
    partitions of short sequences take part. Whole clusters dispatched at random with turns
    after every wave-wide operation, and with turns kept until a workgroup waits (so a rank
    runs ahead of the rest: dropping cluster_combine's trailing cluster_sync fails there,
    checked by mutation 2026-12-06, error 1.2-5.7)."""
    from cpa.inputs import make_paged_inputs

    inp = make_paged_inputs(len(lens), 16, 2, 128, 16, list(lens), dtype=torch.float16, seed=P + len(lens),
                            alibi=tiling == "scalar")
    kw = inp.as_kwargs()
    ref = reference.paged_attention(**kw)
    n = -(-max(lens) // P)
    assert n in (3, 6, 16) and V.cluster_unsupported("sm_90", n) is None
    for wg, turns in ((1, "random"), (2 * n, "random"), (n, "until_blocked")):
        out = emu.paged_attention(**kw, partition_size=P, tiling=tiling, platform="cuda", cluster_reduce=True,
                                  workgroups_at_once=wg, schedule_seed=wg, turns=turns)
        err = reference.relative_error(out, ref, per_seq=True)
        assert err <= reference.REL_ERR_TOL[torch.float16], f"{wg} at once, {turns}: relative error {err:.3g}"


PDL = [("mfma16", 256, (1, 17, 300, 1000), False, "auto", "reduce_few"),
       ("mfma16", 64, (1, 17, 300, 1000), False, "fp8", "reduce"),
       ("scalar", 512, (1, 17, 600, 5000), True, "auto", "reduce"),
       ("mfma4", 256, (1, 17, 200), False, "auto", None)]


@pytest.mark.parametrize("tiling,P,lens,shared,kv,reduce_kernel", PDL,
                         ids=[f"{c[0]}-{c[4]}-{c[5]}" + "-shared" * c[3] for c in PDL])
def test_pdl_chain_in_the_emulator(tiling, P, lens, shared, kv, reduce_kernel):
    """The launches chained as sm_90 makes them (pdl=True): an emulated kernel writing the K/V
    cache, the block tables, the sequence lengths and the query (into buffers that start
    poisoned, NaN or 0; it lets its dependent launch at once),
    the attention kernel as its programmatic dependent, the reduce kernel (where one runs) as the
    attention kernel's. A dependent's workgroups start once every workgroup before it has run
    launch_dependents, interleaved with those still running, and pass griddepcontrol.wait once
    they have all ended. Both reduce kernels, shared steps, an fp8 cache, and one partition (no
    reduce). Checked by mutation (2026-12-06): the attention kernel's wait moved below its query
    load, or the reduce kernels' wait dropped or moved below their loads of the partials, passes
    without pdl and fails here (error inf; with 8 workgroups at once, not always with 2); so
    does (2026-12-07, all 4 cases) the attention kernel's wait moved below its reads of the
    sequence length and the block table, above the query load."""
    from cpa.inputs import make_paged_inputs

    inp = make_paged_inputs(len(lens), 16, 2, 128, 16, list(lens), dtype=torch.float16, seed=P + 5,
                            kv_cache_dtype=kv)
    kw = inp.as_kwargs()
    assert V.reduce_kernel(-(-max(lens) // P), len(lens), 16) == reduce_kernel
    ref = reference.paged_attention(**kw)
    k = emu.build(V.variant_for(tiling=tiling, partition_size=P, head_size=128, block_size=16, dtype="fp16",
                                kv_cache_dtype=kv, gqa_ratio=8, platform="cuda"))
    keep = [t.clone() for t in (kw["query"], kw["key_cache"], kw["value_cache"])]
    for seed in (1, 2):
        out = emu.paged_attention(**kw, partition_size=P, tiling=tiling, platform="cuda", shared_steps=shared,
                                  pdl=True, workgroups_at_once=8, schedule_seed=seed)
        assert k.switches > 100, k.switches
        err = reference.relative_error(out, ref, per_seq=True)
        assert err <= reference.REL_ERR_TOL[torch.float16], f"seed {seed}: relative error {err:.3g}"
    # (the caller's tensors untouched, bit for bit: their unused cache slots hold NaN)
    assert all(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
               for a, b in zip(keep, (kw["query"], kw["key_cache"], kw["value_cache"])))
    for extra, match in ((dict(platform="hip", tiling="mfma16"), "CUDA's"), (dict(flags=("-DCPA_PDL=0",)), "CPA_PDL=0")):
        args = {**dict(partition_size=P, tiling=tiling, platform="cuda", pdl=True), **extra}
        with pytest.raises(ValueError, match=match):  # (before any build)
            emu.paged_attention(**kw, **args)


@pytest.mark.parametrize("tiling,P,lens", [CLUSTER[0], CLUSTER[2]], ids=["mfma16", "scalar"])
def test_cluster_launch_in_a_pdl_chain(tiling, P, lens):
    """The sm_90 cluster combine's launch as launch_clustered makes it, a programmatic dependent
    (pdl=True with cluster_reduce=True): the input writer, then the attention kernel's clusters
    (3 and 16 partitions) taken up whole beside it. Checked by mutation (2026-12-07): the
    attention kernel's wait moved below its query load, or below its reads of the sequence length
    and the block table, passes without pdl and fails here with 8 workgroups at once (error inf,
    both cases)."""
    from cpa.inputs import make_paged_inputs

    inp = make_paged_inputs(len(lens), 16, 2, 128, 16, list(lens), dtype=torch.float16, seed=3,
                            alibi=tiling == "scalar")
    kw = inp.as_kwargs()
    ref = reference.paged_attention(**kw)
    k = emu.build(V.variant_for(tiling=tiling, partition_size=P, head_size=128, block_size=16, dtype="fp16",
                                kv_cache_dtype="auto", gqa_ratio=8, platform="cuda"))
    for wg, seed, turns in ((8, 8, "random"), (8, 9, "random"), (3, 3, "until_blocked")):
        out = emu.paged_attention(**kw, partition_size=P, tiling=tiling, platform="cuda", cluster_reduce=True,
                                  pdl=True, workgroups_at_once=wg, schedule_seed=seed, turns=turns)
        assert k.switches > 20, k.switches
        err = reference.relative_error(out, ref, per_seq=True)
        assert err <= reference.REL_ERR_TOL[torch.float16], f"{wg} at once, seed {seed}: relative error {err:.3g}"


def test_emulator_refuses_clusters_it_cannot_form():
    from cpa.inputs import make_paged_inputs

    kw = make_paged_inputs(1, 8, 1, 128, 16, [3000], dtype=torch.float16).as_kwargs()
    for extra, match in ((dict(platform="hip"), "CUDA's"), (dict(partition_size=128), "at most 16"),
                         (dict(fused_reduce=True), "other in-kernel combine"),
                         (dict(return_intermediates=True), "never writes"), (dict(turns="fifo"), "turns")):
        args = {**dict(partition_size=256, tiling="mfma16", platform="cuda", cluster_reduce=True), **extra}
        with pytest.raises(ValueError, match=match):
            emu.paged_attention(**kw, **args)
    one = make_paged_inputs(1, 8, 1, 128, 16, [200], dtype=torch.float16).as_kwargs()
    with pytest.raises(ValueError, match="nothing to combine"):
        emu.paged_attention(**one, partition_size=256, tiling="mfma16", platform="cuda", cluster_reduce=True)


KNOBS = [("cuda", "-DCPA_K_WHOLE_LINES=0"), ("cuda", "-DCPA_V_AFTER_QK=1"), ("cuda", "-DCPA_BT_PREFETCH=0"),
         ("cuda", "-DCPA_FP8_F16_MMA=0"), ("cuda", "-DCPA_REDUCE_FEW_ALWAYS=1"), ("cuda", "-DCPA_FP8_CVT=0"),
         ("hip", "-DCPA_BT_PREFETCH=1"),
         ("hip", "-DCPA_V_AFTER_QK=1")]


@pytest.mark.parametrize("platform,flag", KNOBS, ids=[f"{p}{f[2:]}" for p, f in KNOBS])
def test_knob_builds_in_the_emulator(platform, flag):
    """A knob's build (the -D flags of scripts/h200.sh's A/B arms and of `cpa static --flags`)
    through the emulator, every tiling, bf16 queries with an fp8 cache and with a 16-bit one:
    an arm's lane mapping or control flow checked on the CPU before a GPU times it (breaking
    CPA_K_WHOLE_LINES=0's token order in tilings.h fails here and nowhere else on a CPU)."""
    for tiling in V.TILINGS:
        for kv in V.KV_CACHE_DTYPES:
            r = emu.check(tiling, 256, dtype="bf16", kv_cache_dtype=kv, platform=platform, flags=(flag,),
                          seq_lens=(1, 17, 300, 1000, 2100))
            assert r["ok"], r


def test_emulator_refuses_what_it_does_not_run():
    from cpa.inputs import make_paged_inputs

    inp = make_paged_inputs(1, 8, 1, 128, 16, [40], dtype=torch.float16)
    with pytest.raises(ValueError, match="partition_size"):  # the shared validation, before any build
        emu.paged_attention(**inp.as_kwargs(), partition_size=100, tiling="mfma16")
    fnuz = make_paged_inputs(1, 8, 1, 128, 16, [40], dtype=torch.float16, kv_cache_dtype="fp8",
                             fp8_format="e4m3fnuz")
    with pytest.raises(ValueError, match="e4m3fnuz"):  # MI300's encoding: the NVIDIA kernels do not read it
        emu.paged_attention(**fnuz.as_kwargs(), partition_size=256, tiling="mfma16", platform="cuda")
    with pytest.raises(ValueError, match="heads"):  # AMD's mfma4 holds 4 heads: GQA 8 is no HIP variant
        emu.paged_attention(**inp.as_kwargs(), partition_size=256, tiling="mfma4", platform="hip")
    with pytest.raises(ValueError, match="shared steps need >= 512 tokens"):  # AMD mfma4: 64-token steps
        emu.paged_attention(**make_paged_inputs(1, 4, 1, 128, 16, [40], dtype=torch.float16).as_kwargs(),
                            partition_size=256, tiling="mfma4", shared_steps=True)
    with pytest.raises(ValueError, match="fused_reduce=True is not combined with shared steps"):
        emu.paged_attention(**inp.as_kwargs(), partition_size=512, tiling="mfma16", shared_steps=True,
                            fused_reduce=True)
    for flags, match in ((("-DCPA_KV_ASYNC=1",), "staged"), (("-DCPA_LOAD_ONLY",), "load-only"),
                         (("-O0",), "only -DNAME"), (("-DCPA_EMU_CUDA",), "platform")):
        with pytest.raises(ValueError, match=match):  # (before any compile)
            emu.paged_attention(**inp.as_kwargs(), partition_size=256, tiling="mfma16", flags=flags)
    with pytest.raises(ValueError, match="CPA_FUSED_REDUCE=0"):
        emu.paged_attention(**inp.as_kwargs(), partition_size=64, tiling="mfma16", fused_reduce=True,
                            flags=("-DCPA_FUSED_REDUCE=0",))



def test_cli_runs_variants_through_the_emulator():
    from typer.testing import CliRunner

    from cpa.cli import app

    def ran(*args):
        """`cpa emu ARGS`: exit 0 and the variants of its ok rows."""
        res = CliRunner().invoke(app, ["emu", *args])
        assert res.exit_code == 0, res.output
        return [ln.split()[0] for ln in res.output.splitlines() if ln.endswith("  ok")]

    def refused(*args):
        res = CliRunner().invoke(app, ["emu", *args])
        assert res.exit_code == 2
        return res.output

    assert ran("--tilings", "mfma16,mfma4", "--partition-sizes", "256", "--seq-lens", "5,300") == [
        "mfma16-p256-h128-b16-fp16-kvauto-g16-hip", "mfma4-p256-h128-b16-fp16-kvauto-g4-hip"]
    assert "fp16 or bf16" in refused("--dtype", "fp64")
    assert ran("--platform", "cuda", "--tilings", "mfma4", "--seq-lens", "5,300",
               "--flags", "-DCPA_K_WHOLE_LINES=0") == ["mfma4-p256-h128-b16-fp16-kvauto-g8-cuda"]
    assert "not emulated" in refused("--flags", "-DCPA_KV_ASYNC=4")
    assert ran("--platform", "cuda", "--tilings", "mfma16", "--partition-sizes", "512", "--seq-lens", "5,1600",
               "--shared-steps", "--workgroups-at-once", "4") == ["mfma16-p512-h128-b16-fp16-kvauto-g8-cuda"]
    assert "1 to 64" in refused("--workgroups-at-once", "0")
    assert ran("--platform", "cuda", "--tilings", "mfma16", "--seq-lens", "5,1000", "--cluster",
               "--turns", "until_blocked") == ["mfma16-p256-h128-b16-fp16-kvauto-g8-cuda"]
    assert "until_blocked" in refused("--turns", "fifo")
    assert ran("--platform", "cuda", "--tilings", "mfma16", "--seq-lens", "5,1000", "--pdl",
               "--workgroups-at-once", "8") == ["mfma16-p256-h128-b16-fp16-kvauto-g8-cuda"]
    assert ran("--platform", "cuda", "--tilings", "mfma16", "--seq-lens", "5,1000", "--pdl", "--cluster",
               "--workgroups-at-once", "8") == ["mfma16-p256-h128-b16-fp16-kvauto-g8-cuda"]
    assert "CUDA's" in refused("--tilings", "mfma16", "--pdl")
    assert ran("--tilings", "mfma16", "--seq-lens", "5,1000", "--fused", "--memory-model", "sequential") == [
        "mfma16-p256-h128-b16-fp16-kvauto-g16-hip"]
    assert "acquire-release, release, sequential" in refused("--memory-model", "tso")


def test_two_threads_emulate_at_once():
    """The emulator's state is per host thread (ctypes releases the GIL during a launch)."""
    from concurrent.futures import ThreadPoolExecutor as Pool

    with Pool(2) as pool:
        rows = list(pool.map(lambda t: emu.check(t, 256, seq_lens=(1, 300, 700), seed=7), ["mfma16", "mfma4"] * 2))
    assert all(r["ok"] for r in rows), rows
    assert rows[0]["rel_err"] == rows[2]["rel_err"] and rows[1]["rel_err"] == rows[3]["rel_err"]  # deterministic


@pytest.mark.parametrize("tiling", sorted(V.TILINGS))
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_mi300s_fp8_encoding_e4m3fnuz(tiling, dtype):
    """gfx94x's fp8 is e4m3fnuz (exponent bias 8), which vLLM writes there: the AMD kernels read
    it with the same bit conversion and a host factor of 128 (e4m3fn: 256). Checked against the
    reference and the independent float64 decode of the bytes; read as e4m3fn it is ~2x off."""
    from cpa.inputs import make_paged_inputs

    P, lens = 256, [1, 17, 255, 256, 257, 775]
    inp = make_paged_inputs(len(lens), GQA["hip"][tiling] * 2, 2, 128, 16, lens, dtype=TORCH_DTYPE[dtype],
                            kv_cache_dtype="fp8", fp8_format="e4m3fnuz", seed=11)
    assert inp.key_cache.dtype == torch.float8_e4m3fnuz
    kw = inp.as_kwargs()
    out = emu.paged_attention(**kw, partition_size=P, tiling=tiling)
    tol = reference.REL_ERR_TOL[inp.query.dtype]
    assert reference.relative_error(out, reference.paged_attention(**kw), per_seq=True) <= tol
    assert reference.relative_error(out, reference.naive_paged_attention_fp64(inp), per_seq=True) <= tol
    # vLLM's uint8 storage with the format named: the same launch
    raw = dict(kw, key_cache=inp.key_cache.view(torch.uint8), value_cache=inp.value_cache.view(torch.uint8))
    assert torch.equal(emu.paged_attention(**raw, partition_size=P, tiling=tiling, fp8_format="e4m3fnuz"), out)
    wrong = emu.paged_attention(**raw, partition_size=P, tiling=tiling)  # (read as e4m3fn: the CPU's default)
    assert reference.relative_error(wrong, out) > 0.5


# ------------------------------------------------------------ seeded random configurations
def _random_cases(n: int, seed: int = 2026, platform: str = "hip"):
    """Valid configurations of `platform` drawn at random (fixed seed): what the fixed matrix above reaches
    least -- the block-wide reduce over many partitions, the fused combine over several of its
    8-partition rounds, GQA ratios that leave tile rows empty, both fp8 encodings, ALiBi, a grid
    sized past every sequence, lengths at block and partition edges."""
    import random

    rng = random.Random(seed)
    out = []
    while len(out) < n:
        t = rng.choice(V.TILINGS)
        p = rng.choice((64, 128, 128, 256, 512, 1024))
        head, block = rng.choice((64, 128, 256)), rng.choice((16, 32))
        gqa = rng.randint(1, 4 if t == "mfma4" and platform == "hip" else 16)
        kv = rng.choice(("auto", "fp8"))
        try:
            v = V.variant_for(tiling=t, partition_size=p, head_size=head, block_size=block, dtype="fp16",
                              kv_cache_dtype=kv, gqa_ratio=gqa, platform=platform)
        except ValueError:
            continue
        parts = rng.choice((2, 5, 9, 17)) if p <= 128 else rng.choice((1, 2, 3))
        edge = [1, block - 1, block + 1, p - 1, p, p + 1]
        lens = [max(1, min(parts * p, rng.choice(edge + [rng.randint(1, parts * p)])))
                for _ in range(rng.randint(0, 4))] + [parts * p - rng.choice((0, 0, 1))]  # (the longest last)
        out.append(dict(variant=v, tiling=t, partition_size=p, head_size=head, block_size=block, gqa=gqa,
                        num_kv_heads=rng.randint(1, 3), kv=kv, dtype=rng.choice(("fp16", "bf16")),
                        fp8_format=rng.choice(("e4m3fn", "e4m3fnuz") if platform == "hip" else ("e4m3fn",)),
                        alibi=rng.random() < 0.3, platform=platform,
                        fused=rng.random() < 0.4, extra=rng.choice((0, 0, p)), lens=lens, seed=rng.randrange(10_000)))
    return out


RANDOM_CASES = _random_cases(32) + _random_cases(16, seed=2027, platform="cuda")


@pytest.mark.parametrize("c", RANDOM_CASES, ids=[f"r{i}-{c['platform']}" for i, c in enumerate(RANDOM_CASES)])
def test_random_configurations(c):
    from cpa.inputs import make_paged_inputs

    inp = make_paged_inputs(len(c["lens"]), c["gqa"] * c["num_kv_heads"], c["num_kv_heads"], c["head_size"],
                            c["block_size"], c["lens"], dtype=TORCH_DTYPE[c["dtype"]], kv_cache_dtype=c["kv"],
                            seed=c["seed"], alibi=c["alibi"], fp8_format=c["fp8_format"])
    kw = inp.as_kwargs()
    msl = max(c["lens"]) + c["extra"]  # (a grid sized past every sequence)
    P = c["partition_size"]
    out, es, ml, tmp = emu.paged_attention(**kw, partition_size=P, tiling=c["tiling"], fused_reduce=c["fused"],
                                           return_intermediates=True, max_seq_len=msl, check_values=False,
                                           platform=c["platform"])
    ref = reference.paged_attention(**kw)
    tol = reference.REL_ERR_TOL[inp.query.dtype]
    assert not torch.isnan(out).any()
    err = reference.relative_error(out, ref, per_seq=True)
    assert err <= tol, f"{c['variant'].name} {c['lens']} fused={c['fused']}: output error {err:.3g} > {tol:g}"
    _, ref_es, ref_ml, _ = reference.paged_attention(**kw, partition_size=P, return_intermediates=True)
    parts = torch.tensor([math.ceil(s / P) for s in c["lens"]])
    valid = (torch.arange(ref_ml.shape[-1])[None, :] < parts[:, None])[:, None, :].expand_as(ref_ml)
    torch.testing.assert_close(ml[..., :ref_ml.shape[-1]][valid], ref_ml[valid], rtol=1e-3, atol=2e-3)
    torch.testing.assert_close(es[..., :ref_es.shape[-1]][valid], ref_es[valid], rtol=2e-3, atol=1e-4)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_random_cases_reach_the_paths_the_matrix_reaches_least(platform):
    cases = [c for c in RANDOM_CASES if c["platform"] == platform]
    multi = [c for c in cases if max(c["lens"]) > 8 * c["partition_size"]]
    assert any(c["fused"] for c in multi) and any(not c["fused"] for c in multi)
    assert {c["fp8_format"] for c in cases if c["kv"] == "fp8"} == (
        {"e4m3fn", "e4m3fnuz"} if platform == "hip" else {"e4m3fn"})
    assert any(c["extra"] for c in cases) and any(c["alibi"] for c in cases)
    assert {c["tiling"] for c in cases} == set(V.TILINGS)
