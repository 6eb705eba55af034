"""cpa.peers: how peers are fed (contiguous K/V, HND pages, CSR page tables) and when they are skipped.

The layout helpers are pure torch and run on the CPU against the reference; the peers
themselves run on the GPU only (``@pytest.mark.gpu``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cpa
from cpa import peers as P
from cpa import reference, sweep as S


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _inputs(seq_lens, *, heads=8, kv=2, D=64, bs=16, device="cpu"):
    return cpa.make_paged_inputs(len(seq_lens), heads, kv, D, bs, list(seq_lens), dtype=torch.float16, seed=4,
                                 device=device)


def _logical_kv(inp, s, L):
    """K, V of sequence s, [kv_heads, L, D], read token by token through the block table."""
    kc, vc, bt = inp.key_cache, inp.value_cache, inp.block_tables
    bs = kc.shape[3]
    ks, vs = [], []
    for t in range(L):
        b, o = int(bt[s, t // bs]), t % bs
        ks.append(kc[b, :, :, o, :].reshape(kc.shape[1], -1))
        vs.append(vc[b, :, :, o])
    return torch.stack(ks, 1), torch.stack(vs, 1)


def test_padded_kv_reads_only_used_blocks_and_zeroes_the_rest():
    lens = [5, 40, 33]  # mixed: garbage block-table tails and NaN-poisoned slots past each end
    inp = _inputs(lens)
    k, v = P.padded_kv(inp.key_cache, inp.value_cache, inp.block_tables, lens, max(lens))
    assert k.shape == v.shape == (3, 2, 40, 64) and k.is_contiguous()
    assert torch.isfinite(k).all() and torch.isfinite(v).all()
    for s, L in enumerate(lens):
        lk, lv = _logical_kv(inp, s, L)
        assert torch.equal(k[s, :, :L], lk) and torch.equal(v[s, :, :L], lv)
        assert not k[s, :, L:].any() and not v[s, :, L:].any()


@pytest.mark.parametrize("lens", [[37, 37, 37], [1, 200, 63, 64]])
def test_sdpa_on_padded_kv_with_mask_matches_reference(lens):
    inp = _inputs(lens)
    ref = reference.paged_attention(**inp.as_kwargs())
    L = max(lens)
    k, v = P.padded_kv(inp.key_cache, inp.value_cache, inp.block_tables, lens, L)
    mask = None if len(set(lens)) == 1 else P.length_mask(lens, L, k.device)
    o = F.scaled_dot_product_attention(inp.query.unsqueeze(2).float(), k.float(), v.float(), attn_mask=mask,
                                       scale=inp.scale, enable_gqa=True).squeeze(2)
    assert reference.relative_error(o, ref, per_seq=True) <= reference.REL_ERR_TOL[torch.float16]


def test_hnd_caches_and_csr_pages():
    lens = [17, 1, 48]
    inp = _inputs(lens)
    k, v = P.hnd_caches(inp.key_cache, inp.value_cache)
    n, kvh, bs, D = inp.key_cache.shape[0], 2, 16, 64
    assert k.shape == v.shape == (n, kvh, bs, D) and k.is_contiguous() and v.is_contiguous()
    # HND [page, head, slot, dim]: slot o of block b is token o of that block
    same = dict(rtol=0, atol=0, equal_nan=True)  # NaN: poisoned slots stay poisoned
    for b in range(n):
        for o in range(bs):
            torch.testing.assert_close(k[b, :, o], inp.key_cache[b, :, :, o, :].reshape(kvh, D), **same)
            torch.testing.assert_close(v[b, :, o], inp.value_cache[b, :, :, o], **same)
    indptr, indices, last = P.csr_pages(inp.block_tables, lens, 16)
    assert indptr.tolist() == [0, 2, 3, 6]
    assert last.tolist() == [1, 1, 16]
    bt = inp.block_tables
    assert indices.tolist() == bt[0, :2].tolist() + bt[1, :1].tolist() + bt[2, :3].tolist()
    assert indices.dtype == indptr.dtype == last.dtype == torch.int32
    # the pages with their last_page_len give back exactly the reference's attention
    ref = reference.paged_attention(**inp.as_kwargs())
    outs = []
    for s in range(3):
        pages = indices[indptr[s]:indptr[s + 1]].long()
        kk = k[pages].permute(1, 0, 2, 3).reshape(kvh, -1, D)[:, :lens[s]]
        vv = v[pages].permute(1, 0, 2, 3).reshape(kvh, -1, D)[:, :lens[s]]
        q = inp.query[s].float().view(kvh, -1, D)
        a = torch.softmax(q @ kk.float().transpose(1, 2) * inp.scale, -1)
        outs.append((a @ vv.float()).reshape(-1, D))
    assert reference.relative_error(torch.stack(outs), ref, per_seq=True) <= reference.REL_ERR_TOL[torch.float16]


def test_peers_skip_with_reasons_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("this checks the no-GPU path")
    found, skipped = P.available_peers()
    assert found == [] and set(skipped) == set(P.PEER_NAMES)
    assert all("GPU" in why for why in skipped.values())
    with pytest.raises(ValueError, match="unknown"):
        P.available_peers(["nope"])


def test_flashinfer_skip_reason_when_missing():
    try:
        import flashinfer  # noqa: F401
    except Exception:
        why = P.FlashInferPeer().available()
        assert why and "flashinfer" in why
    else:
        assert P.FlashInferPeer().available() is None


def test_cpu_runner_has_no_peers(tmp_path):
    g = S.parse_grid({"name": "p", "defaults": dict(num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                                                    max_seq_len=20), "axes": {"num_seqs": [1]},
                      "variants": {"tilings": ["scalar"], "partition_sizes": [64]}})
    msgs = []
    df = S.run_sweep(g, tmp_path / "p.parquet", runner=S.ReferenceRunner(replays=1), progress=False, echo=msgs.append)
    assert set(df.tiling) == {"scalar"}
    assert sum("skipped: no peers on the CPU" in m for m in msgs) == 3


@pytest.mark.gpu
@pytest.mark.parametrize("name", P.PEER_NAMES)
def test_peer_on_gpu(name):
    found, skipped = P.available_peers([name])
    if not found:
        pytest.skip(f"{name}: {skipped[name]}")
    peer = found[0]
    r = S.CudaRunner(replays=3)
    r.meta = {"read_gbps": 1.0}
    for lens in ([300, 300], [17, 700, 64]):
        pt = S.make_point(dict(num_seqs=len(lens), num_heads=16, num_kv_heads=2, head_size=128, block_size=16,
                               seq_lens=lens))
        state = r.open_point(pt, seed=2)
        built = peer.build(state)
        ver = peer.verify(state, built)
        assert ver["verified"], ver
        t = peer.time(state, built)
        assert t["time_us"] > 0 and t["n_sets"] >= 1
        peer.release(built)
        r.close_point(state)


@pytest.mark.parametrize("lens", [[300, 300], [17, 700, 64]])
def test_sdpa_peer_verify_on_cpu(monkeypatch, lens):
    """The SDPA peer's backend choice and verification, run on the CPU (no device syncs needed)."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: None)
    pt = S.make_point(dict(num_seqs=len(lens), num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                           seq_lens=lens))
    inp = cpa.make_paged_inputs(pt.num_seqs, 8, 2, 64, 16, list(lens), dtype=torch.float16, seed=9)
    ref = reference.paged_attention(**inp.as_kwargs())
    state = S.CudaPointState(pt, inp, ref, reference.REL_ERR_TOL[torch.float16], sets=None, replays=1)
    peer = P.SdpaPeer()
    built = peer.build(state)
    res = peer.verify(state, built)
    assert res["verified"], res
    assert res["backend"] in ("flash_attention", "efficient_attention", "math")
    assert "CUDNN_ATTENTION" in res["note"]  # refused on the CPU, and said so
    assert ("key mask" in res["note"]) == (len(set(lens)) > 1)
    fp8 = S.make_point(dict(num_seqs=1, num_heads=8, num_kv_heads=2, head_size=64, block_size=16, max_seq_len=9,
                            kv_cache_dtype="fp8"))
    with pytest.raises(S.Unsupported):
        peer.build(S.CudaPointState(fp8, None, None, 0.0, None, 1))


def test_flex_refuses_the_points_its_decoding_kernel_fails_to_compile(monkeypatch):
    """K/V of >= 2^31 elements is refused as unsupported before any copy or compile in torch
    <= 2.11 (where every such compile failed), tried on a later torch or with CPA_FLEX_LARGE=1."""
    monkeypatch.delenv("CPA_FLEX_LARGE", raising=False)
    kw = dict(num_heads=64, num_kv_heads=8, head_size=128, block_size=16)
    edge = S.make_point(dict(num_seqs=64, max_seq_len=32768, **kw))  # exactly 2^31 elements
    below = S.make_point(dict(num_seqs=32, max_seq_len=32768, **kw))
    mixed = S.make_point(dict(num_seqs=128, seq_lens=[100] * 127 + [32768], **kw))  # padded to its longest
    assert P.flex_kv_elements(edge) == 1 << 31
    assert P.flex_fails_to_compile(edge, "2.11.0+cu130") and P.flex_fails_to_compile(mixed, "2.9.1")
    assert not P.flex_fails_to_compile(below, "2.11.0+cu130")
    assert not P.flex_fails_to_compile(edge, "2.12.0")
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    with pytest.raises(S.Unsupported, match=r"unsupported: .*2\^31 elements.*2147483648.*CPA_FLEX_LARGE=1"):
        P.FlexPeer().build(S.CudaPointState(edge, None, None, 0.0, None, 1))
    P.FlexPeer().build(S.CudaPointState(below, None, None, 0.0, None, 1))
    monkeypatch.setenv("CPA_FLEX_LARGE", "1")
    assert not P.flex_fails_to_compile(edge, "2.11.0")
