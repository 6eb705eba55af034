"""The CPA kernel against cpa.reference on the GPU: output and intermediates, fresh random
inputs, poisoned outputs, NaN in every cache slot no sequence uses.

Matrix (issue 3): the full cross product tiling x partition size x {fp16, bf16} x {auto, fp8}
at head 128, block 16, GQA 8; every other axis value (head 64 and 256, block 32, GQA 1, 4,
16, ALiBi) with every tiling at partition 256 and 512. Each case runs two batches: the
edge lengths {1, 17, P-1, P, P+1, 4093, 32768} and a long-tailed mix.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from cpa import variants as V
from cpa.jit import staged_loops_flagged

pytestmark = pytest.mark.gpu

BASE = dict(head_size=128, block_size=16, gqa=8, alibi=False)
AXES = [dict(head_size=64), dict(head_size=256), dict(block_size=32), dict(gqa=1), dict(gqa=4), dict(gqa=16),
        dict(alibi=True)]


def _cases():
    cases = []
    for t in V.TILINGS:
        for p in V.PARTITION_SIZES:
            for dt in V.DTYPES:
                for kv in V.KV_CACHE_DTYPES:
                    cases.append(dict(BASE, tiling=t, partition_size=p, dtype=dt, kv=kv))
    for t in V.TILINGS:
        for p in (256, 512):
            for i, ax in enumerate(AXES):
                # alternate dtypes / caches over the axis cases so each axis meets both
                dt = V.DTYPES[i % 2]
                kv = V.KV_CACHE_DTYPES[(i // 2) % 2]
                cases.append(dict(BASE, tiling=t, partition_size=p, dtype=dt, kv=kv, **ax))
    # the largest partitions: two and four block-table entries per lane (CPA_BT_PREFETCH) at block 16
    for i, ax in enumerate(AXES):
        for p in (4096, 8192):
            cases.append(dict(BASE, tiling="mfma16", partition_size=p, dtype=V.DTYPES[(i + p // 4096) % 2],
                              kv=V.KV_CACHE_DTYPES[(i // 2) % 2], **ax))
    return cases


CASES = _cases()
TORCH_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}


def case_id(c):
    return (f"{c['tiling']}-p{c['partition_size']}-{c['dtype']}-{c['kv']}-h{c['head_size']}-b{c['block_size']}"
            f"-g{c['gqa']}{'-alibi' if c['alibi'] else ''}")


def edge_lengths(p: int) -> list[int]:
    return [1, 17, p - 1, p, p + 1, 4093, 32768]


def mixed_lengths(seed: int, n: int = 8) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    # long-tailed, as decode traffic: log-normal around ~600 tokens, capped at 20k
    x = torch.empty(n).log_normal_(mean=6.4, std=1.2, generator=g)
    return [int(min(max(v, 1), 20000)) for v in x.tolist()]


def _variant_or_skip(c, platform):
    try:
        return V.variant_for(tiling=c["tiling"], partition_size=c["partition_size"], head_size=c["head_size"],
                             block_size=c["block_size"], dtype=c["dtype"], kv_cache_dtype=c["kv"],
                             gqa_ratio=c["gqa"], platform=platform)
    except ValueError as e:
        pytest.skip(f"not a variant on {platform}: {e}")


def check_against_reference(c, seq_lens, seed):
    import cpa.ops as ops
    from cpa import reference
    from cpa.jit import device_arch
    from cpa.inputs import make_paged_inputs

    platform, _ = device_arch()
    _variant_or_skip(c, platform)
    num_kv_heads = 2
    inp = make_paged_inputs(len(seq_lens), c["gqa"] * num_kv_heads, num_kv_heads, c["head_size"], c["block_size"],
                            seq_lens, dtype=TORCH_DTYPE[c["dtype"]], kv_cache_dtype=c["kv"], seed=seed,
                            device="cuda", alibi=c["alibi"])
    kw = inp.as_kwargs()
    out = torch.full_like(inp.query, float("nan"))
    launch = ops.prepare(**kw, partition_size=c["partition_size"], tiling=c["tiling"], out=out,
                         return_intermediates=True)
    for t in (launch.exp_sums, launch.max_logits, launch.tmp_out):
        t.fill_(float("nan"))
    launch()
    torch.cuda.synchronize()

    ref_out, ref_es, ref_ml, ref_tmp = reference.paged_attention(**kw, partition_size=c["partition_size"],
                                                                 return_intermediates=True)
    assert not torch.isnan(out).any(), "output has unwritten (NaN) elements"
    tol = reference.REL_ERR_TOL[inp.query.dtype]
    err = reference.relative_error(out, ref_out, per_seq=True)
    assert err <= tol, f"output relative error {err:.3g} > {tol:g}"

    # intermediates: only the partitions each sequence has are defined
    P = c["partition_size"]
    parts = torch.tensor([math.ceil(s / P) for s in seq_lens], device="cuda")
    valid = torch.arange(launch.num_partitions, device="cuda")[None, :] < parts[:, None]  # [seqs, parts]
    valid = valid[:, None, :].expand_as(launch.max_logits)
    ml, es = launch.max_logits[valid], launch.exp_sums[valid]
    assert not torch.isnan(ml).any() and not torch.isnan(es).any(), "unwritten max_logits / exp_sums"
    torch.testing.assert_close(ml, ref_ml[valid], rtol=1e-3, atol=2e-3)
    torch.testing.assert_close(es, ref_es[valid], rtol=2e-3, atol=1e-4)
    tmp = launch.tmp_out[valid]
    assert not torch.isnan(tmp).any(), "unwritten tmp_out"
    terr = reference.relative_error(tmp, ref_tmp[valid], per_seq=True)
    assert terr <= tol, f"tmp_out relative error {terr:.3g} > {tol:g}"


@pytest.mark.parametrize("c", CASES, ids=[case_id(c) for c in CASES])
def test_edge_lengths(c):
    check_against_reference(c, edge_lengths(c["partition_size"]), seed=zlib.crc32(case_id(c).encode()) % 10_000)


@pytest.mark.parametrize("c", CASES, ids=[case_id(c) for c in CASES])
def test_mixed_lengths(c):
    seed = (zlib.crc32(case_id(c).encode()) + 1) % 10_000
    check_against_reference(c, mixed_lengths(seed), seed=seed)


def test_single_partition_skips_reduce():
    """max_seq_len <= partition: one kernel, `out` written directly, no tmp_out."""
    import cpa.ops as ops
    from cpa import reference
    from cpa.inputs import make_paged_inputs

    inp = make_paged_inputs(4, 16, 2, 128, 16, [5, 100, 200, 256], dtype=torch.float16, device="cuda", seed=3)
    out = torch.full_like(inp.query, float("nan"))
    launch = ops.prepare(**inp.as_kwargs(), partition_size=256, tiling="mfma16", out=out)
    assert launch.num_partitions == 1 and launch.reduce_args is None and launch.tmp_out is None
    launch()
    ref = reference.paged_attention(**inp.as_kwargs())
    assert reference.relative_error(out, ref, per_seq=True) <= reference.REL_ERR_TOL[torch.float16]


def test_default_variant_and_128k_context():
    """Defaults from cpa.variants; a 128k-token context at the smallest partition size. Where
    the device's default partition size is chosen by shape, the launch has the size the wave
    model picks with the built kernel's own occupancy (the runtime's query)."""
    import cpa
    from cpa import occupancy as O
    from cpa import ops, reference
    from cpa.inputs import make_paged_inputs
    from cpa.jit import device_arch

    inp = make_paged_inputs(1, 8, 1, 128, 16, [131072], dtype=torch.bfloat16, device="cuda", seed=5)
    ref = reference.paged_attention(**inp.as_kwargs())
    for kw in ({}, {"partition_size": 64, "tiling": "mfma16"}):
        out = cpa.paged_attention(**inp.as_kwargs(), **kw)
        assert reference.relative_error(out, ref) <= reference.REL_ERR_TOL[torch.bfloat16]
    platform, arch = device_arch()
    tiling, partition, _ = V.default_choice(arch, 8, "bf16", "auto")
    launch = ops.prepare(**inp.as_kwargs())
    assert launch.kernel.variant.tiling == tiling
    if partition != V.BY_SHAPE:
        assert launch.shape.partition_size == partition
        return
    axes = dict(tiling=tiling, head_size=128, block_size=16, dtype="bf16", kv_cache_dtype="auto", gqa_ratio=8,
                platform=platform)
    per_sm = launch.kernel.attributes()["attention"]["blocks_per_sm"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    want = O.partition_by_wave_model(O.shape_model(arch), V.partition_candidates(max_seq_len=131072, **axes),
                                     num_seqs=1, num_heads=8, num_kv_heads=1, head_size=128, max_seq_len=131072,
                                     kv_elem_bytes=2, slots=per_sm * sms, compute_units=sms)
    assert launch.shape.partition_size == want and ops.resident_per_sm(launch.kernel.variant, "cuda") == per_sm >= 1


UNSUPPORTED = [
    # a power-of-two multiple of the block size (16), but not a partition size any variant builds
    # with: refused by the variant (cpa.variants.Variant.validate)
    (dict(partition_size=32), r"^partition_size=32 is not supported; allowed: 64, 128, .*, 8192$"),
    (dict(partition_size=16384), r"^partition_size=16384 is not supported; allowed: 64, 128, .*, 8192$"),
    # not a power-of-two multiple of the block size: refused by cpa.validation
    (dict(partition_size=96), r"^partition_size: got 96; must be None or a power-of-two multiple of block_size 16 "),
    (dict(tiling="mfma32"), r"^tiling='mfma32' is not supported; allowed: 'mfma16', 'mfma4', 'scalar'$"),
]


@pytest.mark.parametrize("bad,match", UNSUPPORTED, ids=[",".join(f"{k}={v}" for k, v in b.items())
                                                          for b, _ in UNSUPPORTED])
def test_unsupported_variant_refused_before_launch(bad, match):
    import cpa
    from cpa.inputs import make_paged_inputs

    inp = make_paged_inputs(2, 8, 1, 128, 16, [40, 300], dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match=match):
        cpa.paged_attention(**inp.as_kwargs(), **{"tiling": "mfma16", **bad})


def test_unsupported_head_size_refused():
    import cpa
    from cpa.inputs import make_paged_inputs

    inp = make_paged_inputs(1, 8, 1, 80, 16, [40], dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="head"):
        cpa.paged_attention(**inp.as_kwargs())


@pytest.mark.parametrize("dtype", V.DTYPES)
@pytest.mark.parametrize("tiling", V.TILINGS)
def test_fp8_decodes_every_byte(tiling, dtype):
    """Every finite e4m3 byte through the kernel's decode, bit-exact: with one token per
    sequence the output is that token's V row times v_scale (softmax weight 1), so each output
    element is one decoded byte (subnormals, both zeros and +-448 included)."""
    import cpa.ops as ops
    from cpa.inputs import FP8_E4M3_NAN_BYTE, make_paged_inputs
    from cpa.jit import device_arch

    _variant_or_skip(dict(BASE, tiling=tiling, partition_size=256, dtype=dtype, kv="fp8"), device_arch()[0])
    gqa, kv_heads, head = 8, 2, 128
    inp = make_paged_inputs(2, gqa * kv_heads, kv_heads, head, 16, [1, 1], dtype=TORCH_DTYPE[dtype],
                            kv_cache_dtype="fp8", seed=11, device="cuda")
    finite = torch.tensor([b for b in range(256) if b & 0x7F != FP8_E4M3_NAN_BYTE], dtype=torch.uint8)
    rows = finite.repeat(3)[: 2 * kv_heads * head].view(2, kv_heads, head)  # [seq, kv head, d]: all 254 bytes
    blocks = inp.block_tables[:, 0].long()
    vc = inp.value_cache
    vc[blocks, :, :, 0] = rows.to(vc.device)  # token 0 of each sequence's first block
    out = torch.full_like(inp.query, float("nan"))
    ops.prepare(**inp.as_kwargs(), partition_size=256, tiling=tiling, out=out)()
    torch.cuda.synchronize()
    decoded = rows.view(torch.float8_e4m3fn).float() * inp.v_scale  # [seq, kv head, d]
    want = decoded.repeat_interleave(gqa, dim=1).to(out.dtype)      # query head h reads KV head h // gqa
    torch.testing.assert_close(out.cpu(), want, rtol=0, atol=0)


@pytest.mark.parametrize("tiling", V.TILINGS)
def test_query_range_with_fp8_cache(tiling):
    """bf16 queries far outside fp16's range, with an fp8 cache (where the matrix-core tilings
    compute in fp16, CPA_FP8_F16_MMA): scaling the query by 2^s and the scale by 2^-s leaves
    the logits unchanged, so the output must match the unscaled call; and one group mixing
    heads 2^60 apart in magnitude must match the fp32 reference. Unscaled fp16 would overflow
    at 2^20 (inf, then NaN) and flush 2^-40 to zero (uniform attention)."""
    import cpa.ops as ops
    from cpa import reference
    from cpa.inputs import make_paged_inputs
    from cpa.jit import device_arch

    c = dict(BASE, tiling=tiling, partition_size=256, dtype="bf16", kv="fp8")
    _variant_or_skip(c, device_arch()[0])
    lens = [1, 255, 600, 4093]
    inp = make_paged_inputs(len(lens), 16, 2, 128, 16, lens, dtype=torch.bfloat16, kv_cache_dtype="fp8",
                            seed=23, device="cuda")
    kw = inp.as_kwargs()
    tol = reference.REL_ERR_TOL[torch.bfloat16]

    def run(**over):
        out = torch.full_like(inp.query, float("nan"))
        ops.prepare(**{**kw, **over}, partition_size=256, tiling=tiling, out=out)()
        torch.cuda.synchronize()
        assert torch.isfinite(out).all(), f"non-finite output with {sorted(over)}"
        return out

    base = reference.paged_attention(**kw)
    for e in (20, -40):
        out = run(query=inp.query * 2.0 ** e, scale=inp.scale * 2.0 ** -e)  # exact in bf16
        err = reference.relative_error(out, base, per_seq=True)
        assert err <= tol, f"query x 2^{e}: relative error {err:.3g} > {tol:g}"
    # one KV head's group: heads 0-3 at 2^30, 4-7 at 2^-30; the rest as they are
    q = inp.query.clone()
    q[:, 0:4] *= 2.0 ** 30
    q[:, 4:8] *= 2.0 ** -30
    scale = inp.scale * 2.0 ** -30  # the large heads' logits as before, the small ones ~0
    out = run(query=q, scale=scale)
    ref = reference.paged_attention(**{**kw, "query": q, "scale": scale})
    err = reference.relative_error(out, ref, per_seq=True)
    assert err <= tol, f"mixed-range group: relative error {err:.3g} > {tol:g}"


FUSED_CASES = [dict(BASE, tiling=t, partition_size=p, dtype=dt, kv=kv) for t in V.TILINGS for p in (64, 256, 1024)
               for dt, kv in (("fp16", "auto"), ("bf16", "fp8"))]
# the one-round combine maps output columns (gqa x head_size / 4 of them) onto threads two at a
# time: other head sizes and group sizes give other column counts, some not a multiple of the
# workgroup, and block 32 other partition edges
FUSED_CASES += [dict(BASE, tiling=t, partition_size=512, dtype="fp16", kv="auto", **ax) for t in V.TILINGS
                for ax in (dict(head_size=64, gqa=16), dict(head_size=256, gqa=1), dict(gqa=4, block_size=32))]


@pytest.mark.parametrize("c", FUSED_CASES, ids=[case_id(c) for c in FUSED_CASES])
def test_fused_reduce(c):
    """The last workgroup of each (sequence, KV head) reduces; repeated launches (the kernel
    resets its counters) give the same output each time."""
    import cpa.ops as ops
    from cpa import reference
    from cpa.inputs import make_paged_inputs

    P = c["partition_size"]
    lens = edge_lengths(P) + mixed_lengths(P, 5)
    inp = make_paged_inputs(len(lens), 2 * c["gqa"], 2, c["head_size"], c["block_size"], lens,
                            dtype=TORCH_DTYPE[c["dtype"]], kv_cache_dtype=c["kv"], device="cuda", seed=P)
    ref = reference.paged_attention(**inp.as_kwargs())
    out = torch.full_like(inp.query, float("nan"))
    launch = ops.prepare(**inp.as_kwargs(), partition_size=P, tiling=c["tiling"], out=out, fused_reduce=True)
    assert launch.fused_reduce and launch.reduce_args is None
    tol = reference.REL_ERR_TOL[inp.query.dtype]
    for _ in range(3):
        out.fill_(float("nan"))
        launch()
        torch.cuda.synchronize()
        err = reference.relative_error(out, ref, per_seq=True)
        assert err <= tol, f"fused output relative error {err:.3g} > {tol:g}"


# (num_seqs, num_heads, num_kv_heads, head_size, partition_size, max partitions, dtype, KV cache):
# both sides of the launcher's reduce-kernel rule (cpa.variants.reduce_kernel). The matrix
# above has 32k-token sequences in every batch, so its reduces are all block-wide.
REDUCE_CASES = [
    (3, 16, 2, 128, 256, 2, "fp16", "auto"),  # 48 heads, 2 partitions: few
    (5, 16, 2, 64, 128, 4, "bf16", "fp8"),  # 80 heads, 4: few
    (64, 16, 2, 128, 256, 8, "fp16", "auto"),  # 1024 heads, 8: few
    (48, 32, 4, 256, 64, 16, "bf16", "auto"),  # 1536 heads, 16: few
    (4, 16, 2, 128, 256, 8, "fp16", "fp8"),  # 64 heads, 8: block-wide
    (64, 16, 2, 128, 64, 17, "bf16", "auto"),  # 17 partitions: block-wide
]


@pytest.mark.parametrize("c", REDUCE_CASES, ids=[f"s{c[0]}-h{c[1]}-d{c[3]}-p{c[4]}-n{c[5]}-{c[6]}-{c[7]}"
                                                 for c in REDUCE_CASES])
def test_reduce_kernel_choice(c):
    """The launch runs the reduce kernel the rule names (seen by the profiler) and the
    output matches the reference, with sequences of 1 .. max partitions."""
    import cpa.ops as ops
    from cpa import reference
    from cpa.inputs import make_paged_inputs

    num_seqs, num_heads, num_kv_heads, head, P, n, dt, kv = c
    g = torch.Generator().manual_seed(n * 1000 + num_seqs)
    lens = [n * P, P, P + 1, 1, (n - 1) * P + 1] + torch.randint(1, n * P + 1, (num_seqs,), generator=g).tolist()
    lens = lens[:num_seqs]
    inp = make_paged_inputs(num_seqs, num_heads, num_kv_heads, head, 16, lens, dtype=TORCH_DTYPE[dt],
                            kv_cache_dtype=kv, device="cuda", seed=n)
    out = torch.full_like(inp.query, float("nan"))
    launch = ops.prepare(**inp.as_kwargs(), partition_size=P, tiling="mfma16", out=out, cluster_reduce=False,
                         fused_reduce=False)
    assert launch.num_partitions == n
    want = V.reduce_kernel(n, num_seqs, num_heads)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        launch()
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages() if "paged_attention_reduce" in e.key]
    few = [k for k in names if "reduce_few" in k]
    assert len(names) == 1 and bool(few) == (want == "reduce_few"), f"rule says {want}, launched {names}"
    ref = reference.paged_attention(**inp.as_kwargs())
    err = reference.relative_error(out, ref, per_seq=True)
    assert err <= reference.REL_ERR_TOL[inp.query.dtype], f"output relative error {err:.3g}"


def launch_poisoned_and_check(launch, out, ref, what):
    """One launch into a NaN-filled `out`: every element written, within the reference's
    tolerance (per sequence)."""
    from cpa import reference

    out.fill_(float("nan"))
    launch()
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "output has unwritten (NaN) elements"
    tol = reference.REL_ERR_TOL[out.dtype]
    err = reference.relative_error(out, ref, per_seq=True)
    assert err <= tol, f"{what} output relative error {err:.3g} > {tol:g}"


# The cluster combine (sm_90+): (partition size, partitions = cluster size) pairs that cover
# the portable and non-portable sizes, odd sizes and 8192-token partitions; every tiling with
# a 16-bit and an fp8 cache, then every other axis.
CLUSTER_SIZES = [(64, 16), (256, 3), (512, 5), (1024, 8), (4096, 2), (8192, 4)]
CLUSTER_CASES = [dict(BASE, tiling=t, partition_size=p, n=n, dtype=dt, kv=kv) for t in V.TILINGS
                 for p, n in CLUSTER_SIZES for dt, kv in (("fp16", "auto"), ("bf16", "fp8"))]
CLUSTER_CASES += [dict(BASE, tiling=t, partition_size=256, n=11, dtype=V.DTYPES[i % 2],
                       kv=V.KV_CACHE_DTYPES[(i // 2) % 2], **ax) for t in V.TILINGS for i, ax in enumerate(AXES)]


def _cluster_or_skip():
    from cpa.jit import device_arch

    _, arch = device_arch()
    why = V.cluster_unsupported(arch, 2)
    if why:
        pytest.skip(why)


@pytest.mark.parametrize("c", CLUSTER_CASES, ids=[f"{case_id(c)}-n{c['n']}" for c in CLUSTER_CASES])
def test_cluster_reduce(c):
    """Each (sequence, KV head)'s partitions as one cluster, combined through distributed
    shared memory: sequences of every partition count 1 .. n in one batch (so clusters hold
    empty workgroups), partial last partitions; repeated launches give the same output and
    nothing is left unwritten."""
    import cpa.ops as ops
    from cpa import reference
    from cpa.jit import device_arch
    from cpa.inputs import make_paged_inputs

    _cluster_or_skip()
    platform, _ = device_arch()
    _variant_or_skip(c, platform)
    P, n = c["partition_size"], c["n"]
    g = torch.Generator().manual_seed(P * 100 + n)
    lens = [n * P, 1, 17, P - 1, P, P + 1, (n - 1) * P + 1, n * P - 3] + torch.randint(1, n * P + 1, (4,), generator=g).tolist()
    lens = [min(max(x, 1), n * P) for x in lens]
    num_kv_heads = 2
    inp = make_paged_inputs(len(lens), c["gqa"] * num_kv_heads, num_kv_heads, c["head_size"], c["block_size"], lens,
                            dtype=TORCH_DTYPE[c["dtype"]], kv_cache_dtype=c["kv"], device="cuda", seed=P + n,
                            alibi=c["alibi"])
    ref = reference.paged_attention(**inp.as_kwargs())
    out = torch.full_like(inp.query, float("nan"))
    launch = ops.prepare(**inp.as_kwargs(), partition_size=P, tiling=c["tiling"], out=out, cluster_reduce=True)
    assert launch.cluster == n and launch.reduce_args is None and launch.tmp_out is None
    first = None
    for _ in range(3):
        launch_poisoned_and_check(launch, out, ref, "cluster")
        if first is None:
            first = out.clone()
        else:
            assert torch.equal(out, first), "repeated launches differ"


def test_cluster_reduce_refusals():
    """cluster_reduce=True that cannot be honoured raises before any launch; None falls back."""
    import cpa.ops as ops
    from cpa.inputs import make_paged_inputs

    _cluster_or_skip()
    inp = make_paged_inputs(2, 16, 2, 128, 16, [17 * 64, 300], dtype=torch.float16, device="cuda", seed=9)
    with pytest.raises(ValueError, match="at most 16"):
        ops.prepare(**inp.as_kwargs(), partition_size=64, tiling="mfma16", cluster_reduce=True)
    with pytest.raises(ValueError, match="return_intermediates"):
        ops.prepare(**inp.as_kwargs(), partition_size=256, tiling="mfma16", cluster_reduce=True,
                    return_intermediates=True)
    with pytest.raises(ValueError, match="fused_reduce"):
        ops.prepare(**inp.as_kwargs(), partition_size=256, tiling="mfma16", cluster_reduce=True, fused_reduce=True)
    launch = ops.prepare(**inp.as_kwargs(), partition_size=64, tiling="mfma16")  # 17 partitions: the reduce
    assert launch.cluster == 0 and launch.reduce_args is not None


def test_cluster_reduce_auto():
    """cluster_reduce=None takes the cluster combine exactly where cpa.variants.cluster_default
    says (grids of at most half the SMs), and the output is right either way."""
    import cpa.ops as ops
    from cpa import reference
    from cpa.inputs import make_paged_inputs

    _cluster_or_skip()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for num_seqs, P, want in ((1, 512, True), (8, 512, False)):
        inp = make_paged_inputs(num_seqs, 64, 8, 128, 16, [2048] * num_seqs, dtype=torch.float16, device="cuda",
                                seed=num_seqs)
        launch = ops.prepare(**inp.as_kwargs(), partition_size=P, tiling="mfma16")
        n = 2048 // P
        assert want == (num_seqs * 8 * n <= sms // 2)
        assert (launch.cluster == n) == want and (launch.reduce_args is None) == want
        out = launch()
        ref = reference.paged_attention(**inp.as_kwargs())
        assert reference.relative_error(out, ref, per_seq=True) <= reference.REL_ERR_TOL[torch.float16]


def test_fused_reduce_auto():
    """fused_reduce=None takes the fused reduce exactly where cpa.variants.fused_default says and
    no other combine is chosen or asked for; the default launch is right, launch after launch
    (the counters reset), and so is paged_attention's default path."""
    import cpa
    import cpa.ops as ops
    from cpa import reference
    from cpa.inputs import make_paged_inputs
    from cpa.jit import device_arch

    _, arch = device_arch()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # 16 sequences x 8 KV heads: 128 workgroups per partition, too many for the cluster rule
    inp = make_paged_inputs(16, 64, 8, 128, 16, [2048] * 15 + [1500], dtype=torch.float16, device="cuda", seed=5)
    kw = dict(inp.as_kwargs(), tiling="mfma16")
    for P in (256, 512, 1024):  # 8, 4, 2 partitions
        n = 2048 // P
        launch = ops.prepare(**kw, partition_size=P)
        want = V.fused_default(arch, n) and not V.cluster_default(arch, n, 16, 8, sms)
        assert launch.fused_reduce == want and (launch.reduce_args is None) == (want or launch.cluster > 0)
        assert not ops.prepare(**kw, partition_size=P, shared_steps=True).fused_reduce
        if not V.cluster_unsupported(arch, n):
            assert not ops.prepare(**kw, partition_size=P, cluster_reduce=True).fused_reduce
    ref = reference.paged_attention(**inp.as_kwargs())
    tol = reference.REL_ERR_TOL[torch.float16]
    out = torch.full_like(inp.query, float("nan"))
    launch = ops.prepare(**kw, partition_size=256, out=out)
    assert launch.fused_reduce == (arch in V.FUSED_AUTO_ARCHS)  # 8 partitions: the rule's case
    for _ in range(3):
        out.fill_(float("nan"))
        launch()
        torch.cuda.synchronize()
        assert reference.relative_error(out, ref, per_seq=True) <= tol
    if not launch.fused_reduce:
        return
    # paged_attention's one-shot launches share the stream's counters (no fill per call): each
    # call leaves them at zero for the next, and another stream gets a buffer of its own
    pool = ops.stream_counters(16 * 8, "cuda")
    for _ in range(3):
        out = cpa.paged_attention(**kw, partition_size=256)
        assert reference.relative_error(out, ref, per_seq=True) <= tol
        assert ops.stream_counters(16 * 8, "cuda").data_ptr() == pool.data_ptr()
        assert int(pool.abs().sum()) == 0, "counters not left at zero"
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert ops.stream_counters(16 * 8, "cuda").data_ptr() != pool.data_ptr()
        out = cpa.paged_attention(**kw, partition_size=256)
    torch.cuda.synchronize()
    assert reference.relative_error(out, ref, per_seq=True) <= tol
    # captured into a CUDA graph: the launch's own counters, zeroed by the captured fill
    static_out = torch.full_like(inp.query, float("nan"))
    cap = dict(kw, partition_size=256, out=static_out, check_values=False, max_seq_len=2048)  # no host sync
    cpa.paged_attention(**cap)  # warm-up (the build) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cpa.paged_attention(**cap)
    for _ in range(3):
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert reference.relative_error(static_out, ref, per_seq=True) <= tol


@pytest.mark.parametrize("combine", ["reduce", "fused", "shared", "cluster"])
def test_launch_replayed_after_seq_lens_grew(combine):
    """A Launch sized for 1024 tokens (4 partitions of 256), replayed after its sequences grew
    past that -- a graph captured too short, or check_values=False with too small a max_seq_len:
    each sequence is attended to over the tokens the grid covers (the reference with its length
    clamped there), nothing is read out of bounds, and the launch's counters are back at zero,
    so the stream's shared counters serve the next (valid) call. Before the kernels clamped
    their counts the reduce read other rows' partials and the fused reduce never fired."""
    import cpa
    import cpa.ops as ops
    from cpa import reference
    from cpa.inputs import make_paged_inputs
    from cpa.jit import device_arch

    _, arch = device_arch()
    sized, P = 1024, 256
    lens = [4096, 700, 1500, 4093]
    inp = make_paged_inputs(len(lens), 64, 8, 128, 16, lens, dtype=torch.float16, device="cuda", seed=21)
    kw = inp.as_kwargs()
    grown = kw["seq_lens"].clone()
    seq_lens = grown.clamp(max=sized)  # the lengths the launch is prepared (or captured) with
    opts = {"reduce": dict(fused_reduce=False, cluster_reduce=False),
            "fused": dict(fused_reduce=True, cluster_reduce=False),
            "shared": dict(shared_steps=True, fused_reduce=False, cluster_reduce=False),
            "cluster": dict(cluster_reduce=True, fused_reduce=False)}[combine]
    if combine == "cluster" and V.cluster_unsupported(arch, sized // P):
        pytest.skip(V.cluster_unsupported(arch, sized // P))
    out = torch.full_like(inp.query, float("nan"))
    launch = ops.prepare(**dict(kw, seq_lens=seq_lens), partition_size=P, out=out, check_values=False,
                         max_seq_len=sized, **opts)
    assert launch.num_partitions == sized // P
    tol = reference.REL_ERR_TOL[torch.float16]
    truncated = reference.paged_attention(**dict(kw, seq_lens=grown.clamp(max=sized)))
    seq_lens.copy_(grown)  # the sequences grow; the launch is replayed as it was made
    for _ in range(2):
        out.fill_(float("nan"))
        launch()
        torch.cuda.synchronize()
        assert reference.relative_error(out, truncated, per_seq=True) <= tol
    counters = launch.fused_counters if combine == "fused" else launch.steal_counters
    if counters is not None:
        assert int(counters.abs().sum()) == 0, "counters left set"
    # the same through paged_attention's shared per-stream counters, then a valid call after it
    short = cpa.paged_attention(**kw, partition_size=P, check_values=False, max_seq_len=sized, **opts)
    assert reference.relative_error(short, truncated, per_seq=True) <= tol
    full = cpa.paged_attention(**kw, partition_size=P, **opts)
    assert reference.relative_error(full, reference.paged_attention(**kw), per_seq=True) <= tol


@pytest.mark.parametrize("combine,P", [("reduce", 256), ("reduce_few", 1024), ("fused", 256), ("shared", 256)])
def test_a_sequence_longer_than_its_block_table_row_is_truncated_to_the_row(combine, P):
    """check_values=False lets a seq_len past the block-table row through (invalid input): the
    attention kernel and every combine clamp it to the row's tokens, so the output is the
    reference over the row. Before the reduce kernels clamped to the row they combined the
    partitions past it, which nothing wrote (NaN here: the partials start poisoned)."""
    import cpa.ops as ops
    from cpa import reference
    from cpa.inputs import make_paged_inputs

    row = 2048
    lens = [row, 700, 1500]
    inp = make_paged_inputs(len(lens), 64, 8, 128, 16, lens, dtype=torch.float16, device="cuda", seed=22)
    kw = inp.as_kwargs()
    assert kw["block_tables"].shape[1] * 16 == row
    separate = dict(fused_reduce=False, cluster_reduce=False)
    opts = {"reduce": separate, "reduce_few": separate,
            "fused": dict(fused_reduce=True, cluster_reduce=False),
            "shared": dict(shared_steps=True, fused_reduce=False, cluster_reduce=False)}[combine]
    out = torch.full_like(inp.query, float("nan"))
    launch = ops.prepare(**dict(kw, seq_lens=torch.tensor([3000, 700, 1500], dtype=torch.int32, device="cuda")),
                         partition_size=P, out=out, check_values=False, max_seq_len=3072, **opts)
    assert launch.num_partitions == 3072 // P
    if combine.startswith("reduce"):  # both reduce kernels
        assert V.reduce_kernel(launch.num_partitions, len(lens), 64) == combine
    for t in (launch.exp_sums, launch.max_logits, launch.tmp_out):
        if t is not None:
            t.fill_(float("nan"))
    launch()
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "the combine read partials nothing wrote"
    err = reference.relative_error(out, reference.paged_attention(**kw), per_seq=True)
    assert err <= reference.REL_ERR_TOL[torch.float16], f"relative error {err:.3g}"


# Shared steps: the workgroups of each (sequence, KV head) take its steps from one counter.
# Every tiling with a 16-bit and an fp8 cache at partitions from the smallest allowed (two steps
# per wave) to 8192, then every other axis.
SHARED_CASES = [dict(BASE, tiling=t, partition_size=p, dtype=dt, kv=kv) for t in V.TILINGS
                for p in (256, 1024, 8192) for dt, kv in (("fp16", "auto"), ("bf16", "fp8"))]
SHARED_CASES += [dict(BASE, tiling=t, partition_size=512, dtype=V.DTYPES[i % 2], kv=V.KV_CACHE_DTYPES[(i // 2) % 2],
                      **ax) for t in V.TILINGS for i, ax in enumerate(AXES)]


def _shared_launch(c, lens, seed):
    import cpa.ops as ops
    from cpa.jit import device_arch
    from cpa.inputs import make_paged_inputs

    platform, _ = device_arch()
    v = _variant_or_skip(c, platform)
    why = V.shared_steps_unsupported(v, kv_async=staged_loops_flagged())
    if why:  # (a staged-loop knob build keeps fixed partitions: test_shared_steps_refusals checks it refuses)
        pytest.skip(why)
    num_kv_heads = 2
    inp = make_paged_inputs(len(lens), c["gqa"] * num_kv_heads, num_kv_heads, c["head_size"], c["block_size"], lens,
                            dtype=TORCH_DTYPE[c["dtype"]], kv_cache_dtype=c["kv"], device="cuda", seed=seed,
                            alibi=c["alibi"])
    out = torch.full_like(inp.query, float("nan"))
    launch = ops.prepare(**inp.as_kwargs(), partition_size=c["partition_size"], tiling=c["tiling"], out=out,
                         shared_steps=True)
    assert launch.shared_steps and launch.cluster == 0 and not launch.fused_reduce
    return inp, out, launch


@pytest.mark.parametrize("c", SHARED_CASES, ids=[case_id(c) for c in SHARED_CASES])
def test_shared_steps(c):
    """Shared steps against the reference: edge and mixed lengths in one batch (sequences of one
    workgroup up to many, partial last steps), three launches each right and nothing left
    unwritten, the counters back at zero after every launch; two attention launches with no
    reduce between them (the kernel resets its own counters) still give the right output."""
    from cpa import reference

    P = c["partition_size"]
    seed = zlib.crc32(case_id(c).encode()) % 10_000
    lens = edge_lengths(P) + [2 * P + 5, 3 * P] + mixed_lengths(seed, 4)
    inp, out, launch = _shared_launch(c, lens, seed)
    ref = reference.paged_attention(**inp.as_kwargs())
    tol = reference.REL_ERR_TOL[inp.query.dtype]
    for _ in range(3):
        launch_poisoned_and_check(launch, out, ref, "shared-steps")
        assert int(launch.steal_counters.abs().sum()) == 0, "step counters not reset"
    out.fill_(float("nan"))
    launch.attention()
    launch.attention()
    launch.reduce()
    torch.cuda.synchronize()
    err = reference.relative_error(out, ref, per_seq=True)
    assert err <= tol and int(launch.steal_counters.abs().sum()) == 0


def test_shared_steps_many_rounds():
    """A grid of many rounds (4096 workgroups at 2 per SM): later workgroups start when most
    steps are taken and run only their own first step."""
    from cpa import reference

    c = dict(BASE, tiling="mfma16", partition_size=256, dtype="fp16", kv="auto")
    lens = [8192] * 60 + [1, 300, 7000, 8191]
    inp, out, launch = _shared_launch(c, lens, 77)
    launch()
    torch.cuda.synchronize()
    ref = reference.paged_attention(**inp.as_kwargs())
    assert reference.relative_error(out, ref, per_seq=True) <= reference.REL_ERR_TOL[torch.float16]
    assert int(launch.steal_counters.abs().sum()) == 0


def test_shared_steps_refusals():
    """shared_steps=True that cannot be honoured raises before any launch."""
    import cpa.ops as ops
    from cpa.inputs import make_paged_inputs

    inp = make_paged_inputs(2, 16, 2, 128, 16, [3000, 300], dtype=torch.float16, device="cuda", seed=9)
    with pytest.raises(ValueError, match="tokens per partition"):
        ops.prepare(**inp.as_kwargs(), partition_size=128, tiling="mfma16", shared_steps=True)
    if staged_loops_flagged():  # CPA_NVCC_FLAGS=-DCPA_KV_ASYNC=N: the staged loops keep fixed partitions
        with pytest.raises(ValueError, match="KV_ASYNC"):
            ops.prepare(**inp.as_kwargs(), partition_size=256, tiling="mfma16", shared_steps=True)
        return
    with pytest.raises(ValueError, match="return_intermediates"):
        ops.prepare(**inp.as_kwargs(), partition_size=256, tiling="mfma16", shared_steps=True, return_intermediates=True)
    with pytest.raises(ValueError, match="fused_reduce"):
        ops.prepare(**inp.as_kwargs(), partition_size=256, tiling="mfma16", shared_steps=True, fused_reduce=True)
    with pytest.raises(ValueError, match="cluster_reduce"):
        ops.prepare(**inp.as_kwargs(), partition_size=256, tiling="mfma16", shared_steps=True, cluster_reduce=True)
    launch = ops.prepare(**inp.as_kwargs(), partition_size=256, tiling="mfma16", shared_steps=True)
    assert launch.shared_steps and launch.cluster == 0 and launch.reduce_args is not None


def test_e4m3fnuz_caches_are_refused_on_nvidia():
    """MI300's fp8 encoding is not what the NVIDIA kernels decode (hardware e4m3fn conversion):
    refused before any build or launch, by dtype or by name."""
    import cpa
    from cpa.inputs import make_paged_inputs

    inp = make_paged_inputs(2, 16, 2, 128, 16, [40, 300], dtype=torch.float16, kv_cache_dtype="fp8",
                            fp8_format="e4m3fnuz", seed=3, device="cuda")
    with pytest.raises(ValueError, match="e4m3fnuz"):
        cpa.paged_attention(**inp.as_kwargs())
    raw = dict(inp.as_kwargs(), key_cache=inp.key_cache.view(torch.uint8), value_cache=inp.value_cache.view(torch.uint8))
    with pytest.raises(ValueError, match="e4m3fnuz"):
        cpa.paged_attention(**raw, fp8_format="e4m3fnuz")
