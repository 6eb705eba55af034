"""One test per validation rule: the right error type, and a message naming the argument."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from cpa.inputs import make_paged_inputs
from cpa.validation import (
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_HEAD_SIZES,
    PagedAttentionShape,
    validate_paged_attention_args,
)

LENS = [1, 40, 100]  # blocks of 16: 1, 3, 7


def base(dtype=torch.float16, kv="auto", **kw):
    inp = make_paged_inputs(3, 8, 2, 128, 16, LENS, dtype=dtype, kv_cache_dtype=kv, alibi=True,
                            max_blocks_per_seq=9, **kw)
    return inp.as_kwargs()


def call(kw, **over):
    args = {**kw, **over}
    pos = [args.pop(k) for k in ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "scale")]
    return validate_paged_attention_args(*pos, **args)


def raises(err, name, kw, **over):
    """Assert the call raises ``err`` with a message that starts with ``name``; returns the message."""
    with pytest.raises(err) as info:
        call(kw, **over)
    msg = str(info.value)
    assert msg.startswith(name), f"message does not start with {name!r}: {msg}"
    return msg


@pytest.fixture
def kw():
    return base()


# ---- the happy path -------------------------------------------------------------------------------
def test_valid_returns_shape(kw):
    s = call(kw, partition_size=64)
    assert isinstance(s, PagedAttentionShape)
    assert (s.num_seqs, s.num_heads, s.num_kv_heads, s.head_size, s.block_size, s.x) == (3, 8, 2, 128, 16, 8)
    assert (s.max_blocks_per_seq, s.gqa_ratio, s.partition_size) == (9, 4, 64)
    assert s.num_blocks == kw["key_cache"].shape[0]
    assert s.max_seq_len == 100 and s.max_num_partitions == 2
    assert s.query_dtype == torch.float16 and s.kv_cache_dtype == "auto"
    assert s.device == torch.device("cpu")
    with pytest.raises(Exception):
        s.num_seqs = 4  # frozen


def test_single_pass_has_one_partition(kw):
    assert call(kw).max_num_partitions == 1


@pytest.mark.parametrize("spelling", ["fp8", "fp8_e4m3"])
def test_fp8_normalized_and_x16(spelling):
    kw = base(kv=spelling)
    s = call(kw)
    assert s.kv_cache_dtype == "fp8" and s.x == 16


def test_fp8_accepts_float8_tensors():
    kw = base(kv="fp8")
    s = call(kw, key_cache=kw["key_cache"].view(torch.float8_e4m3fn),
             value_cache=kw["value_cache"].view(torch.float8_e4m3fn))
    assert s.x == 16


@pytest.mark.parametrize("dtype,x", [(torch.float32, 4), (torch.float16, 8), (torch.bfloat16, 8)])
def test_query_dtypes_and_x(dtype, x):
    assert call(base(dtype=dtype)).x == x


def test_out_accepted(kw):
    call(kw, out=torch.empty_like(kw["query"]))


def test_garbage_past_used_blocks_is_not_checked(kw):
    bt = kw["block_tables"].clone()
    bt[0, 1:] = -7  # seq 0 uses 1 block
    bt[1, 3:] = 10**9  # seq 1 uses 3
    bt[2, 7:] = -1  # seq 2 uses 7
    call(kw, block_tables=bt)


# ---- Python types ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["query", "key_cache", "value_cache", "block_tables", "seq_lens"])
def test_tensor_args_must_be_tensors(kw, name):
    msg = raises(TypeError, name, kw, **{name: kw[name].numpy()})
    assert "ndarray" in msg and "torch.Tensor" in msg


@pytest.mark.parametrize("name", ["alibi_slopes", "out"])
def test_optional_tensor_args_must_be_tensors(kw, name):
    raises(TypeError, name, kw, **{name: [0.5] * 8})


@pytest.mark.parametrize("name", ["scale", "k_scale", "v_scale"])
@pytest.mark.parametrize("bad", ["1.0", True, None, torch.tensor(1.0)])
def test_scale_types(kw, name, bad):
    raises(TypeError, name, kw, **{name: bad})


@pytest.mark.parametrize("name", ["scale", "k_scale", "v_scale"])
@pytest.mark.parametrize("bad", [0.0, -0.125, float("inf"), float("nan")])
def test_scale_values(kw, name, bad):
    msg = raises(ValueError, name, kw, **{name: bad})
    assert "positive finite" in msg


@pytest.mark.parametrize("ok", [1, np.float32(0.5), 0.088])
def test_scale_accepts_reals(kw, ok):
    call(kw, scale=ok, k_scale=ok, v_scale=ok)


def test_kv_cache_dtype_value(kw):
    msg = raises(ValueError, "kv_cache_dtype", kw, kv_cache_dtype="fp16")
    assert "'fp16'" in msg and "'auto'" in msg and "'fp8'" in msg


def test_kv_cache_dtype_type(kw):
    raises(TypeError, "kv_cache_dtype", kw, kv_cache_dtype=torch.uint8)


@pytest.mark.parametrize("bad", [64.0, "64", True])
def test_partition_size_type(kw, bad):
    raises(TypeError, "partition_size", kw, partition_size=bad)


@pytest.mark.parametrize("bad", [2.5, "100"])
def test_max_seq_len_type(kw, bad):
    raises(TypeError, "max_seq_len", kw, max_seq_len=bad)


def test_check_values_type(kw):
    raises(TypeError, "check_values", kw, check_values=1)


# ---- dtypes -----------------------------------------------------------------------------------------
def test_query_dtype(kw):
    msg = raises(TypeError, "query", kw, query=kw["query"].double())
    assert "torch.float64" in msg and "torch.float16" in msg


def test_query_dtypes_parameter(kw):
    raises(TypeError, "query", kw, query_dtypes=(torch.bfloat16,))


@pytest.mark.parametrize("name", ["key_cache", "value_cache"])
def test_auto_cache_dtype_must_match_query(kw, name):
    msg = raises(TypeError, name, kw, **{name: kw[name].float()})
    assert "must match query" in msg


@pytest.mark.parametrize("name", ["key_cache", "value_cache"])
def test_fp8_cache_dtype(name):
    kw = base(kv="fp8")
    bad = kw[name].to(torch.float16)
    msg = raises(TypeError, name, kw, **{name: bad})
    assert "torch.uint8" in msg


def test_fp8_cache_dtypes_must_agree():
    kw = base(kv="fp8")
    raises(TypeError, "value_cache", kw, value_cache=kw["value_cache"].view(torch.float8_e4m3fn))


@pytest.mark.parametrize("name", ["block_tables", "seq_lens"])
def test_index_dtypes(kw, name):
    msg = raises(TypeError, name, kw, **{name: kw[name].long()})
    assert "torch.int64" in msg and "torch.int32" in msg


def test_alibi_dtype(kw):
    raises(TypeError, "alibi_slopes", kw, alibi_slopes=kw["alibi_slopes"].half())


def test_out_dtype(kw):
    raises(TypeError, "out", kw, out=torch.empty(kw["query"].shape, dtype=torch.float32))


# ---- ranks ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,reshape",
    [
        ("query", lambda t: t.reshape(t.shape[0], -1)),
        ("key_cache", lambda t: t.reshape(*t.shape[:3], -1)),
        ("value_cache", lambda t: t.unsqueeze(-1)),
        ("block_tables", lambda t: t.reshape(-1)),
        ("seq_lens", lambda t: t.unsqueeze(0)),
        ("alibi_slopes", lambda t: t.unsqueeze(0)),
    ],
)
def test_ndim(kw, name, reshape):
    msg = raises(ValueError, name, kw, **{name: reshape(kw[name])})
    assert "-d" in msg


# ---- one device, contiguous ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["key_cache", "value_cache", "block_tables", "seq_lens", "alibi_slopes"])
def test_one_device(kw, name):
    msg = raises(ValueError, name, kw, **{name: kw[name].to("meta")})
    assert "meta" in msg and "one device" in msg


def test_out_device(kw):
    raises(ValueError, "out", kw, out=torch.empty(kw["query"].shape, dtype=kw["query"].dtype, device="meta"))


def _noncontig(t: torch.Tensor) -> torch.Tensor:
    # same shape and values, transposed memory layout of the first two dims (or a strided copy)
    if t.dim() >= 2 and t.shape[0] != 1 and t.shape[1] != 1:
        nc = t.transpose(0, 1).contiguous().transpose(0, 1)
    else:
        nc = torch.stack([t, t], dim=-1)[..., 0]
    assert not nc.is_contiguous() and nc.shape == t.shape
    return nc


@pytest.mark.parametrize("name", ["query", "key_cache", "value_cache", "block_tables", "seq_lens", "alibi_slopes"])
def test_contiguous(kw, name):
    msg = raises(ValueError, name, kw, **{name: _noncontig(kw[name])})
    assert "contiguous" in msg


def test_out_contiguous(kw):
    raises(ValueError, "out", kw, out=_noncontig(torch.empty_like(kw["query"])))


def _offset_view(t, elements):
    """A contiguous copy of t that starts `elements` elements into its own allocation."""
    buf = torch.empty(t.numel() + elements, dtype=t.dtype)
    view = buf[elements:].view(t.shape)
    view.copy_(t)
    assert view.is_contiguous() and view.storage_offset() == elements
    return view


@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("name", ["query", "key_cache", "value_cache", "out"])
def test_data_on_a_16_byte_boundary(name, kv):
    # contiguous but not 16-byte aligned: the kernel's vector loads would fault on NVIDIA
    kw = base(kv=kv)
    t = torch.empty_like(kw["query"]) if name == "out" else kw[name]
    msg = raises(ValueError, name, kw, **{name: _offset_view(t, 1)})
    assert "16-byte" in msg and "storage offset 1" in msg
    call(kw, **{name: _offset_view(t, 16 // t.element_size())})  # 16 bytes in: aligned, accepted


@pytest.mark.parametrize("name", ["query", "key_cache", "value_cache", "block_tables", "seq_lens", "alibi_slopes"])
def test_out_shares_no_memory_with_an_input(kw, name):
    # the kernel writes out while other workgroups still read the inputs: out laid over any of
    # them (the whole tensor, or a query-shaped window into a cache) is refused
    t = kw[name]
    need = kw["query"].numel() * kw["query"].element_size()
    if t.numel() * t.element_size() >= need:
        window = t.view(-1).view(torch.uint8)[:need].view(kw["query"].dtype).view(kw["query"].shape)
    else:  # smaller than out: out starts inside a buffer whose head holds this input
        buf = torch.zeros(need, dtype=torch.uint8)
        buf[:t.numel() * t.element_size()].copy_(t.view(-1).view(torch.uint8))
        kw = dict(kw, **{name: buf[:t.numel() * t.element_size()].view(t.dtype).view(t.shape)})
        window = buf.view(kw["query"].dtype).view(kw["query"].shape)
    msg = raises(ValueError, "out", kw, out=window)
    assert f"overlaps {name}" in msg


def test_out_next_to_an_input_is_accepted(kw):
    # one allocation, query then out right after it: adjacent, not overlapping
    q = kw["query"]
    buf = torch.empty(2 * q.numel(), dtype=q.dtype)
    query, out = buf[:q.numel()].view(q.shape), buf[q.numel():].view(q.shape)
    query.copy_(q)
    call(kw, query=query, out=out)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_alibi_slopes_finite(kw, bad):
    slopes = kw["alibi_slopes"].clone()
    slopes[5] = bad
    msg = raises(ValueError, "alibi_slopes", kw, alibi_slopes=slopes)
    assert "alibi_slopes[5]" in msg and "finite" in msg
    call(kw, alibi_slopes=slopes, check_values=False)  # a value check: skipped with the others


# ---- shapes ---------------------------------------------------------------------------------------------
def test_num_heads_multiple_of_kv_heads():
    kw = make_paged_inputs(2, 6, 3, 64, 16, 20, dtype=torch.float32).as_kwargs()
    q = kw["query"]
    msg = raises(ValueError, "key_cache", kw, query=torch.randn(q.shape[0], 4, q.shape[2]))
    assert "multiple of" in msg and "num_kv_heads" in msg


def test_head_size_unsupported():
    kw = make_paged_inputs(2, 4, 2, 48, 16, 20, dtype=torch.float16).as_kwargs()
    msg = raises(ValueError, "query", kw)
    assert "48" in msg and str(SUPPORTED_HEAD_SIZES) in msg


def test_head_sizes_parameter(kw):
    raises(ValueError, "query", kw, head_sizes=(64, 256))


def test_block_size_unsupported():
    kw = make_paged_inputs(2, 4, 2, 64, 4, 20, dtype=torch.float16).as_kwargs()
    msg = raises(ValueError, "key_cache", kw)
    assert "block_size" in msg and str(SUPPORTED_BLOCK_SIZES) in msg


def test_block_sizes_parameter(kw):
    raises(ValueError, "key_cache", kw, block_sizes=(8, 32))


def test_key_cache_x(kw):
    k = kw["key_cache"]  # [nb, kvh, 16, 16, 8] -> x = 4
    bad = k.reshape(k.shape[0], k.shape[1], k.shape[2] * 2, k.shape[3], 4)
    msg = raises(ValueError, "key_cache", kw, key_cache=bad)
    assert "x = 16 // element_size" in msg


def test_key_cache_head_size(kw):
    k = kw["key_cache"]
    raises(ValueError, "key_cache", kw, key_cache=k[:, :, :8].contiguous())


@pytest.mark.parametrize("dim,what", [(0, "num_blocks"), (1, "num_kv_heads"), (2, "head_size"), (3, "block_size")])
def test_value_cache_dims(kw, dim, what):
    v = kw["value_cache"]
    bad = v.narrow(dim, 0, v.shape[dim] // 2).contiguous()
    msg = raises(ValueError, "value_cache", kw, value_cache=bad)
    assert what in msg


def test_block_tables_rows(kw):
    raises(ValueError, "block_tables", kw, block_tables=kw["block_tables"][:2].contiguous())


def test_block_tables_empty(kw):
    raises(ValueError, "block_tables", kw, block_tables=torch.zeros(3, 0, dtype=torch.int32))


def test_seq_lens_length(kw):
    raises(ValueError, "seq_lens", kw, seq_lens=kw["seq_lens"][:2].contiguous())


def test_alibi_length(kw):
    raises(ValueError, "alibi_slopes", kw, alibi_slopes=kw["alibi_slopes"][:4].contiguous())


def test_out_shape(kw):
    q = kw["query"]
    raises(ValueError, "out", kw, out=torch.empty(q.shape[0], q.shape[1], 64, dtype=q.dtype))


def test_no_sequences(kw):
    raises(ValueError, "query", kw, query=kw["query"][:0], block_tables=kw["block_tables"][:0],
           seq_lens=kw["seq_lens"][:0], check_values=False)


# ---- partition size ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -16, 8, 24, 48, 96, 1000])
def test_partition_size_value(kw, bad):
    msg = raises(ValueError, "partition_size", kw, partition_size=bad)
    assert "power-of-two multiple of block_size 16" in msg


@pytest.mark.parametrize("ok", [16, 32, 64, 256, 512, 1024, 4096])
def test_partition_size_ok(kw, ok):
    assert call(kw, partition_size=ok).partition_size == ok


def test_partition_size_checked_without_value_checks(kw):
    raises(ValueError, "partition_size", kw, partition_size=48, check_values=False)


# ---- values -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -3])
def test_seq_len_at_least_one(kw, bad):
    sl = kw["seq_lens"].clone()
    sl[1] = bad
    msg = raises(ValueError, "seq_lens", kw, seq_lens=sl)
    assert f"seq_lens[1] = {bad}" in msg


def test_seq_len_within_block_table(kw):
    sl = kw["seq_lens"].clone()
    sl[2] = 9 * 16 + 1  # 9 blocks of 16 in each row
    msg = raises(ValueError, "seq_lens", kw, seq_lens=sl)
    assert "144" in msg
    sl[2] = 9 * 16
    bt = kw["block_tables"].clone()
    bt[2] = torch.arange(9, dtype=torch.int32)
    call(kw, seq_lens=sl, block_tables=bt)


@pytest.mark.parametrize("bad", [-1, "num_blocks", 2**31 - 1])
def test_used_block_entries_in_range(kw, bad):
    nb = kw["key_cache"].shape[0]
    value = nb if bad == "num_blocks" else bad
    bt = kw["block_tables"].clone()
    bt[2, 6] = value  # seq 2 (100 tokens) uses entries 0..6
    msg = raises(ValueError, "block_tables", kw, block_tables=bt)
    assert f"block_tables[2, 6] = {value}" in msg and f"num_blocks = {nb}" in msg


def test_check_values_false_skips_value_checks(kw):
    bt = kw["block_tables"].clone()
    bt[:, 0] = -1
    sl = kw["seq_lens"].clone()
    sl[0] = 0
    s = call(kw, block_tables=bt, seq_lens=sl, check_values=False)
    assert s.max_seq_len is None
    assert s.max_num_partitions == 1
    assert call(kw, check_values=False, partition_size=32).max_num_partitions is None


def test_max_seq_len_given(kw):
    s = call(kw, max_seq_len=1000, partition_size=256)
    assert s.max_seq_len == 1000 and s.max_num_partitions == 4
    s = call(kw, max_seq_len=300, partition_size=256, check_values=False)
    assert s.max_seq_len == 300 and s.max_num_partitions == 2


def test_max_seq_len_too_small(kw):
    msg = raises(ValueError, "max_seq_len", kw, max_seq_len=99)
    assert "100" in msg


def test_max_seq_len_positive(kw):
    raises(ValueError, "max_seq_len", kw, max_seq_len=0, check_values=False)


def test_value_checks_are_vectorized():
    # 256 sequences x 2048 blocks per row: must not loop over sequences in Python
    n, width = 256, 2048
    kw = make_paged_inputs(2, 8, 8, 128, 16, 16, dtype=torch.float16).as_kwargs()
    bt = torch.randint(0, kw["key_cache"].shape[0], (n, width), dtype=torch.int32)
    sl = torch.randint(1, width * 16 + 1, (n,), dtype=torch.int32)
    q = torch.randn(n, 8, 128, dtype=torch.float16)
    t = time.perf_counter()
    s = call(kw, query=q, block_tables=bt, seq_lens=sl, partition_size=512)
    dt = time.perf_counter() - t
    assert s.max_seq_len == int(sl.max())
    assert dt < 1.0, f"validation took {dt:.3f} s"


def test_staged_loops_flag_detection(monkeypatch):
    """CPA_NVCC_FLAGS=-DCPA_KV_ASYNC=N (N != 0) is a staged-loop build; =0 and other knobs are not."""
    from cpa.jit import staged_loops_flagged

    for flags, staged in (("", False), ("-DCPA_KV_ASYNC=0", False), ("-DCPA_MIN_BLOCKS=3", False),
                          ("-DCPA_KV_ASYNC=4", True), ("-DCPA_MIN_BLOCKS=3 -DCPA_KV_ASYNC=2", True)):
        monkeypatch.setenv("CPA_NVCC_FLAGS", flags)
        assert staged_loops_flagged() is staged, flags


def test_provenance_command_names_knob_flags(monkeypatch):
    """A row made with CPA_NVCC_FLAGS records them, with CPA_COMMAND too (a knob build's bench or
    target-2 rows went unlabelled); CPA_COMMAND is otherwise taken as is."""
    from cpa.provenance import command

    monkeypatch.delenv("CPA_COMMAND", raising=False)
    monkeypatch.setenv("CPA_NVCC_FLAGS", "-DCPA_KV_ASYNC=4 -DCPA_MIN_BLOCKS=3")
    assert command().startswith("CPA_NVCC_FLAGS='-DCPA_KV_ASYNC=4 -DCPA_MIN_BLOCKS=3' ")
    monkeypatch.setenv("CPA_NVCC_FLAGS", "")
    assert not command().startswith("CPA_NVCC_FLAGS")
    monkeypatch.setenv("CPA_COMMAND", "python3 -m cpa bench")
    assert command() == "python3 -m cpa bench"
    monkeypatch.setenv("CPA_NVCC_FLAGS", "-DCPA_MIN_BLOCKS=3")
    assert command() == "CPA_NVCC_FLAGS=-DCPA_MIN_BLOCKS=3 python3 -m cpa bench"
    monkeypatch.setenv("CPA_COMMAND", "CPA_NVCC_FLAGS=-DCPA_MIN_BLOCKS=3 python3 -m cpa bench")
    assert command() == "CPA_NVCC_FLAGS=-DCPA_MIN_BLOCKS=3 python3 -m cpa bench"


# ------------------------------------------------------------------ fp8 encodings (e4m3fn / e4m3fnuz)
def test_fp8_format_follows_the_storage_dtype_or_the_argument():
    kw = base(kv="fp8")
    assert call(kw).fp8_format == "e4m3fn"  # uint8 on the CPU: e4m3fn
    assert call(kw, fp8_format="e4m3fnuz").fp8_format == "e4m3fnuz"
    fnuz = dict(key_cache=kw["key_cache"].view(torch.float8_e4m3fnuz),
                value_cache=kw["value_cache"].view(torch.float8_e4m3fnuz))
    assert call(kw, **fnuz).fp8_format == "e4m3fnuz"
    raises(ValueError, "fp8_format", kw, fp8_format="e4m3fn", **fnuz)  # contradicts the dtype
    raises(ValueError, "fp8_format", kw, fp8_format="e5m2")
    raises(ValueError, "fp8_format", base(), fp8_format="e4m3fn")  # an auto cache has none
    assert call(base()).fp8_format is None


def test_default_fp8_format_is_the_devices(monkeypatch):
    """gfx94x (MI300) reads uint8 fp8 caches as e4m3fnuz, as vLLM writes them there; NVIDIA, gfx90a
    and gfx950 as e4m3fn."""
    import cpa.jit as J
    from cpa import validation as Val

    assert Val.default_fp8_format(torch.device("cpu")) == "e4m3fn"
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    for arch, want in (("gfx942", "e4m3fnuz"), ("gfx940", "e4m3fnuz"), ("gfx90a", "e4m3fn"), ("gfx950", "e4m3fn")):
        monkeypatch.setattr(J, "device_info", lambda device=None, a=arch: ("hip", a, 304))
        assert Val.default_fp8_format(torch.device("cuda", 0)) == want, arch
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(J, "device_info", lambda device=None: ("cuda", "sm_90", 132))
    assert Val.default_fp8_format(torch.device("cuda", 0)) == "e4m3fn"
