"""Realistic random inputs for paged-attention decode.

:func:`make_paged_inputs` builds what a serving engine hands a decode kernel:

* a **shuffled block table**: each sequence owns ``ceil(seq_len / block_size)`` distinct
  physical blocks drawn at random from a pool of ``num_blocks`` (default: the blocks needed
  plus about 10% spare, at least one); the unused tail of each row holds garbage (-1,
  ``num_blocks + random``, the int32 maximum, or an in-range block owned by someone else),
  which kernels must never read;
* q, K, V drawn from a standard normal on the CPU by generators (``torch.Generator``) seeded
  from ``seed`` (the block table and q from one seeded by ``seed``; each fixed-size chunk of K and
  of V from its own, seeded from ``seed``, the cache and the chunk index, so that chunks are
  drawn on several threads), then moved to ``device`` -- the same values on CPU and GPU,
  whatever the thread count;
* with ``poison_unused`` (default) every cache slot no sequence uses -- slots past ``seq_len``
  in a sequence's last block and whole unused blocks -- holds NaN (fp8: byte 0x7F, the
  e4m3fn NaN), so a kernel that reads one produces NaN;
* fp8 (``kv_cache_dtype="fp8"``): K is drawn with standard deviation 2 and V with 0.5 (so
  that swapping ``k_scale`` and ``v_scale`` shows), ``k_scale = amax(K) / 448`` and
  ``v_scale = amax(V) / 448`` (Python floats), and the caches are
  ``(x / scale).to(torch.float8_e4m3fn).view(torch.uint8)``, as vLLM stores them;
  ``fp8_format="e4m3fnuz"`` (MI300's encoding) divides by 240 instead, keeps the caches as
  ``torch.float8_e4m3fnuz`` tensors (the dtype names the encoding) and poisons with 0x7F, its
  largest value (its only NaN, 0x80, decodes to -0 in the kernels' bit conversion, which would
  not show);
* ALiBi slopes (``alibi=True``) as in the ALiBi paper (Press et al.): for ``n`` heads a power
  of two, ``slope_i = 2 ** (-8 * i / n)``, ``i = 1..n``; otherwise the slopes of the closest
  smaller power of two ``m`` followed by every other slope of the ``2m`` sequence.
"""

from __future__ import annotations

import hashlib
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .validation import FP8_FORMATS, normalize_kv_cache_dtype

__all__ = ["PagedInputs", "make_paged_inputs", "alibi_slopes", "FP8_E4M3_MAX", "FP8_E4M3_NAN_BYTE",
           "FP8_E4M3FNUZ_MAX", "FP8_E4M3FNUZ_POISON_BYTE"]

FP8_E4M3_MAX = 448.0
FP8_E4M3_NAN_BYTE = 0x7F
FP8_E4M3FNUZ_MAX = 240.0
FP8_E4M3FNUZ_POISON_BYTE = 0x7F  # +240
_FP8_MAX = {"e4m3fn": FP8_E4M3_MAX, "e4m3fnuz": FP8_E4M3FNUZ_MAX}

#: elements per chunk when filling the caches: bounds host memory for big caches, and each chunk
#: has its own generator (so changing this changes the values)
_CHUNK_ELEMS = 1 << 22


@dataclass
class PagedInputs:
    """Arguments of one paged-attention decode call (see :mod:`cpa.validation` for the layout)."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    scale: float
    alibi_slopes: torch.Tensor | None = None
    kv_cache_dtype: str = "auto"
    k_scale: float = 1.0
    v_scale: float = 1.0
    #: host copy of seq_lens (avoids a device sync for max_seq_len / kv_bytes)
    seq_lens_host: tuple[int, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.seq_lens_host:
            self.seq_lens_host = tuple(int(v) for v in self.seq_lens.tolist())

    def as_kwargs(self) -> dict:
        """Keyword arguments for ``cpa.reference.paged_attention`` (and the kernel op)."""
        return {
            "query": self.query,
            "key_cache": self.key_cache,
            "value_cache": self.value_cache,
            "block_tables": self.block_tables,
            "seq_lens": self.seq_lens,
            "scale": self.scale,
            "alibi_slopes": self.alibi_slopes,
            "kv_cache_dtype": self.kv_cache_dtype,
            "k_scale": self.k_scale,
            "v_scale": self.v_scale,
        }

    @property
    def num_seqs(self) -> int:
        return int(self.query.shape[0])

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host)

    def kv_bytes(self) -> int:
        """Bytes of K and V a kernel must read at least once: sum(seq_len) * kv_heads * head * 2 * elem."""
        kvh = int(self.value_cache.shape[1])
        hs = int(self.value_cache.shape[2])
        return sum(self.seq_lens_host) * kvh * hs * 2 * self.key_cache.element_size()

    def to(self, device: str | torch.device) -> "PagedInputs":
        """A copy with every tensor on ``device``."""
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return PagedInputs(
            query=mv(self.query),
            key_cache=mv(self.key_cache),
            value_cache=mv(self.value_cache),
            block_tables=mv(self.block_tables),
            seq_lens=mv(self.seq_lens),
            scale=self.scale,
            alibi_slopes=mv(self.alibi_slopes),
            kv_cache_dtype=self.kv_cache_dtype,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            seq_lens_host=self.seq_lens_host,
        )


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi slopes (float32, CPU) for ``num_heads`` heads, as in the ALiBi paper."""
    if num_heads < 1:
        raise ValueError(f"num_heads: must be >= 1, got {num_heads}")

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]

    m = 1 << (num_heads.bit_length() - 1)  # largest power of two <= num_heads
    slopes = geometric(m)
    if m < num_heads:
        slopes += geometric(2 * m)[0::2][: num_heads - m]
    return torch.tensor(slopes, dtype=torch.float32)


def _chunk_seed(seed: int, stream: str, index: int) -> int:
    """Seed of one chunk of one stream: independent of thread count and device."""
    h = hashlib.blake2b(f"cpa:{seed}:{stream}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def _draw_chunk(seed: int, stream: str, index: int, numel: int, std: float) -> torch.Tensor:
    """Chunk ``index`` of ``stream``: standard normal * std, float32 on the CPU."""
    n = min(_CHUNK_ELEMS, numel - index * _CHUNK_ELEMS)
    g = torch.Generator(device="cpu").manual_seed(_chunk_seed(seed, stream, index))
    return torch.randn(n, generator=g, dtype=torch.float32).mul_(std)


def _fill_cache(
    shape: tuple[int, ...],
    seed: int,
    stream: str,
    std: float,
    dtype: torch.dtype,
    device: torch.device,
    fp8: bool,
    fp8_format: str = "e4m3fn",
) -> tuple[torch.Tensor, float]:
    """A cache of ``shape`` filled chunk by chunk; returns (cache, fp8 scale or 1.0).

    Each chunk has its own generator (seeded from ``seed``, ``stream`` and the chunk index), so
    chunks are drawn on several CPU threads at once and the values do not depend on how many.
    """
    numel = math.prod(shape)
    n_chunks = -(-numel // _CHUNK_ELEMS)
    workers = max(1, min(torch.get_num_threads(), n_chunks, 32))
    scale = 1.0
    with ThreadPoolExecutor(max_workers=workers) as ex:
        if fp8:
            # first pass: amax of everything to be drawn (chunks are re-drawn, not kept)
            amaxes = ex.map(lambda i: float(_draw_chunk(seed, stream, i, numel, std).abs().max()), range(n_chunks))
            amax = max(amaxes)
            scale = amax / _FP8_MAX[fp8_format] if amax > 0 else 1.0
        fp8_dtype = FP8_FORMATS[fp8_format]

        def make(i: int) -> torch.Tensor:
            c = _draw_chunk(seed, stream, i, numel, std)
            if fp8:
                return c.div_(scale).to(fp8_dtype).view(torch.uint8)
            return c.to(dtype)

        cache = torch.empty(numel, dtype=torch.uint8 if fp8 else dtype, device=device)
        for first in range(0, n_chunks, workers):  # at most `workers` chunks in flight
            futures = [ex.submit(make, i) for i in range(first, min(first + workers, n_chunks))]
            for i, f in zip(range(first, n_chunks), futures):
                c = f.result()
                cache[i * _CHUNK_ELEMS : i * _CHUNK_ELEMS + c.numel()].copy_(c)
    return cache.view(shape), scale


def make_paged_inputs(
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    seq_lens: int | Sequence[int],
    *,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
    seed: int = 0,
    device: str | torch.device = "cpu",
    alibi: bool = False,
    num_blocks: int | None = None,
    poison_unused: bool = True,
    max_blocks_per_seq: int | None = None,
    fp8_format: str = "e4m3fn",
) -> PagedInputs:
    """Random, realistically laid-out decode inputs (see the module docstring).

    ``seq_lens``: one int for every sequence, or one per sequence. ``dtype`` is the query's
    dtype (and the caches' with ``kv_cache_dtype="auto"``). ``max_blocks_per_seq`` (width of
    the block table) defaults to the most blocks any sequence needs; a wider table gives
    every row a garbage tail.
    """
    kv_dtype = normalize_kv_cache_dtype(kv_cache_dtype)
    fp8 = kv_dtype == "fp8"
    if fp8_format not in FP8_FORMATS:
        raise ValueError(f"fp8_format: got {fp8_format!r}; allowed: {', '.join(map(repr, FP8_FORMATS))}")
    fnuz = fp8 and fp8_format == "e4m3fnuz"
    device = torch.device(device)
    if isinstance(seq_lens, int):
        lens = [int(seq_lens)] * num_seqs
    else:
        lens = [int(v) for v in seq_lens]
        if len(lens) != num_seqs:
            raise ValueError(f"seq_lens: got {len(lens)} lengths for num_seqs={num_seqs}")
    if num_seqs < 1 or any(v < 1 for v in lens):
        raise ValueError(f"seq_lens: need num_seqs >= 1 and every seq_len >= 1, got num_seqs={num_seqs}, {lens[:8]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads: {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    elem = 1 if fp8 else torch.empty((), dtype=dtype).element_size()
    x = 16 // elem
    if head_size % x:
        raise ValueError(f"head_size: {head_size} is not a multiple of x = {x}")

    blocks_per_seq = [-(-v // block_size) for v in lens]
    total = sum(blocks_per_seq)
    if num_blocks is None:
        num_blocks = total + max(1, math.ceil(0.1 * total))
    if num_blocks < total:
        raise ValueError(f"num_blocks: {num_blocks} is fewer than the {total} blocks the sequences need")
    width = max(blocks_per_seq) if max_blocks_per_seq is None else int(max_blocks_per_seq)
    if width < max(blocks_per_seq):
        raise ValueError(f"max_blocks_per_seq: {width} is fewer than the {max(blocks_per_seq)} blocks the longest sequence needs")

    gen = torch.Generator(device="cpu").manual_seed(seed)

    # ---- block table: distinct shuffled physical blocks, garbage tails ----------------
    perm = torch.randperm(num_blocks, generator=gen)
    garbage_kind = torch.randint(0, 4, (num_seqs, width), generator=gen)
    garbage = torch.stack(
        [
            torch.full((num_seqs, width), -1, dtype=torch.int64),
            num_blocks + torch.randint(0, 1 << 20, (num_seqs, width), generator=gen),
            torch.full((num_seqs, width), 2**31 - 1, dtype=torch.int64),
            torch.randint(0, num_blocks, (num_seqs, width), generator=gen),
        ]
    ).gather(0, garbage_kind.unsqueeze(0)).squeeze(0)
    block_tables = garbage.clone()
    tokens_in_block = torch.zeros(num_blocks, dtype=torch.int64)  # valid slots per physical block
    start = 0
    for s, (n, L) in enumerate(zip(blocks_per_seq, lens)):
        phys = perm[start : start + n]
        start += n
        block_tables[s, :n] = phys
        counts = torch.full((n,), block_size, dtype=torch.int64)
        counts[-1] = L - (n - 1) * block_size
        tokens_in_block[phys] = counts
    block_tables = block_tables.to(torch.int32)

    # ---- q, K, V -----------------------------------------------------------------------
    query = torch.randn(num_seqs, num_heads, head_size, generator=gen, dtype=torch.float32).to(dtype)
    k_std, v_std = (2.0, 0.5) if fp8 else (1.0, 1.0)
    cache_dtype = dtype
    key_cache, k_scale = _fill_cache(
        (num_blocks, num_kv_heads, head_size // x, block_size, x), seed, "key", k_std, cache_dtype, device, fp8,
        fp8_format
    )
    value_cache, v_scale = _fill_cache(
        (num_blocks, num_kv_heads, head_size, block_size), seed, "value", v_std, cache_dtype, device, fp8, fp8_format
    )

    if poison_unused:
        unused = torch.arange(block_size)[None, :] >= tokens_in_block[:, None]  # [num_blocks, block_size]
        unused = unused.to(device)
        poison = (FP8_E4M3FNUZ_POISON_BYTE if fnuz else FP8_E4M3_NAN_BYTE) if fp8 else float("nan")
        key_cache.masked_fill_(unused[:, None, None, :, None], poison)
        value_cache.masked_fill_(unused[:, None, None, :], poison)
    if fnuz:  # (the dtype tells every reader which e4m3 the bytes are)
        key_cache, value_cache = key_cache.view(FP8_FORMATS[fp8_format]), value_cache.view(FP8_FORMATS[fp8_format])

    slopes = alibi_slopes(num_heads).to(device) if alibi else None
    return PagedInputs(
        query=query.to(device),
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32).to(device),
        scale=1.0 / math.sqrt(head_size),
        alibi_slopes=slopes,
        kv_cache_dtype=kv_dtype,
        k_scale=k_scale,
        v_scale=v_scale,
        seq_lens_host=tuple(lens),
    )
