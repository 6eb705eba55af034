"""Variant constraints raise before any build; defaults come from one table."""

from __future__ import annotations

import pytest
import torch

from cpa import variants as V


def test_names_unique_and_round_trip():
    for platform in V.PLATFORMS:
        vs = list(V.all_variants(platform))
        assert len({v.name for v in vs}) == len(vs)
        for v in vs[:50]:
            assert V.Variant(**v.as_dict()) == v


@pytest.mark.parametrize("field,value,match", [
    ("partition_size", 32, "partition_size"), ("partition_size", 16384, "partition_size"),
    ("partition_size", 96, "partition_size"), ("tiling", "mfma32", "tiling"), ("head_size", 80, "head_size"),
    ("block_size", 8, "block_size"), ("dtype", "fp32", "dtype"), ("kv_cache_dtype", "int8", "kv_cache_dtype"),
    ("heads_cap", 3, "heads_cap"), ("platform", "metal", "platform"),
])
def test_invalid_field_raises(field, value, match):
    good = dict(tiling="mfma16", partition_size=256, head_size=128, block_size=16, dtype="fp16",
                kv_cache_dtype="auto", heads_cap=8, platform="cuda")
    with pytest.raises(ValueError, match=match):
        V.Variant(**{**good, field: value})


def test_heads_cap_per_platform():
    assert V.heads_cap_for("mfma16", "cuda", 8) == 8
    assert V.heads_cap_for("mfma16", "cuda", 9) == 16
    assert V.heads_cap_for("mfma16", "hip", 1) == 16
    assert V.heads_cap_for("mfma4", "hip", 4) == 4
    assert V.heads_cap_for("scalar", "cuda", 3) == 4
    with pytest.raises(ValueError, match="at most 4"):
        V.heads_cap_for("mfma4", "hip", 5)
    with pytest.raises(ValueError, match="GQA"):
        V.heads_cap_for("mfma16", "cuda", 17)


def _variant(**kw):
    """A Variant built directly (not through variant_for, whose cache would keep a variant of a
    widened domain for the tests after this one)."""
    return V.Variant(**{**dict(dtype="fp16", kv_cache_dtype="auto"), **kw})


def test_partition_must_hold_whole_wave_steps(monkeypatch):
    # hip mfma4 and scalar take 64 tokens per wave step: 64 is the smallest partition there
    for t in ("mfma4", "scalar"):
        v = V.variant_for(tiling=t, partition_size=64, head_size=128, block_size=32, dtype="fp16",
                          kv_cache_dtype="auto", gqa_ratio=4, platform="hip")
        assert v.partition_size % v.tokens_per_step == 0
    # every partition size of today's domain holds whole steps and blocks, so the two rules are
    # reached with a wider domain (the rules guard a future change of PARTITION_SIZES / BLOCK_SIZES)
    monkeypatch.setattr(V, "PARTITION_SIZES", (32, *V.PARTITION_SIZES))
    monkeypatch.setattr(V, "BLOCK_SIZES", (*V.BLOCK_SIZES, 64))
    for t in ("mfma4", "scalar"):
        with pytest.raises(ValueError, match=rf"partition_size=32 is not a multiple of the 64 tokens one wave of "
                                             rf"tiling '{t}' handles per step on hip"):
            _variant(tiling=t, partition_size=32, head_size=128, block_size=16, heads_cap=4, platform="hip")
    # 32 tokens per step on cuda: 32 is a whole step, but not a whole block of 64
    assert _variant(tiling="mfma16", partition_size=32, head_size=128, block_size=16, heads_cap=8,
                    platform="cuda").partition_size == 32
    with pytest.raises(ValueError, match=r"partition_size=32 is not a multiple of block_size=64"):
        _variant(tiling="mfma16", partition_size=32, head_size=128, block_size=64, heads_cap=8, platform="cuda")
    assert _variant(tiling="mfma16", partition_size=64, head_size=128, block_size=64, heads_cap=8,
                    platform="cuda").block_size == 64
    # all_variants skips exactly the refused combinations
    got = {(v.tiling, v.partition_size, v.block_size)
           for v in V.all_variants("hip", partition_sizes=(32, 64), head_sizes=(128,), block_sizes=(16, 64),
                                   dtypes=("fp16",), kv_cache_dtypes=("auto",))}
    assert ("mfma16", 32, 16) in got and ("mfma16", 32, 64) not in got and ("mfma16", 64, 64) in got
    assert not any(p == 32 for t, p, _ in got if t in ("mfma4", "scalar"))


def test_scalar_head_size_multiple_of_wave(monkeypatch):
    V.variant_for(tiling="scalar", partition_size=256, head_size=64, block_size=16, dtype="bf16",
                  kv_cache_dtype="fp8", gqa_ratio=1, platform="hip")
    # today's head sizes are multiples of both wave sizes: the rule is reached with a wider domain
    monkeypatch.setattr(V, "HEAD_SIZES", (*V.HEAD_SIZES, 80, 96))
    for platform, head, wave in (("hip", 96, 64), ("cuda", 80, 32), ("hip", 80, 64)):
        with pytest.raises(ValueError, match=rf"tiling 'scalar' needs head_size a multiple of the wave size {wave}$"):
            _variant(tiling="scalar", partition_size=256, head_size=head, block_size=16, heads_cap=1,
                     platform=platform)
    # a head size of one wave on cuda (3 x 32) is not one on hip (1.5 x 64); the matrix-core tilings have no such rule
    assert _variant(tiling="scalar", partition_size=256, head_size=96, block_size=16, heads_cap=1,
                    platform="cuda").head_size == 96
    assert _variant(tiling="mfma16", partition_size=256, head_size=96, block_size=16, heads_cap=16,
                    platform="hip").head_size == 96


def test_defaults_table():
    assert V.default_choice("gfx942", 8)[:2] == ("mfma16", 256)
    assert V.default_choice("gfx942", 2)[:2] == ("mfma4", 256)
    tiling, p, src = V.default_choice("sm_90", 8)
    assert tiling in V.TILINGS and p == V.BY_SHAPE and "measured" in src
    assert "sm_90" in V.SHAPE_MODELS  # a BY_SHAPE rule needs the device's model
    assert V.default_choice("sm_75", 8)[:2] == ("mfma16", 256)  # fallback rule
    # sm_90: one choice for every query / KV cache dtype pair (measured: they tie)
    for dt, kv in (("bf16", "fp8"), ("bf16", "auto"), ("fp16", "fp8"), ("fp16", "auto"), (None, None)):
        assert V.default_choice("sm_90", 8, dt, kv)[:2] == (tiling, p)
    assert V.default_choice("gfx942", 8, "bf16", "fp8")[:2] == ("mfma16", 256)
    # every arch with a shape rule has a model; no AMD arch has one (nothing measured there)
    for arch, rules in V.DEFAULTS.items():
        if any(r[2] == V.BY_SHAPE for r in rules):
            assert arch in V.SHAPE_MODELS
    assert not any(a.startswith("gfx") for a in V.SHAPE_MODELS)


CANDIDATE_AXES = dict(head_size=128, block_size=16, dtype="fp16", kv_cache_dtype="auto", gqa_ratio=8)


@pytest.mark.parametrize("platform,tiling,max_seq_len,want", [
    # NVIDIA: 32 tokens per wave step, 4 waves: at least 128; at most the first size covering the context
    ("cuda", "mfma16", 100_000, [128, 256, 512, 1024, 2048, 4096, 8192]),
    ("cuda", "mfma16", 1000, [128, 256, 512, 1024]),
    ("cuda", "mfma16", 1024, [128, 256, 512, 1024]),
    ("cuda", "mfma16", 1025, [128, 256, 512, 1024, 2048]),
    ("cuda", "mfma16", 1, [128]),
    # AMD mfma4 / scalar take 64 tokens per wave step: at least 256
    ("hip", "mfma4", 4096, [256, 512, 1024, 2048, 4096]),
    ("hip", "mfma16", 300, [128, 256, 512]),
])
def test_partition_candidates(platform, tiling, max_seq_len, want):
    axes = dict(CANDIDATE_AXES, gqa_ratio=4 if tiling == "mfma4" else 8)
    assert V.partition_candidates(tiling=tiling, platform=platform, max_seq_len=max_seq_len, **axes) == want


def test_partition_candidates_respect_block_size():
    got = V.partition_candidates(tiling="mfma16", platform="cuda", max_seq_len=64, num_waves=1,
                                 **dict(CANDIDATE_AXES, block_size=32))
    assert got == [64]  # 32 (one step) is not a partition size the library builds; 64 is


def test_defaults_rule_for_a_dtype_pair(monkeypatch):
    """A rule may name the (query dtype, KV cache dtype) it is for; other pairs skip it."""
    rules = [(16, "mfma4", 1024, "pair rule", ("bf16", "fp8")), (16, "mfma16", 512, "general")]
    monkeypatch.setitem(V.DEFAULTS, "sm_90", rules)
    assert V.default_choice("sm_90", 8, "bf16", "fp8")[:2] == ("mfma4", 1024)
    assert V.default_choice("sm_90", 8, torch.bfloat16, "fp8_e4m3")[:2] == ("mfma4", 1024)
    for dt, kv in (("bf16", "auto"), ("fp16", "fp8"), (None, None)):
        assert V.default_choice("sm_90", 8, dt, kv)[:2] == ("mfma16", 512)


def test_sources_instantiate_exactly_the_variant():
    v = V.variant_for(tiling="mfma4", partition_size=512, head_size=64, block_size=32, dtype="bf16",
                      kv_cache_dtype="fp8", gqa_ratio=8, platform="cuda")
    src = v.source()
    assert v.name in src and "cpa::TilingMfma4, cpa::BF16, 64, 32, true, 512, 8" in src
    assert "paged_attention_kernel" in v.kernel_instantiation_source()


def test_dtype_and_kv_names():
    import torch

    assert V.dtype_name(torch.float16) == "fp16" and V.dtype_name(torch.bfloat16) == "bf16"
    with pytest.raises(TypeError):
        V.dtype_name(torch.float32)
    assert V.kv_name("fp8_e4m3") == "fp8"
    with pytest.raises(ValueError):
        V.kv_name("fp8_e5m2")


def test_cluster_rules():
    assert V.cluster_unsupported("sm_90", 2) is None and V.cluster_unsupported("sm_90", 16) is None
    assert "at most 16" in V.cluster_unsupported("sm_90", 17)
    assert "nothing to combine" in V.cluster_unsupported("sm_90", 1)
    assert "sm_90" in V.cluster_unsupported("sm_80", 4) and "sm_90" in V.cluster_unsupported("gfx942", 4)
    # H200 (132 SMs): the measured rule, grids of at most half the SMs
    assert V.cluster_default("sm_90", 4, 1, 8, 132)  # 32 workgroups
    assert V.cluster_default("sm_90", 8, 1, 8, 132)  # 64
    assert not V.cluster_default("sm_90", 16, 1, 8, 132)  # 128
    assert not V.cluster_default("sm_90", 17, 1, 1, 132)  # too many partitions for a cluster
    assert not V.cluster_default("gfx942", 4, 1, 8, 304)  # no clusters on AMD


def test_fused_reduce_rule():
    # sm_90: the one-round combine where it saved time against the reduce launch (5-8 partitions)
    lo, hi = V.FUSED_AUTO_PARTITIONS
    assert (lo, hi) == (5, V.FUSED_ROUND) == (5, 8)
    assert [n for n in range(1, 40) if V.fused_default("sm_90", n)] == [5, 6, 7, 8]
    assert not any(V.fused_default(a, 8) for a in ("gfx942", "gfx90a", "sm_80", "sm_100"))  # not measured there


def test_shared_steps_need_two_steps_per_wave():
    # 4 waves x 2 steps of the tiling's tokens per partition at least
    def v(platform, p, tiling="mfma16"):
        return V.variant_for(tiling=tiling, partition_size=p, head_size=128, block_size=16, dtype="fp16",
                             kv_cache_dtype="auto", gqa_ratio=4, platform=platform)

    for platform in ("cuda", "hip"):
        for tiling in V.TILINGS:
            need = 2 * V.NUM_WAVES * v(platform, 256, tiling).tokens_per_step
            assert V.shared_steps_unsupported(v(platform, need, tiling)) is None
            assert f"{need} tokens per partition" in V.shared_steps_unsupported(v(platform, need // 2, tiling))
    assert "KV_ASYNC" in V.shared_steps_unsupported(v("cuda", 1024), kv_async=True)


def test_prebuild_selection_keeps_exactly_the_named_variants():
    from cpa import jobs as J

    vs = J.bench_variants("cuda")
    sel = J.select_variants(vs, ["mfma16"], [1024, 2048])
    assert {(v.tiling, v.partition_size) for v in sel} == {("mfma16", 1024), ("mfma16", 2048)}
    assert J.select_variants(vs, None, None) == vs
    with pytest.raises(ValueError, match="unknown tiling"):
        J.select_variants(vs, ["mfma17"], None)
    with pytest.raises(ValueError, match="unknown partition size"):
        J.select_variants(vs, None, [300])


def test_variant_for_keeps_its_answers_but_never_an_error():
    import torch

    kw = dict(tiling="mfma16", partition_size=256, head_size=128, block_size=16, dtype=torch.float16,
              kv_cache_dtype="auto", gqa_ratio=8, platform="cuda")
    a = V.variant_for(**kw)
    assert V.variant_for(**kw) is a and a.dtype == "fp16" and a.heads_cap == 8
    assert V.variant_for(**dict(kw, dtype="fp16")) == a
    for _ in range(2):  # refused every time, not only the first
        with pytest.raises(ValueError, match="partition_size"):
            V.variant_for(**dict(kw, partition_size=48))
