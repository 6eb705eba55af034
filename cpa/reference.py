"""Pure-torch reference for paged-attention decode (CPU and GPU).

:func:`paged_attention` is the reference a kernel is checked against: float32 compute,
output in the query's dtype, the same arguments and validation as the kernel, and, with an
integer ``partition_size``, the same two-phase algorithm as a partitioned ("v2") kernel, so
that its intermediates (``exp_sums``, ``max_logits``, ``tmp_out``) can be compared too.

:func:`naive_paged_attention_fp64` is an independent float64 ground truth used by the tests:
a per-token gather through the block table, an explicit softmax and a weighted sum.

Tolerances for comparing an output with the float64 ground truth live here, in one place:
:data:`REL_ERR_TOL` (relative norm error ``||out - ref|| / ||ref||``, per output dtype).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Any, Iterator

import torch

from .validation import FP8_FORMATS, PagedAttentionShape, resolve_fp8_format, validate_paged_attention_args

__all__ = [
    "REL_ERR_TOL",
    "relative_error",
    "dequantize_cache",
    "paged_attention",
    "reduce_partitions",
    "naive_paged_attention_fp64",
]

#: max relative norm error ||out - ref|| / ||ref|| of the reference against the float64 ground
#: truth, by output (query) dtype: float32 compute, then one rounding to the output dtype.
REL_ERR_TOL: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1e-2,
}


def relative_error(out: torch.Tensor, ref: torch.Tensor, *, per_seq: bool = False) -> float:
    """``||out - ref|| / ||ref||`` in float64; inf if ``out`` has a NaN or inf.

    ``per_seq=True``: the maximum over ``dim 0`` (sequences) of each sequence's own relative
    error -- a long sequence's output has a small norm and would hide in the batch norm.
    """
    o = out.detach().to(torch.float64)
    r = ref.detach().to(torch.float64).to(o.device)
    if not bool(torch.isfinite(o).all()):
        return float("inf")
    if per_seq:
        num = torch.linalg.vector_norm((o - r).reshape(o.shape[0], -1), dim=1)
        den = torch.linalg.vector_norm(r.reshape(r.shape[0], -1), dim=1)
        return float(torch.where(den > 0, num / den.clamp_min(1e-300), num).max())
    den = torch.linalg.vector_norm(r).item()
    num = torch.linalg.vector_norm(o - r).item()
    return num / den if den > 0 else num


def dequantize_cache(cache: torch.Tensor, kv_cache_dtype: str, scale: float, dtype: torch.dtype = torch.float32,
                     fp8_format: str = "e4m3fn") -> torch.Tensor:
    """Cache values as ``dtype``: a plain upcast for "auto"; for "fp8", the e4m3 value of each
    byte (uint8 bytes read as ``fp8_format``; a float8 tensor as its own dtype) * scale."""
    if kv_cache_dtype == "auto":
        return cache.to(dtype)
    if cache.dtype == torch.uint8:
        cache = cache.view(FP8_FORMATS[fp8_format])
    return cache.to(dtype) * scale


_cpu_exp_warmed = False


def _warm_cpu_exp() -> None:
    """Call torch.exp once per process (float32 and float64, big enough to run in parallel).

    Seen with torch 2.13.0 (CPU build) on a 2-core x86-64 VM: in roughly one process in four,
    the *first* parallel ``torch.exp`` returned values with relative errors up to ~1.5e-4 in
    the chunk computed by the calling thread, while every later call was correct to an ulp.
    A throw-away first call keeps that out of reference results.
    """
    global _cpu_exp_warmed
    if not _cpu_exp_warmed:
        for dt in (torch.float32, torch.float64):
            torch.exp(torch.zeros(1 << 17, dtype=dt))
        _cpu_exp_warmed = True


@contextlib.contextmanager
def _ieee_fp32_matmul(device: torch.device) -> Iterator[None]:
    """Keep float32 matmuls in full precision (no TF32) on CUDA for the duration."""
    if device.type != "cuda":
        yield
        return
    m = torch.backends.cuda.matmul
    if hasattr(m, "fp32_precision"):
        old = m.fp32_precision
        m.fp32_precision = "ieee"
        try:
            yield
        finally:
            m.fp32_precision = old
    else:  # older torch
        old = m.allow_tf32
        m.allow_tf32 = False
        try:
            yield
        finally:
            m.allow_tf32 = old


def _gather_seq(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    blocks: torch.Tensor,
    seq_len: int,
    shape: PagedAttentionShape,
    k_scale: float,
    v_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of one sequence as float32 ``[num_kv_heads, seq_len, head_size]``."""
    kvh, hs = shape.num_kv_heads, shape.head_size
    n = blocks.numel()
    # key: [n, kvh, hs/x, bs, x] -> [kvh, n, bs, hs/x, x] -> [kvh, n*bs, hs]
    k = key_cache.index_select(0, blocks).permute(1, 0, 3, 2, 4).reshape(kvh, n * shape.block_size, hs)
    # value: [n, kvh, hs, bs] -> [kvh, n, bs, hs] -> [kvh, n*bs, hs]
    v = value_cache.index_select(0, blocks).permute(1, 0, 3, 2).reshape(kvh, n * shape.block_size, hs)
    k = dequantize_cache(k[:, :seq_len], shape.kv_cache_dtype, k_scale, fp8_format=shape.fp8_format)
    v = dequantize_cache(v[:, :seq_len], shape.kv_cache_dtype, v_scale, fp8_format=shape.fp8_format)
    return k, v


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    alibi_slopes: torch.Tensor | None = None,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    partition_size: int | None = None,
    return_intermediates: bool = False,
    fp8_format: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference paged-attention decode: one query token per sequence against its paged KV.

    Arguments follow :func:`cpa.validation.validate_paged_attention_args` (checked first,
    including the value checks). Computes in float32 and returns ``[num_seqs, num_heads,
    head_size]`` in the query's dtype. Logits are ``scale * q.k`` plus, with ALiBi,
    ``alibi_slopes[h] * (t - seq_len + 1)``. Cache slots past ``seq_len`` are never used.

    ``partition_size=None`` is a single-pass softmax. An integer selects the partitioned
    algorithm: for each partition ``p`` (tokens ``[p*P, min((p+1)*P, seq_len))``)

    * ``max_logits[s, h, p]`` = max logit,
    * ``exp_sums[s, h, p]`` = sum of ``exp(logit - max_logits)``,
    * ``tmp_out[s, h, p, :]`` = ``sum(exp(logit - max_logits) * v) / exp_sums``,

    then ``M = max_p max_logits``, ``w_p = exp_sums_p * exp(max_logits_p - M)`` and
    ``out = sum_p w_p * tmp_out_p / sum_p w_p``.

    With ``return_intermediates=True`` returns ``(out, exp_sums, max_logits, tmp_out)``, the
    last three float32 of shapes ``[num_seqs, num_heads, max_num_partitions]`` and
    ``[num_seqs, num_heads, max_num_partitions, head_size]`` (``max_num_partitions =
    ceil(max(seq_lens) / partition_size)``; 1 for the single pass, whose only partition is the
    whole sequence). Partitions past a sequence's end hold ``max_logits = -inf``,
    ``exp_sums = 0`` and ``tmp_out = 0``.
    """
    shape = validate_paged_attention_args(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        scale,
        alibi_slopes=alibi_slopes,
        kv_cache_dtype=kv_cache_dtype,
        k_scale=k_scale,
        v_scale=v_scale,
        partition_size=partition_size,
        fp8_format=fp8_format,
    )
    k_scale, v_scale, scale = float(k_scale), float(v_scale), float(scale)
    S, H, D = shape.num_seqs, shape.num_heads, shape.head_size
    KVH, G = shape.num_kv_heads, shape.gqa_ratio
    P = shape.partition_size
    NP = shape.max_num_partitions
    dev = query.device
    bs = shape.block_size

    out = torch.empty(S, H, D, dtype=torch.float32, device=dev)
    if return_intermediates:
        exp_sums = torch.zeros(S, H, NP, dtype=torch.float32, device=dev)
        max_logits = torch.full((S, H, NP), float("-inf"), dtype=torch.float32, device=dev)
        tmp_out = torch.zeros(S, H, NP, D, dtype=torch.float32, device=dev)

    if dev.type == "cpu":
        _warm_cpu_exp()
    lens = seq_lens.tolist()
    bt = block_tables.to(torch.int64)
    q_all = query.to(torch.float32).view(S, KVH, G, D)
    slopes = None if alibi_slopes is None else alibi_slopes.view(KVH, G, 1)

    with _ieee_fp32_matmul(dev), torch.no_grad():
        for s, L in enumerate(lens):
            nblk = -(-L // bs)
            k, v = _gather_seq(key_cache, value_cache, bt[s, :nblk], L, shape, k_scale, v_scale)
            # logits [KVH, G, L]
            logits = torch.matmul(q_all[s], k.transpose(1, 2)).mul_(scale)
            if slopes is not None:
                pos = torch.arange(1 - L, 1, device=dev, dtype=torch.float32)  # t - L + 1
                logits.add_(slopes * pos)
            if P is None:
                m = logits.amax(dim=-1, keepdim=True)  # [KVH, G, 1]
                e = torch.exp(logits - m)
                denom = e.sum(dim=-1, keepdim=True)
                o = torch.matmul(e, v).div_(denom)  # [KVH, G, D]
                out[s] = o.reshape(H, D)
                if return_intermediates:
                    max_logits[s, :, 0] = m.reshape(H)
                    exp_sums[s, :, 0] = denom.reshape(H)
                    tmp_out[s, :, 0] = o.reshape(H, D)
                continue
            nps = -(-L // P)
            pad = nps * P - L
            if pad:
                logits = torch.nn.functional.pad(logits, (0, pad), value=float("-inf"))
                v = torch.nn.functional.pad(v, (0, 0, 0, pad))  # zeros; never NaN from cache
            lp = logits.view(KVH, G, nps, P)
            m = lp.amax(dim=-1)  # [KVH, G, nps]; finite: every partition has >= 1 token
            e = torch.exp(lp - m.unsqueeze(-1))  # padded tokens -> 0
            es = e.sum(dim=-1)  # [KVH, G, nps]
            vp = v.reshape(KVH, nps, P, D)
            # [KVH, nps, G, P] @ [KVH, nps, P, D] -> [KVH, nps, G, D] (no broadcast copy of V)
            part = torch.matmul(e.transpose(1, 2), vp).transpose(1, 2)  # [KVH, G, nps, D]
            part = part / es.unsqueeze(-1)
            o = reduce_partitions(es, m, part)  # [KVH, G, D]
            out[s] = o.reshape(H, D)
            if return_intermediates:
                max_logits[s, :, :nps] = m.reshape(H, nps)
                exp_sums[s, :, :nps] = es.reshape(H, nps)
                tmp_out[s, :, :nps] = part.reshape(H, nps, D)

    out = out.to(query.dtype)
    if return_intermediates:
        return out, exp_sums, max_logits, tmp_out
    return out


def reduce_partitions(exp_sums: torch.Tensor, max_logits: torch.Tensor, tmp_out: torch.Tensor) -> torch.Tensor:
    """The second phase alone: ``[..., P]``, ``[..., P]``, ``[..., P, D]`` -> ``[..., D]`` (float32 in, float32 out).

    Empty partitions (``max_logits = -inf``, ``exp_sums = 0``) get weight 0. Every
    ``(seq, head)`` must have at least one non-empty partition.
    """
    gm = max_logits.amax(dim=-1, keepdim=True)
    w = exp_sums * torch.exp(max_logits - gm)
    return (w.unsqueeze(-1) * tmp_out).sum(dim=-2) / w.sum(dim=-1).unsqueeze(-1)


def _e4m3_values(fp8_format: str) -> torch.Tensor:
    """float64 value of each of the 256 e4m3 bytes, from the encoding's definition: sign, 4
    exponent bits (bias 7 for e4m3fn, 8 for e4m3fnuz), 3 mantissa bits, subnormals at exponent 0;
    NaN at S.1111.111 (e4m3fn) or at 0x80 alone (e4m3fnuz, which has no negative zero)."""
    bias = {"e4m3fn": 7, "e4m3fnuz": 8}[fp8_format]
    vals = []
    for b in range(256):
        sign, e, m = -1.0 if b & 0x80 else 1.0, (b >> 3) & 0xF, b & 0x7
        if (fp8_format == "e4m3fn" and e == 15 and m == 7) or (fp8_format == "e4m3fnuz" and b == 0x80):
            vals.append(math.nan)
        elif e == 0:
            vals.append(sign * m / 8.0 * 2.0 ** (1 - bias))
        else:
            vals.append(sign * (1.0 + m / 8.0) * 2.0 ** (e - bias))
    return torch.tensor(vals, dtype=torch.float64)


def naive_paged_attention_fp64(inputs: Any) -> torch.Tensor:
    """Float64 ground truth: ``[num_seqs, num_heads, head_size]`` on the inputs' device.

    ``inputs`` is a :class:`cpa.inputs.PagedInputs` (anything with ``as_kwargs()``) or a
    mapping with the same keys. Independent of :func:`paged_attention`: it gathers token by
    token through the block table (block ``bt[s, t // block_size]``, slot ``t %
    block_size``), maps query head ``h`` to KV head ``h // (num_heads // num_kv_heads)``,
    and does an explicit max-subtracted softmax and weighted sum, all in float64. It reads
    only slots ``t < seq_len``. No argument validation beyond what indexing implies.
    """
    kw = inputs.as_kwargs() if hasattr(inputs, "as_kwargs") else dict(inputs)
    if not isinstance(kw, Mapping):
        raise TypeError(f"inputs: expected PagedInputs or a mapping, got {type(inputs).__name__}")
    q = kw["query"]
    kc, vc = kw["key_cache"], kw["value_cache"]
    bt, sl = kw["block_tables"], kw["seq_lens"]
    scale = float(kw["scale"])
    kv_dtype = kw.get("kv_cache_dtype", "auto")
    kv_dtype = "fp8" if kv_dtype in ("fp8", "fp8_e4m3") else kv_dtype
    k_scale, v_scale = float(kw.get("k_scale", 1.0)), float(kw.get("v_scale", 1.0))
    slopes = kw.get("alibi_slopes")
    if kv_dtype == "fp8":  # decoded by its own table, not torch's float8 casts (see _e4m3_values)
        table = _e4m3_values(resolve_fp8_format(kw.get("fp8_format"), kc)).to(kc.device)

    if q.device.type == "cpu":
        _warm_cpu_exp()
    S, H, D = q.shape
    KVH, BS = kc.shape[1], kc.shape[3]
    kv_of_head = torch.arange(H, device=q.device) // (H // KVH)
    res = torch.empty(S, H, D, dtype=torch.float64, device=q.device)
    for s, L in enumerate(sl.tolist()):
        t = torch.arange(L, device=q.device)
        phys = bt[s].to(torch.int64)[t // BS]  # [L]
        slot = t % BS
        # advanced indexing on dims 0 and 3 -> [L, KVH, D/x, x]
        k = kc[phys, :, :, slot, :].reshape(L, KVH, D)
        v = vc[phys, :, :, slot]  # [L, KVH, D]
        if kv_dtype == "fp8":
            k = table[k.contiguous().view(torch.uint8).to(torch.int64)] * k_scale
            v = table[v.contiguous().view(torch.uint8).to(torch.int64)] * v_scale
        else:
            k, v = k.to(torch.float64), v.to(torch.float64)
        kh = k[:, kv_of_head]  # [L, H, D]
        vh = v[:, kv_of_head]
        qd = q[s].to(torch.float64)  # [H, D]
        logits = (kh * qd.unsqueeze(0)).sum(-1).T * scale  # [H, L]
        if slopes is not None:
            logits = logits + slopes.to(torch.float64)[:, None] * (t - L + 1).to(torch.float64)[None, :]
        logits = logits - logits.max(dim=1, keepdim=True).values
        p = torch.exp(logits)
        p = p / p.sum(dim=1, keepdim=True)
        res[s] = (p.T.unsqueeze(-1) * vh).sum(0)  # [H, D]
    return res
