"""Argument validation for paged-attention decode, shared by the reference and the kernels.

Layout (vLLM's ROCm ``paged_attention`` contract)::

    query         [num_seqs, num_heads, head_size]                          float32 | float16 | bfloat16
    key_cache     [num_blocks, num_kv_heads, head_size // x, block_size, x]   x = 16 // key_cache.element_size()
    value_cache   [num_blocks, num_kv_heads, head_size, block_size]
    block_tables  [num_seqs, max_blocks_per_seq]                             int32
    seq_lens      [num_seqs]                                                 int32
    alibi_slopes  None | [num_heads]                                         float32
    out           None | like query

With ``kv_cache_dtype="auto"`` the caches have the query's dtype. With ``"fp8"`` (alias
``"fp8_e4m3"``) they are ``torch.uint8`` tensors of float8 e4m3 bytes, as vLLM stores them,
dequantized as ``value(byte) * k_scale`` (``v_scale`` for V). Two e4m3 encodings exist
(``fp8_format``): ``"e4m3fn"`` (OCP: exponent bias 7, max 448; NVIDIA, and vLLM everywhere but
gfx94x) and ``"e4m3fnuz"`` (exponent bias 8, max 240, one NaN at 0x80; MI300's hardware format,
which vLLM writes on gfx94x -- with scales doubled, so that the same byte means the same real
value). ``torch.float8_e4m3fn`` / ``torch.float8_e4m3fnuz`` storage says its format; uint8 bytes
are read in the device's format (e4m3fnuz on a gfx94x GPU, e4m3fn elsewhere) unless
``fp8_format`` names one.

:func:`validate_paged_attention_args` raises :class:`TypeError` for a wrong Python type or
tensor dtype and :class:`ValueError` for everything else (shapes, devices, layout, values);
every message starts with the name of the offending argument.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = [
    "SUPPORTED_HEAD_SIZES",
    "SUPPORTED_BLOCK_SIZES",
    "FP8_FORMATS",
    "default_fp8_format",
    "resolve_fp8_format",
    "SUPPORTED_QUERY_DTYPES",
    "KV_CACHE_DTYPES",
    "PagedAttentionShape",
    "normalize_kv_cache_dtype",
    "validate_paged_attention_args",
]

SUPPORTED_HEAD_SIZES = (64, 80, 96, 112, 128, 192, 256)
SUPPORTED_BLOCK_SIZES = (8, 16, 32)
SUPPORTED_QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: accepted spellings of ``kv_cache_dtype`` -> normalized name
KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8", "fp8_e4m3": "fp8"}

_FP8_STORAGE_DTYPES = (torch.uint8, torch.float8_e4m3fn, torch.float8_e4m3fnuz)
#: fp8 encodings of a KV cache -> the torch dtype that decodes it
FP8_FORMATS = {"e4m3fn": torch.float8_e4m3fn, "e4m3fnuz": torch.float8_e4m3fnuz}
_FP8_FORMAT_OF_DTYPE = {torch.float8_e4m3fn: "e4m3fn", torch.float8_e4m3fnuz: "e4m3fnuz"}


@dataclass(frozen=True)
class PagedAttentionShape:
    """Sizes derived from validated paged-attention arguments."""

    num_seqs: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    x: int  #: 16 // key_cache.element_size()
    num_blocks: int
    max_blocks_per_seq: int
    gqa_ratio: int  #: num_heads // num_kv_heads
    partition_size: int | None
    max_seq_len: int | None  #: None when check_values=False and it was not given
    max_num_partitions: int | None  #: ceil(max_seq_len / partition_size); 1 without partitioning
    query_dtype: torch.dtype
    kv_cache_dtype: str  #: "auto" or "fp8" (normalized)
    device: torch.device
    fp8_format: str | None = None  #: "e4m3fn" or "e4m3fnuz" with an fp8 cache, else None


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a torch.Tensor (dtype={value.dtype}, shape={tuple(value.shape)}, device={value.device})"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _is_int(value: Any) -> bool:
    # (type() first: the abstract-class check costs a few us per call of the eager path)
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def _check_tensor(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {_describe(value)}")
    return value


def _check_dtype(name: str, t: torch.Tensor, allowed: Sequence[torch.dtype], why: str = "") -> None:
    if t.dtype not in allowed:
        allowed_s = ", ".join(str(d) for d in allowed)
        raise TypeError(f"{name}: dtype {t.dtype} is not allowed{why}; allowed: {allowed_s}")


def _check_ndim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        raise ValueError(
            f"{name}: expected a {ndim}-d tensor {layout}, got {t.dim()}-d with shape {tuple(t.shape)}"
        )


def _check_dim(name: str, t: torch.Tensor, dim: int, expected: int, what: str, layout: str) -> None:
    if t.shape[dim] != expected:
        raise ValueError(
            f"{name}: shape[{dim}] must be {what} = {expected} (layout {layout}), "
            f"got {t.shape[dim]} in shape {tuple(t.shape)}"
        )


def _check_positive_float(name: str, value: Any) -> float:
    if type(value) is not float and (not isinstance(value, numbers.Real) or isinstance(value, bool)):
        raise TypeError(f"{name}: expected a positive finite float, got {_describe(value)}")
    f = float(value)
    if not (math.isfinite(f) and f > 0.0):
        raise ValueError(f"{name}: expected a positive finite float, got {f!r}")
    return f


def normalize_kv_cache_dtype(kv_cache_dtype: Any) -> str:
    """``"auto"`` -> ``"auto"``; ``"fp8"``/``"fp8_e4m3"`` -> ``"fp8"``; anything else raises."""
    if not isinstance(kv_cache_dtype, str):
        raise TypeError(
            f"kv_cache_dtype: expected a str, got {_describe(kv_cache_dtype)}; "
            f"allowed: {', '.join(map(repr, KV_CACHE_DTYPES))}"
        )
    try:
        return KV_CACHE_DTYPES[kv_cache_dtype]
    except KeyError:
        raise ValueError(
            f"kv_cache_dtype: got {kv_cache_dtype!r}; allowed: {', '.join(map(repr, KV_CACHE_DTYPES))}"
        ) from None


_Q_LAYOUT = "[num_seqs, num_heads, head_size]"
_K_LAYOUT = "[num_blocks, num_kv_heads, head_size // x, block_size, x]"
_V_LAYOUT = "[num_blocks, num_kv_heads, head_size, block_size]"
_BT_LAYOUT = "[num_seqs, max_blocks_per_seq]"
_SL_LAYOUT = "[num_seqs]"


def default_fp8_format(device: torch.device) -> str:
    """The e4m3 encoding a device's fp8 KV cache holds where the caller names none: e4m3fnuz on
    gfx94x (MI300; vLLM's ``current_platform.fp8_dtype()`` there), e4m3fn elsewhere (NVIDIA,
    the CPU, gfx90a, gfx950)."""
    if device.type == "cuda" and getattr(torch.version, "hip", None):
        from .jit import device_info

        if device_info(device)[1].startswith("gfx94"):
            return "e4m3fnuz"
    return "e4m3fn"


def resolve_fp8_format(fp8_format: Any, cache: torch.Tensor) -> str:
    """The encoding of an fp8 cache: its float8 dtype's, else ``fp8_format``, else the device's.
    ValueError for an unknown name or one that contradicts the tensor's dtype."""
    if fp8_format is not None and fp8_format not in FP8_FORMATS:
        raise ValueError(f"fp8_format: got {fp8_format!r}; allowed: None, {', '.join(map(repr, FP8_FORMATS))}")
    of_dtype = _FP8_FORMAT_OF_DTYPE.get(cache.dtype)
    if of_dtype is not None:
        if fp8_format is not None and fp8_format != of_dtype:
            raise ValueError(f"fp8_format: {fp8_format!r} contradicts the caches' dtype {cache.dtype}")
        return of_dtype
    return fp8_format or default_fp8_format(cache.device)


def validate_paged_attention_args(
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
    out: torch.Tensor | None = None,
    check_values: bool = True,
    max_seq_len: int | None = None,
    head_sizes: Sequence[int] = SUPPORTED_HEAD_SIZES,
    block_sizes: Sequence[int] = SUPPORTED_BLOCK_SIZES,
    query_dtypes: Sequence[torch.dtype] = SUPPORTED_QUERY_DTYPES,
    fp8_format: str | None = None,
) -> PagedAttentionShape:
    """Check paged-attention decode arguments and return the derived sizes.

    Structural checks (types, dtypes, shapes, one device, contiguity, 16-byte aligned data,
    ``out`` sharing no memory with an input, supported head and block sizes, ``partition_size``
    a power-of-two multiple of ``block_size``) never touch tensor data. With
    ``check_values=True`` (default) it also reads ``seq_lens``, ``block_tables`` and
    ``alibi_slopes`` -- a device sync -- and checks ``1 <= seq_len <= max_blocks_per_seq *
    block_size``, that the block-table entries each sequence uses (the first
    ``ceil(seq_len / block_size)`` of its row) lie in ``[0, num_blocks)`` and that the slopes
    are finite. Entries past a sequence's used blocks are never read: serving engines leave
    garbage there.

    ``max_seq_len``: if given it is used as is (with ``check_values`` it must be at least the
    true maximum); otherwise it is computed when ``check_values`` is set, else left None.

    ``fp8_format`` (fp8 caches only): ``"e4m3fn"``, ``"e4m3fnuz"`` or None (see the module
    docstring); the result's ``fp8_format`` is the one the caches are read in.
    """
    # ---- Python-level types ------------------------------------------------------------
    kv_dtype = normalize_kv_cache_dtype(kv_cache_dtype)
    query = _check_tensor("query", query)
    key_cache = _check_tensor("key_cache", key_cache)
    value_cache = _check_tensor("value_cache", value_cache)
    block_tables = _check_tensor("block_tables", block_tables)
    seq_lens = _check_tensor("seq_lens", seq_lens)
    if alibi_slopes is not None:
        _check_tensor("alibi_slopes", alibi_slopes)
    if out is not None:
        _check_tensor("out", out)
    _check_positive_float("scale", scale)
    _check_positive_float("k_scale", k_scale)
    _check_positive_float("v_scale", v_scale)
    if partition_size is not None and not _is_int(partition_size):
        raise TypeError(f"partition_size: expected None or an int, got {_describe(partition_size)}")
    if max_seq_len is not None and not _is_int(max_seq_len):
        raise TypeError(f"max_seq_len: expected None or an int, got {_describe(max_seq_len)}")
    if not isinstance(check_values, bool):
        raise TypeError(f"check_values: expected a bool, got {_describe(check_values)}")

    # ---- dtypes --------------------------------------------------------------------------
    _check_dtype("query", query, tuple(query_dtypes))
    if kv_dtype == "auto":
        _check_dtype("key_cache", key_cache, (query.dtype,), " with kv_cache_dtype='auto' (must match query)")
        _check_dtype("value_cache", value_cache, (query.dtype,), " with kv_cache_dtype='auto' (must match query)")
    else:
        why = f" with kv_cache_dtype={kv_cache_dtype!r} (fp8 e4m3 bytes)"
        _check_dtype("key_cache", key_cache, _FP8_STORAGE_DTYPES, why)
        _check_dtype("value_cache", value_cache, _FP8_STORAGE_DTYPES, why)
        if value_cache.dtype != key_cache.dtype:
            raise TypeError(
                f"value_cache: dtype {value_cache.dtype} differs from key_cache dtype {key_cache.dtype}"
            )
    if kv_dtype == "fp8":
        fp8_format = resolve_fp8_format(fp8_format, key_cache)
    elif fp8_format is not None:
        raise ValueError(f"fp8_format: {fp8_format!r} is for an fp8 cache; kv_cache_dtype is 'auto'")
    _check_dtype("block_tables", block_tables, (torch.int32,))
    _check_dtype("seq_lens", seq_lens, (torch.int32,))
    if alibi_slopes is not None:
        _check_dtype("alibi_slopes", alibi_slopes, (torch.float32,))
    if out is not None:
        _check_dtype("out", out, (query.dtype,), " (must match query)")

    # ---- ranks ---------------------------------------------------------------------------
    _check_ndim("query", query, 3, _Q_LAYOUT)
    _check_ndim("key_cache", key_cache, 5, _K_LAYOUT)
    _check_ndim("value_cache", value_cache, 4, _V_LAYOUT)
    _check_ndim("block_tables", block_tables, 2, _BT_LAYOUT)
    _check_ndim("seq_lens", seq_lens, 1, _SL_LAYOUT)
    if alibi_slopes is not None:
        _check_ndim("alibi_slopes", alibi_slopes, 1, "[num_heads]")

    # ---- one device, contiguous ----------------------------------------------------------
    device = query.device
    named = [
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("alibi_slopes", alibi_slopes),
        ("out", out),
    ]
    for name, t in named:
        if t is not None and t.device != device:
            raise ValueError(f"{name}: is on device {t.device} but query is on {device}; all tensors must be on one device")
    for name, t in [("query", query)] + named:
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")
    # the kernel reads queries and cache rows as 16-byte vectors: a view that starts inside an
    # allocation (a nonzero storage offset) can break that alignment while staying contiguous
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache), ("out", out)):
        if t is not None and t.data_ptr() % 16:
            raise ValueError(f"{name}: its data must start at a 16-byte boundary (the kernel loads 16-byte "
                             f"vectors); this view starts {t.data_ptr() % 16} bytes past one (storage offset "
                             f"{t.storage_offset()}): pass a tensor that owns its memory, e.g. .clone()")
    # the kernels write out while other workgroups still read the inputs (the fused reduce, the
    # reduce kernel): out must share no byte with one (contiguous: each spans [data_ptr, +nbytes))
    if out is not None:
        out_start = out.data_ptr()
        out_end = out_start + out.nbytes
        for name, t in [("query", query)] + named:
            if t is not None and t is not out and t.data_ptr() < out_end and out_start < t.data_ptr() + t.nbytes:
                raise ValueError(f"out: overlaps {name} in memory; the kernel reads {name} while it writes out, "
                                 f"so out must be a separate tensor (e.g. torch.empty_like(query))")

    # ---- shapes --------------------------------------------------------------------------
    num_seqs, num_heads, head_size = (int(s) for s in query.shape)
    x = 16 // key_cache.element_size()
    num_blocks, num_kv_heads = int(key_cache.shape[0]), int(key_cache.shape[1])
    block_size = int(key_cache.shape[3])
    if num_seqs < 1:
        raise ValueError(f"query: num_seqs (shape[0]) must be >= 1, got shape {tuple(query.shape)}")
    if num_heads < 1:
        raise ValueError(f"query: num_heads (shape[1]) must be >= 1, got shape {tuple(query.shape)}")
    if head_size not in head_sizes:
        raise ValueError(f"query: head_size (shape[2]) {head_size} is not supported; allowed: {tuple(head_sizes)}")
    if num_blocks < 1:
        raise ValueError(f"key_cache: num_blocks (shape[0]) must be >= 1, got shape {tuple(key_cache.shape)}")
    if num_kv_heads < 1:
        raise ValueError(f"key_cache: num_kv_heads (shape[1]) must be >= 1, got shape {tuple(key_cache.shape)}")
    _check_dim("key_cache", key_cache, 4, x, f"x = 16 // element_size ({key_cache.dtype})", _K_LAYOUT)
    _check_dim("key_cache", key_cache, 2, head_size // x, f"head_size // x = {head_size} // {x}", _K_LAYOUT)
    if block_size not in block_sizes:
        raise ValueError(
            f"key_cache: block_size (shape[3]) {block_size} is not supported; allowed: {tuple(block_sizes)}"
        )
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"key_cache: num_heads ({num_heads}, from query) must be a multiple of "
            f"num_kv_heads (key_cache.shape[1] = {num_kv_heads})"
        )
    _check_dim("value_cache", value_cache, 0, num_blocks, "num_blocks (from key_cache)", _V_LAYOUT)
    _check_dim("value_cache", value_cache, 1, num_kv_heads, "num_kv_heads (from key_cache)", _V_LAYOUT)
    _check_dim("value_cache", value_cache, 2, head_size, "head_size (from query)", _V_LAYOUT)
    _check_dim("value_cache", value_cache, 3, block_size, "block_size (from key_cache)", _V_LAYOUT)
    _check_dim("block_tables", block_tables, 0, num_seqs, "num_seqs (from query)", _BT_LAYOUT)
    max_blocks_per_seq = int(block_tables.shape[1])
    if max_blocks_per_seq < 1:
        raise ValueError(f"block_tables: max_blocks_per_seq (shape[1]) must be >= 1, got shape {tuple(block_tables.shape)}")
    _check_dim("seq_lens", seq_lens, 0, num_seqs, "num_seqs (from query)", _SL_LAYOUT)
    if alibi_slopes is not None:
        _check_dim("alibi_slopes", alibi_slopes, 0, num_heads, "num_heads (from query)", "[num_heads]")
    if out is not None and tuple(out.shape) != tuple(query.shape):
        raise ValueError(f"out: shape {tuple(out.shape)} must equal query's shape {tuple(query.shape)}")

    # ---- partition size ------------------------------------------------------------------
    if partition_size is not None:
        p = int(partition_size)
        ratio = p // block_size
        if p <= 0 or p % block_size != 0 or ratio & (ratio - 1) != 0:
            raise ValueError(
                f"partition_size: got {p}; must be None or a power-of-two multiple of "
                f"block_size {block_size} (e.g. {block_size * 4}, {block_size * 8}, {block_size * 16})"
            )
        partition_size = p

    # ---- values (reads device memory: one sync on the happy path) --------------------------
    capacity = max_blocks_per_seq * block_size
    if max_seq_len is not None:
        max_seq_len = int(max_seq_len)
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len: must be >= 1, got {max_seq_len}")
    if check_values:
        true_max = _check_values(block_tables, seq_lens, num_blocks, block_size, capacity, alibi_slopes)
        if max_seq_len is None:
            max_seq_len = true_max
        elif max_seq_len < true_max:
            raise ValueError(f"max_seq_len: got {max_seq_len}, but the longest sequence in seq_lens has {true_max} tokens")

    if partition_size is None:
        max_num_partitions: int | None = 1
    elif max_seq_len is None:
        max_num_partitions = None
    else:
        max_num_partitions = -(-max_seq_len // partition_size)

    return PagedAttentionShape(
        num_seqs=num_seqs,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=block_size,
        x=x,
        num_blocks=num_blocks,
        max_blocks_per_seq=max_blocks_per_seq,
        gqa_ratio=num_heads // num_kv_heads,
        partition_size=partition_size,
        max_seq_len=max_seq_len,
        max_num_partitions=max_num_partitions,
        query_dtype=query.dtype,
        kv_cache_dtype=kv_dtype,
        device=device,
        fp8_format=fp8_format,
    )


def _check_values(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int, capacity: int,
    alibi_slopes: torch.Tensor | None = None,
) -> int:
    """Vectorized value checks; returns max(seq_lens). One host sync unless something is wrong.
    Eight small kernels and one copy (two more with ALiBi slopes): each kernel costs the host
    several us per eager call, so the check uses the fewest that still locate every error it
    reports."""
    sl = seq_lens
    # entry j of a row is in use when its first token j * block_size is within the sequence
    first_token = torch.arange(0, block_tables.shape[1] * block_size, block_size, device=block_tables.device)
    in_use = first_token[None, :] < sl[:, None]
    out_of_range = block_tables.clamp(0, num_blocks - 1) != block_tables
    bad = in_use & out_of_range
    stats = [*torch.aminmax(sl), bad.sum(dtype=torch.int32)]
    if alibi_slopes is not None:  # an infinite or NaN slope makes every logit of its head NaN
        stats.append((~torch.isfinite(alibi_slopes)).sum(dtype=torch.int32))
    lo, hi, nbad, *nonfinite = (int(v) for v in torch.stack(stats).tolist())
    if lo < 1 or hi > capacity:
        wrong = ((sl < 1) | (sl > capacity)).nonzero()[0, 0].item()
        raise ValueError(
            f"seq_lens: seq_lens[{wrong}] = {int(sl[wrong].item())}; each must be in "
            f"[1, max_blocks_per_seq * block_size = {capacity}]"
        )
    if nbad:
        used = (sl.to(torch.int64) + block_size - 1) // block_size  # (1 <= seq_len <= capacity here)
        s, j = (int(v) for v in bad.nonzero()[0].tolist())
        raise ValueError(
            f"block_tables: block_tables[{s}, {j}] = {int(block_tables[s, j].item())} is out of range "
            f"[0, num_blocks = {num_blocks}); sequence {s} (seq_len {int(sl[s].item())}) uses the first "
            f"{int(used[s].item())} entries of its row ({nbad} bad entr{'y' if nbad == 1 else 'ies'} in all)"
        )
    if nonfinite and nonfinite[0]:
        h = int((~torch.isfinite(alibi_slopes)).nonzero()[0, 0].item())
        raise ValueError(f"alibi_slopes: alibi_slopes[{h}] = {float(alibi_slopes[h].item())}; every slope must be "
                         f"finite ({nonfinite[0]} not)")
    return hi
