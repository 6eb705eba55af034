"""Peers: other decode-attention implementations, timed in the same sweep as rows of the same table.

Each peer is verified against ``cpa.reference.paged_attention`` on the point's fresh
verification inputs (the same ones the CPA kernel is checked on) and timed with
``cpa.timing.time_graph`` over the point's rotating input sets (``cpa.bench.make_sets``).
Rows carry ``tiling`` = the peer's name, ``partition_size`` = 0, ``num_partitions`` = 1 and
``bytes`` = K/V read once + q + out (a peer's own split-KV scratch traffic is not known
here); ``backend`` says what ran, ``note`` how it was fed.

* ``sdpa`` -- ``torch.nn.functional.scaled_dot_product_attention`` (``enable_gqa=True``) on
  contiguous K/V ``[num_seqs, num_kv_heads, max_seq_len, head_size]`` gathered out of the
  paged caches once, before timing (``padded_kv``: as ``cpa.bench.contiguous_kv``, leaner). The
  backend is the first of cuDNN, flash, efficient, math that runs the point (column
  ``backend``; one that runs but fails verification is passed over when a later one verifies).
  A point of mixed lengths is padded to its longest sequence with a boolean
  key mask, so SDPA reads ``num_seqs x max_seq_len`` tokens while ``gbps`` still counts
  ``sum(seq_lens)`` -- the cost of feeding a dense kernel a ragged batch.
* ``flex`` -- ``torch.compile(flex_attention, dynamic=False)`` (static shapes, so that
  inductor can pick its flex-decoding kernel for the one-token query) on
  the same contiguous K/V, ``enable_gqa=True``; no block mask for a point of equal lengths,
  otherwise a block mask (``create_block_mask``, ``kv_idx < seq_len[b]``). Not the
  experimental paged helper (``torch.nn.attention.experimental._paged_attention``): it keeps
  its own page-table format and cache layout, so it would time a re-laid-out copy too. Timed
  under CUDA-graph replay when the compiled call captures, else by plain replay (``note``).
  Points whose contiguous K has >= 2^31 elements get an ``unsupported`` row in torch <= 2.11,
  where every compile of them failed (``FLEX_LARGE_FAILS_UP_TO``; ``CPA_FLEX_LARGE=1`` tries).
* ``flashinfer`` -- ``flashinfer.BatchDecodeWithPagedKVCacheWrapper(kv_layout="HND",
  use_tensor_cores=True)``: paged, with the block table as its page table (page = block,
  ``page_size = block_size``, CSR ``indptr`` / ``indices`` from each sequence's first
  ``ceil(seq_len / block_size)`` blocks, ``last_page_len = seq_len - (n - 1) * block_size``).
  Layout: HND is ``[pages, num_kv_heads, page_size, head_size]`` for K and for V. Neither of
  our caches is in it: V ``[blocks, kv_heads, head_size, block_size]`` is HND with the last
  two axes swapped (a transpose copy), K ``[blocks, kv_heads, head_size / x, block_size, x]``
  has the head dimension split around the token axis (a permute copy). Both copies are made
  once per point, outside the timed region; indices are unchanged. One wrapper per input set,
  each planned once (``use_cuda_graph=True`` with fixed index buffers, so replays capture).
  Skipped with a printed reason when ``import flashinfer`` fails.

All peers take fp16/bf16 K/V only: fp8 points get an ``unsupported`` row. On the CPU runner
there are no peers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

PEER_NAMES = ("sdpa", "flex", "flashinfer")
SDPA_BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
FLASHINFER_WORKSPACE = 128 << 20


def _unsupported(msg: str) -> Exception:
    from .sweep import UNSUPPORTED, Unsupported

    return Unsupported(f"{UNSUPPORTED}: {msg}")


def padded_kv(key_cache, value_cache, block_tables, seq_lens: Sequence[int], length: int):
    """K, V as ``[num_seqs, num_kv_heads, length, head_size]``, zero past each sequence's end.

    Reads only each sequence's first ``ceil(seq_len / block_size)`` block-table entries
    (garbage tails are never dereferenced; NaN poison in unused slots never reaches a peer).
    Filled sequence by sequence into one buffer: the peak is the output plus one sequence.
    """
    import torch

    _, kvh, dx, bs, x = key_cache.shape
    D = dx * x
    S = block_tables.shape[0]
    k = torch.zeros(S, kvh, length, D, dtype=key_cache.dtype, device=key_cache.device)
    v = torch.zeros_like(k)
    for s, L in enumerate(seq_lens):
        L = min(int(L), length)
        n = -(-L // bs)
        blocks = block_tables[s, :n].to(torch.int64)
        k[s, :, :L] = key_cache.index_select(0, blocks).permute(1, 0, 3, 2, 4).reshape(kvh, n * bs, D)[:, :L]
        v[s, :, :L] = value_cache.index_select(0, blocks).permute(1, 0, 3, 2).reshape(kvh, n * bs, D)[:, :L]
    return k, v


def length_mask(seq_lens, length: int, device):
    """Boolean SDPA mask ``[num_seqs, 1, 1, length]``: True where a key is attended."""
    import torch

    lens = torch.as_tensor(list(seq_lens), device=device, dtype=torch.int64)
    return (torch.arange(length, device=device)[None, :] < lens[:, None])[:, None, None, :]


def _timing_kv(state):
    """Contiguous K/V of every timing set, [S, KVH, max_seq_len, D] (zero-padded rows for mixed points).

    What ``cpa.bench.contiguous_kv`` gives for equal lengths, built with ``padded_kv`` so that
    the largest points (34 GB of K/V at 256 x 32k) do not need two transient copies."""
    pt, sets = state.point, state.sets
    return [padded_kv(sets.key_cache, sets.value_cache, bt, pt.seq_lens, pt.max_seq_len) for bt in sets.block_tables]


def _result(t, n_sets: int, replays: int, **extra) -> dict:
    return {**t.as_dict(), "attn_time_us": t.median_us, "reduce_time_us": 0.0, "n_sets": n_sets,
            "replays": replays, **extra}


def _time_with_fallback(calls, replays: int):
    """time_graph with graph capture; plain replay if the calls do not capture."""
    import torch

    from .timing import time_graph

    try:
        return time_graph(calls, replays=replays), "graph replay"
    except Exception as e:
        torch.cuda.synchronize()
        return time_graph(calls, replays=replays, use_graph=False), f"plain replay (capture failed: {type(e).__name__})"


@dataclass
class PeerBuilt:
    data: dict = field(default_factory=dict)


# ======================================================================================= SDPA
class SdpaPeer:
    name = "sdpa"

    def available(self) -> str | None:
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
        except ImportError as e:
            return f"torch.nn.attention unavailable ({e})"
        return None

    def build(self, state) -> PeerBuilt:
        if state.point.kv_cache_dtype != "auto":
            raise _unsupported("sdpa takes fp16/bf16 K/V, not fp8")
        return PeerBuilt()

    def _call(self, backend, q, k, v, mask, scale):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, backend)):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    def verify(self, state, built: PeerBuilt) -> dict:
        import torch
        from torch.nn.attention import SDPBackend

        from . import reference

        pt, inp = state.point, state.inputs
        k, v = padded_kv(inp.key_cache, inp.value_cache, inp.block_tables, pt.seq_lens, pt.max_seq_len)
        mask = None if pt.fixed_length else length_mask(pt.seq_lens, pt.max_seq_len, k.device)
        q = inp.query.unsqueeze(2)
        failures, chosen = [], None
        for backend in SDPA_BACKENDS:  # the first that runs and verifies; else the first that runs
            if not hasattr(SDPBackend, backend):
                continue
            try:
                o = self._call(backend, q, k, v, mask, inp.scale)
                torch.cuda.synchronize()
            except Exception as e:  # this backend refuses the shape: try the next
                failures.append(f"{backend}: {type(e).__name__}")
                continue
            err = reference.relative_error(o.squeeze(2), state.ref, per_seq=True)
            del o
            if chosen is None:
                chosen = (backend, err)
            if err <= state.tol:
                chosen = (backend, err)
                break
            failures.append(f"{backend}: max_rel_err {err:.2e}")
        del k, v
        torch.cuda.empty_cache()
        if chosen is None:
            raise RuntimeError("no SDPA backend runs this point: " + "; ".join(failures))
        backend, err = chosen
        built.data["backend"] = backend
        note = "contiguous K/V" + ("" if pt.fixed_length else ", padded to max_seq_len with a key mask")
        if failures:
            note += " (passed over: " + ", ".join(failures) + ")"
        built.data["note"] = note
        return {"verified": bool(err <= state.tol), "max_rel_err": err, "backend": backend.lower(), "note": note}

    def time(self, state, built: PeerBuilt) -> dict:
        pt, sets = state.point, state.sets
        backend = built.data["backend"]
        kvs = _timing_kv(state)
        qs = [q.unsqueeze(2) for q in sets.queries]
        mask = None if pt.fixed_length else length_mask(pt.seq_lens, pt.max_seq_len, qs[0].device)
        outs: list[Any] = [None] * len(qs)

        def call(i):
            def f():
                outs[i] = self._call(backend, qs[i], kvs[i][0], kvs[i][1], mask, sets.scale)
            return f

        t, how = _time_with_fallback([call(i) for i in range(len(qs))], state.replays)
        return _result(t, len(qs), state.replays, backend=backend.lower(), note=f"{built.data['note']}; {how}")

    def release(self, built: PeerBuilt) -> None:
        built.data.clear()


# ====================================================================================== Flex
_FLEX = None


def _flex():
    global _FLEX
    if _FLEX is None:
        import torch
        import torch._dynamo
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        # every point is a new shape: keep the compiled variants instead of falling back to eager
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 512)
        if hasattr(torch._dynamo.config, "accumulated_cache_size_limit"):
            torch._dynamo.config.accumulated_cache_size_limit = max(
                torch._dynamo.config.accumulated_cache_size_limit, 4096)
        # dynamic=False: one static compile per shape. The first H200 sweeps (automatic
        # dynamic shapes) timed flex at ~10x SDPA, scaling like a 128-row query tile for one
        # query token; the suspected cause, not yet confirmed on the device, is a symbolic
        # batch after the second shape, which keeps inductor off its flex-decoding kernel.
        _FLEX = (torch.compile(flex_attention, dynamic=False), create_block_mask)
    return _FLEX


# torch.compile(flex_attention, dynamic=False) failed at every point whose contiguous K (or V)
# has >= 2^31 elements: 26 of the 26 such rows that reached the compile in the six sweeps since
# dynamic=False (torch 2.11.0+cu130, H200 and H100; llama70b-decode 64 x 32k up, mixed-lengths'
# largest points; Inductor's SubprocException; the others ran out of memory first), and every
# such row of scripts/sweep_memory.py (SubprocException or CompilationError). Each failure cost
# a compile and left gigabytes allocated (notes/kernel-notes.md, twenty-fifth and twenty-sixth
# sessions). The automatic-dynamic compile of the first sweeps ran those points (a general flex
# kernel, ~10x SDPA's time), so the limit is the decoding kernel's. A later torch is tried again.
FLEX_LARGE_FAILS_UP_TO = (2, 11)


def flex_kv_elements(pt) -> int:
    """Elements of the contiguous K that the flex peer compiles for (padded to max_seq_len)."""
    return pt.num_seqs * pt.num_kv_heads * pt.max_seq_len * pt.head_size


def flex_fails_to_compile(pt, torch_version: str | None = None) -> bool:
    """Whether the flex peer refuses ``pt`` as known to fail (see FLEX_LARGE_FAILS_UP_TO)."""
    import os

    if os.environ.get("CPA_FLEX_LARGE") == "1" or flex_kv_elements(pt) < 1 << 31:
        return False
    if torch_version is None:
        import torch

        torch_version = torch.__version__
    major, minor = (int(x) for x in torch_version.split(".")[:2])
    return (major, minor) <= FLEX_LARGE_FAILS_UP_TO


class FlexPeer:
    name = "flex"

    def available(self) -> str | None:
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed (torch.compile of flex_attention needs it)"
        try:
            from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
        except ImportError as e:
            return f"torch.nn.attention.flex_attention unavailable ({e})"
        return None

    def build(self, state) -> PeerBuilt:
        pt = state.point
        if pt.kv_cache_dtype != "auto":
            raise _unsupported("flex_attention takes fp16/bf16 K/V, not fp8")
        if flex_fails_to_compile(pt):
            raise _unsupported(f"flex_attention's decoding kernel does not compile at K/V of >= 2^31 elements in "
                               f"torch {FLEX_LARGE_FAILS_UP_TO[0]}.{FLEX_LARGE_FAILS_UP_TO[1]} (this point: "
                               f"{flex_kv_elements(pt)}); CPA_FLEX_LARGE=1 tries anyway")
        return PeerBuilt()

    def _mask(self, pt, device):
        import torch

        if pt.fixed_length:
            return None
        _, create_block_mask = _flex()
        lens = torch.tensor(pt.seq_lens, dtype=torch.int32, device=device)

        def within(b, h, q_idx, kv_idx):
            return kv_idx < lens[b]

        return create_block_mask(within, B=pt.num_seqs, H=None, Q_LEN=1, KV_LEN=pt.max_seq_len, device=device)

    def verify(self, state, built: PeerBuilt) -> dict:
        import torch

        from . import reference

        pt, inp = state.point, state.inputs
        fn, _ = _flex()
        k, v = padded_kv(inp.key_cache, inp.value_cache, inp.block_tables, pt.seq_lens, pt.max_seq_len)
        bm = self._mask(pt, k.device)
        built.data["block_mask"] = bm
        o = fn(inp.query.unsqueeze(2), k, v, block_mask=bm, scale=inp.scale, enable_gqa=True)
        torch.cuda.synchronize()
        err = reference.relative_error(o.squeeze(2), state.ref, per_seq=True)
        del k, v, o
        torch.cuda.empty_cache()
        note = "torch.compile(flex_attention, dynamic=False), contiguous K/V" + ("" if pt.fixed_length else ", block mask")
        built.data["note"] = note
        return {"verified": bool(err <= state.tol), "max_rel_err": err, "backend": "inductor", "note": note}

    def time(self, state, built: PeerBuilt) -> dict:
        fn, _ = _flex()
        sets = state.sets
        kvs = _timing_kv(state)
        qs = [q.unsqueeze(2) for q in sets.queries]
        bm = built.data.get("block_mask")
        outs: list[Any] = [None] * len(qs)

        def call(i):
            def f():
                outs[i] = fn(qs[i], kvs[i][0], kvs[i][1], block_mask=bm, scale=sets.scale, enable_gqa=True)
            return f

        t, how = _time_with_fallback([call(i) for i in range(len(qs))], state.replays)
        return _result(t, len(qs), state.replays, backend="inductor", note=f"{built.data.get('note', '')}; {how}")

    def release(self, built: PeerBuilt) -> None:
        built.data.clear()


# ================================================================================ FlashInfer
def hnd_caches(key_cache, value_cache):
    """Our K [n, kvh, D/x, bs, x] and V [n, kvh, D, bs] as FlashInfer HND [n, kvh, bs, D] (copies)."""
    n, kvh, dx, bs, x = key_cache.shape
    k = key_cache.permute(0, 1, 3, 2, 4).reshape(n, kvh, bs, dx * x).contiguous()
    v = value_cache.transpose(2, 3).contiguous()
    return k, v


def csr_pages(block_tables, seq_lens: Sequence[int], block_size: int):
    """(indptr [S+1], indices, last_page_len [S]) int32 on the block table's device."""
    import torch

    dev = block_tables.device
    lens = torch.as_tensor(list(seq_lens), dtype=torch.int32, device=dev)
    nblk = (lens + block_size - 1) // block_size
    used = torch.arange(block_tables.shape[1], device=dev)[None, :] < nblk[:, None]
    indices = block_tables[used].to(torch.int32).contiguous()  # row-major: sequence by sequence
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device=dev)
    indptr[1:] = torch.cumsum(nblk, 0)
    last = (lens - (nblk - 1) * block_size).to(torch.int32)
    return indptr, indices, last


class FlashInferPeer:
    name = "flashinfer"

    def available(self) -> str | None:
        try:
            import flashinfer  # noqa: F401
        except Exception as e:  # ImportError, or a broken install raising something else
            return f"import flashinfer failed ({type(e).__name__}: {e})"[:200]
        return None

    def build(self, state) -> PeerBuilt:
        if state.point.kv_cache_dtype != "auto":
            raise _unsupported("flashinfer peer is fed fp16/bf16 K/V only here")
        return PeerBuilt()

    def _wrapper(self, pt, indptr, indices, last, dtype, scale, graph: bool):
        import flashinfer
        import torch

        dev = indices.device
        ws = torch.zeros(FLASHINFER_WORKSPACE, dtype=torch.uint8, device=dev)
        kw = {}
        if graph:
            kw = dict(use_cuda_graph=True, paged_kv_indptr_buffer=torch.empty_like(indptr),
                      paged_kv_indices_buffer=torch.empty_like(indices),
                      paged_kv_last_page_len_buffer=torch.empty_like(last))
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "HND", use_tensor_cores=True, **kw)
        args = (indptr, indices, last, pt.num_heads, pt.num_kv_heads, pt.head_size, pt.block_size)
        try:
            w.plan(*args, pos_encoding_mode="NONE", q_data_type=dtype, kv_data_type=dtype, sm_scale=scale)
        except TypeError:  # older releases: one data_type
            w.plan(*args, pos_encoding_mode="NONE", data_type=dtype, sm_scale=scale)
        w._cpa_keep = (ws, kw)
        return w

    @staticmethod
    def _run(w, q, kv, out):
        try:
            return w.run(q, kv, out=out)
        except TypeError:  # releases without out=
            o = w.run(q, kv)
            out.copy_(o)
            return out

    def verify(self, state, built: PeerBuilt) -> dict:
        import torch

        from . import reference

        pt, inp = state.point, state.inputs
        k, v = hnd_caches(inp.key_cache, inp.value_cache)
        indptr, indices, last = csr_pages(inp.block_tables, pt.seq_lens, pt.block_size)
        # planned as the timed wrappers are (use_cuda_graph=True: FlashInfer's planner picks its tiles
        # differently for graphs), so the configuration that is timed is the one checked
        w = self._wrapper(pt, indptr, indices, last, inp.query.dtype, inp.scale, graph=True)
        out = torch.full_like(inp.query, float("nan"))
        self._run(w, inp.query, (k, v), out)
        torch.cuda.synchronize()
        err = reference.relative_error(out, state.ref, per_seq=True)
        del k, v, w
        torch.cuda.empty_cache()
        return {"verified": bool(err <= state.tol), "max_rel_err": err, "backend": "tensor_cores HND",
                "note": "paged (block table as page table); K and V copied to HND once"}

    def time(self, state, built: PeerBuilt) -> dict:
        import torch

        pt, sets = state.point, state.sets
        k, v = hnd_caches(sets.key_cache, sets.value_cache)
        wrappers, outs = [], []
        for q, bt in zip(sets.queries, sets.block_tables):
            indptr, indices, last = csr_pages(bt, pt.seq_lens, pt.block_size)
            wrappers.append(self._wrapper(pt, indptr, indices, last, q.dtype, sets.scale, graph=True))
            outs.append(torch.empty_like(q))
        built.data["keep"] = (k, v, wrappers, outs)

        def call(i):
            def f():
                self._run(wrappers[i], sets.queries[i], (k, v), outs[i])
            return f

        t, how = _time_with_fallback([call(i) for i in range(len(wrappers))], state.replays)
        return _result(t, len(wrappers), state.replays, backend="tensor_cores HND",
                       note=f"paged (block table as page table); K and V copied to HND once; {how}")

    def release(self, built: PeerBuilt) -> None:
        built.data.clear()


# ==================================================================================== lookup
PEERS = {"sdpa": SdpaPeer, "flex": FlexPeer, "flashinfer": FlashInferPeer}


def available_peers(names: Sequence[str] | None = None) -> tuple[list, dict[str, str]]:
    """(peer objects that can run here, {name: reason} for the others)."""
    import torch

    names = list(names) if names else list(PEER_NAMES)
    bad = [n for n in names if n not in PEERS]
    if bad:
        raise ValueError(f"peers: unknown {bad}; allowed: {', '.join(PEER_NAMES)}")
    found, skipped = [], {}
    for n in names:
        if not torch.cuda.is_available():
            skipped[n] = "no GPU (peers run on the GPU only)"
            continue
        if getattr(torch.version, "hip", None) and n == "flashinfer":
            skipped[n] = "FlashInfer is CUDA-only"
            continue
        p = PEERS[n]()
        why = p.available()
        if why:
            skipped[n] = why
        else:
            found.append(p)
    return found, skipped
