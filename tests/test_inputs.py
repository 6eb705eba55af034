"""cpa.inputs.make_paged_inputs: layout, realism of the block table, poison, fp8, ALiBi, determinism."""

from __future__ import annotations

import math

import pytest
import torch

from cpa.inputs import FP8_E4M3_NAN_BYTE, PagedInputs, alibi_slopes, make_paged_inputs
from cpa.reference import paged_attention
from cpa.validation import validate_paged_attention_args


def used_mask(inp: PagedInputs) -> torch.Tensor:
    """[num_blocks, block_size] True where some sequence has a token (from the block table)."""
    nb, bs = inp.value_cache.shape[0], inp.value_cache.shape[3]
    used = torch.zeros(nb, bs, dtype=torch.bool)
    bt = inp.block_tables.cpu()
    for s, L in enumerate(inp.seq_lens_host):
        for t in range(0, L, bs):
            used[bt[s, t // bs], : min(bs, L - t)] = True
    return used


@pytest.mark.parametrize(
    "dtype,kv,elem,x",
    [
        (torch.float32, "auto", 4, 4),
        (torch.float16, "auto", 2, 8),
        (torch.bfloat16, "auto", 2, 8),
        (torch.float16, "fp8", 1, 16),
        (torch.bfloat16, "fp8_e4m3", 1, 16),
    ],
)
def test_shapes_and_dtypes(dtype, kv, elem, x, device):
    lens = [5, 33, 64]
    inp = make_paged_inputs(3, 8, 2, 128, 16, lens, dtype=dtype, kv_cache_dtype=kv, device=device)
    nb = inp.key_cache.shape[0]
    assert inp.query.shape == (3, 8, 128) and inp.query.dtype == dtype
    cache_dtype = dtype if kv == "auto" else torch.uint8
    assert inp.key_cache.shape == (nb, 2, 128 // x, 16, x) and inp.key_cache.dtype == cache_dtype
    assert inp.value_cache.shape == (nb, 2, 128, 16) and inp.value_cache.dtype == cache_dtype
    assert inp.key_cache.element_size() == elem
    assert inp.block_tables.dtype == torch.int32 and inp.block_tables.shape == (3, 4)
    assert inp.seq_lens.dtype == torch.int32 and inp.seq_lens.tolist() == lens
    assert inp.scale == pytest.approx(1 / math.sqrt(128))
    assert inp.kv_cache_dtype == ("auto" if kv == "auto" else "fp8")
    for t in (inp.query, inp.key_cache, inp.value_cache, inp.block_tables, inp.seq_lens):
        assert t.device.type == torch.device(device).type and t.is_contiguous()
    # passes the shared validation, value checks included
    s = validate_paged_attention_args(**{k: v for k, v in inp.as_kwargs().items()})
    assert s.x == x and s.max_seq_len == 64


def test_num_blocks_default_and_explicit():
    lens = [16, 17, 100]  # 1 + 2 + 7 = 10 blocks of 16
    inp = make_paged_inputs(3, 4, 4, 64, 16, lens, dtype=torch.float16)
    assert inp.key_cache.shape[0] == 10 + 1
    big = make_paged_inputs(1, 4, 4, 64, 16, 16 * 200, dtype=torch.float16)
    assert big.key_cache.shape[0] == 200 + 20
    assert make_paged_inputs(3, 4, 4, 64, 16, lens, dtype=torch.float16, num_blocks=50).key_cache.shape[0] == 50
    with pytest.raises(ValueError, match="^num_blocks"):
        make_paged_inputs(3, 4, 4, 64, 16, lens, dtype=torch.float16, num_blocks=9)


def test_block_table_is_shuffled_distinct_with_garbage_tails():
    lens = [1, 16, 17, 300, 1000, 64]
    inp = make_paged_inputs(len(lens), 4, 2, 64, 16, lens, dtype=torch.float16, seed=3, max_blocks_per_seq=70)
    nb = inp.key_cache.shape[0]
    bt = inp.block_tables
    used = [bt[s, : math.ceil(L / 16)] for s, L in enumerate(lens)]
    flat = torch.cat(used)
    assert flat.numel() == sum(math.ceil(L / 16) for L in lens)
    assert flat.unique().numel() == flat.numel(), "physical blocks shared between sequences"
    assert flat.min() >= 0 and flat.max() < nb
    assert not torch.equal(flat, torch.arange(flat.numel(), dtype=flat.dtype)), "not shuffled"
    tails = torch.cat([bt[s, math.ceil(L / 16):] for s, L in enumerate(lens)])
    assert tails.numel() == len(lens) * 70 - flat.numel()
    assert ((tails < 0) | (tails >= nb)).any(), "garbage tails never out of range"
    assert (tails == -1).any()


def test_seq_lens_int_and_sequence():
    a = make_paged_inputs(3, 4, 4, 64, 8, 20, dtype=torch.float32)
    assert a.seq_lens_host == (20, 20, 20) and a.max_seq_len == 20
    with pytest.raises(ValueError, match="^seq_lens"):
        make_paged_inputs(3, 4, 4, 64, 8, [20, 30], dtype=torch.float32)
    with pytest.raises(ValueError, match="^seq_lens"):
        make_paged_inputs(2, 4, 4, 64, 8, [20, 0], dtype=torch.float32)
    with pytest.raises(ValueError, match="^num_heads"):
        make_paged_inputs(2, 6, 4, 64, 8, 10, dtype=torch.float32)


@pytest.mark.parametrize("kv,dtype", [("auto", torch.float32), ("auto", torch.bfloat16), ("fp8", torch.float16)])
def test_poison_exactly_the_unused_slots(kv, dtype):
    lens = [1, 17, 250, 33]
    inp = make_paged_inputs(len(lens), 4, 2, 64, 16, lens, dtype=dtype, kv_cache_dtype=kv, seed=2)
    used = used_mask(inp)  # [nb, bs]
    if kv == "auto":
        k_bad = torch.isnan(inp.key_cache)
        v_bad = torch.isnan(inp.value_cache)
    else:
        k_bad = inp.key_cache == FP8_E4M3_NAN_BYTE
        v_bad = inp.value_cache == FP8_E4M3_NAN_BYTE
    # key [nb, kvh, hs/x, bs, x], value [nb, kvh, hs, bs]: poisoned iff the slot is unused
    assert torch.equal(k_bad.permute(0, 3, 1, 2, 4).flatten(2).all(-1), ~used)
    assert torch.equal(k_bad.permute(0, 3, 1, 2, 4).flatten(2).any(-1), ~used)
    assert torch.equal(v_bad.permute(0, 3, 1, 2).flatten(2).all(-1), ~used)
    assert torch.equal(v_bad.permute(0, 3, 1, 2).flatten(2).any(-1), ~used)
    assert (~used).any()


def test_no_poison_keeps_used_values():
    kw = dict(dtype=torch.float16, seed=4)
    a = make_paged_inputs(2, 4, 2, 64, 16, [3, 40], poison_unused=False, **kw)
    b = make_paged_inputs(2, 4, 2, 64, 16, [3, 40], poison_unused=True, **kw)
    assert not torch.isnan(a.key_cache).any() and not torch.isnan(a.value_cache).any()
    used = used_mask(a)
    assert torch.equal(a.value_cache.permute(0, 3, 1, 2)[used], b.value_cache.permute(0, 3, 1, 2)[used])
    assert torch.equal(a.key_cache.permute(0, 3, 1, 2, 4)[used], b.key_cache.permute(0, 3, 1, 2, 4)[used])


def test_fp8_quantization():
    inp = make_paged_inputs(2, 4, 2, 128, 16, [100, 333], dtype=torch.float16, kv_cache_dtype="fp8", seed=6)
    assert isinstance(inp.k_scale, float) and isinstance(inp.v_scale, float)
    assert inp.k_scale > 0 and inp.v_scale > 0 and inp.k_scale != inp.v_scale
    used = used_mask(inp)
    k = inp.key_cache.permute(0, 3, 1, 2, 4)[used]
    v = inp.value_cache.permute(0, 3, 1, 2)[used]
    assert not (k == FP8_E4M3_NAN_BYTE).any() and not (k == 0xFF).any()
    kf = k.view(torch.float8_e4m3fn).float() * inp.k_scale
    vf = v.view(torch.float8_e4m3fn).float() * inp.v_scale
    assert torch.isfinite(kf).all() and torch.isfinite(vf).all()
    # amax / 448 scaling uses the e4m3 range: the largest byte magnitude is close to 448
    assert kf.abs().max() <= 448 * inp.k_scale * (1 + 1e-6)
    assert kf.abs().max() / inp.k_scale > 200
    # the drawn distributions: K std ~ 2, V std ~ 0.5
    assert 1.8 < kf.std() < 2.2 and 0.45 < vf.std() < 0.55


@pytest.mark.parametrize("n", [1, 2, 8, 12, 32, 40, 64])
def test_alibi_slopes(n):
    s = alibi_slopes(n)
    assert s.dtype == torch.float32 and s.shape == (n,)
    assert torch.all(s > 0) and torch.all(s < 1)
    p = 1 << (n.bit_length() - 1)
    expect = [2 ** (-8 * i / p) for i in range(1, p + 1)]
    expect += [2 ** (-8 * i / (2 * p)) for i in range(1, 2 * p + 1, 2)][: n - p]
    assert torch.allclose(s, torch.tensor(expect, dtype=torch.float32))
    assert len(set(s.tolist())) == n


def test_alibi_on_inputs(device):
    inp = make_paged_inputs(2, 8, 2, 64, 16, 10, dtype=torch.float16, alibi=True, device=device)
    assert inp.alibi_slopes.dtype == torch.float32 and inp.alibi_slopes.device.type == torch.device(device).type
    assert torch.allclose(inp.alibi_slopes.cpu(), 2.0 ** (-torch.arange(1, 9, dtype=torch.float32)))
    assert make_paged_inputs(2, 8, 2, 64, 16, 10, dtype=torch.float16).alibi_slopes is None


def test_deterministic_by_seed():
    kw = dict(dtype=torch.bfloat16, kv_cache_dtype="fp8", alibi=True)
    a = make_paged_inputs(3, 4, 2, 64, 16, [5, 60, 200], seed=1, **kw)
    b = make_paged_inputs(3, 4, 2, 64, 16, [5, 60, 200], seed=1, **kw)
    c = make_paged_inputs(3, 4, 2, 64, 16, [5, 60, 200], seed=2, **kw)
    for name in ("query", "key_cache", "value_cache", "block_tables"):
        assert torch.equal(getattr(a, name), getattr(b, name))
        assert not torch.equal(getattr(a, name), getattr(c, name))
    assert (a.k_scale, a.v_scale) == (b.k_scale, b.v_scale)


@pytest.mark.parametrize("chunk", [None, 1000])
def test_fp8_scale_replay_over_chunks(monkeypatch, chunk):
    """The fp8 path draws twice (amax, then values) and must replay the same stream, chunk by chunk:
    then the largest |value| maps exactly to 448 (byte 0x7E, sign bit aside) in each cache."""
    import cpa.inputs as mod

    if chunk is not None:
        monkeypatch.setattr(mod, "_CHUNK_ELEMS", chunk)
    inp = make_paged_inputs(2, 4, 2, 64, 16, [50, 70], dtype=torch.float16, kv_cache_dtype="fp8",
                            seed=12, poison_unused=False)
    assert inp.key_cache.numel() > 4 * 1000
    for cache in (inp.key_cache, inp.value_cache):
        assert int((cache & 0x7F).max()) == 0x7E
    a = make_paged_inputs(2, 4, 2, 64, 16, [50, 70], dtype=torch.float16, kv_cache_dtype="fp8",
                          seed=12, poison_unused=False)
    assert torch.equal(a.key_cache, inp.key_cache) and a.k_scale == inp.k_scale


def test_values_independent_of_thread_count(monkeypatch):
    import cpa.inputs as mod

    monkeypatch.setattr(mod, "_CHUNK_ELEMS", 1 << 16)
    kw = dict(dtype=torch.float16, kv_cache_dtype="fp8", seed=13)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = make_paged_inputs(2, 4, 2, 128, 16, [3000, 7000], **kw)
        torch.set_num_threads(max(2, old))
        b = make_paged_inputs(2, 4, 2, 128, 16, [3000, 7000], **kw)
    finally:
        torch.set_num_threads(old)
    assert a.key_cache.numel() > 8 * (1 << 16)  # several chunks
    assert torch.equal(a.key_cache, b.key_cache) and torch.equal(a.value_cache, b.value_cache)
    assert (a.k_scale, a.v_scale) == (b.k_scale, b.v_scale)


def test_as_kwargs_and_helpers(device):
    lens = [7, 100, 33]
    inp = make_paged_inputs(3, 8, 2, 128, 16, lens, dtype=torch.float16, device=device)
    kw = inp.as_kwargs()
    assert list(kw) == ["query", "key_cache", "value_cache", "block_tables", "seq_lens", "scale",
                        "alibi_slopes", "kv_cache_dtype", "k_scale", "v_scale"]
    out = paged_attention(**inp.as_kwargs(), partition_size=256)
    assert out.shape == (3, 8, 128) and not torch.isnan(out).any()
    assert inp.max_seq_len == 100
    assert inp.kv_bytes() == sum(lens) * 2 * 128 * 2 * 2
    fp8 = make_paged_inputs(3, 8, 2, 128, 16, lens, dtype=torch.float16, kv_cache_dtype="fp8")
    assert fp8.kv_bytes() == sum(lens) * 2 * 128 * 2 * 1
    moved = inp.to("cpu")
    assert torch.equal(moved.block_tables.cpu(), inp.block_tables.cpu()) and moved.seq_lens_host == inp.seq_lens_host


@pytest.mark.gpu
def test_same_values_on_gpu():
    kw = dict(dtype=torch.float16, kv_cache_dtype="auto", alibi=True, seed=5)
    a = make_paged_inputs(2, 8, 2, 128, 16, [10, 1000], device="cpu", **kw)
    b = make_paged_inputs(2, 8, 2, 128, 16, [10, 1000], device="cuda", **kw)
    assert b.key_cache.is_cuda
    for name in ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "alibi_slopes"):
        x, y = getattr(a, name), getattr(b, name).cpu()
        assert torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num()), name
