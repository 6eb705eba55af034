"""The shipped H200 sweeps (data/sweeps): every (point, variant) row of each named grid is
there, verified, with provenance and the ceilings of its run; the sm_90 default in
cpa.variants is the best single choice the llama70b-decode sweep measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cpa import bench as B
from cpa import sweep as S
from cpa import variants as V

DATA = Path(__file__).resolve().parent.parent / "data" / "sweeps"
GRIDS = ("llama70b-decode", "gqa-scan", "head-size-scan", "mixed-lengths", "kv-dtype-scan")
PEERS = ("sdpa", "flex", "flashinfer")
# the peers each shipped grid has a row of at every point (kv-dtype-scan ran without the
# FlashInfer wheel, and its fp8 points give SDPA and flex an `unsupported` row)
GRID_PEERS = {"kv-dtype-scan": ("sdpa", "flex")}


@pytest.fixture(scope="module", params=GRIDS)
def shipped(request):
    path = DATA / f"h200-{request.param}.parquet"
    if not path.exists():
        pytest.fail(f"{path} is missing: the H200 dataset ships with the repository")
    df, meta = S.read_results(path)
    return request.param, df, meta


def test_every_row_of_the_grid_is_there_and_verified(shipped):
    name, df, meta = shipped
    grid = S.load_grid(name)
    assert meta["schema_version"] == S.SCHEMA_VERSION
    want = {S.row_key(p.point_id, v.tiling, v.partition_size) for p, v in grid.rows()}
    want |= {S.row_key(p.point_id, peer, 0) for p in grid.points for peer in GRID_PEERS.get(name, PEERS)}
    got = {S.row_key(a, b, c) for a, b, c in zip(df.point_id, df.tiling, df.partition_size)}
    assert got == want
    # every CPA row verified; a peer may fail (compile error, out of memory) but says why
    cpa_rows = ~df.tiling.isin(PEERS)
    assert df[cpa_rows].verified.all() and df[cpa_rows].error.isna().all()
    failed = df[~df.verified]
    assert failed.tiling.isin(PEERS).all() and failed.error.str.len().gt(0).all()
    assert (df.verified == df.error.isna()).all()
    ok = df[df.verified]
    supported = ~df.error.fillna("").str.startswith("unsupported")  # (a peer that cannot take fp8 K/V)
    assert len(ok) >= 0.99 * supported.sum()
    assert (ok.time_us_p25 <= ok.time_us).all() and (ok.time_us <= ok.time_us_p75).all()
    assert ((ok.frac_peak_bw > 0) & (ok.frac_peak_bw < 1.05)).all()
    assert set(S.REQUIRED_COLUMNS) <= set(df.columns)


def test_provenance_and_ceilings(shipped):
    name, df, meta = shipped
    assert (df.device_name == "NVIDIA H200").all()
    assert df.git_commit.str.fullmatch(r"[0-9a-f]{40}").all()
    runs = {r["run_id"]: r for r in meta["runs"]}
    assert set(df.run_id) <= set(runs)
    doc = json.loads((DATA / "h200-ceilings.json").read_text())
    by_id = {r["run_id"]: r for r in doc["runs"]}
    for run_id, g in df.groupby("run_id"):
        c = by_id[run_id]  # the ceilings file lists the run that measured these rows
        assert c["grid"] == name and c["device_name"] == "NVIDIA H200"
        assert (g.read_gbps_ceiling == c["read_gbps"]).all() and (g.copy_gbps_ceiling == c["copy_gbps"]).all()
        assert 3000 < c["read_gbps"] < 5500 and 3000 < c["copy_gbps"] < 5500


# Two fixed choices whose geometric-mean slowdowns differ by less than this are a tie: the
# same rows measured twice on the H200 differ by up to ~0.5% (notes/kernel-notes.md).
TIE = 1.005


def test_sm90_default_is_the_best_single_choice_of_the_sweep():
    """The sm_90 default is the sweep's best single (tiling, partition), or ties with it."""
    df, _ = S.read_results(DATA / "h200-llama70b-decode.parquet")
    choice, table = B.best_fixed_choice(df[df.tiling.isin(V.TILINGS)])
    tiling, partition, source = V.default_choice("sm_90", 8)
    mine = table[(table.tiling == tiling) & (table.partition_size == partition) & ~table.fused_reduce.astype(bool)]
    assert len(mine) == 1
    assert mine.geomean_slowdown.iloc[0] <= choice["geomean_slowdown"] * TIE, (tiling, partition, choice)
    assert "measured" in source and "h200-llama70b-decode" in source
