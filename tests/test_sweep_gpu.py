"""cpa.sweep's CudaRunner on the GPU: the CPA kernel and the peers as rows of one table,
verified against the reference and timed by graph replay; a resumed run adds nothing."""

from __future__ import annotations

import math

import pytest

from cpa import sweep as S

pytestmark = pytest.mark.gpu

GRID = """
name: gpu-smoke
seed: 5
defaults: {num_heads: 16, num_kv_heads: 2, head_size: 128, block_size: 16, dtype: fp16}
points:
  - {num_seqs: 2, max_seq_len: 1500}
  - {num_seqs: 3, seq_lens: [17, 700, 2100]}
  - {num_seqs: 2, max_seq_len: 900, kv_cache_dtype: fp8, dtype: bf16}
variants: {tilings: all, partition_sizes: [64, 256, 1024]}
"""


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    d = tmp_path_factory.mktemp("sweep")
    g = d / "g.yaml"
    g.write_text(GRID)
    out = d / "r.parquet"
    runner = S.CudaRunner(replays=5)
    df = S.run_sweep(str(g), out, runner=runner, progress=False, echo=print, ceilings_json=d / "ceil.json")
    return df, out, g, d


def test_every_cpa_row_is_verified_or_unsupported(table):
    df, *_ = table
    grid = S.load_grid(table[2])
    cpa = df[df.tiling.isin(grid.tilings)]
    assert len(cpa) == len(grid.rows())
    unsupported = cpa.error.fillna("").str.startswith(S.UNSUPPORTED)
    ran = cpa[~unsupported]
    assert len(ran) >= len(cpa) - 3 * 3  # at most the 64-token partitions of one tiling per point
    assert ran.error.isna().all(), ran[ran.error.notna()][["point_id", "tiling", "partition_size", "error"]]
    assert ran.verified.all()
    assert (ran.max_rel_err < 1e-2).all()
    for col in ("time_us", "time_us_p25", "time_us_p75", "attn_time_us"):
        assert (ran[col] > 0).all(), col
    assert (ran.time_us_p25 <= ran.time_us).all() and (ran.time_us <= ran.time_us_p75).all()
    multi = ran.num_partitions > 1
    assert (ran[multi].reduce_time_us > 0).all() and (ran[~multi].reduce_time_us == 0).all()
    assert (ran.frac_peak_bw > 0).all() and (ran.frac_peak_bw < 1.5).all()
    assert ran.build_from_cache.notna().all()


def test_peers_are_rows_of_the_same_table(table):
    df, *_ = table
    sdpa = df[df.tiling == "sdpa"]
    assert len(sdpa) == 3
    fp16 = sdpa[sdpa.kv_cache_dtype == "auto"]
    assert fp16.verified.all() and (fp16.time_us > 0).all(), fp16[["point_id", "error", "backend"]]
    assert sdpa[sdpa.kv_cache_dtype == "fp8"].error.str.startswith(S.UNSUPPORTED).all()
    for name in ("flex", "flashinfer"):
        rows = df[df.tiling == name]
        if not len(rows):  # skipped peers leave no rows (and a printed reason)
            continue
        ok = rows[rows.kv_cache_dtype == "auto"]
        assert ok.verified.all() and (ok.time_us > 0).all(), ok[["point_id", "error", "note"]]
        assert (rows.partition_size == 0).all()


def test_ceilings_and_provenance_recorded(table):
    import json

    df, out, _, d = table
    doc = json.loads((d / "ceil.json").read_text())
    (run,) = doc["runs"]
    assert run["read_gbps"] > 100 and run["copy_gbps"] > 100
    assert (df.read_gbps_ceiling == run["read_gbps"]).all()
    for col in ("device_name", "driver_version", "torch_version", "git_commit", "timestamp"):
        assert df[col].notna().all() and (df[col].astype(str) != "").all(), col
    ok = df[df.verified]
    assert ok.apply(lambda r: math.isclose(r.gbps, r.kv_bytes / r.time_us / 1e3, rel_tol=1e-9), axis=1).all()


def test_resume_adds_nothing(table):
    df, out, g, _ = table
    again = S.run_sweep(str(g), out, runner=S.CudaRunner(replays=5), resume=True, progress=False, echo=print)
    assert len(again) == len(df)
    assert sorted(again.run_id.unique()) == sorted(df.run_id.unique())


def test_rows_say_what_they_were_timed_on(table):
    """Small points rotate make_sets' sets; a point whose inputs cover the 1 GiB pool and whose
    pool would hold one set is timed on its inputs, the row says which (column timing_inputs),
    and both ways verify."""
    import gc

    import torch

    df, *_ = table
    timed = df[df.time_us.notna()]
    assert (timed.timing_inputs == "sets").all()
    runner = S.CudaRunner(replays=3)  # (no begin: the ceilings are not needed for one row)
    big = S.make_point(dict(num_seqs=32, max_seq_len=8192, num_heads=64, num_kv_heads=8, head_size=128,
                            block_size=16))
    state = runner.open_point(big, seed=7)
    try:
        assert state.timing_inputs == "inputs" and state.sets.key_cache is state.inputs.key_cache
        res = S._run_row(runner, state, S.RowVariant("mfma16", 512))
        assert res.get("error") is None and res["verified"] and res["timing_inputs"] == "inputs"
    finally:
        runner.close_point(state)
        del state
        gc.collect()
        torch.cuda.empty_cache()
