"""cpa.sweep on the CPU: grids, the runner protocol with the reference as the timed op, the
parquet results, and crash safety (injected crash, kill -9, corrupt journal / parquet)."""

from __future__ import annotations

import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import textwrap
import time
import weakref
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from cpa import sweep as S
from cpa import variants as V
from cpa.cli import app

ROOT = Path(__file__).resolve().parents[1]

TINY = """
name: tiny
seed: 3
defaults: {num_heads: 4, num_kv_heads: 2, head_size: 64, block_size: 16}
axes:
  num_seqs: [2, 3]
  max_seq_len: [40, 300]
points:
  - {num_seqs: 3, seq_lens: [17, 100, 301]}
  - {num_seqs: 4, seq_lens: {distribution: lognormal, median: 100, sigma: 1.0, min: 1, max: 2000, seed: 7}}
  - {num_seqs: 2, max_seq_len: 50, head_size: 80}    # no kernel variant has head 80: unsupported rows
variants: {tilings: [mfma16, scalar], partition_sizes: [64, 256]}
"""
TINY_ROWS = 7 * 4


@pytest.fixture(autouse=True)
def _one_thread():
    # tiny reference ops on 2 shared cores: one thread avoids OpenMP spin contention
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def tiny(tmp_path) -> Path:
    p = tmp_path / "tiny.yaml"
    p.write_text(TINY)
    return p


def _quiet(_msg: str) -> None:
    pass


def _run(grid, out, runner=None, **kw):
    return S.run_sweep(grid, out, runner=runner or S.ReferenceRunner(replays=1), progress=False, echo=_quiet, **kw)


def _signature(df):
    """What must not depend on interruptions: the keys, verified flags, errors."""
    keys = list(zip(df.point_id, df.tiling, df.partition_size))
    assert len(keys) == len(set(keys)), "duplicate (point, variant) rows"
    return {k: (bool(v), e if isinstance(e, str) else None, None if m != m else round(float(m), 12))
            for k, v, e, m in zip(keys, df.verified, df.error, df.max_rel_err)}


# ====================================================================================== grids
def test_builtin_grids_expand():
    assert set(S.builtin_grids()) >= {"llama70b-decode", "gqa-scan", "head-size-scan", "mixed-lengths"}
    g = S.load_grid("llama70b-decode")
    assert len(g.points) == 7 * 8 and len(g.variants()) == 3 * len(V.PARTITION_SIZES) == 3 * 8
    assert len(g.rows()) == 1344 > 200
    assert sorted({p.num_seqs for p in g.points}) == [1, 4, 16, 32, 64, 128, 256]
    assert sorted({p.max_seq_len for p in g.points}) == [128, 512, 1024, 2048, 4096, 8192, 16384, 32768]
    assert {(p.num_heads, p.num_kv_heads, p.head_size, p.block_size, p.dtype, p.kv_cache_dtype)
            for p in g.points} == {(64, 8, 128, 16, "fp16", "auto")}
    assert g.source == "builtin:llama70b-decode"

    gqa = S.load_grid("gqa-scan")
    assert [p.gqa_ratio for p in gqa.points] == [1, 2, 4, 8, 16]
    assert {p.num_kv_heads for p in gqa.points} == {8} and len({p.kv_bytes for p in gqa.points}) == 1

    hs = S.load_grid("head-size-scan")
    assert {p.head_size for p in hs.points} == {64, 128, 256}
    assert {p.gqa_ratio for p in hs.points} == {8}
    for b in (16, 64):
        for L in (2048, 8192):
            sel = [p for p in hs.points if p.num_seqs == b and p.max_seq_len == L]
            assert len(sel) == 3 and len({p.kv_bytes for p in sel}) == 1  # fixed KV bytes

    mixed = S.load_grid("mixed-lengths")
    assert mixed.points and not any(p.fixed_length for p in mixed.points)

    kvd = S.load_grid("kv-dtype-scan")
    assert {(p.dtype, p.kv_cache_dtype) for p in kvd.points} == {
        (d, k) for d in ("fp16", "bf16") for k in ("auto", "fp8")}
    assert len(kvd.points) == 16 and len(kvd.rows()) == 16 * 3 * 6
    fp8 = [p for p in kvd.points if p.kv_cache_dtype == "fp8"]
    auto = {(p.dtype, p.num_seqs, p.max_seq_len): p.kv_bytes for p in kvd.points if p.kv_cache_dtype == "auto"}
    for p in fp8:  # an fp8 cache reads half the bytes of the 16-bit point it is paired with
        assert 2 * p.kv_bytes == auto[(p.dtype, p.num_seqs, p.max_seq_len)]
    for gname in S.builtin_grids():  # every shipped grid loads and has unique point ids
        gg = S.load_grid(gname)
        assert len({p.point_id for p in gg.points}) == len(gg.points)


def test_mixed_lengths_deterministic_and_long_tailed():
    a, b = S.load_grid("mixed-lengths"), S.load_grid("mixed-lengths")
    assert [p.seq_lens for p in a.points] == [p.seq_lens for p in b.points]
    assert [p.point_id for p in a.points] == [p.point_id for p in b.points]
    assert all("seed=20250101" in p.point_id for p in a.points)
    for p in a.points:
        lens = p.seq_lens
        assert len(lens) == p.num_seqs and 16 <= min(lens) and max(lens) <= 32768
    big = [p for p in a.points if p.num_seqs == 256]
    assert len(big) == 2
    for p in big:
        med = statistics.median(p.seq_lens)
        assert 700 < med < 1400  # median 1024
        assert p.mean_seq_len > 1.3 * med  # right-skewed
        assert p.max_seq_len > 8 * med  # long tail
    # the smaller batches are prefixes of the same draw stream
    for sigma in ("sigma=1,", "sigma=1.5,"):
        pts = sorted((p for p in a.points if sigma in p.point_id), key=lambda p: p.num_seqs)
        for small, large in zip(pts, pts[1:]):
            assert large.seq_lens[:small.num_seqs] == small.seq_lens
    spec = {"distribution": "lognormal", "median": 1024, "sigma": 1.0, "min": 16, "max": 32768, "seed": 20250101}
    assert S.sample_seq_lens(spec, 16)[0] == big[0].seq_lens[:16]
    assert S.sample_seq_lens({**spec, "seed": 1}, 16)[0] != big[0].seq_lens[:16]


def test_user_grid_yaml(tmp_path):
    p = tmp_path / "mine.yaml"
    p.write_text(textwrap.dedent("""
        name: mine
        seed: 5
        defaults: {block_size: 32, dtype: bf16}
        axes:
          num_seqs: [1, 8]
          shape:
            - {num_heads: 32, num_kv_heads: 4, head_size: 128}
            - {num_heads: 16, num_kv_heads: 16, head_size: 64}
          max_seq_len: [100, 1000]
        points:
          - {num_seqs: 3, num_heads: 8, num_kv_heads: 1, head_size: 256, seq_lens: [5, 50, 500]}
        variants: {tilings: [scalar], partition_sizes: [128, 512]}
    """))
    g = S.load_grid(p)
    assert g.name == "mine" and g.source == str(p)
    assert len(g.points) == 2 * 2 * 2 + 1 and len(g.variants()) == 2 and len(g.rows()) == 18
    assert [p.num_seqs for p in g.points[:4]] == [1, 1, 1, 1]  # first axis outermost
    assert (g.points[0].num_heads, g.points[0].max_seq_len, g.points[1].max_seq_len) == (32, 100, 1000)
    assert {(p.block_size, p.dtype) for p in g.points} == {(32, "bf16")}
    overridden = S.parse_grid({"name": "o", "defaults": dict(num_heads=4, num_kv_heads=4, head_size=64, block_size=16,
                                                             max_seq_len=10),
                               "points": [{"num_seqs": 2}, {"num_seqs": 2, "seq_lens": [3, 4]}]})
    assert [p.seq_lens for p in overridden.points] == [(10, 10), (3, 4)]
    last = g.points[-1]
    assert last.seq_lens == (5, 50, 500) and last.seq_lens_dist.startswith("list:") and last.gqa_ratio == 8
    assert g.with_variants(["mfma16", "mfma4"], [64]).variants() == [S.RowVariant("mfma16", 64),
                                                                     S.RowVariant("mfma4", 64)]
    # the point seed depends on the grid seed and the point, nothing else
    assert S.load_grid(p).point_seed(last) == g.point_seed(last)


@pytest.mark.parametrize("spec, needle", [
    ({"name": "x", "axes": {"num_seqs": [1]}, "bogus": 1}, "bogus"),
    ({"name": "x", "defaults": {"num_heads": 8, "num_kv_heads": 8, "head_size": 64, "block_size": 16,
                                "max_seq_len": 10, "seq_lens": [1]}, "axes": {"num_seqs": [1]}}, "exactly one"),
    ({"name": "x", "defaults": {"num_heads": 8, "num_kv_heads": 3, "head_size": 64, "block_size": 16,
                                "max_seq_len": 10}, "axes": {"num_seqs": [1]}}, "num_heads"),
    ({"name": "x", "defaults": {"num_heads": 8, "num_kv_heads": 8, "head_size": 64, "block_size": 16,
                                "max_seq_len": 10}, "axes": {"num_seqs": [1]}, "variants": {"tilings": ["wmma"]}},
     "tiling"),
    ({"name": "x", "axes": {"heads": [8]}}, "heads"),
    ({"name": "x", "defaults": {"num_heads": 8, "num_kv_heads": 8, "head_size": 64, "block_size": 16,
                                "seq_lens": {"distribution": "lognormal", "median": 10, "max": 20}},
      "axes": {"num_seqs": [2]}}, "seed"),
    ({"axes": {"num_seqs": [1]}}, "name"),
])
def test_grid_errors_name_the_field(spec, needle):
    with pytest.raises(ValueError, match=needle):
        S.parse_grid(spec, "test")


def test_unknown_grid_name():
    with pytest.raises(ValueError, match="no such shipped grid"):
        S.load_grid("no-such-grid")


def test_large_points_are_timed_on_their_verification_inputs():
    from types import SimpleNamespace

    from cpa.bench import POOL_BYTES
    from cpa.inputs import make_paged_inputs

    def cache(nbytes):  # only the caches' sizes matter
        return SimpleNamespace(key_cache=SimpleNamespace(nbytes=nbytes // 2), value_cache=SimpleNamespace(nbytes=nbytes // 2))

    llama = dict(num_heads=64, num_kv_heads=8, head_size=128, block_size=16)
    big = S.make_point(dict(num_seqs=256, max_seq_len=32768, **llama))
    assert big.kv_bytes == 256 * 32768 * 8 * 128 * 2 * 2
    assert S.times_on_inputs(big, cache(int(big.kv_bytes * 1.1)))
    # below half the pool, make_sets draws several disjoint sets: the point keeps them
    small = S.make_point(dict(num_seqs=8, max_seq_len=8192, **llama))  # 268 MB of K/V
    assert not S.times_on_inputs(small, cache(int(small.kv_bytes * 1.1)))
    # one set, but the inputs alone would not cover the pool: timed on make_sets' 1 GiB pool
    assert not S.times_on_inputs(S.make_point(dict(num_seqs=16, max_seq_len=8192, **llama)), cache(POOL_BYTES))
    three_q = S.make_point(dict(num_seqs=24, max_seq_len=8192, **llama))  # 768 MiB: make_sets' one set
    assert not S.times_on_inputs(three_q, cache(int(three_q.kv_bytes * 1.1)))
    assert S.times_on_inputs(three_q, cache(POOL_BYTES))
    # a mixed point's sets give every sequence max_seq_len; its inputs hold the real lengths
    mixed = S.make_point(dict(num_seqs=64, seq_lens=[32768] + [128] * 63, **llama))
    assert not S.times_on_inputs(mixed, cache(int(mixed.kv_bytes * 1.1)))
    # fp8: counted as make_sets draws it (in the query's dtype); the scales go to the launch
    f8 = S.make_point(dict(num_seqs=1, max_seq_len=100, kv_cache_dtype="fp8", **llama))
    inp = make_paged_inputs(1, 64, 8, 128, 16, 100, dtype=torch.float16, kv_cache_dtype="fp8", seed=3)
    sets = S.sets_of_inputs(f8, inp)
    assert sets.key_cache is inp.key_cache and sets.queries[0] is inp.query and sets.block_tables[0] is inp.block_tables
    assert sets.kv_bytes_per_set == f8.kv_bytes and sets.scale == inp.scale
    kw = S.launch_kwargs(f8, sets)
    assert kw["kv_cache_dtype"] == "fp8" and (kw["k_scale"], kw["v_scale"]) == (inp.k_scale, inp.v_scale) != (1.0, 1.0)
    assert (S.launch_kwargs(f8)["k_scale"], S.launch_kwargs(f8)["v_scale"]) == (1.0, 1.0)


def test_bytes_accounting_matches_bench():
    pt = S.make_point(dict(num_seqs=8, num_heads=64, num_kv_heads=8, head_size=128, block_size=16, max_seq_len=2048))
    S_, H, D, kvh, L = 8, 64, 128, 8, 2048
    kv = 2 * S_ * L * kvh * D * 2
    assert pt.kv_bytes == kv
    for P in (64, 256, 2048):
        NP = -(-L // P)
        partials = 0 if NP == 1 else 2 * S_ * H * NP * (D + 2) * 4
        v = S.RowVariant("mfma16", P)
        assert S.num_partitions(pt, v) == NP
        assert S.bytes_moved(pt, v) == kv + 2 * S_ * H * D * 2 + partials  # cpa.bench's accounting
    assert S.bytes_moved(pt, S.RowVariant("sdpa", 0, peer=True)) == kv + 2 * S_ * H * D * 2
    # mixed lengths: each sequence's own partitions
    mp = S.make_point(dict(num_seqs=2, num_heads=4, num_kv_heads=2, head_size=64, block_size=16, seq_lens=[10, 300]))
    assert S.bytes_moved(mp, S.RowVariant("scalar", 64)) == mp.kv_bytes + 2 * 2 * 4 * 64 * 2 + 2 * 4 * (1 + 5) * 66 * 4


# ===================================================================================== runner
def test_reference_runner_protocol():
    r = S.ReferenceRunner(replays=2)
    meta = r.begin()
    assert meta["read_gbps"] > 0 and meta["read_method"]
    assert r.peer_variants()[0] == [] and set(r.peer_variants()[1]) == {"sdpa", "flex", "flashinfer"}
    pt = S.make_point(dict(num_seqs=3, num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                           seq_lens=[17, 100, 301]))
    state = r.open_point(pt, seed=1)
    built = r.build(state, S.RowVariant("mfma16", 64))
    ver = r.verify(state, built)
    assert ver["verified"] is True and ver["max_rel_err"] < 1e-3
    t = r.time(state, built)
    for k in ("time_us", "time_us_p25", "time_us_p75", "attn_time_us", "reduce_time_us"):
        assert t[k] > 0, k
    assert t["time_us_p25"] <= t["time_us"] <= t["time_us_p75"]
    with pytest.raises(S.Unsupported, match="unsupported"):
        r.build(r.open_point(S.make_point(dict(num_seqs=1, num_heads=4, num_kv_heads=2, head_size=80, block_size=16,
                                                max_seq_len=20)), 0), S.RowVariant("mfma16", 64))
    gqa8 = S.make_point(dict(num_seqs=1, num_heads=16, num_kv_heads=2, head_size=64, block_size=16, max_seq_len=20))
    hip = S.ReferenceRunner(platform="hip")  # platform rules come from cpa.variants: hip mfma4 holds 4 heads
    with pytest.raises(S.Unsupported, match="heads"):
        hip.build(hip.open_point(gqa8, 0), S.RowVariant("mfma4", 64))


class _HalfWriter(S.ReferenceRunner):
    """An op that leaves the second half of the sequences unwritten."""

    def compute(self, kwargs, partition_size, out):
        full = torch.empty_like(out)
        super().compute(kwargs, partition_size, full)
        n = out.shape[0] // 2
        out[:n] = full[:n]


def test_poisoned_output_buffer_catches_unwritten_rows(tmp_path, tiny):
    df = _run(tiny, tmp_path / "o.parquet", runner=_HalfWriter(replays=1))
    ran = df[df.error.isna()]
    assert len(ran) == 24 and not ran.verified.any()
    assert (ran.max_rel_err == float("inf")).all()


_KEPT_ERRORS: list = []
_ROW_COPIES: list = []


class _KeptFailure(S.ReferenceRunner):
    """A verify that fails the way a torch.compile'd peer does: the library keeps its exception,
    raised while the point's cache and a per-row copy of it are locals (flex_attention at
    >= 2^31-element K/V, H100)."""

    def verify(self, state, built):
        cache = state.kwargs["key_cache"]
        copy = cache.clone()  # a peer's contiguous K/V copy
        _ROW_COPIES.append(weakref.ref(copy))
        try:
            raise RuntimeError("compile failed")
        except RuntimeError as e:
            _KEPT_ERRORS.append(e)
            raise

    def close_point(self, state):  # as CudaRunner: the point's tensors go with the point
        state.kwargs = state.ref = None


def test_failed_row_keeps_no_point_data():
    r = _KeptFailure(replays=1)
    r.begin()
    pt = S.make_point(dict(num_seqs=2, num_heads=4, num_kv_heads=2, head_size=64, block_size=16, max_seq_len=40))
    state = r.open_point(pt, seed=1)
    cache = weakref.ref(state.kwargs["key_cache"])
    res = S._run_row(r, state, S.RowVariant("mfma16", 64))
    assert res["error"] == "RuntimeError: compile failed" and not res["verified"]
    gc.collect()
    assert _ROW_COPIES[-1]() is None, "a failed row's exception still holds the row's copy"
    r.close_point(state)
    gc.collect()
    assert cache() is None, "a failed row's exception still holds the point's cache"
    _KEPT_ERRORS.clear()


class _WrappedError(Exception):
    """As torch's InductorError: the inner failure as an attribute, a traceback of its own."""

    def __init__(self, inner):
        self.inner_exception = inner
        super().__init__(f"{type(inner).__name__}: {inner}")


def _compile_frame(copy):  # a compile frame with the row's copy as a local (Dynamo's trace_frame)
    return _wait_on_kernel()


def _wait_on_kernel():
    try:
        raise RuntimeError("in a subprocess")
    except RuntimeError as e:
        _KEPT_ERRORS.append(e)  # the library's cached future keeps the original, and through
        raise RuntimeError("kernel failed") from e  # its frame's f_back the whole compile stack


def _compile_with_closure(copy):  # Dynamo's _compile: its inner function closes over the copy
    def compile_inner():
        return _raise_as_the_pool_does(copy)

    return compile_inner()


def _raise_as_the_pool_does(copy):
    """async_compile's result(): the pool's failure, kept in the kernel cache, is re-raised as a
    renamed copy `from` it, so the kept original's traceback runs through this frame."""
    try:
        try:
            raise RuntimeError("in a subprocess")
        except RuntimeError as e:
            _KEPT_ERRORS.append(e)
            raise
    except RuntimeError as e:
        raise RuntimeError("renamed") from e


class _WrappedFailure(_KeptFailure):
    """The SubprocException path of torch 2.11 (H100, twenty-sixth session): the caller sees
    a wrapper raised outside the handler (no context) that holds the inner failure only as an
    attribute; the original stays in a library cache, its frames linked to the compile frames."""

    compile = staticmethod(_compile_frame)

    def verify(self, state, built):
        copy = state.kwargs["key_cache"].clone()
        _ROW_COPIES.append(weakref.ref(copy))
        failure = None
        try:
            self.compile(copy)
        except RuntimeError as inner:
            failure = inner
        del copy
        raise _WrappedError(failure)


class _ClosureFailure(_WrappedFailure):
    """Today's H100 chain (twenty-seventh session, 256 x 16k): the copy is a closure cell of the
    compile functions whose frames the kept failure's traceback holds. A frame holds its
    function, and the function its cells, so clearing the frames' locals does not free it."""

    compile = staticmethod(_compile_with_closure)


@pytest.mark.parametrize("runner,inner", [(_WrappedFailure, "kernel failed"), (_ClosureFailure, "renamed")],
                         ids=["frame-locals", "closure-cells"])
def test_failed_row_keeps_no_point_data_through_a_wrapped_failure(runner, inner):
    r = runner(replays=1)
    r.begin()
    pt = S.make_point(dict(num_seqs=2, num_heads=4, num_kv_heads=2, head_size=64, block_size=16, max_seq_len=40))
    state = r.open_point(pt, seed=1)
    res = S._run_row(r, state, S.RowVariant("mfma16", 64))
    assert res["error"] == f"_WrappedError: RuntimeError: {inner}" and not res["verified"]
    gc.collect()
    assert _KEPT_ERRORS, "the stand-in library keeps its failure"
    assert _ROW_COPIES[-1]() is None, "a kept inner failure's frames (or their functions' cells) hold the row's copy"
    assert str(_KEPT_ERRORS[-1]) == "in a subprocess"  # the library's kept failure keeps its message
    r.close_point(state)
    _KEPT_ERRORS.clear()


def _caller_of_a_kept_failure(copy):
    return _failure_caught_where_raised()


def _failure_caught_where_raised():
    try:
        raise RuntimeError("kept")
    except RuntimeError as e:
        return e  # its traceback has this frame only; the caller is reached through f_back


def test_release_frames_clears_the_finished_callers_of_a_failure():
    """A finished frame that holds a tensor and is reachable only as the f_back of a kept
    failure's frame (how torch's cached future held the compile stack) loses its locals."""
    import torch

    copy = torch.zeros(8)
    ref = weakref.ref(copy)
    kept = _caller_of_a_kept_failure(copy)
    del copy
    gc.collect()
    assert ref() is not None  # held by the finished caller's frame
    S.release_frames(kept)
    gc.collect()
    assert ref() is None


def test_release_frames_leaves_a_suspended_generator_running():
    """A generator that caught the failure and is suspended (not finished) keeps working."""

    def steps():
        try:
            raise RuntimeError("caught inside")
        except RuntimeError as e:
            yield e
        yield "still running"

    gen = steps()
    S.release_frames(next(gen))
    assert next(gen) == "still running"


# ==================================================================================== results
def test_sweep_results_parquet(tmp_path, tiny):
    out = tmp_path / "r" / "res.parquet"
    df = _run(tiny, out)
    assert out.exists() and not (out.parent / "res.parquet.journal").exists()
    schema = pq.read_schema(out)
    assert schema.metadata[b"cpa.sweep.schema_version"] == str(S.SCHEMA_VERSION).encode()
    df2, meta = S.read_results(out)
    assert meta["schema_version"] == S.SCHEMA_VERSION and len(meta["runs"]) == 1
    run = meta["runs"][0]
    assert run["ceilings"]["read_gbps"] > 0 and run["grid"] == "tiny" and run["provenance"]["torch_version"]
    missing = [c for c in S.REQUIRED_COLUMNS if c not in df2.columns]
    assert not missing, missing
    assert len(df2) == TINY_ROWS == len(df)
    assert len(set(zip(df2.point_id, df2.tiling, df2.partition_size))) == TINY_ROWS
    ok = df2[df2.error.isna()]
    uns = df2[df2.error.notna()]
    assert len(ok) == 24 and ok.verified.all() and (ok.max_rel_err <= 2e-3).all()
    assert (ok.timing_inputs == "inputs").all() and uns.timing_inputs.isna().all()  # the CPU runner's
    assert len(uns) == 4 and (uns.head_size == 80).all() and uns.error.str.startswith("unsupported").all()
    assert not uns.verified.any()
    r = ok.iloc[0]
    assert r.gbps == pytest.approx(r.kv_bytes / (r.time_us * 1e-6) / 1e9)
    assert r.frac_peak_bw == pytest.approx(r.gbps / r.read_gbps_ceiling)
    assert r.total_gbps == pytest.approx(r.bytes / (r.time_us * 1e-6) / 1e9)
    assert (ok.read_gbps_ceiling == run["ceilings"]["read_gbps"]).all()
    for c in ("device_name", "driver_version", "torch_version", "git_commit", "timestamp"):
        assert ok[c].notna().all(), c
    mixed = df2[df2.seq_lens_dist.str.startswith("lognormal")]
    assert len(mixed) == 4 and (mixed.mean_seq_len < mixed.max_seq_len).all()
    summ = S.summary_table(df2)
    assert len(summ) == 7 and summ.verified.tolist()[:6] == ["4/4"] * 6


def test_existing_output_needs_resume_or_overwrite(tmp_path, tiny):
    out = tmp_path / "o.parquet"
    _run(tiny, out, tilings=["scalar"], partition_sizes=[64])
    with pytest.raises(FileExistsError):
        _run(tiny, out)
    df = _run(tiny, out, overwrite=True, tilings=["mfma16"], partition_sizes=[256])
    assert set(df.tiling) == {"mfma16"} and len(df) == 7


def test_second_writer_is_locked_out(tmp_path):
    a = S.ResultStore(tmp_path / "o.parquet")
    a.lock()
    try:
        with pytest.raises(RuntimeError, match="another sweep"):
            S.ResultStore(tmp_path / "o.parquet").lock()
    finally:
        a.unlock()
    S.ResultStore(tmp_path / "o.parquet").lock()


# ============================================================================== crash / resume
class _Crash(BaseException):
    """Not an Exception: the sweep must not swallow it (like KeyboardInterrupt or SystemExit)."""


class _CrashAfter(S.ReferenceRunner):
    """Dies (an exception the sweep does not catch, like Ctrl-C) in the middle of row n + 1."""

    def __init__(self, n, **kw):
        super().__init__(**kw)
        self.n, self.rows = n, 0

    def time(self, state, built):
        self.rows += 1
        if self.rows > self.n:
            raise _Crash
        return super().time(state, built)


class _Counting(S.ReferenceRunner):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.built = []

    def build(self, state, variant):
        self.built.append((state.point.point_id, variant.tiling, variant.partition_size))
        return super().build(state, variant)


def test_injected_crash_then_resume_equals_uninterrupted(tmp_path, tiny):
    ref = _run(tiny, tmp_path / "ref.parquet")
    out = tmp_path / "o.parquet"
    with pytest.raises(_Crash):
        _run(tiny, out, runner=_CrashAfter(10, replays=1))
    part = S.ResultStore(out).compact()  # what survived: exactly the finished rows
    assert len(part) == 10
    again = _Counting(replays=1)
    df = _run(tiny, out, runner=again, resume=True)
    assert len(again.built) == TINY_ROWS - 10  # only the missing rows ran
    assert _signature(df) == _signature(ref)
    _, meta = S.read_results(out)
    assert len(meta["runs"]) == 2 and len(set(df.run_id)) == 2
    # resuming a complete file runs nothing
    nothing = _Counting(replays=1)
    assert _signature(_run(tiny, out, runner=nothing, resume=True)) == _signature(ref)
    assert nothing.built == []


def test_corrupt_journal_files_are_ignored(tmp_path, tiny):
    ref = _run(tiny, tmp_path / "ref.parquet")
    out = tmp_path / "o.parquet"
    with pytest.raises(_Crash):
        _run(tiny, out, runner=_CrashAfter(13, replays=1))  # compacted on the way out: 13 rows
    # what a kill -9 leaves: journal rows not yet compacted, one of them torn, and debris
    store = S.ResultStore(out)
    later = ref.iloc[13:15].to_dict("records")
    store.append(later[0])  # intact: kept, not run again
    store.append(later[1])
    j = store.journal
    torn = max(j.glob("row-*.json"), key=lambda p: p.stat().st_mtime_ns)
    torn.write_bytes(torn.read_bytes()[:100])  # a torn write
    (j / "row-garbage.json").write_bytes(b"\x00\xff not json")
    (j / "row-wrongshape.json").write_text(json.dumps({"schema_version": 1, "row": [1, 2]}))
    (j / "row-nokey.json").write_text(json.dumps({"schema_version": 1, "row": {"tiling": "x"}}))
    (j / ".tmp-999-row-abc.json").write_text('{"half')  # a killed writer's temporary file
    (j / "run-broken.json").write_text("{")
    msgs = []
    again = _Counting(replays=1)
    df = S.run_sweep(tiny, out, runner=again, resume=True, progress=False, echo=msgs.append)
    assert _signature(df) == _signature(ref)
    assert len(again.built) == TINY_ROWS - 13 - 1  # the torn row ran again, the intact one did not
    assert sum("unreadable journal file" in m for m in msgs) == 5
    assert not list(j.glob(".tmp-*"))
    assert len(list(j.glob("*.corrupt"))) == 5  # kept aside for a post-mortem, never read again
    assert not list(j.glob("row-*.json"))


def test_corrupt_parquet_is_moved_aside(tmp_path, tiny):
    ref = _run(tiny, tmp_path / "ref.parquet")
    out = tmp_path / "o.parquet"
    _run(tiny, out)
    data = out.read_bytes()
    out.write_bytes(data[: len(data) // 3])  # truncated
    df = _run(tiny, out, resume=True)
    assert _signature(df) == _signature(ref)
    assert list(tmp_path.glob("o.parquet.corrupt-*"))


def test_foreign_parquet_is_not_touched(tmp_path, tiny):
    import pandas as pd

    out = tmp_path / "o.parquet"
    pd.DataFrame({"a": [1]}).to_parquet(out)
    with pytest.raises(ValueError, match="not a cpa sweep"):
        _run(tiny, out, resume=True)
    assert pd.read_parquet(out).a.tolist() == [1]


SLOW = """
import time
import torch
from cpa.sweep import ReferenceRunner

class Slow(ReferenceRunner):
    def time(self, state, built):
        time.sleep(0.12)
        return super().time(state, built)

def make(replays=None):
    torch.set_num_threads(1)
    return Slow(replays=replays or 1)
"""


def _done(out: Path) -> int:
    """Distinct finished rows on disk: the parquet's plus the journal's (they overlap while compacting)."""
    keys = set()
    if out.exists():
        try:
            t = pq.read_table(out, columns=list(S.KEY))
            keys |= set(zip(*(t[c].to_pylist() for c in S.KEY)))
        except Exception:
            pass
    j = out.with_name(out.name + ".journal")
    for p in (j.glob("row-*.json") if j.exists() else []):
        try:
            r = json.loads(p.read_bytes())["row"]
            keys.add((r["point_id"], r["tiling"], r["partition_size"]))
        except Exception:  # unlinked by the compaction meanwhile
            pass
    return len(keys)


def test_kill_9_mid_sweep_then_resume(tmp_path, tiny):
    (tmp_path / "slowmod.py").write_text(SLOW)
    out = tmp_path / "o.parquet"
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "cpa", "sweep", "--grid", str(tiny), "--out", str(out),
                             "--runner", "slowmod:make", "--replays", "1", "--no-progress"],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 90
        while _done(out) < 6 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.02)
        assert proc.poll() is None, f"sweep ended before the kill: {proc.stderr.read().decode()[-2000:]}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    killed_at = _done(out)
    assert 6 <= killed_at < TINY_ROWS
    if out.exists():  # whatever parquet is there is a complete, readable file
        S.read_results(out)
    ref = _run(tiny, tmp_path / "ref.parquet")
    again = _Counting(replays=1)
    df = _run(tiny, out, runner=again, resume=True)
    assert _signature(df) == _signature(ref)
    assert len(again.built) <= TINY_ROWS - killed_at + 1  # at most the row in flight is lost


# ======================================================================================== CLI
def test_cli_sweep_cpu(tmp_path, tiny):
    out = tmp_path / "c.parquet"
    args = ["sweep", "--grid", str(tiny), "--out", str(out), "--runner", "cpu", "--replays", "1", "--no-progress",
            "--tilings", "scalar", "--partition-sizes", "64,256"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "peer sdpa skipped" in res.output and "best_us" in res.output
    assert "14 rows of grid tiny" in res.output
    again = CliRunner().invoke(app, args)
    assert again.exit_code != 0  # exists: needs --resume or --overwrite
    res = CliRunner().invoke(app, args + ["--resume"])
    assert res.exit_code == 0 and "0 to run" in res.output


def test_cli_sweep_dry_run():
    res = CliRunner().invoke(app, ["sweep", "--grid", "llama70b-decode", "--out", "unused.parquet", "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "56 points x 24 variants = 1344 rows" in res.output
    assert not Path("unused.parquet").exists()


# ======================================================================================== GPU
@pytest.mark.gpu
def test_cuda_runner_small_sweep(tmp_path):
    """The real runner end to end: one bench variant (usually prebuilt), two points, the peers that import."""
    g = S.parse_grid({"name": "gpu-small", "defaults": dict(num_heads=64, num_kv_heads=8, head_size=128,
                                                            block_size=16, max_seq_len=1000),
                      "axes": {"num_seqs": [4]}, "points": [{"num_seqs": 3, "seq_lens": [17, 2000, 700]}],
                      "variants": {"tilings": ["mfma16"], "partition_sizes": [256]}}, "test")
    df = S.run_sweep(g, tmp_path / "g.parquet", runner=S.CudaRunner(replays=5), progress=False, echo=_quiet)
    cpa_rows = df[df.tiling == "mfma16"]
    assert len(cpa_rows) == 2 and cpa_rows.verified.all(), cpa_rows[["point_id", "error", "max_rel_err"]]
    assert (cpa_rows.time_us > 0).all() and (cpa_rows.frac_peak_bw > 0).all()
    assert (cpa_rows.n_sets >= 1).all() and (cpa_rows.reduce_time_us > 0).all()
    peers = df[df.tiling != "mfma16"]
    ran = peers[peers.error.isna()]
    assert ran.verified.all(), ran[["tiling", "point_id", "max_rel_err", "note"]]
    assert ran[ran.tiling == "sdpa"].backend.notna().all()


# ------------------------------------------------------------ the sweep audit (resume, grid values)
class _OtherGPU(S.ReferenceRunner):
    name = "fake-gpu"

    def begin(self) -> dict:
        return {**super().begin(), "arch": "sm_90"}


def test_resume_refuses_rows_of_another_runner_or_seed(tmp_path, tiny):
    """A resume adds rows only to a table of the same runner, GPU model, arch and input seeds
    (it mixed a CPU run's rows with a GPU run's, ranked side by side); --allow-mixed opts in."""
    out = tmp_path / "o.parquet"
    with pytest.raises(_Crash):
        _run(tiny, out, runner=_CrashAfter(6, replays=1))
    counting = _Counting(replays=1)
    with pytest.raises(ValueError, match="runner 'cpu-reference', this run's is 'fake-gpu'"):
        _run(tiny, out, runner=type("C", (_OtherGPU, _Counting), {})(replays=1), resume=True)
    assert len(S.ResultStore(out).compact()) == 6
    reseeded = tmp_path / "reseeded.yaml"
    reseeded.write_text(TINY.replace("seed: 3\n", "seed: 4\n", 1))
    with pytest.raises(ValueError, match="other input seeds"):
        _run(reseeded, out, runner=counting, resume=True)
    assert counting.built == [] and len(S.ResultStore(out).compact()) == 6
    df = _run(tiny, out, runner=_OtherGPU(replays=1), resume=True, allow_mixed=True)
    assert len(df) == TINY_ROWS and set(df.runner) == {"cpu-reference", "fake-gpu"}
    # the same runner resumes as before
    out2 = tmp_path / "p.parquet"
    with pytest.raises(_Crash):
        _run(tiny, out2, runner=_CrashAfter(6, replays=1))
    assert len(_run(tiny, out2, resume=True)) == TINY_ROWS


def test_resume_conflicts_by_hand():
    import pandas as pd

    rows = pd.DataFrame({"runner": ["cuda"], "device_name": ["NVIDIA H200"], "arch": ["sm_90"],
                         "point_id": ["p1"], "seed": [5]})
    assert S.resume_conflicts(rows, runner="cuda", device_name="NVIDIA H200", arch="sm_90", seeds={"p1": 5}) == ""
    assert "device_name 'NVIDIA H200'" in S.resume_conflicts(rows, device_name="NVIDIA H100 80GB HBM3")
    assert "arch" in S.resume_conflicts(rows, arch="sm_100")
    assert "['p1']" in S.resume_conflicts(rows, seeds={"p1": 6})
    assert S.resume_conflicts(rows, seeds={"p2": 6}) == ""  # (a point the table lacks)
    assert S.resume_conflicts(rows.iloc[:0], runner="x") == ""


@pytest.mark.parametrize("fields,match", [
    ({"head_size": 72}, r"head_size: 72 is not a paged_attention head size"),
    ({"block_size": 24}, r"block_size: 24 is not a paged_attention block size"),
    ({"seq_lens": {"distribution": "lognormal", "median": float("inf"), "max": 100, "seed": 1}}, r"median: expected a finite"),
    ({"seq_lens": {"distribution": "lognormal", "median": 50, "sigma": float("nan"), "max": 100, "seed": 1}}, r"sigma: expected a finite"),
    ({"seq_lens": {"distribution": "lognormal", "median": True, "max": 100, "seed": 1}}, r"median: expected a finite"),
    ({"seq_lens": {"distribution": "uniform", "max": True, "seed": 1}}, r"must be integers"),
])
def test_grid_values_refused_at_parse_time(fields, match):
    """Values the op cannot run or that are not numbers: a ValueError naming the field when the
    grid is read (head / block sizes became failed rows after the GPU set-up; .inf and huge mu
    were OverflowError tracebacks)."""
    base = {"num_seqs": 2, "num_heads": 8, "num_kv_heads": 2, "head_size": 128, "block_size": 16, "max_seq_len": 64}
    f = {**base, **fields}
    if "seq_lens" in fields:
        f.pop("max_seq_len")
    with pytest.raises(ValueError, match=match):
        S.make_point(f)


def test_a_huge_lognormal_mu_draws_the_maximum():
    lens, _ = S.sample_seq_lens({"distribution": "lognormal", "mu": 1000, "max": 4096, "seed": 1}, 3)
    assert lens == (4096, 4096, 4096)


@pytest.mark.parametrize("replays", [0, -3, True])
def test_replays_must_be_positive(replays, tmp_path):
    with pytest.raises(ValueError, match="at least 1 replay"):
        S.make_runner("cpu", replays=replays)
    if isinstance(replays, bool):
        return  # (the CLI's option is an integer)
    res = CliRunner().invoke(app, ["sweep", "--grid", "llama70b-decode", "--out", str(tmp_path / "x.parquet"), "--runner", "cpu",
                                   "--replays", str(int(replays))])
    assert res.exit_code == 2 and "replay" in res.output


def test_lock_removes_a_killed_compactions_temporary_table(tmp_path):
    out = tmp_path / "o.parquet"
    stale = tmp_path / ".tmp-4242-o.parquet"
    stale.write_bytes(b"half a parquet")
    other = tmp_path / ".tmp-4242-other.parquet"
    other.write_bytes(b"not ours")
    store = S.ResultStore(out)
    store.lock()
    store.unlock()
    assert not stale.exists() and other.exists()


def test_cuda_runner_settles_each_points_first_timing(monkeypatch):
    """CudaRunner.time: the first timing of a point warms up for cpa.timing.SETTLE_US (a run's
    first timing reads up to 1.5% slow after a 20 ms warm-up, data/bench/README.md), every
    later one -- the same point's other variants and timings -- for the usual warm-up."""
    import types

    import cpa.timing
    from cpa import sweep as S

    seen = []

    def time_graph(calls, replays, warmup_us=None):
        seen.append(warmup_us)
        return cpa.timing.Timing(10.0, 9.0, 11.0, replays)

    monkeypatch.setattr(cpa.timing, "time_graph", time_graph)
    launch = types.SimpleNamespace(reduce_args=(), attention=lambda: None, reduce=lambda: None)
    launch.__call__ = lambda: None
    runner = S.CudaRunner(replays=3)
    states = [S.CudaPointState(None, None, None, 0.0, None, 3) for _ in range(2)]
    for state in states:
        for _ in range(2):  # two variants of the point
            row = runner.time(state, S.Built(("cpa", None, [launch])))
            assert row["time_us"] == 10.0 and row["reduce_time_us"] == 10.0
    settle = cpa.timing.SETTLE_US
    assert seen == [settle, None, None, None, None, None] * 2
