"""Compile-only checks, no GPU: the variants compile for gfx942 (clang-19, HIP device-only)
and sm_90 (nvcc), and the ISA holds the matrix-core instructions each tiling promises.

By default a subset: every tiling x partition size x dtype x KV-cache dtype at head 128 /
block 16 with the GQA-8 heads cap, every other head size and block size at partition 256,
and the smallest and largest heads caps once. Set
CPA_COMPILE_ALL=1 for every variant (what `cpa static` ships in data/static/).
"""

from __future__ import annotations

import os
import re
import shutil

import pytest

from cpa import variants as V

pytestmark = pytest.mark.compile


def _subset(platform):
    if os.environ.get("CPA_COMPILE_ALL") == "1":
        return list(V.all_variants(platform))
    # the GQA-8 instantiation of each tiling (scalar's larger head caps compile slowly)
    def gqa8(vs):
        return [v for v in vs if v.heads_cap == V.heads_cap_for(v.tiling, platform, min(8, max(v.info.heads_caps)))]

    vs = gqa8(V.all_variants(platform, head_sizes=(128,), block_sizes=(16,)))
    vs += gqa8(V.all_variants(platform, partition_sizes=(256,), head_sizes=(64, 256), dtypes=("fp16",),
                              kv_cache_dtypes=("auto", "fp8")))
    vs += gqa8(V.all_variants(platform, partition_sizes=(256,), block_sizes=(32,), dtypes=("bf16",)))
    vs += list(V.all_variants(platform, partition_sizes=(512,), head_sizes=(128,), block_sizes=(16,),
                              dtypes=("fp16",), kv_cache_dtypes=("auto",), tilings=("mfma16", "scalar"),
                              heads_caps=(1, 16)))
    return list(dict.fromkeys(vs))


def _have(exe):
    return shutil.which(exe) is not None


@pytest.fixture(scope="module")
def gfx942():
    if not (_have("clang++-19") or _have("clang++")):
        pytest.skip("clang-19 not installed (apt-get install clang-19 lld-19 libamdhip64-dev)")
    from cpa import static

    return static.compile_variants(_subset("hip"), "gfx942", progress=False)


@pytest.fixture(scope="module")
def sm90():
    if not _have("nvcc"):
        pytest.skip("nvcc not on PATH")
    from cpa import static

    return static.compile_variants(_subset("cuda"), "sm_90", progress=False)


EXPECTED = {
    ("gfx942", "mfma16"): r"v_mfma_f32_16x16x16_{dt}",
    ("gfx942", "mfma4"): r"v_mfma_f32_4x4x4_16b_{dt}",
    ("sm_90", "mfma16"): r"mma\.sync\.m16n8k16",
    ("sm_90", "mfma4"): r"mma\.sync\.m16n8k8",
}


def _check_mma(df, arch):
    att = df[df.kernel == "attention"]
    assert len(att) > 0
    mma_cols = [c for c in att.columns if c.startswith("mma:")]
    for _, r in att.iterrows():
        present = {c[4:]: int(r[c]) for c in mma_cols if r[c] > 0}
        if r.tiling == "scalar":
            assert not present, f"{r.variant}: scalar tiling uses matrix cores: {present}"
            continue
        dt = V.tile_dtype(r["tiling"], r["dtype"], r["kv_cache_dtype"])  # bf16 + fp8: fp16 tiles
        pat = EXPECTED[(arch, r["tiling"])].format(dt={"fp16": "f16", "bf16": "bf16"}[dt])
        assert present, f"{r.variant}: no matrix-core instruction in the {arch} code"
        wrong = [m for m in present if not re.fullmatch(pat, m)]
        assert not wrong, f"{r.variant}: unexpected matrix-core instructions {wrong} (expected {pat})"
        # QK and PV of one step on the matrix cores: at least head_size/16 instructions each
        assert sum(present.values()) >= 2 * r.head_size // 16, f"{r.variant}: too few mma {present}"
    red = df[df.kernel == "reduce"]
    assert (red[mma_cols].sum(axis=1) == 0).all(), "the reduce kernel should not use matrix cores"


def test_gfx942_every_variant_compiles_with_expected_mfma(gfx942):
    _check_mma(gfx942, "gfx942")
    att = gfx942[gfx942.kernel == "attention"]
    assert (att.waves_per_simd_compiler >= 1).all()
    assert not att.dynamic_stack.any(), "an unresolved device-library call (dynamic stack) skews the resources"
    assert (att.lds_bytes <= 64 * 1024).all(), "LDS over the 64 KiB a CDNA3 workgroup can have"
    assert (att.global_loads > 0).all()


def test_gfx942_mfma16_keeps_accumulators_in_vgprs_for_a_third_wave(gfx942, tmp_path):
    """CPA_MIN_BLOCKS=0 (the per-variant rule): AMD mfma16 at head <= 128 asks clang for two
    resident workgroups; it then keeps the output accumulators in VGPRs (no AGPRs, no
    scratch) and head 128 fits 3 waves per SIMD, head 64 5. Forced back to 1 the same kernel
    takes AGPRs and 2 waves per SIMD at head 128 -- the rule is what moves it."""
    from cpa import static

    att = gfx942[(gfx942.kernel == "attention") & (gfx942.tiling == "mfma16") & (gfx942.head_size <= 128)]
    assert len(att) > 0
    assert (att.agprs == 0).all() and (att.scratch_bytes == 0).all(), att[["variant", "agprs", "scratch_bytes"]]
    assert (att[att.head_size == 128].waves_per_simd_compiler >= 3).all()
    assert (att[att.head_size == 64].waves_per_simd_compiler >= 5).all()
    v = V.Variant("mfma16", 256, 128, 16, "fp16", "auto", 16, "hip")
    res, _ = static._compile_amd([v], "gfx942", tmp_path, flags=["-DCPA_MIN_BLOCKS=1"])
    old = next(r for k, r in res.items() if static.attention_symbol_key(v) in k)
    assert int(old["AGPRs"]) > 0 and int(old["Occupancy [waves/SIMD]"]) == 2, old


def test_sm90_every_variant_compiles_with_expected_mma(sm90):
    _check_mma(sm90, "sm_90")
    att = sm90[sm90.kernel == "attention"]
    assert (att.registers <= 255).all()
    assert (att.shared_bytes <= 48 * 1024).all(), "static shared memory over 48 KiB"
    assert (att.exp > 0).all()


def test_scalar_tiling_has_no_matrix_instructions_anywhere(gfx942, sm90):
    for df in (gfx942, sm90):
        s = df[(df.tiling == "scalar") & (df.kernel == "attention")]
        assert len(s) > 0
        assert (s[[c for c in df.columns if c.startswith("mma:")]].sum(axis=1) == 0).all()


# The staged main loop is an A/B knob (-DCPA_KV_ASYNC=1|2, off by default): keep it compiling,
# and make sure it only changes what it says it changes.
_STAGED = [V.Variant("mfma16", 256, 128, 16, "fp16", "auto", 8, "cuda"),
           V.Variant("mfma4", 512, 64, 32, "bf16", "fp8", 8, "cuda"),
           V.Variant("scalar", 256, 128, 16, "fp16", "auto", 8, "cuda")]


def _sm90_attention(tmp_path, variants, flags=()):
    """cpa.static's own nvcc compile of one TU with extra flags: per attention kernel of each
    variant, its ptxas resources and its PTX text."""
    from cpa import static

    res, _ = static._compile_nv(variants, "sm_90", tmp_path, flags=flags)
    ptx = static.split_ptx_entries((tmp_path / "tu.ptx").read_text())

    def by_variant(d):
        return {v.name: next(x for k, x in d.items() if static.attention_symbol_key(v) in k) for v in variants}

    return by_variant(res), {name: "\n".join(body) for name, body in by_variant(ptx).items()}


def _sm90_default_and_flagged(tmp_path, variants, flags):
    """_sm90_attention of the default build and of the build with `flags`, for an A/B of a knob:
    ((resources, ptx) default, (resources, ptx) flagged)."""
    return _sm90_attention(tmp_path, variants), _sm90_attention(tmp_path, variants, flags)


@pytest.mark.parametrize("arm", ["1", "2"])
def test_sm90_staged_loop_uses_cp_async_only_when_asked(tmp_path, arm):
    if not _have("nvcc"):
        pytest.skip("nvcc not on PATH")
    _, staged = _sm90_attention(tmp_path, _STAGED, [f"-DCPA_KV_ASYNC={arm}"])
    _, direct = _sm90_attention(tmp_path, _STAGED)
    for v in _STAGED:
        if v.tiling == "scalar":  # no Staged: the scalar tiling keeps its direct loads
            assert "cp.async" not in staged[v.name]
            continue
        # .ca, not .cg: the bypassing copies asked the H200's L2 for every sector twice (ncu)
        assert "cp.async.ca.shared.global" in staged[v.name] and "cp.async.wait_group" in staged[v.name]
        assert "cp.async.cg" not in staged[v.name]
        assert "ld.shared.v4" in staged[v.name] or "ld.shared.v2" in staged[v.name]
        assert "cp.async" not in direct[v.name]


def test_sm90_split_staged_loop(tmp_path):
    """-DCPA_KV_ASYNC=4: K and V of a step are their own cp.async groups (two commits per step
    plus the first step's two), and the mma variants compile without spills (correctness and
    speed: `CPA_AB_FLAG=-DCPA_KV_ASYNC=4 bash scripts/h200.sh ab-flag` on the H200)."""
    if not _have("nvcc"):
        pytest.skip("nvcc not on PATH")
    res, split = _sm90_attention(tmp_path, _STAGED, ["-DCPA_KV_ASYNC=4"])
    for v in _STAGED:
        if v.tiling == "scalar":
            assert "cp.async" not in split[v.name]
            continue
        body = split[v.name]
        assert body.count("cp.async.commit_group") == 4, v.name
        # (the instruction list: the step's wait for K, and the wait for V -- all but the
        # newest group, or all on the last step)
        assert body.count("cp.async.wait_group") >= 3, v.name
        r = res[v.name]
        assert r["spill_stores"] + r["spill_loads"] == 0 and r["registers"] <= 255, (v.name, r)


def test_sm90_ring_loop_uses_bulk_copies_only_when_asked(tmp_path):
    """-DCPA_KV_ASYNC=3: the mma tilings fill their rings with TMA bulk copies that complete on
    mbarriers (no per-16-byte cp.async), read them with ld.shared, and the main variant keeps
    two workgroups per SM (<= 255 registers without spills; the dynamic shared memory of its
    ring is checked on the H200 by the GPU tests)."""
    if not _have("nvcc"):
        pytest.skip("nvcc not on PATH")
    res, ring = _sm90_attention(tmp_path, _STAGED, ["-DCPA_KV_ASYNC=3"])
    bulk = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
    for v in _STAGED:
        if v.tiling == "scalar":
            assert "cp.async" not in ring[v.name] and "mbarrier" not in ring[v.name]
            continue
        assert bulk in ring[v.name] and "mbarrier.try_wait.parity" in ring[v.name]
        assert "mbarrier.arrive.expect_tx" in ring[v.name] and "fence.proxy.async" in ring[v.name]
        assert "cp.async.cg" not in ring[v.name]
        assert "ld.shared.v4" in ring[v.name] or "ld.shared.v2" in ring[v.name]
    main = res[_STAGED[0].name]
    assert main["spill_stores"] == 0 and main["registers"] <= 255, main


def test_sm90_refuses_a_removed_staged_loop(tmp_path):
    """-DCPA_KV_ASYNC=5 / 6 (the hybrid and the workgroup ring, measured slower and removed)
    must not compile as some other loop."""
    if not _have("nvcc"):
        pytest.skip("nvcc not on PATH")
    with pytest.raises(RuntimeError, match="CPA_KV_ASYNC is 0"):
        _sm90_attention(tmp_path, [_STAGED[0]], ["-DCPA_KV_ASYNC=6"])


_FP8 = [V.Variant("mfma16", 256, 128, 16, "fp16", "fp8", 8, "cuda"),
        V.Variant("mfma4", 512, 64, 32, "bf16", "fp8", 8, "cuda"),
        V.Variant("scalar", 256, 128, 16, "bf16", "fp8", 8, "cuda"),
        V.Variant("mfma16", 256, 128, 16, "bf16", "auto", 8, "cuda")]


def test_sm90_fp8_decodes_with_the_hardware_conversion(tmp_path):
    """sm_90 fp8 variants decode e4m3 pairs with cvt.rn.f16x2.e4m3x2 (and one exact 2^-8
    multiply per pair, the kernel's value / 256 convention); -DCPA_FP8_CVT=0 gives the
    integer bit trick, which AMD always uses; 16-bit caches decode nothing."""
    if not _have("nvcc"):
        pytest.skip("nvcc not on PATH")
    (_, hw), (_, bits) = _sm90_default_and_flagged(tmp_path, _FP8, ["-DCPA_FP8_CVT=0"])
    for v in _FP8:
        n = hw[v.name].count("cvt.rn.f16x2.e4m3x2")
        if v.kv_cache_dtype == "fp8":
            assert n > 0 and hw[v.name].count("mul.rn.f16x2") >= n, v.name
        else:
            assert n == 0, v.name
        assert "e4m3" not in bits[v.name], v.name


def test_sm90_bf16_queries_with_fp8_cache_run_fp16_tiles(tmp_path):
    """bf16 queries with an fp8 cache: the mma tilings run f16 mma (the cache decodes straight
    to fp16, no fp16 -> fp32 conversions) and convert the query once (cvt.rn.f16x2.f32 after a
    wave max); -DCPA_FP8_F16_MMA=0 keeps bf16 mma and the conversions. Other dtype pairs and
    the scalar tiling are the same code either way."""
    if not _have("nvcc"):
        pytest.skip("nvcc not on PATH")
    (res_on, on), (res_off, off) = _sm90_default_and_flagged(tmp_path, _FP8, ["-DCPA_FP8_F16_MMA=0"])
    mma = re.compile(r"mma\.sync\.aligned\.m16n8k(?:16|8)\.row\.col\.f32\.(\w+)\.")
    for v in _FP8:
        kinds_on, kinds_off = set(mma.findall(on[v.name])), set(mma.findall(off[v.name]))
        if v.tiling == "scalar":
            assert not kinds_on and on[v.name] == off[v.name], v.name
            continue
        want = {"fp16": "f16", "bf16": "bf16"}[v.tile_dtype]
        assert kinds_on == {want}, (v.name, kinds_on)
        assert kinds_off == {"f16" if v.dtype == "fp16" else "bf16"}, (v.name, kinds_off)
        if v.tile_dtype != v.dtype:
            assert "cvt.f32.f16" not in on[v.name] and "cvt.f32.f16" in off[v.name], v.name
            assert res_on[v.name]["registers"] < res_off[v.name]["registers"], (res_on[v.name], res_off[v.name])
        else:
            assert on[v.name] == off[v.name], v.name


def test_sm90_head256_loads_v_after_qk_by_default(tmp_path):
    """Head 256: a 32-token step's K and V alone are 256 registers, so by default the mma
    tilings load V after QK (CPA_V_AFTER_QK=-1) and stop spilling hundreds of bytes per
    thread; -DCPA_V_AFTER_QK=0 is the old build. Head 128 and the scalar tiling are the same
    code either way."""
    if not _have("nvcc"):
        pytest.skip("nvcc not on PATH")
    vs = [V.Variant("mfma16", 512, 256, 16, "fp16", "auto", 8, "cuda"),
          V.Variant("mfma4", 1024, 256, 32, "bf16", "fp8", 8, "cuda"),
          V.Variant("scalar", 512, 256, 16, "fp16", "auto", 8, "cuda"),
          V.Variant("mfma16", 512, 128, 16, "fp16", "auto", 8, "cuda")]
    (res, ptx), (res0, ptx0) = _sm90_default_and_flagged(tmp_path, vs, ["-DCPA_V_AFTER_QK=0"])
    for v in vs:
        if v.tiling == "scalar" or v.head_size < 256:
            assert ptx[v.name] == ptx0[v.name], v.name
            continue
        spill, spill0 = (r[v.name]["spill_stores"] + r[v.name]["spill_loads"] for r in (res, res0))
        assert spill <= 64 and spill0 >= 4 * max(spill, 64), (v.name, spill, spill0)


def test_v_after_qk_knob_frees_registers(tmp_path):
    """-DCPA_V_AFTER_QK=1 exists to keep K and V from being live together: with it, the mma
    attention kernel at head 128 must need fewer registers than without and still not spill
    (on sm_90 it fits 3 workgroups per SM: <= 168 registers). Only with the block-table
    entries read per step (-DCPA_BT_PREFETCH=0): when V's block offsets are shuffles of
    registers, ptxas hoists V's loads above QK again (214 registers, as without the knob)."""
    if not _have("nvcc"):
        pytest.skip("nvcc not on PATH")
    v = V.Variant("mfma16", 512, 128, 16, "fp16", "auto", 8, "cuda")
    base = _sm90_attention(tmp_path, [v])[0][v.name]
    late = _sm90_attention(tmp_path, [v], ["-DCPA_V_AFTER_QK=1", "-DCPA_BT_PREFETCH=0"])[0][v.name]
    assert late["registers"] < base["registers"]
    assert late["registers"] <= 168 and late["spill_stores"] == 0, late


def test_sm90_default_loads_whole_key_lines_and_reads_the_block_table_once(tmp_path):
    """The two load-path defaults of the mma tilings (H200 A/Bs in notes/kernel-notes.md), each
    against its `=0` arm, which must keep compiling: whole-line K loads add the quad transpose
    of P (shfl.sync.bfly with lane masks 1 and 2, 4 per 8 heads per step) and no spills; the
    per-lane block-table entries turn the per-step table reads into shuffles (shfl.sync.idx),
    but only where they were measured (16-bit cache, head <= 128, <= 8 heads per tile): on an
    fp8 cache they cost registers, so that variant keeps its table reads."""
    if not _have("nvcc"):
        pytest.skip("nvcc not on PATH")
    mma = [v for v in _STAGED if v.tiling != "scalar"]
    (res, default), (res0, off) = _sm90_default_and_flagged(
        tmp_path, mma, ["-DCPA_K_WHOLE_LINES=0", "-DCPA_BT_PREFETCH=0"])
    for v in mma:
        d, o = default[v.name], off[v.name]
        assert d.count("shfl.sync.bfly") > o.count("shfl.sync.bfly"), v.name
        tabled = v.kv_cache_dtype == "auto" and v.head_size <= 128 and v.heads_cap <= 8
        # (both builds also have the fused combine's weight shuffles at head >= 128)
        assert (d.count("shfl.sync.idx") > o.count("shfl.sync.idx")) == tabled, v.name
        assert "mma.sync.aligned" in d and "mma.sync.aligned" in o
        assert res[v.name]["spill_stores"] == 0 and res0[v.name]["spill_stores"] == 0, v.name


def test_sm90_cluster_combine_in_every_attention_kernel(tmp_path):
    """The cluster combine (cpa/csrc/attention.h cluster_combine) is in the sm_90 attention
    kernel of every tiling: cluster barriers and distributed shared-memory loads in its PTX;
    the reduce kernels have none."""
    if not _have("nvcc"):
        pytest.skip("nvcc not on PATH")
    _, ptx = _sm90_attention(tmp_path, _STAGED)
    for name, text in ptx.items():
        assert "barrier.cluster.arrive" in text and "barrier.cluster.wait" in text, name
        assert "mapa.shared::cluster" in text and "ld.shared::cluster" in text, name
    from cpa import static

    entries = static.split_ptx_entries((tmp_path / "tu.ptx").read_text())
    reduces = [body for k, body in entries.items() if "reduce" in k]
    assert reduces and not any("cluster" in op for body in reduces for op in body)
