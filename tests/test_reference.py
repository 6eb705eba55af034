"""cpa.reference.paged_attention against the float64 naive ground truth, and its own consistency."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from cpa.inputs import make_paged_inputs
from cpa.reference import (
    REL_ERR_TOL,
    naive_paged_attention_fp64,
    paged_attention,
    reduce_partitions,
    relative_error,
)
from cpa.validation import SUPPORTED_BLOCK_SIZES, SUPPORTED_HEAD_SIZES

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]


def assert_matches_truth(out: torch.Tensor, inp, truth: torch.Tensor | None = None) -> float:
    """Output dtype/shape, no NaN, per-sequence relative error within REL_ERR_TOL[query dtype]."""
    assert out.dtype == inp.query.dtype
    assert out.shape == inp.query.shape
    assert out.device == inp.query.device
    assert not torch.isnan(out).any(), "NaN in output"
    if truth is None:
        truth = naive_paged_attention_fp64(inp)
    err = relative_error(out, truth, per_seq=True)
    tol = REL_ERR_TOL[inp.query.dtype]
    assert err <= tol, f"per-seq relative error {err:.3g} > {tol:g} ({inp.query.dtype})"
    return err


def with_seq_lens(inp, lens):
    """Same caches and block table, shorter seq_lens."""
    sl = torch.tensor(lens, dtype=torch.int32, device=inp.seq_lens.device)
    return dataclasses.replace(inp, seq_lens=sl, seq_lens_host=tuple(lens))


# ---- coverage of the layout: every head size x block size, each cache element size -------------
@pytest.mark.parametrize("block_size", SUPPORTED_BLOCK_SIZES)
@pytest.mark.parametrize("head_size", SUPPORTED_HEAD_SIZES)
@pytest.mark.parametrize(
    "dtype,kv", [(torch.float32, "auto"), (torch.float16, "auto"), (torch.bfloat16, "fp8")], ids=["x4", "x8", "x16-fp8"]
)
def test_head_and_block_sizes(head_size, block_size, dtype, kv, device):
    # lengths: 1, a multiple of the block size, and neither a multiple of block nor partition
    lens = [1, 3 * block_size, 5 * block_size + 3]
    inp = make_paged_inputs(3, 4, 2, head_size, block_size, lens, dtype=dtype, kv_cache_dtype=kv,
                            seed=head_size * 100 + block_size, device=device)
    truth = naive_paged_attention_fp64(inp)
    assert_matches_truth(paged_attention(**inp.as_kwargs()), inp, truth)
    assert_matches_truth(paged_attention(**inp.as_kwargs(), partition_size=2 * block_size), inp, truth)


# ---- dtypes x GQA x ALiBi x fp8 ----------------------------------------------------------------
@pytest.mark.parametrize("alibi", [False, True], ids=["noalibi", "alibi"])
@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_dtypes_gqa_alibi_fp8(dtype, gqa, kv, alibi, device):
    num_kv_heads = 2
    lens = [1, 37, 300, 777]
    inp = make_paged_inputs(len(lens), num_kv_heads * gqa, num_kv_heads, 128, 16, lens, dtype=dtype,
                            kv_cache_dtype=kv, alibi=alibi, seed=gqa, device=device)
    truth = naive_paged_attention_fp64(inp)
    for p in (None, 128, 512):
        assert_matches_truth(paged_attention(**inp.as_kwargs(), partition_size=p), inp, truth)


# ---- long contexts (>= 8k tokens) ---------------------------------------------------------------
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,dtype,kv,alibi",
    [
        (8, 1, torch.float16, "auto", False),
        (4, 4, torch.bfloat16, "fp8", True),
        (8, 2, torch.float32, "auto", True),
    ],
    ids=["gqa8-fp16", "mha-bf16-fp8-alibi", "gqa4-fp32-alibi"],
)
def test_long_context(num_heads, num_kv_heads, dtype, kv, alibi, device):
    lens = [8192 + 77, 1, 12289]
    inp = make_paged_inputs(len(lens), num_heads, num_kv_heads, 128, 16, lens, dtype=dtype,
                            kv_cache_dtype=kv, alibi=alibi, seed=7, device=device)
    truth = naive_paged_attention_fp64(inp)
    for p in (None, 256, 1024):
        assert_matches_truth(paged_attention(**inp.as_kwargs(), partition_size=p), inp, truth)


# ---- random shapes --------------------------------------------------------------------------------
@pytest.mark.parametrize("case", range(12))
def test_random_shapes(case, device):
    rng = random.Random(1000 + case)
    head_size = rng.choice(SUPPORTED_HEAD_SIZES)
    block_size = rng.choice(SUPPORTED_BLOCK_SIZES)
    num_kv_heads = rng.choice([1, 2, 3])
    gqa = rng.choice([1, 2, 4, 8])
    dtype = rng.choice(DTYPES)
    kv = rng.choice(["auto", "fp8", "fp8_e4m3"])
    num_seqs = rng.randint(1, 5)
    lens = [rng.choice([1, rng.randint(2, 64), rng.randint(65, 2000)]) for _ in range(num_seqs)]
    lens[0] = 1 if case % 3 == 0 else lens[0]
    partition_size = rng.choice([None, block_size, block_size * 2 ** rng.randint(1, 6)])
    width = max(-(-v // block_size) for v in lens) + rng.randint(0, 3)
    inp = make_paged_inputs(num_seqs, num_kv_heads * gqa, num_kv_heads, head_size, block_size, lens,
                            dtype=dtype, kv_cache_dtype=kv, alibi=rng.random() < 0.5, seed=case,
                            device=device, max_blocks_per_seq=width)
    assert_matches_truth(paged_attention(**inp.as_kwargs(), partition_size=partition_size), inp)


# ---- partitioned == single pass -------------------------------------------------------------------
@pytest.mark.parametrize("alibi", [False, True], ids=["noalibi", "alibi"])
def test_partitioned_equals_single_pass(alibi, device):
    lens = [1, 15, 16, 17, 1000, 4099]
    inp = make_paged_inputs(len(lens), 8, 2, 64, 16, lens, dtype=torch.float32, alibi=alibi, seed=3, device=device)
    single = paged_attention(**inp.as_kwargs())
    for p in (16, 32, 64, 128, 256, 512, 1024, 4096, 8192):
        part = paged_attention(**inp.as_kwargs(), partition_size=p)
        err = relative_error(part, single, per_seq=True)
        assert err < 2e-6, f"partition_size={p}: {err}"


# ---- intermediates -----------------------------------------------------------------------------------
@pytest.mark.parametrize("alibi", [False, True], ids=["noalibi", "alibi"])
@pytest.mark.parametrize("partition_size", [32, 256])
def test_intermediates(partition_size, alibi, device):
    P = partition_size
    lens = [1, P, P + 1, 3 * P + 5, 7 * P]
    H, D = 8, 64
    inp = make_paged_inputs(len(lens), H, 2, D, 16, lens, dtype=torch.float32, alibi=alibi, seed=11, device=device)
    out, exp_sums, max_logits, tmp_out = paged_attention(**inp.as_kwargs(), partition_size=P, return_intermediates=True)
    NP = math.ceil(max(lens) / P)
    assert exp_sums.shape == max_logits.shape == (len(lens), H, NP)
    assert tmp_out.shape == (len(lens), H, NP, D)
    for t in (exp_sums, max_logits, tmp_out):
        assert t.dtype == torch.float32 and t.device == inp.query.device

    used = torch.tensor([math.ceil(L / P) for L in lens], device=device)
    live = torch.arange(NP, device=device)[None, :] < used[:, None]  # [S, NP]
    live_h = live[:, None, :].expand(-1, H, -1)
    # empty partitions: -inf / 0 / 0; live ones finite with exp_sums >= 1 (the max term is exp(0))
    assert torch.all(max_logits[~live_h] == float("-inf"))
    assert torch.all(exp_sums[~live_h] == 0)
    assert torch.all(tmp_out[~live_h] == 0)
    assert torch.isfinite(max_logits[live_h]).all()
    assert torch.all(exp_sums[live_h] >= 1.0)
    assert torch.all(exp_sums[live_h] <= P)

    # re-reducing the intermediates gives out
    again = reduce_partitions(exp_sums, max_logits, tmp_out)
    assert relative_error(again, out, per_seq=True) < 1e-6

    # partition 0 alone is attention over the first min(L, P) tokens (ALiBi's per-sequence shift
    # is a constant within a partition, so the softmax is unchanged in exact arithmetic; in float32
    # the shift, up to slope * (L - P), costs a few ulps of those larger logits)
    first = paged_attention(**with_seq_lens(inp, [min(L, P) for L in lens]).as_kwargs())
    assert relative_error(tmp_out[:, :, 0], first, per_seq=True) < (1e-4 if alibi else 1e-6)

    # the single pass reports one partition holding everything
    out1, es1, ml1, to1 = paged_attention(**inp.as_kwargs(), return_intermediates=True)
    assert es1.shape == (len(lens), H, 1) and to1.shape == (len(lens), H, 1, D)
    assert torch.equal(to1[:, :, 0], out1)
    assert relative_error(out1, out, per_seq=True) < 2e-6


def test_intermediates_low_precision_out(device):
    inp = make_paged_inputs(2, 4, 4, 128, 16, [100, 300], dtype=torch.bfloat16, seed=2, device=device)
    out, es, ml, to = paged_attention(**inp.as_kwargs(), partition_size=64, return_intermediates=True)
    assert out.dtype == torch.bfloat16
    assert es.dtype == ml.dtype == to.dtype == torch.float32
    assert torch.equal(reduce_partitions(es, ml, to).to(torch.bfloat16), out)


# ---- poison, ALiBi and fp8 scales actually matter --------------------------------------------------
@pytest.mark.parametrize("kv,dtype", [("auto", torch.float16), ("fp8", torch.float16), ("auto", torch.float32)])
def test_poisoned_slots_do_not_leak(kv, dtype, device):
    lens = [1, 17, 250, 33]
    kw = dict(dtype=dtype, kv_cache_dtype=kv, seed=5, device=device, max_blocks_per_seq=20)
    clean = make_paged_inputs(4, 4, 2, 64, 16, lens, poison_unused=False, **kw)
    poisoned = make_paged_inputs(4, 4, 2, 64, 16, lens, poison_unused=True, **kw)
    if kv == "auto":
        assert torch.isnan(poisoned.key_cache).any() and torch.isnan(poisoned.value_cache).any()
    else:
        assert (poisoned.key_cache == 0x7F).any() and (poisoned.value_cache == 0x7F).any()
    for p in (None, 16, 64):
        a = paged_attention(**clean.as_kwargs(), partition_size=p)
        b = paged_attention(**poisoned.as_kwargs(), partition_size=p)
        assert not torch.isnan(b).any()
        assert torch.equal(a, b)


def test_alibi_changes_output(device):
    inp = make_paged_inputs(2, 4, 2, 64, 16, [50, 400], dtype=torch.float32, alibi=True, seed=1, device=device)
    with_alibi = paged_attention(**inp.as_kwargs())
    without = paged_attention(**dataclasses.replace(inp, alibi_slopes=None).as_kwargs())
    assert relative_error(with_alibi, without) > 1e-2
    # and the truth agrees on which is which
    assert_matches_truth(with_alibi, inp)


def test_fp8_scales_are_applied(device):
    inp = make_paged_inputs(2, 4, 2, 64, 16, [50, 400], dtype=torch.float32, kv_cache_dtype="fp8", seed=1, device=device)
    assert inp.k_scale != inp.v_scale
    good = paged_attention(**inp.as_kwargs())
    assert_matches_truth(good, inp)
    swapped = paged_attention(**dataclasses.replace(inp, k_scale=inp.v_scale, v_scale=inp.k_scale).as_kwargs())
    assert relative_error(swapped, good) > 1e-1


def test_fp8_float8_tensor_caches_match_uint8(device):
    inp = make_paged_inputs(2, 4, 2, 64, 16, [50, 400], dtype=torch.float16, kv_cache_dtype="fp8", seed=4, device=device)
    f8 = dataclasses.replace(inp, key_cache=inp.key_cache.view(torch.float8_e4m3fn),
                             value_cache=inp.value_cache.view(torch.float8_e4m3fn))
    assert torch.equal(paged_attention(**inp.as_kwargs()), paged_attention(**f8.as_kwargs()))


def test_seq_len_one_is_value_row(device):
    # one token: softmax weight 1, output = its V row (rounded to the query dtype)
    inp = make_paged_inputs(3, 4, 2, 64, 8, 1, dtype=torch.float32, seed=9, device=device)
    out = paged_attention(**inp.as_kwargs(), partition_size=8)
    blk = inp.block_tables[:, 0].long()
    v = inp.value_cache[blk, :, :, 0]  # [S, KVH, D]
    assert torch.equal(out, v.repeat_interleave(2, dim=1))


def test_validation_runs_first():
    inp = make_paged_inputs(1, 4, 2, 64, 16, 20, dtype=torch.float32)
    with pytest.raises(ValueError, match="^partition_size"):
        paged_attention(**inp.as_kwargs(), partition_size=24)
    with pytest.raises(ValueError, match="^seq_lens"):
        paged_attention(**with_seq_lens(inp, [0]).as_kwargs())


def test_naive_accepts_mapping():
    inp = make_paged_inputs(2, 4, 2, 64, 16, [5, 70], dtype=torch.float16, seed=8)
    a = naive_paged_attention_fp64(inp)
    b = naive_paged_attention_fp64(inp.as_kwargs())
    assert a.dtype == torch.float64 and torch.equal(a, b)


# ---- GPU ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_gpu_matches_cpu(kv):
    kw = dict(dtype=torch.float16, kv_cache_dtype=kv, alibi=True, seed=21)
    cpu = make_paged_inputs(3, 8, 2, 128, 16, [1, 999, 4321], device="cpu", **kw)
    gpu = make_paged_inputs(3, 8, 2, 128, 16, [1, 999, 4321], device="cuda", **kw)
    for name in ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "alibi_slopes"):
        x, y = getattr(cpu, name), getattr(gpu, name).cpu()
        assert torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num()), name
    truth = naive_paged_attention_fp64(cpu)
    for p in (None, 256):
        out = paged_attention(**gpu.as_kwargs(), partition_size=p)
        assert out.is_cuda
        assert_matches_truth(out.cpu(), cpu, truth)


def test_e4m3_decoding_tables_match_torch_and_vllms_fnuz_convention():
    """The float64 truth decodes bytes from the encodings' definitions (not torch's casts); both
    agree with torch on all 256 bytes, and every finite nonzero byte means twice as much in
    e4m3fn as in e4m3fnuz -- why vLLM doubles the scales where it writes e4m3fnuz (gfx94x)."""
    import math

    from cpa.reference import _e4m3_values

    allb = torch.arange(256, dtype=torch.uint8)
    for fmt, dt in (("e4m3fn", torch.float8_e4m3fn), ("e4m3fnuz", torch.float8_e4m3fnuz)):
        assert torch.equal(allb.view(dt).double().nan_to_num(9.0), _e4m3_values(fmt).nan_to_num(9.0)), fmt
    fn, uz = _e4m3_values("e4m3fn"), _e4m3_values("e4m3fnuz")
    finite = [b for b in range(256) if b not in (0, 0x80) and not math.isnan(fn[b]) and not math.isnan(uz[b])]
    assert len(finite) == 252 and all(fn[b] == 2 * uz[b] for b in finite)
    assert math.isnan(uz[0x80]) and uz[0x7F] == 240.0 and math.isnan(fn[0x7F]) and fn[0x7E] == 448.0


def test_fp8_e4m3fnuz_caches(device):
    """MI300's encoding: the same bytes read as e4m3fnuz with scale 2s are e4m3fn with s (vLLM's
    convention), the reference agrees with the float64 truth, and reading them as e4m3fn is wrong."""
    inp = make_paged_inputs(2, 4, 2, 64, 16, [50, 400], dtype=torch.float16, kv_cache_dtype="fp8",
                            fp8_format="e4m3fnuz", seed=4, device=device)
    assert inp.key_cache.dtype == torch.float8_e4m3fnuz
    out = paged_attention(**inp.as_kwargs())
    assert_matches_truth(out, inp)
    raw = dict(inp.as_kwargs(), key_cache=inp.key_cache.view(torch.uint8), value_cache=inp.value_cache.view(torch.uint8))
    assert torch.equal(paged_attention(**raw, fp8_format="e4m3fnuz"), out)
    # read as e4m3fn with vLLM's (doubled) scales: every value twice too large, and the largest
    # bytes (0x7F / 0xFF: +-240 in e4m3fnuz, the amax of each cache) NaN
    assert not relative_error(paged_attention(**raw), out) < 0.5
