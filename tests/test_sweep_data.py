"""The shipped H200 sweeps (data/sweeps): every (point, variant) row of each named grid is
there, verified, with provenance and the ceilings of its run; the sm_90 default in
cpa.variants is the best single choice the llama70b-decode sweep measured. Last, the H100 run
of the llama70b-decode grid and what the shape rule does on it."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from cpa import bench as B
from cpa import occupancy as O
from cpa import sweep as S
from cpa import variants as V

DATA = Path(__file__).resolve().parent.parent / "data" / "sweeps"
GRIDS = ("llama70b-decode", "gqa-scan", "head-size-scan", "mixed-lengths", "kv-dtype-scan")
PEERS = ("sdpa", "flex", "flashinfer")
# the peers each shipped grid has a row of at every point (kv-dtype-scan ran without the
# FlashInfer wheel, and its fp8 points give SDPA and flex an `unsupported` row)
GRID_PEERS = {"kv-dtype-scan": ("sdpa", "flex")}


def rows_of_grid(name: str, peers) -> set:
    """The row keys a whole run of a named grid holds: every (point, variant) and one row per peer."""
    grid = S.load_grid(name)
    want = {S.row_key(p.point_id, v.tiling, v.partition_size) for p, v in grid.rows()}
    return want | {S.row_key(p.point_id, peer, 0) for p in grid.points for peer in peers}


def rows_of_table(df) -> set:
    return {S.row_key(a, b, c) for a, b, c in zip(df.point_id, df.tiling, df.partition_size)}


@pytest.fixture(scope="module", params=GRIDS)
def shipped(request):
    path = DATA / f"h200-{request.param}.parquet"
    if not path.exists():
        pytest.fail(f"{path} is missing: the H200 dataset ships with the repository")
    df, meta = S.read_results(path)
    return request.param, df, meta


def test_every_row_of_the_grid_is_there_and_verified(shipped):
    name, df, meta = shipped
    assert meta["schema_version"] == S.SCHEMA_VERSION
    assert rows_of_table(df) == rows_of_grid(name, GRID_PEERS.get(name, PEERS))
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


@pytest.mark.parametrize("name,max_geomean,max_worst", [
    ("llama70b-decode", 1.01, 1.15), ("kv-dtype-scan", 1.01, 1.05), ("head-size-scan", 1.01, 1.05),
    ("gqa-scan", 1.01, 1.05), ("mixed-lengths", 1.01, 1.05)])
def test_sm90_default_partition_by_shape_on_the_sweeps(name, max_geomean, max_worst):
    """The sm_90 default's shape-chosen partition size against each sweep's per-shape best
    (any tiling and partition), and against the best fixed (tiling, partition) of the sweep."""
    df, _ = S.read_results(DATA / f"h200-{name}.parquet")
    t = B.by_shape_choice(df)
    assert t.time_us.notna().all() and len(t) >= 5
    g = B.geomean(t.slowdown)
    assert g <= max_geomean and t.slowdown.max() <= max_worst, (name, g, t.sort_values("slowdown").tail(3))
    tiling, partition, source = V.default_choice("sm_90", 8)
    if name == "llama70b-decode":
        choice, _ = B.best_fixed_choice(df[df.tiling.isin(V.TILINGS)])
        assert g < choice["geomean_slowdown"]
        assert f"{g:.3f}x" in source and f"{choice['geomean_slowdown']:.3f}x" in source


def test_sm90_shape_choice_does_not_hang_on_the_fitted_constant(monkeypatch):
    """The partition sizes the model picks over every shipped shape are the same from 1.5 us to
    about twice the fitted per-wave cost (the claim of cpa.variants.SHAPE_MODELS), while a
    per-wave cost far above any stream time picks a size with the fewest waves (those of the
    largest candidate)."""
    frames = [S.read_results(DATA / f"h200-{n}.parquet")[0] for n in
              ("llama70b-decode", "kv-dtype-scan", "head-size-scan", "gqa-scan", "mixed-lengths")]
    base = dict(V.SHAPE_MODELS["sm_90"])
    picks = {}
    for t_wave in (base["t_wave_us"], 1.5, 3.0, 1e6):
        monkeypatch.setitem(V.SHAPE_MODELS, "sm_90", dict(base, t_wave_us=t_wave))
        picks[t_wave] = [B.by_shape_choice(f) for f in frames]
    chosen = {k: [list(t.partition_size) for t in v] for k, v in picks.items()}
    assert chosen[1.5] == chosen[base["t_wave_us"]] == chosen[3.0]
    for t in picks[1e6]:
        slots = t.resident_per_sm * 132
        waves = -(-t.workgroups // slots)
        largest = pd.Series([max(c) for c in t.candidates], index=t.index)
        fewest = -(-(t.num_seqs * t.num_kv_heads * -(-t.max_seq_len // largest)) // slots)
        assert (waves == fewest).all()
    assert chosen[1e6] != chosen[base["t_wave_us"]]


def test_merged_peer_rows_are_marked_and_the_runs_apart_quoted():
    """Notebook 01: the FlashInfer rows of the shipped llama70b sweep come from the e7697f4 run, in
    which SDPA ran a median 1.3% slower (0.96-1.07x) than in the CPA rows' run; speedups() marks
    such rows (<peer>_same_run False) and the heatmap says "other run"."""
    import pandas as pd

    from cpa import analysis as A

    d = A.sweep_results("llama70b-decode", mode="shipped").df
    sp = A.speedups(d)
    assert (sp.flashinfer_same_run == False).all()  # noqa: E712
    assert bool(sp.sdpa_same_run.dropna().all()) and bool(sp.flex_same_run.dropna().all())
    root = Path(__file__).resolve().parents[1]
    old = pd.read_parquet(root / "data" / "sweeps" / "experiments" / "h200-llama70b-decode-e7697f4.parquet")
    fi_runs = set(d[d.tiling == "flashinfer"].run_id)
    s_now = d[(d.tiling == "sdpa") & d.verified].set_index("point_id").time_us
    s_then = old[(old.tiling == "sdpa") & old.verified & old.run_id.isin(fi_runs)].set_index("point_id").time_us
    r = (s_then / s_now).dropna()
    assert len(r) >= 50 and round(float(r.median()), 3) == 1.013 and 0.96 < r.min() and r.max() < 1.075
    text = (root / "notebooks" / "01_partition_sweep.py").read_text()
    assert "median 1.3% slower (0.96-1.07x)" in text


def test_the_merged_flex_rows_of_mixed_lengths_are_another_set_up():
    """data/sweeps/README.md: 3 flex rows of the mixed-lengths table were merged from fb24390 and
    compiled without dynamic=False: 12.6-13.7x the best CPA time against 2.6-6.3x; marked other-run."""
    from cpa import analysis as A

    d = pd.read_parquet(Path(__file__).resolve().parents[1] / "data" / "sweeps" / "h200-mixed-lengths.parquet")
    sp = A.speedups(d)
    other = sp[sp.flex_same_run == False]  # noqa: E712
    same = sp[sp.flex_same_run == True]  # noqa: E712
    assert len(other) == 3 and other.vs_flex.between(12.6, 13.7).all() and same.vs_flex.between(2.6, 6.3).all()
    flex = d[d.tiling == "flex"]
    assert (~flex[flex.run_id.isin(set(d[d.tiling == "flex"].run_id) - set(d[d.tiling == "mfma16"].run_id))]
            .note.str.contains("dynamic=False")).all()


# ------------------------------------------------------------------ the same grid on an H100
H100_SWEEP = DATA / "experiments" / "h100-llama70b-decode-c7e79b8.parquet"


def test_the_h100_sweep_is_whole_but_for_two_points_that_do_not_fit():
    """data/sweeps/README.md: the llama70b-decode grid on an H100 at c7e79b8; every row of 54
    shapes there and every CPA row of them verified; the two largest points (256 x 16k, 32k)
    failed their set-up out of memory (80 GB), each of their rows saying so; provenance is the
    H100's, its ceilings file lists the run."""
    from cpa import analysis as A

    df, meta = S.read_results(H100_SWEEP)
    assert rows_of_table(df) == rows_of_grid("llama70b-decode", ("sdpa", "flex"))
    assert len(df) == 1456 and int(df.verified.sum()) == 1400
    big = (df.num_seqs == 256) & df.max_seq_len.isin([16384, 32768])
    assert not df[big].verified.any() and df[big].error.str.contains("OutOfMemoryError").all()
    cpa_rows = df.tiling.isin(V.TILINGS) & ~big
    assert df[cpa_rows].verified.all() and int(cpa_rows.sum()) == 54 * 24
    assert (df.device_name == "NVIDIA H100 80GB HBM3").all() and (df.driver_version == "580.159.04").all()
    assert (df.git_commit == "c7e79b8ecbe45c46faee15d20eba22af8bd97c94").all()
    assert (df.torch_version == "2.11.0+cu130").all() and df.command.str.contains("--grid llama70b-decode").all()
    doc = json.loads((DATA / "experiments" / "h100-ceilings-c7e79b8.json").read_text())
    (run,) = doc["runs"]
    assert set(df.run_id) == {run["run_id"]} and run["device_name"] == "NVIDIA H100 80GB HBM3"
    assert (df.read_gbps_ceiling == run["read_gbps"]).all() and 3000 < run["read_gbps"] < 3500
    assert A.shipped_sweep_on("llama70b-decode", "h100").path == H100_SWEEP


@pytest.mark.parametrize("name, point_rows, failed_before", [("llama70b-decode", 52, 52), ("mixed-lengths", 17, 11)])
def test_the_points_that_did_not_fit_on_80_gb_measured_since(name, point_rows, failed_before):
    """data/sweeps/README.md: the points of the H100 tables that had failed out of memory (256 x
    16k / 32k; mixed-lengths' 256 x sigma 1.5), re-measured at df60a7d on another H100 (read
    ceiling 3145 against 3225 GB/s) and kept apart from those tables: every CPA and SDPA row
    verified, flex `unsupported` (>= 2^31-element K/V); the best CPA launch 0.979x / 0.980x of
    SDPA at 256 x 16k / 32k, 96.3% / 96.6% of its run's read ceiling; the mixed point 10.39x."""
    from cpa import analysis as A

    whole = A.shipped_sweep_on(name, "h100").df
    part, meta = S.read_results(DATA / "experiments" / f"h100-{name}-s256-df60a7d.parquet")
    assert len(part) == point_rows and len(meta["runs"]) == 1
    # exactly the rows that failed in the whole table, now all measured
    at_points = whole[whole.point_id.isin(part.point_id)]
    failed = at_points[at_points.error.notna() & ~at_points.error.fillna("").str.startswith("unsupported")]
    assert len(failed) == failed_before and rows_of_table(part) == rows_of_table(at_points)
    ran = part[part.tiling != "flex"]
    assert ran.verified.all() and (part[part.tiling == "flex"].error.str.startswith("unsupported: flex_attention")).all()
    assert (part.git_commit == "df60a7d74ee19d70fd32f817d1e7430c2bfdcce1").all()
    assert (part.device_name == "NVIDIA H100 80GB HBM3").all() and (part.torch_version == "2.11.0+cu130").all()
    doc = json.loads((DATA / "experiments" / "h100-ceilings-df60a7d.json").read_text())
    run = {r["run_id"]: r for r in doc["runs"]}[meta["runs"][0]["run_id"]]
    assert run["grid"] == name and (part.read_gbps_ceiling == run["read_gbps"]).all()
    assert 3144 <= run["read_gbps"] < 3145 and round(whole.read_gbps_ceiling.median()) in (3225, 3226)
    v = A.speedups(part).sort_values("max_seq_len").vs_sdpa
    if name == "llama70b-decode":
        assert v.round(3).tolist() == [0.979, 0.98]
        best = part[part.tiling.isin(V.TILINGS)].groupby("max_seq_len").frac_peak_bw.max().round(3)
        assert best.tolist() == [0.963, 0.966]
    else:
        assert v.round(2).tolist() == [10.39]


def test_the_shape_rule_carries_to_the_h100():
    """Notebook 02, "Does the model carry to another card?": on the H100 sweep the shipped sm_90
    model (the H200's constants) is 1.011x the per-shape best (worst 1.17x at 4 x 2k), the
    model refitted to the H100 1.010x with the same picks at 52 of 54 shapes, the best fixed
    size (512) 1.081x (worst 1.62x); the refit's constants are about 1 us per wave and about 4
    us each for the reduce and the launch; any per-wave cost from 0.5 to 3 us, at either card's
    bandwidth, picks the same sizes."""
    df, _ = S.read_results(H100_SWEEP)
    t = B.model_transfer(df).set_index("rule")
    shipped, refit = t.loc["shape-chosen, shipped model"], t.loc["shape-chosen, refitted model"]
    fixed = t.loc["fixed mfma16 / 512"]
    assert round(shipped.geomean_slowdown, 3) == 1.011 and round(shipped.worst_slowdown, 2) == 1.17
    assert shipped.worst_shape == "4 x 2048" and shipped.same_picks == shipped.shapes == 54
    assert round(refit.geomean_slowdown, 3) == 1.010 and refit.same_picks == 52
    assert round(fixed.geomean_slowdown, 3) == 1.081 and round(fixed.worst_slowdown, 2) == 1.62
    assert fixed.fixed_partition_size == 512 and t.fixed_partition_size.isna().sum() == 2
    assert 0.9 < refit.t_wave_us < 1.1 and 3.5 < refit.t_reduce_us < 4.5 and 3.0 < refit.t_launch_us < 4.0
    assert refit.t_wave_us < shipped.t_wave_us
    base = B.by_shape_choice(df).partition_size.tolist()
    for t_wave in (0.5, 3.0):
        for gbps in (3225.4, 4605.0):
            m = O.WaveModel(gbps * 1e9, t_wave, 0.0, 0.0, "test")
            assert B.by_shape_choice(df, model=m).partition_size.tolist() == base, (t_wave, gbps)
    text = (Path(__file__).resolve().parents[1] / "notebooks" / "02_occupancy.py").read_text()
    for quoted in ("all\n# but two shapes", "within about 1%", "against 8%", "from 0.5 to 3 us", "4 x 2k"):
        assert quoted in text, quoted


def test_refit_shape_model_reproduces_the_shipped_constants():
    """cpa.variants.SHAPE_MODELS["sm_90"] is the refit of the shipped H200 sweep (rounded), and a
    table that mixes head sizes is refused rather than fitted as one."""
    df, _ = S.read_results(DATA / "h200-llama70b-decode.parquet")
    m, fitted = B.refit_shape_model(df)
    assert round(m.t_wave_us, 2) == V.SHAPE_MODELS["sm_90"]["t_wave_us"]
    assert round(m.bw_bytes_per_s / 1e9) == round(V.SHAPE_MODELS["sm_90"]["read_gbps"])
    assert len(fitted) == 56 * 8 and fitted.model_us.notna().all()
    mixed, _ = S.read_results(DATA / "h200-head-size-scan.parquet")
    with pytest.raises(ValueError, match="mixes head sizes"):
        B.refit_shape_model(mixed)


H100_OTHER_GRIDS = ("gqa-scan", "head-size-scan", "mixed-lengths", "kv-dtype-scan")


@pytest.mark.parametrize("name", H100_OTHER_GRIDS)
def test_the_other_grids_on_the_h100(name):
    """data/sweeps/README.md: the four other grids on the same H100 at a1f9c4d, every row there;
    every CPA row verified but those of mixed-lengths' 256 x sigma 1.5 point at partitions
    64-256 (their partial buffers, sized by a 32k maximum, did not fit 80 GB), which say so;
    the shipped shape rule within 0.6% of each grid's per-shape best (geometric mean), worst
    1.05x (head 256 at 16 x 2k), as notebook 02 says."""
    from cpa import analysis as A

    data = A.shipped_sweep_on(name, "h100")
    df = data.df
    assert data.path.name == f"h100-{name}-a1f9c4d.parquet"
    assert rows_of_table(df) == rows_of_grid(name, ("sdpa", "flex"))
    assert (df.device_name == "NVIDIA H100 80GB HBM3").all() and (df.driver_version == "580.159.04").all()
    assert (df.git_commit == "a1f9c4dcc556aeea10fbaac04448108b0b3e727e").all()
    assert df.command.str.contains(f"--grid {name} ").all()
    doc = json.loads((DATA / "experiments" / "h100-ceilings-a1f9c4d.json").read_text())
    by_id = {r["run_id"]: r for r in doc["runs"]}
    for run_id, g in df.groupby("run_id"):
        assert by_id[run_id]["grid"] == name and (g.read_gbps_ceiling == by_id[run_id]["read_gbps"]).all()
    cpa_rows = df[df.tiling.isin(V.TILINGS)]
    failed = cpa_rows[~cpa_rows.verified]
    if name == "mixed-lengths":
        assert set(failed.partition_size) == {64, 128, 256} and len(failed) == 9
        assert failed.point_id.str.startswith("s256-").all() and failed.point_id.str.contains("sigma=1.5").all()
        assert failed.error.str.contains("OutOfMemoryError").all()
    else:
        assert failed.empty
    t = B.by_shape_choice(df)
    assert t.time_us.notna().all()
    assert B.geomean(t.slowdown) <= 1.006 and t.slowdown.max() < 1.055
    if name == "head-size-scan":
        w = t.loc[t.slowdown.idxmax()]
        assert (int(w.head_size), int(w.num_seqs), int(w.max_seq_len)) == (256, 16, 2048)
        assert round(float(w.slowdown), 2) == 1.05
    text = (Path(__file__).resolve().parents[1] / "notebooks" / "02_occupancy.py").read_text()
    assert "within 0.6% of the H100's per-shape best" in text and "worst 1.05x, head 256 at 16 x 2k" in text


def test_the_readme_quotes_the_rule_on_the_h100():
    """README, "partition_size=None": the shape rule over the five H100 grids, in the order the
    H200 numbers are quoted (llama70b-decode, kv-dtype, head-size, GQA, mixed lengths)."""
    from cpa import analysis as A

    order = ("llama70b-decode", "kv-dtype-scan", "head-size-scan", "gqa-scan", "mixed-lengths")
    quoted = " / ".join(f"{B.geomean(B.by_shape_choice(A.shipped_sweep_on(g, 'h100').df).slowdown):.3f}x"
                        for g in order)
    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    assert f"the rule is {quoted} the H100's per-shape best" in readme, quoted
