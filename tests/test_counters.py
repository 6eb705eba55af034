"""cpa.counters on the shipped H200 counter table (data/counters/h200-llama70b.parquet): the
rows and their provenance, the join to the sweep, the bandwidth / bytes / occupancy checks
against hand computations, the figures of notebook 03, and sweep.merge_results."""

from __future__ import annotations

import math
import subprocess
import sys

import pandas as pd
import pytest

from cpa import analysis as A
from cpa import counters as C
from cpa import hardware as hw
from cpa import occupancy as O
from cpa import sweep as S
from cpa import variants as V

SHAPES = {(1, 32768), (4, 8192), (16, 2048), (32, 32768), (128, 2048), (256, 8192)}
TILINGS = {"mfma16", "mfma4", "scalar"}
PARTITIONS = list(V.PARTITION_SIZES)
NROWS = len(SHAPES) * len(TILINGS) * len(PARTITIONS)  # 6 x 3 x 8 = 144


@pytest.fixture(scope="module")
def counters():
    return C.load("llama70b-decode")


@pytest.fixture(scope="module")
def joined(counters):
    sweep = A.shipped_sweep_at("llama70b-decode", counters.df.git_commit.unique())
    return C.with_sweep(counters.df, sweep.df)


# ------------------------------------------------------------------------- the shipped table
def test_shipped_rows_columns_and_provenance(counters):
    df = counters.df
    assert counters.path == C.shipped_path("llama70b-decode") and counters.path.exists()
    assert len(df) == NROWS == 144
    missing = [c for c in (*C.KEYS, *C.METRICS, "point_id", "profiler", "counter_set", "device_name",
                           "driver_version", "torch_version", "git_commit", "timestamp", "command")
               if c not in df.columns]
    assert not missing, missing
    assert counters.metrics == list(C.METRICS)  # every portable metric of the `full` set was collected
    assert set(zip(df.num_seqs, df.max_seq_len)) == SHAPES
    assert set(df.tiling) == TILINGS and sorted(df.partition_size.unique()) == PARTITIONS
    assert not df.duplicated(list(C.KEYS)).any()
    assert df[list(C.METRICS)].notna().all().all()
    # provenance: measured on an H200 with ncu, at a recorded kernel commit
    assert df.device_name.str.contains("H200").all() and "H200" in counters.device
    assert (df.profiler == "ncu").all() and (df.counter_set == "full").all()
    assert df.git_commit.notna().all() and df.git_commit.str.fullmatch(r"[0-9a-f]{40}").all()
    assert df.command.str.contains("cpa profile --profiler ncu --counters full").all()
    b = counters.banner()
    assert "measured on NVIDIA H200" in b and f"{NROWS} (point, variant) rows" in b and "MI300" not in b


def test_with_sweep_joins_every_row(counters, joined):
    assert len(joined) == len(counters.df) == NROWS
    assert joined.attn_time_us.notna().all() and (joined.attn_time_us > 0).all()
    assert not joined.duplicated(list(C.KEYS)).any()
    # the join keeps the kernel's threads per block apart from the KV cache's block size
    assert (joined.block_size == 128).all() and (joined.kv_block_size == 16).all()
    for col in ("attention_bytes", "flops", "sweep_attn_gbps", "counter_dram_gbps", "bw_ratio", "time_ratio",
                "read_ratio", "arithmetic_intensity", "achieved_tflops", "shape"):
        assert joined[col].notna().all(), col
    assert set(joined["shape"]) == {f"b{b} ctx {c}" for b, c in SHAPES}


def test_counter_bandwidth_agrees_with_the_sweep_at_long_contexts(joined):
    long = joined[joined.max_seq_len >= 8192]
    assert len(long) == 4 * len(TILINGS) * len(PARTITIONS)
    assert long.bw_ratio.between(0.9, 1.1).all(), long.bw_ratio.describe()
    # what the H200 data says (README): 0.924 .. 1.033 at every shape
    assert joined.bw_ratio.min() == pytest.approx(0.924, abs=0.002)
    assert joined.bw_ratio.max() == pytest.approx(1.033, abs=0.002)
    r = joined.iloc[0]
    assert r.counter_dram_gbps == pytest.approx((r.dram_read_bytes + r.dram_write_bytes) / r.duration_ns, rel=1e-6)
    agree = C.bandwidth_agreement(joined)
    assert len(agree) == 6 and agree.rows.sum() == NROWS
    assert set(zip(agree[agree.long_context].num_seqs, agree[agree.long_context].max_seq_len)) == \
        {(1, 32768), (4, 8192), (32, 32768), (256, 8192)}
    assert agree.within_10pct.all()


def test_dram_reads_match_the_modeled_bytes(joined):
    # every K/V byte read from DRAM once: 1.000 .. 1.009 of what the kernel must read
    assert joined.read_ratio.between(1.0, 1.01).all(), joined.read_ratio.describe()
    assert (joined.arithmetic_intensity > 7.0).all() and (joined.arithmetic_intensity < 8.0).all()


# ----------------------------------------------------------------- bytes and flops by hand
def _row(**kw):
    r = dict(dtype="fp16", kv_cache_dtype="auto", num_seqs=2, mean_seq_len=300.0, max_seq_len=300,
             num_heads=8, num_kv_heads=2, head_size=64, partition_size=128)
    r.update(kw)
    return pd.Series(r)


def test_attention_bytes_by_hand():
    kv = 2 * (2 * 300) * 2 * 64 * 2  # K and V x tokens x KV heads x head size x fp16
    q = 2 * 8 * 64 * 2
    # 3 partitions of 128: partials written as fp32 (out + max logit + exp sum) per partition
    partials = 2 * 8 * 3 * (64 + 2) * 4
    assert kv == 307200 and q == 2048 and partials == 12672
    assert C.attention_bytes(_row()) == kv + q + partials == 321920
    # one partition: out is written directly (as large as q)
    assert C.attention_bytes(_row(partition_size=512)) == kv + 2 * q == 311296
    # fp8 KV cache: one byte per K/V element
    assert C.attention_bytes(_row(partition_size=512, kv_cache_dtype="fp8")) == kv // 2 + 2 * q
    assert C.attention_bytes(_row(dtype="bf16")) == C.attention_bytes(_row())
    with pytest.raises(KeyError):
        C.attention_bytes(_row(dtype="fp32"))


def test_attention_flops_by_hand():
    # QK^T and PV: 2 x (2 flops per multiply-add) x heads x tokens x head size
    assert C.attention_flops(_row()) == 4 * 8 * 2 * 300 * 64 == 1228800
    assert C.attention_flops(_row(mean_seq_len=150.0)) == 614400


# ------------------------------------------------------------------------ occupancy by hand
def _static(variant: str, registers: int, shared_bytes: int = 8324, threads: int = 128):
    return pd.DataFrame([{"kernel": "attention", "variant": variant, "registers": registers,
                          "shared_bytes": shared_bytes, "threads_per_block": threads, "stack_bytes": 0,
                          "spills": 0}])


def _one(joined, tiling="mfma16", partition_size=1024, num_seqs=1, max_seq_len=32768):
    d = joined
    return d[(d.tiling == tiling) & (d.partition_size == partition_size) & (d.num_seqs == num_seqs) &
             (d.max_seq_len == max_seq_len)].reset_index(drop=True)


def test_theoretical_occupancy_by_hand(joined):
    one = _one(joined)
    name = "mfma16-p1024-h128-b16-fp16-kvauto-g8-cuda"
    # 210 registers -> 216 (8-register granule) x 32 lanes = 6912 per warp; 65536 / 6912 = 9 warps,
    # 2 blocks of 4 warps; 2 x 4 / 64 warp slots = 0.125
    t = C.theoretical_occupancy(one, static=_static(name, 210), spec=hw.H200)
    assert t.theoretical_occupancy.iloc[0] == pytest.approx(2 * 4 / 64) == 0.125
    assert t.slots.iloc[0] == 2 * 132
    # b1 x 32k at partition 1024: 1 x 32 partitions x 8 KV heads = 256 blocks < 264 slots
    assert one.grid_size.iloc[0] == 256
    assert t.grid_limited_occupancy.iloc[0] == pytest.approx(0.125 * 256 / 264)
    # 128 registers x 128 threads: 4096 per warp, 16 warps = 4 blocks -> 0.25
    t = C.theoretical_occupancy(one, static=_static(name, 128), spec=hw.H200)
    assert t.theoretical_occupancy.iloc[0] == pytest.approx(4 * 4 / 64)
    # a variant the static table does not know: NaN, not a guess
    t = C.theoretical_occupancy(one, static=_static("other-variant", 210), spec=hw.H200)
    assert math.isnan(t.theoretical_occupancy.iloc[0])


def test_shipped_occupancy_against_the_counters(joined):
    occ = C.theoretical_occupancy(joined)
    assert occ.theoretical_occupancy.notna().all()
    assert (occ.theoretical_occupancy == 0.125).all()
    # the compiled registers of the static table (cpa static, sm_90) are the ones ncu saw, but
    # for the one register the sequence clamp of 781cf90 added to the mma tilings (the counters
    # are of 0e2dc8d's kernels, the table of today's): the same register limit, 2 blocks per SM
    static = O.resource_table("sm_90", head_size=128).set_index("variant")
    names = [V.variant_for(tiling=r.tiling, partition_size=r.partition_size, head_size=128, block_size=16,
                           dtype="fp16", kv_cache_dtype="auto", gqa_ratio=8, platform="cuda").name
             for r in joined.itertuples()]
    moved = static.registers.loc[names].to_numpy() - joined.registers_per_thread.to_numpy()
    assert ((moved >= 0) & (moved <= 1)).all() and (static.blocks_per_sm.loc[names] == 2).all()
    assert (joined[joined.tiling == "scalar"].registers_per_thread == 255).all()
    assert (joined.occupancy_limit_registers == 2).all()
    assert (occ.achieved_occupancy <= occ.theoretical_occupancy).all()
    assert (occ.achieved_occupancy <= occ.grid_limited_occupancy + 1e-9).all()
    mma = occ[occ.tiling != "scalar"]
    # grids of at most one workgroup per SM (partition >= 2048 at 1 x 32k, 4 x 8k and 16 x 2k):
    # one workgroup of 4 warps on each busy SM; the others hold two per SM
    one = mma.grid_limited_occupancy <= 4 / 64
    assert one.sum() == 18 and mma[one].achieved_occupancy.between(0.058, 0.0626).all()
    assert mma[~one].achieved_occupancy.between(0.110, 0.125).all()


# --------------------------------------------------------------------- where the file comes from
def test_counters_path_override(tmp_path, monkeypatch, counters):
    p = tmp_path / "live.parquet"
    counters.df.head(5).to_parquet(p, index=False)
    monkeypatch.setenv("CPA_COUNTERS_PATH", str(p))
    c = C.load("llama70b-decode")
    assert c.path == p and len(c.df) == 5
    assert "5 (point, variant) rows" in c.banner()
    # an explicit path wins over the environment
    assert len(C.load(path=C.shipped_path()).df) == NROWS


def test_missing_counter_file_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("CPA_COUNTERS_PATH", raising=False)
    with pytest.raises(FileNotFoundError, match=r"no counter table .*h200-llama70b\.parquet.*cpa profile"):
        C.load(path=tmp_path / "nope.parquet")
    with pytest.raises(FileNotFoundError, match="h200-no-such-grid.parquet: no counter table"):
        C.load("no-such-grid")
    monkeypatch.setenv("CPA_COUNTERS_PATH", str(tmp_path / "gone.parquet"))
    with pytest.raises(FileNotFoundError, match="gone.parquet"):
        C.load("llama70b-decode")


def test_counters_and_plots_import_no_notebook_packages():
    code = ("import sys, cpa.counters, cpa.plots; "
            "bad = [m for m in ('plotly', 'ipywidgets') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# -------------------------------------------------------------------------------- the figures
def _traces(fig):
    go = pytest.importorskip("plotly.graph_objects")
    assert isinstance(fig, go.Figure)
    assert len(fig.data) > 0
    return fig.data


def test_counter_figures(joined):
    pytest.importorskip("plotly")
    from cpa import plots as P

    data = _traces(P.counters_vs_partition(joined, "achieved_occupancy"))
    assert {t.name for t in data} == TILINGS and sum(len(t.x) for t in data) == NROWS
    data = _traces(P.counters_vs_partition(joined, "bw_ratio", tilings=["mfma16"], shapes=["b1 ctx 32768"]))
    assert len(data) == 1 and list(data[0].x) == PARTITIONS
    fig = P.bandwidth_agreement(joined)
    assert sum(len(t.x) for t in _traces(fig) if t.mode == "markers") == NROWS
    assert "H200" in fig.layout.title.text and "measured" in fig.layout.title.text
    fig = P.counter_roofline(joined, hw.H200, read_ceiling_gbps=4600.0)
    assert {t.name for t in _traces(fig) if t.mode == "markers"} == TILINGS
    assert "NVIDIA H200" in fig.layout.title.text
    occ = C.theoretical_occupancy(joined)
    fig = P.occupancy_achieved_vs_theoretical(occ)
    assert len(_traces(fig)) == 6 * 3 * 3  # shapes x tilings x (achieved, grid-limited, theoretical)
    assert "modeled" in fig.layout.title.text and "MI300" not in fig.layout.title.text


def test_counter_explorer(joined):
    pytest.importorskip("plotly")
    pytest.importorskip("ipywidgets")
    from cpa import plots as P

    ex = P.counter_explorer(joined, ["duration_ns", "bw_ratio"])
    assert {t.name for t in _traces(ex.figure)} == TILINGS
    ex.metric.value = "bw_ratio"  # the observer redraws (no display handle outside a kernel)
    assert "counter / sweep bandwidth" in ex.figure.layout.title.text
    ex.tilings.value = ("scalar",)
    assert [t.name for t in _traces(ex.figure)] == ["scalar"] * 6  # one trace per shape facet
    ex.shapes.value = ("b4 ctx 8192",)
    assert [t.name for t in _traces(ex.figure)] == ["scalar"]
    ex.shapes.value = ()  # nothing selected: the last figure stays
    assert [t.name for t in ex.figure.data] == ["scalar"]
    with pytest.raises(ValueError):
        P.counter_explorer(joined, [])


# -------------------------------------------------------------------------- sweep.merge_results
def _result_row(point: str, tiling: str, partition_size: int, time_us: float, run_id: str) -> dict:
    ints = {c: 1 for c, k in S.COLUMN_TYPES.items() if k == "int"}
    return {**ints, "point_id": point, "tiling": tiling, "partition_size": partition_size, "time_us": time_us,
            "verified": True, "run_id": run_id, "device_name": "NVIDIA H200", "dtype": "fp16",
            "kv_cache_dtype": "auto", "git_commit": run_id}


def _write_results(path, rows, runs):
    store = S.ResultStore(path)
    for r in rows:
        store.append(r)
    for r in runs:
        store.add_run({"run_id": r, "grid": "tiny"})
    store.compact()
    return path


def test_merge_results(tmp_path):
    into = _write_results(tmp_path / "into.parquet", [
        _result_row("p0", "mfma16", 256, 10.0, "run-a"),
        _result_row("p0", "mfma16", 512, 11.0, "run-a"),
        _result_row("p1", "mfma16", 256, 12.0, "run-a"),
        _result_row("p1", "flashinfer", 0, 13.0, "run-a"),
    ], ["run-a"])
    source = _write_results(tmp_path / "source.parquet", [
        _result_row("p0", "mfma16", 256, 99.0, "run-b"),      # not a merged tiling
        _result_row("p0", "flashinfer", 0, 20.0, "run-b"),    # new: added
        _result_row("p1", "flashinfer", 0, 98.0, "run-b"),    # `into` has it: kept as it was
        _result_row("p0", "sdpa", 0, 21.0, "run-c"),          # not a merged tiling
    ], ["run-b", "run-c"])
    before, _ = S.read_results(into)

    assert S.merge_results(into, source, tilings=["flashinfer"]) == 1
    df, meta = S.read_results(into)
    assert len(df) == 5
    assert not df.duplicated(list(S.KEY)).any()
    key = lambda d: {(a, b, int(c)): t for a, b, c, t in zip(d.point_id, d.tiling, d.partition_size, d.time_us)}
    got = key(df)
    assert got == {**key(before), ("p0", "flashinfer", 0): 20.0}
    assert "sdpa" not in set(df.tiling)
    # schema kept: the same columns in the same order with the same types, and the metadata
    assert list(df.columns) == list(before.columns) == list(S.COLUMN_TYPES)
    assert (df.dtypes == before.dtypes).all()
    assert meta["schema_version"] == S.SCHEMA_VERSION
    assert {r["run_id"] for r in meta["runs"]} == {"run-a", "run-b"}  # run-c gave no row
    added = df[(df.point_id == "p0") & (df.tiling == "flashinfer")].iloc[0]
    assert added.run_id == "run-b" and added.git_commit == "run-b"  # each row keeps its own provenance

    # again: nothing left to add, the file is untouched
    mtime = into.stat().st_mtime_ns
    assert S.merge_results(into, source, tilings=["flashinfer"]) == 0
    assert into.stat().st_mtime_ns == mtime and len(S.read_results(into)[0]) == 5
    assert not list(tmp_path.glob(".tmp-*"))


def test_stall_table_reads_the_shipped_ncu_pages():
    """cpa.counters.stall_table over the H100 ncu pages of 72a477e (8 x 32k, P 4096): the
    longest kernel of each page; every target reads the same bytes, and the readers with 8 warps
    per program reach cuDNN's DRAM throughput where the kernel's loads alone do not."""
    import glob

    from cpa import counters as C

    paths = sorted(glob.glob(str(C.SHIPPED / "experiments" / "h100-stalls-*-72a477e.csv")))
    t = C.stall_table(paths).set_index("label")
    assert len(t) == 7
    assert ((t.dram_read_gb - 1.074).abs() < 0.001).all() and ((t.l2_read_sectors_m - 33.57).abs() < 0.05).all()
    sdpa = t[t.index.str.contains("sdpa")].iloc[0]
    assert "flash_fprop" in sdpa.kernel and sdpa.grid == 256  # the flash kernel, not its reduction
    kern, alone = t.loc["default_mfma16"], t.loc["DCPA_LOAD_ONLY_2_mfma16"]
    assert kern.registers > 200 and kern.grid == 512 and alone.time_us < kern.time_us
    assert kern.dram_throughput_pct < alone.dram_throughput_pct < sdpa.dram_throughput_pct
    wide = t.loc["default_reader_paged_2x8"]
    assert abs(wide.dram_throughput_pct - sdpa.dram_throughput_pct) < 0.2 and wide.warps_active_pct > 3 * kern.warps_active_pct
    assert t.loc["default_reader_paged_2x4"].dram_throughput_pct < alone.dram_throughput_pct
    assert "long_scoreboard" in kern.top_stalls


def test_read_ncu_raw_refuses_a_page_without_time(tmp_path):
    from cpa import counters as C

    f = tmp_path / "stalls-x.csv"
    f.write_text("==PROF== Connected\n\"ID\",\"Kernel Name\"\n\"\",\"\"\n\"0\",\"k\"\n")
    with pytest.raises(ValueError, match="not an ncu raw page"):
        C.read_ncu_raw(f)


def test_read_ncu_raw_takes_what_the_stalls_step_writes(tmp_path):
    """The stalls step redirects the program's output into the page (2>&1): a line it prints
    before the header, a page without the units row, units printed scaled, and "n/a" cells all
    read as ncu meant them -- the longest kernel chosen by its time in base units."""
    from cpa import counters as C

    head = '"ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum"\n'
    rows = '"0","paged_attention_kernel","341.6","1.074"\n"1","paged_attention_reduce_kernel","4.19","n/a"\n'
    f = tmp_path / "stalls-x.csv"
    f.write_text('==PROF== Connected\nstep 3/10, "warm"\n' + head + '"","","usecond","Gbyte"\n' + rows)
    r = C.read_ncu_raw(f)
    assert r["kernel"] == "paged_attention_kernel" and r["time_us"] == pytest.approx(341.6)
    assert r["dram_read_gb"] == pytest.approx(1.074)
    f.write_text(head + rows.replace('"341.6"', '"341600"').replace('"4.19"', '"4190"'))  # no units row:
    r = C.read_ncu_raw(f)  # the first launch is data, not units (it was dropped as units before)
    assert r["kernel"] == "paged_attention_kernel" and r["time_us"] == pytest.approx(341.6)
    f.write_text(head + '"0","k","n/a","1"\n')
    with pytest.raises(ValueError, match="stalls-x.csv: not an ncu raw page"):
        C.read_ncu_raw(f)


def test_stall_table_at_8x128k_reader_shape_matters():
    """The 8 x 128k pages of 39c06c6: the same DRAM bytes everywhere; a paged reader with 8
    warps per program is faster than the kernel and one with 4 slower, cuDNN fastest."""
    import glob

    from cpa import counters as C

    t = C.stall_table(sorted(glob.glob(str(C.SHIPPED / "experiments" / "h100-stalls-*-39c06c6.csv")))).set_index("label")
    assert len(t) == 5 and ((t.dram_read_gb - 4.296).abs() < 0.002).all()
    kern = t.loc["default_mfma16"]
    assert t.loc["default_reader_paged_4x8"].time_us < kern.time_us < t.loc["default_reader_paged_4x4"].time_us
    assert t.loc["default_sdpa_cudnn"].time_us == t.time_us.min()
    assert abs(t.loc["DCPA_LOAD_ONLY_2_mfma16"].time_us / kern.time_us - 1) < 0.005


def test_with_sweep_joins_mixed_length_points_by_point_id():
    """Two mixed-length points can share num_seqs, max_seq_len and every other key: the join uses
    the point id (it once gave both counter rows the first point's sweep row)."""
    import pandas as pd

    from cpa import counters as C

    keys = dict(tiling="mfma16", partition_size=256, num_seqs=2, max_seq_len=4000, num_heads=8, num_kv_heads=1,
                head_size=128, dtype="fp16", kv_cache_dtype="auto")
    sweep = pd.DataFrame([{**keys, "point_id": "a", "mean_seq_len": 2050.0, "attn_time_us": 10.0, "time_us": 12.0,
                           "verified": True, "error": None, "block_size": 16},
                          {**keys, "point_id": "b", "mean_seq_len": 4000.0, "attn_time_us": 20.0, "time_us": 22.0,
                           "verified": True, "error": None, "block_size": 16}])
    counters = pd.DataFrame([{**keys, "point_id": "b", "duration_ns": 20000.0},
                             {**keys, "point_id": "a", "duration_ns": 10000.0}])
    j = C.with_sweep(counters, sweep).set_index("point_id")
    assert j.loc["a", "mean_seq_len"] == 2050.0 and j.loc["b", "mean_seq_len"] == 4000.0
    assert (j.time_ratio == 1.0).all()
    with pytest.raises(ValueError, match="share the keys"):
        C.with_sweep(counters, pd.concat([sweep, sweep.iloc[:1]]))


def test_shipped_counter_rows_profiled_as_cluster_launches():
    """data/counters/README.md names the rows the harness of 0e2dc8d profiled as cluster launches
    (cluster_reduce left at its default): where cluster_default picks the combine on the H200."""
    c = C.load()
    assert set(str(x)[:7] for x in c.df.git_commit) == {"0e2dc8d"}
    parts = -(-c.df.max_seq_len // c.df.partition_size)
    cluster = [V.cluster_default("sm_90", int(p), int(s), int(k), 132)
               for p, s, k in zip(parts, c.df.num_seqs, c.df.num_kv_heads)]
    got = c.df[cluster]
    assert len(got) == 9 and set(got.tiling) == {"mfma16", "mfma4", "scalar"}
    assert set(zip(got.num_seqs, got.max_seq_len, got.partition_size)) == {(1, 32768, 4096), (1, 32768, 8192),
                                                                          (4, 8192, 4096)}
    sw = A.shipped_sweep_at("llama70b-decode", c.df.git_commit.unique())
    j = C.with_sweep(got, sw.df)
    assert j.time_ratio.between(0.9845, 1.0750).all() and j.bw_ratio.between(0.9455, 1.0335).all()
    assert j.read_ratio.between(1.0005, 1.0008).all()
