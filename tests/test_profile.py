"""cpa.profile: counter sets (profiling/*.yaml), the formula evaluator, command builders, pass
splitting, the ncu / rocprofv3 parsers, derived metrics, the join to sweep rows, and every failure
mode of run_profiler -- the last through fake profilers (small shell scripts put first on PATH), so
the real subprocess path runs. No GPU needed.

Fixtures in tests/data:

* ncu_raw_sample.csv, ncu_full_sample.csv -- real captures on this project's H200 (copies of
  /work/shared/samples/): `ncu --csv --page raw --metrics ...` over 6 launches (3 torch randn
  kernels, then 3 cuDNN SDPA kernels) and `--set full` over one cuDNN SDPA launch.
* rocprofv3_counter_collection.csv -- HAND-MADE from the documented layout, NOT captured on an
  MI300 (this project has never had one). Columns exactly as rocprofiler-sdk writes them:
  source/docs/how-to/using-rocprofv3.rst ("Kernel counter collection output", "Output file fields";
  its data file source/docs/data/counter_collection.csv) and source/lib/output/generateCSV.cpp.
  The counter values are invented, chosen so each derived metric has a round expected value.
"""

from __future__ import annotations

import math
import os
import stat
import time
from pathlib import Path

import pandas as pd
import pytest

from cpa import profile as P

DATA = Path(__file__).resolve().parent / "data"
NCU_RAW = DATA / "ncu_raw_sample.csv"
NCU_FULL = DATA / "ncu_full_sample.csv"
ROCPROF_CSV = DATA / "rocprofv3_counter_collection.csv"

REQUIRED_PORTABLE = ["duration_ns", "achieved_occupancy", "dram_read_bytes", "dram_write_bytes", "dram_bandwidth",
                     "l2_hit_rate", "matrix_core_busy", "valu_busy", "lds_bank_conflict_rate",
                     "registers_per_thread", "shared_memory_bytes", "block_size", "grid_size"]
SDPA = "cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16_knob_35_16x128x128_1x4x1_cga1x1x1_kernel0_0"
PA_KERNEL = "void cpa::paged_attention_kernel<__hip_bfloat16, 128, 16, 512, 4>"


def value(tidy, dispatch, metric):
    sel = tidy[(tidy["dispatch"] == dispatch) & (tidy["metric"] == metric)]
    assert len(sel) == 1, (dispatch, metric, len(sel))
    return sel["value"].iloc[0]


# ------------------------------------------------------------------ formula evaluator
def test_formula_arithmetic_precedence_and_dotted_names():
    f = P.Formula("(a.b__c.sum + d) / (e * 1e-9) - -2", {"a.b__c.sum", "d", "e"})
    assert f.names == {"a.b__c.sum", "d", "e"}
    assert f.evaluate({"a.b__c.sum": 3.0, "d": 1.0, "e": 2.0}) == pytest.approx(4 / 2e-9 + 2)
    assert P.Formula("2 + 3 * 4", ()).evaluate({}) == 14
    assert P.Formula("(2 + 3) * 4", ()).evaluate({}) == 20
    assert P.Formula("8 / 4 / 2", ()).evaluate({}) == 1  # left associative
    assert P.Formula("-x + .5", {"x"}).evaluate({"x": 1.5}) == -1.0


def test_formula_division_by_zero_is_nan():
    f = P.Formula("a / b", {"a", "b"})
    assert math.isnan(f.evaluate({"a": 0.0, "b": 0.0}))
    assert math.isnan(f.evaluate({"a": 5.0, "b": 0.0}))


@pytest.mark.parametrize("text", [
    "__import__('os').system('true')",  # call + string
    "os.system",                        # a name it may not use
    "a ** b",                           # power
    "a; b",
    "a(b)",
    "a < b",
    "[a]",
    "a +",
    "(a + b",
    "a b",
    "",
    "lambda: a",
    "a if b else a",
    "x",                                # undeclared name
])
def test_formula_rejects_anything_but_arithmetic_over_known_names(text):
    with pytest.raises(P.FormulaError):
        P.Formula(text, {"a", "b"})


# ------------------------------------------------------------------ counter-set files
@pytest.mark.parametrize("profiler", ["ncu", "rocprofv3"])
def test_counter_set_files_define_every_required_portable_metric(profiler):
    full = P.load_counter_set(profiler, "full")
    assert full.profiler == profiler
    missing = [m for m in REQUIRED_PORTABLE if m not in full.metrics]
    assert not missing, missing
    for name in ("basic", "memory", "compute", "resources"):
        assert P.load_counter_set(profiler, name).metrics
    for m in full.metrics.values():
        assert m.unit and m.description and m.reads
        assert m.formula.names <= set(m.reads) | set(m.constants)
    units = {m: full.metrics[m].unit for m in ("achieved_occupancy", "l2_hit_rate", "matrix_core_busy",
                                               "valu_busy", "lds_bank_conflict_rate")}
    assert set(units.values()) == {"fraction"}
    assert full.metrics["dram_bandwidth"].unit == "byte/s"


def test_counter_set_selection_by_list_and_errors():
    cs = P.load_counter_set("ncu", ["dram_bandwidth", "duration_ns"])
    assert list(cs.metrics) == ["dram_bandwidth", "duration_ns"]
    assert cs.counters == ["dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum"]
    with pytest.raises(P.CounterSetError, match="no set 'nope'"):
        P.load_counter_set("ncu", "nope")
    with pytest.raises(P.CounterSetError, match="unknown metrics"):
        P.load_counter_set("ncu", ["dram_bandwidth", "flops"])
    with pytest.raises(P.CounterSetError, match="no counter-set file"):
        P.load_counter_set("nsys")


def test_rocprofv3_set_separates_dispatch_fields_and_constants():
    cs = P.load_counter_set("rocprofv3", "basic")
    assert "End_Timestamp" in cs.raw_names and "End_Timestamp" not in cs.counters
    assert "VGPR_Count" not in cs.counters
    assert cs.counters == ["MeanOccupancyPerActiveCU", "FETCH_SIZE", "WRITE_SIZE"]
    assert cs.constants_needed == ["MAX_WAVES_PER_CU"]
    from cpa import hardware
    assert P.device_constants(hardware.MI300X) == {"MAX_WAVES_PER_CU": 32}
    assert P.device_constants(hardware.H200) == {}


def _write_set(tmp_path, metrics_yaml, extra=""):
    p = tmp_path / "bad.yaml"
    p.write_text("schema: 1\nprofiler: ncu\nconstants: {K: a constant}\n" + extra + "metrics:\n" + metrics_yaml
                 + "sets:\n  basic: [m]\n")
    return p


@pytest.mark.parametrize("metric, error", [
    ("  m: {reads: [a], formula: a + b, unit: x, description: d}\n", "does not declare"),
    ("  m: {reads: [a], formula: open(a), unit: x, description: d}\n", "unexpected"),
    ("  m: {reads: [a, b], formula: a, unit: x, description: d}\n", "does not use"),
    ("  m: {reads: [a], constants: [Q], formula: a * Q, unit: x, description: d}\n", "not declared"),
    ("  m: {reads: [a], formula: a, unit: x}\n", "'description' is missing"),
    ("  m: {reads: [a], formula: a, unit: x, description: d, fromula: a}\n", "unknown keys"),
])
def test_counter_set_validation_rejects_broken_files(tmp_path, metric, error):
    with pytest.raises(P.CounterSetError, match=error):
        P.load_counter_set("ncu", "basic", path=_write_set(tmp_path, metric))


def test_counter_set_validation_checks_schema_and_sets(tmp_path):
    good = "  m: {reads: [a], constants: [K], formula: a * K, unit: x, description: d}\n"
    assert P.load_counter_set("ncu", "basic", path=_write_set(tmp_path, good)).constants_needed == ["K"]
    p = _write_set(tmp_path, good)
    p.write_text(p.read_text().replace("schema: 1", "schema: 2"))
    with pytest.raises(P.CounterSetError, match="schema must be 1"):
        P.load_counter_set("ncu", "basic", path=p)
    p.write_text(p.read_text().replace("schema: 2", "schema: 1").replace("[m]", "[m, other]"))
    with pytest.raises(P.CounterSetError, match="unknown metrics"):
        P.load_counter_set("ncu", "basic", path=p)


# ------------------------------------------------------------------ command builders
def test_ncu_command_exact_argv():
    argv = P.ncu_command(["gpu__time_duration.sum", "dram__bytes_read.sum"], "paged_attention.*",
                         ["python", "bench.py", "--n", "3"])
    assert argv == ["ncu", "--csv", "--page", "raw", "--print-units", "base",
                    "--metrics", "gpu__time_duration.sum,dram__bytes_read.sum",
                    "--kernel-name", "regex:paged_attention.*", "--clock-control", "none",
                    "python", "bench.py", "--n", "3"]
    argv = P.ncu_command(["a.sum"], "k", ["prog"], clock_control="base", extra=["--target-processes", "all"])
    assert argv == ["ncu", "--csv", "--page", "raw", "--print-units", "base", "--metrics", "a.sum", "--kernel-name", "regex:k",
                    "--clock-control", "base", "--target-processes", "all", "prog"]
    with pytest.raises(ValueError):
        P.ncu_command([], "k", ["prog"])
    with pytest.raises(ValueError):
        P.ncu_command(["a.sum"], "k", [])


def test_rocprofv3_command_exact_argv(tmp_path):
    argv = P.rocprofv3_command(["SQ_WAVES", "FETCH_SIZE"], "paged attention<.*>", tmp_path / "out", "run1",
                               ["python", "bench.py"])
    assert argv == ["rocprofv3", "--pmc", "SQ_WAVES", "FETCH_SIZE", "--kernel-include-regex", "paged attention<.*>",
                    "--output-format", "csv", "-d", str(tmp_path / "out"), "-o", "run1", "--", "python", "bench.py"]
    with pytest.raises(ValueError):
        P.rocprofv3_command([], "k", tmp_path, "n", ["prog"])


# ------------------------------------------------------------------ pass splitting
def test_split_passes_respects_gfx942_block_limits():
    cs = P.load_counter_set("rocprofv3", "full")
    passes = P.split_passes(cs.counters)
    assert sorted(c for p in passes for c in p) == sorted(cs.counters)
    # FETCH_SIZE (3 TCC counters) + WRITE_SIZE (2) exceed TCC's 4 per pass
    assert not any({"FETCH_SIZE", "WRITE_SIZE"} <= set(p) for p in passes)
    for p in passes:
        hw = {h for c in p for h in cs.hardware_counters.get(c, (c,))}
        per_block = {}
        for h in hw:
            per_block[P._counter_block(h)] = per_block.get(P._counter_block(h), 0) + 1
        for block, n in per_block.items():
            assert n <= cs.block_limits.get(block, cs.block_limits["default"]), (p, block, n)
    assert len(passes) == 2


def test_split_passes_shares_hardware_counters_and_handles_plain_counters():
    hw = {"A": ("GRBM_GUI_ACTIVE", "SQ_X"), "B": ("GRBM_GUI_ACTIVE", "SQ_Y")}
    # GRBM_GUI_ACTIVE is programmed once, so A and B fit one pass with GRBM limited to 1
    assert P.split_passes(["A", "B"], {"GRBM": 1, "SQ": 8}, hardware_counters=hw) == [["A", "B"]]
    assert P.split_passes(["SQ_A", "SQ_B", "SQ_C", "SQ_A"], 2, hardware_counters={}) == [["SQ_A", "SQ_B"], ["SQ_C"]]
    assert P.split_passes(["SQC_A", "SQ_B"], {"SQ": 1}, hardware_counters={}) == [["SQC_A"], ["SQ_B"]]
    with pytest.raises(ValueError, match="more than one pass allows"):
        P.split_passes(["FETCH_SIZE"], {"TCC": 2, "default": 2})


# ------------------------------------------------------------------ ncu parser
def test_parse_ncu_raw_sample():
    tidy = P.parse_ncu_raw_csv(NCU_RAW.read_text())
    assert list(tidy.columns[:5]) == ["dispatch", "kernel", "metric", "value", "unit"]
    assert sorted(tidy["dispatch"].unique()) == [0, 1, 2, 3, 4, 5]
    kernels = tidy.drop_duplicates("dispatch").set_index("dispatch")["kernel"]
    assert all(kernels[d] == SDPA for d in (3, 4, 5))
    assert kernels[0].startswith("void at::<unnamed>::distribution_elementwise_grid_stride_kernel")
    durations = [value(tidy, d, "gpu__time_duration.sum") for d in range(6)]
    assert durations == [5888, 308352, 307904, 125760, 124768, 125088]  # "5,888", "308,352", ...
    assert [value(tidy, d, "dram__bytes_read.sum") for d in (3, 4, 5)] == [537440768, 537436416, 537440512]
    assert [value(tidy, d, "dram__bytes_write.sum") for d in (3, 4, 5)] == [146944, 299264, 144384]
    assert value(tidy, 1, "dram__bytes_write.sum") == 239557888
    assert [value(tidy, d, "launch__registers_per_thread") for d in (0, 3)] == [44, 183]
    assert value(tidy, 3, "launch__occupancy_limit_registers") == 2
    assert value(tidy, 3, "sm__warps_active.avg.pct_of_peak_sustained_active") == pytest.approx(12.05)
    assert value(tidy, 0, "device__attribute_clock_rate") == 1_980_000  # thousands separators
    units = tidy.drop_duplicates("metric").set_index("metric")["unit"]
    assert units["gpu__time_duration.sum"] == "ns"
    assert units["dram__bytes_read.sum"] == "byte"
    assert units["launch__registers_per_thread"] == "register/thread"
    assert units["sm__warps_active.avg.pct_of_peak_sustained_active"] == "%"
    # text attributes are not measurements; launch fields are columns
    assert "device__attribute_display_name" not in set(tidy["metric"])
    row = tidy[tidy["dispatch"] == 3].iloc[0]
    assert (row["block"], row["grid"], row["pid"], row["stream"], row["device"]) == ("(128, 1, 1)", "(1, 8, 32)", 687, 7, 0)


def test_parse_ncu_full_sample_and_not_collected_cells():
    tidy = P.parse_ncu_raw_csv(NCU_FULL.read_text())
    assert list(tidy["dispatch"].unique()) == [0]
    assert tidy["kernel"].iloc[0] == SDPA
    assert len(tidy) > 2000
    assert math.isnan(value(tidy, 0, "sass__inst_executed_register_spilling_mem_local"))  # "no data"
    assert math.isnan(value(tidy, 0, "LTS.TriageCompute.lts__throughput.avg.pct_of_peak_sustained_elapsed"))  # ""
    assert value(tidy, 0, "dram__bytes.sum.per_second") == pytest.approx(4_047_816_531_294.79)
    assert value(tidy, 0, "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum") == 2_927_300


def test_parse_ncu_skips_program_output_and_handles_no_results():
    text = NCU_RAW.read_text()
    lines = text.splitlines()
    noisy = "\n".join(lines[:4] + ['"hello", from the program', "step 3/10"] + lines[4:])
    assert P.parse_ncu_raw_csv(noisy).equals(P.parse_ncu_raw_csv(text))
    empty = P.parse_ncu_raw_csv("==PROF== Disconnected from process 1\n==WARNING== No kernels were profiled.\n")
    assert empty.empty and "dispatch" in empty.columns


# ------------------------------------------------------------------ rocprofv3 parser and files
def test_parse_rocprofv3_counter_collection_fixture():
    tidy = P.parse_rocprofv3_counter_csv(ROCPROF_CSV)
    assert P.parse_rocprofv3_counter_csv(ROCPROF_CSV.read_text()).equals(tidy)
    assert sorted(tidy["dispatch"].unique()) == [1, 2, 3]
    assert tidy.loc[tidy["dispatch"] == 2, "kernel"].iloc[0].startswith(PA_KERNEL)
    assert value(tidy, 2, "FETCH_SIZE") == 140000.0
    assert value(tidy, 1, "MfmaUtil") == 0.0  # "0.00000000e+00"
    # dispatch fields become metric rows (once per dispatch), with units
    assert value(tidy, 2, "VGPR_Count") == 128 and value(tidy, 2, "Accum_VGPR_Count") == 64
    assert value(tidy, 2, "End_Timestamp") - value(tidy, 2, "Start_Timestamp") == 42000
    assert (tidy["metric"] == "LDS_Block_Size").sum() == 3
    row = tidy[(tidy["dispatch"] == 2) & (tidy["metric"] == "Grid_Size")].iloc[0]
    assert (row["unit"], row["agent"], row["pid"], row["lds_block_size"], row["sgpr_count"]) == \
        ("work-item", "Agent 1", 4242, 17408, 96)
    assert tidy.loc[tidy["metric"] == "FETCH_SIZE", "unit"].eq("").all()
    with pytest.raises(ValueError, match="not a rocprofv3 counter_collection.csv"):
        P.parse_rocprofv3_counter_csv('"ID","Kernel Name"\n1,"k"\n')


def test_find_rocprofv3_counter_files_layouts(tmp_path):
    csv_text = ROCPROF_CSV.read_text()
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "run_counter_collection.csv").write_text(csv_text)  # -d a -o run
    (tmp_path / "b" / "myhost").mkdir(parents=True)
    (tmp_path / "b" / "myhost" / "12345_counter_collection.csv").write_text(csv_text)  # -d b, default -o
    (tmp_path / "c" / "pmc_1").mkdir(parents=True)
    (tmp_path / "c" / "pmc_1" / "777_counter_collection.csv").write_text(csv_text)  # input file, pass 1
    (tmp_path / "a" / "run_kernel_trace.csv").write_text("x\n")
    assert P.find_rocprofv3_counter_files(tmp_path / "a", "run") == [tmp_path / "a" / "run_counter_collection.csv"]
    assert P.find_rocprofv3_counter_files(tmp_path / "b") == [tmp_path / "b" / "myhost" / "12345_counter_collection.csv"]
    assert len(P.find_rocprofv3_counter_files(tmp_path)) == 3
    merged = P.read_rocprofv3_counters(tmp_path)
    assert len(merged) == len(P.parse_rocprofv3_counter_csv(ROCPROF_CSV))  # same dispatches, kept once
    assert P.read_rocprofv3_counters(tmp_path / "nothing").empty


# ------------------------------------------------------------------ derived metrics
def test_derive_ncu_basic_on_raw_sample():
    cs = P.load_counter_set("ncu", "basic")
    derived = P.derive(P.parse_ncu_raw_csv(NCU_RAW.read_text()), cs)
    assert list(derived.columns) == ["dispatch", "kernel", "metric", "value", "unit"]
    assert len(derived) == 6 * len(cs.metrics)
    w = P.wide(derived)
    assert list(w.index) == [0, 1, 2, 3, 4, 5] and list(w.columns) == ["kernel", *cs.metrics]
    assert w.loc[3, "dram_bandwidth"] == pytest.approx((537440768 + 146944) / 125760e-9)
    assert w.loc[1, "dram_bandwidth"] == pytest.approx((12800 + 239557888) / 308352e-9)
    assert w.loc[3, "achieved_occupancy"] == pytest.approx(0.1205)
    assert w.loc[3, "duration_ns"] == 125760 and w.loc[3, "registers_per_thread"] == 183
    assert w.attrs["units"]["dram_bandwidth"] == "byte/s"
    assert w.loc[3, "kernel"] == SDPA
    # the raw sample did not collect L2 or tensor metrics
    with pytest.raises(P.MissingCounterError, match=r"l2_hit_rate reads \['lts__t_sector_hit_rate.pct'\]"):
        P.derive(P.parse_ncu_raw_csv(NCU_RAW.read_text()), P.load_counter_set("ncu", "memory"))


def test_derive_ncu_full_matches_ncus_own_metrics():
    tidy = P.parse_ncu_raw_csv(NCU_FULL.read_text())
    w = P.wide(P.derive(tidy, P.load_counter_set("ncu", "full"))).loc[0]
    # ncu computes dram__bytes.sum.per_second itself: our bytes / duration must agree
    assert w["dram_bandwidth"] == pytest.approx(value(tidy, 0, "dram__bytes.sum.per_second"), rel=1e-5)
    assert w["dram_read_bytes"] == 268_602_624 and w["dram_write_bytes"] == 2_503_936
    assert w["lds_bank_conflict_rate"] == pytest.approx(46_773 / 2_927_300)
    assert w["l2_hit_rate"] == pytest.approx(0.0082)
    assert w["matrix_core_busy"] == pytest.approx(0.1016)
    assert w["valu_busy"] == pytest.approx(0.0531)
    assert w["shared_memory_bytes"] == 86_336  # static 0 + dynamic 86,336 (not the driver's 1 KiB)
    assert (w["block_size"], w["grid_size"], w["registers_per_thread"]) == (128, 256, 183)


def test_derive_rocprofv3_full_on_fixture():
    cs = P.load_counter_set("rocprofv3", "full")
    tidy = P.parse_rocprofv3_counter_csv(ROCPROF_CSV)
    with pytest.raises(P.MissingCounterError, match="MAX_WAVES_PER_CU"):
        P.derive(tidy, cs)
    w = P.wide(P.derive(tidy, cs, constants={"MAX_WAVES_PER_CU": 32}))
    d = w.loc[2]
    assert d["duration_ns"] == 42000
    assert d["achieved_occupancy"] == pytest.approx(6.4 / 32)
    assert d["dram_read_bytes"] == 140000 * 1024 and d["dram_write_bytes"] == 2048 * 1024
    assert d["dram_bandwidth"] == pytest.approx((140000 + 2048) * 1024 / 42000e-9)
    assert d["l2_hit_rate"] == pytest.approx(0.2)
    assert d["matrix_core_busy"] == pytest.approx(0.125) and d["valu_busy"] == pytest.approx(0.30)
    assert d["lds_bank_conflict_rate"] == pytest.approx(0.025)
    assert (d["registers_per_thread"], d["vgprs"], d["agprs"], d["sgprs"]) == (192, 128, 64, 96)
    assert (d["shared_memory_bytes"], d["scratch_bytes"], d["block_size"], d["grid_size"]) == (17408, 0, 256, 512)
    assert d["waves"] == 2048
    assert math.isnan(w.loc[1, "lds_bank_conflict_rate"])  # the fill kernel touches no LDS: 0 / 0


# ------------------------------------------------------------------ join to sweep rows
def _sweep_rows():
    return pd.DataFrame({"tiling": ["mfma16", "mfma16", "scalar"], "partition_size": [256, 512, 256],
                         "num_seqs": [8, 8, 8], "max_seq_len": [4096, 4096, 4096], "num_heads": [64] * 3,
                         "num_kv_heads": [8] * 3, "head_size": [128] * 3, "time_us": [40.0, 38.0, 90.0]})


def test_join_to_sweep_maps_dispatches_and_reduces_repeats():
    w = P.wide(P.derive(P.parse_ncu_raw_csv(NCU_RAW.read_text()), P.load_counter_set("ncu", "basic")))
    w = w.loc[[3, 4, 5]]
    shape = dict(num_seqs=8, max_seq_len=4096, num_heads=64, num_kv_heads=8, head_size=128)
    mapping = pd.DataFrame([dict(dispatch=3, tiling="mfma16", partition_size=256, **shape),
                            dict(dispatch=4, tiling="mfma16", partition_size=256, **shape),
                            dict(dispatch=5, tiling="mfma16", partition_size=512, **shape)])
    joined = P.join_to_sweep(w, _sweep_rows(), mapping)
    assert len(joined) == 2
    first = joined[joined["partition_size"] == 256].iloc[0]
    assert first["profiled_dispatches"] == 2 and first["time_us"] == 40.0
    assert first["duration_ns"] == pytest.approx((125760 + 124768) / 2)
    assert joined[joined["partition_size"] == 512].iloc[0]["duration_ns"] == 125088
    assert len(P.join_to_sweep(w, _sweep_rows(), mapping, reduce=None)) == 3

    with pytest.raises(ValueError, match="without a mapping row"):
        P.join_to_sweep(w, _sweep_rows(), mapping.iloc[:2])
    with pytest.raises(ValueError, match="missing from the profile"):
        P.join_to_sweep(w.loc[[3, 4]], _sweep_rows(), mapping)
    with pytest.raises(ValueError, match="do not identify sweep rows uniquely"):
        P.join_to_sweep(w, pd.concat([_sweep_rows(), _sweep_rows()]), mapping)
    unmatched = mapping.assign(partition_size=[256, 256, 1024])
    with pytest.raises(ValueError, match="no sweep row"):
        P.join_to_sweep(w, _sweep_rows(), unmatched)
    with pytest.raises(ValueError, match="lacks key columns"):
        P.join_to_sweep(w, _sweep_rows(), mapping.drop(columns="head_size"))


# ------------------------------------------------------------------ fake profilers on PATH
@pytest.fixture
def fake_bin(tmp_path, monkeypatch):
    """install(name, body): write an executable shell script `name` into a folder that is first on PATH."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")

    def install(name: str, body: str) -> Path:
        script = bindir / name
        script.write_text("#!/bin/sh\n" + body)
        script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        return script
    return install


NCU_PROLOGUE = ("echo '==PROF== Connected to process 4242 (/usr/bin/python3.12)'\n")
NCU_NO_KERNELS = "echo '==PROF== Disconnected from process 4242'\necho '==WARNING== No kernels were profiled.'\n"
NCU_ARGS = ["ncu", "--csv", "prog"]


def test_run_profiler_not_installed(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(P.ProfilerNotFoundError, match="ncu not found on PATH; install Nsight Compute"):
        P.run_profiler(NCU_ARGS, timeout=10)
    with pytest.raises(P.ProfilerNotFoundError, match="rocprofv3 not found on PATH; install ROCm's rocprofiler-sdk"):
        P.run_profiler(["rocprofv3", "--pmc", "SQ_WAVES", "--", "prog"], timeout=10)


def test_ncu_success_returns_csv_stdout(fake_bin):
    fake_bin("ncu", f"cat '{NCU_RAW}'\n")
    tidy = P.profile_ncu(P.load_counter_set("ncu", "basic"), "sdpa", ["prog"], timeout=30)
    assert sorted(tidy["dispatch"].unique()) == [0, 1, 2, 3, 4, 5]


def test_ncu_permission_error(fake_bin):
    fake_bin("ncu", NCU_PROLOGUE
             + "echo '==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU Performance "
               "Counters on the target device 0. For instructions on enabling permissions and to get more "
               "information see https://developer.nvidia.com/ERR_NVGPUCTRPERM'\n" + NCU_NO_KERNELS)
    with pytest.raises(P.CounterPermissionError, match="ERR_NVGPUCTRPERM") as e:
        P.run_profiler(NCU_ARGS, timeout=30)
    assert e.value.returncode == 0 and "ERR_NVGPUCTRPERM" in e.value.stdout


def test_ncu_unknown_metric(fake_bin):
    fake_bin("ncu", "echo '==ERROR== Failed to find metric regex:^not__a_metric.sum$' >&2\nexit 1\n")
    with pytest.raises(P.UnknownCounterError) as e:
        P.run_profiler(NCU_ARGS, timeout=30)
    assert e.value.missing == ["^not__a_metric.sum$"]
    fake_bin("ncu", "echo '==ERROR== Failed to find metric dram__bytes_red.sum'\nexit 1\n")
    with pytest.raises(P.UnknownCounterError, match="dram__bytes_red.sum"):
        P.run_profiler(NCU_ARGS, timeout=30)


def test_ncu_no_kernel_matched(fake_bin):
    fake_bin("ncu", NCU_PROLOGUE + NCU_NO_KERNELS)
    with pytest.raises(P.NoKernelsProfiledError, match="--kernel-name"):
        P.profile_ncu(P.load_counter_set("ncu", "basic"), "no_such_kernel", ["prog"], timeout=30)


def test_ncu_program_failed_quotes_last_stderr_lines(fake_bin):
    fake_bin("ncu", NCU_PROLOGUE + 'i=1\nwhile [ $i -le 30 ]; do echo "program stderr line $i" >&2; i=$((i+1)); done\n'
             "echo '==PROF== Disconnected from process 4242'\nexit 3\n")
    with pytest.raises(P.ProfiledProgramFailedError) as e:
        P.run_profiler(NCU_ARGS, timeout=30)
    msg = str(e.value)
    assert e.value.returncode == 3 and "status 3" in msg
    assert "program stderr line 30" in msg and "program stderr line 11" in msg
    assert "program stderr line 10\n" not in msg + "\n"  # only the last 20 lines


def test_timeout_kills_the_profiler_and_its_program(fake_bin):
    fake_bin("ncu", "sleep 30\necho never\n")  # sleep is the script's child: the group must die
    t0 = time.monotonic()
    with pytest.raises(P.ProfilerTimeoutError, match="did not finish within 0.5 s"):
        P.run_profiler(NCU_ARGS, timeout=0.5)
    assert time.monotonic() - t0 < 10


# fake rocprofv3: runs the program after "--" and writes the fixture's rows for the --pmc counters
# to <-d>/<-o>_counter_collection.csv, as rocprofv3 lays them out
FAKE_ROCPROFV3 = r"""
pmc=""; dir=""; name=""; regex=""
while [ $# -gt 0 ]; do
  case "$1" in
    --pmc) shift; while [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; do pmc="$pmc $1"; shift; done; continue;;
    -d) dir="$2"; shift 2; continue;;
    -o) name="$2"; shift 2; continue;;
    --kernel-include-regex) regex="$2"; shift 2; continue;;
    --) shift; break;;
    *) shift;;
  esac
done
"$@"; rc=$?
mkdir -p "$dir"
# as rocprofv3: the counters asked for, of the kernels the regex matches, with the process's own
# dispatch ids (every dispatch counted, the filtered-out FillFunctor too)
awk -F'"' -v want="$pmc" -v re="$regex" 'BEGIN { n = split(want, w, " "); for (i = 1; i <= n; i++) ok[w[i]] = 1 }
  NR == 1 { print; next } ($6 in ok) && $4 ~ re { print }' "$FAKE_ROCPROF_CSV" > "$dir/${name}_counter_collection.csv"
exit $rc
"""
LOCK_WARNING = ("W20251107 19:40:11.772000 140736977257600 ioctl.cpp:68] Device 12345 could not be locked for "
                "profiling due to lack of permissions (capability SYS_PERFMON). PMC Counters may be inaccurate and "
                "System Counter Collection will be degraded.")


@pytest.fixture
def fake_rocprofv3(fake_bin, monkeypatch):
    monkeypatch.setenv("FAKE_ROCPROF_CSV", str(ROCPROF_CSV))
    return fake_bin("rocprofv3", FAKE_ROCPROFV3)


def test_rocprofv3_success_runs_every_pass_and_merges(fake_rocprofv3, tmp_path):
    cs = P.load_counter_set("rocprofv3", "full")
    tidy = P.profile_rocprofv3(cs, "paged_attention", tmp_path / "prof", "run", ["true"], timeout=30)
    assert (tmp_path / "prof" / "pass_1" / "run_counter_collection.csv").exists()
    assert (tmp_path / "prof" / "pass_2" / "run_counter_collection.csv").exists()
    assert set(cs.counters) <= set(tidy["metric"])  # pass 2 supplied WRITE_SIZE and TCC_MISS_sum
    w = P.wide(P.derive(tidy, cs, constants={"MAX_WAVES_PER_CU": 32}))
    # rocprofv3's Dispatch_Id 2 and 3 (1 was torch's fill, filtered out) are the program's
    # first and second attention launches: dispatches 0 and 1, as the harness maps them
    assert list(w.index) == [0, 1] and w.kernel.str.contains("paged_attention_kernel").all()
    assert w.loc[0, "l2_hit_rate"] == pytest.approx(0.2)
    assert w.loc[1, "dram_bandwidth"] == pytest.approx((139500 + 2048) * 1024 / 40000e-9)


def test_rocprofv3_permission_error_and_warning(fake_bin, fake_rocprofv3, tmp_path):
    # lock refused and the run failed: a permission error
    fake_bin("rocprofv3", f"echo '{LOCK_WARNING}' >&2\nexit 1\n")
    with pytest.raises(P.CounterPermissionError, match="CAP_PERFMON"):
        P.run_profiler(["rocprofv3", "--pmc", "SQ_WAVES", "--", "prog"], timeout=30)
    # lock refused but counters collected: the SDK says they "may be inaccurate", so warn
    fake_bin("rocprofv3", f"echo '{LOCK_WARNING}' >&2\n" + FAKE_ROCPROFV3)
    with pytest.warns(P.CounterAccuracyWarning, match="could not be locked"):
        tidy = P.profile_rocprofv3(P.load_counter_set("rocprofv3", ["waves"]), "k", tmp_path / "o", "run",
                                   ["true"], timeout=30)
    assert value(tidy, 2, "SQ_WAVES") == 2048


def test_rocprofv3_unknown_counter(fake_bin):
    fake_bin("rocprofv3", "echo 'W20260406 04:47:19.520811 132040106745856 tool.cpp:1893] Unable to find all counters "
                          "for agent 2 (gpu-0, gfx942) in [FOO_BAR, SQ_WAVES, TCC_HITS]. Found: [SQ_WAVES]. "
                          "Missing: [FOO_BAR, TCC_HITS]' >&2\n")
    with pytest.raises(P.UnknownCounterError, match="FOO_BAR") as e:
        P.run_profiler(["rocprofv3", "--pmc", "FOO_BAR", "SQ_WAVES", "TCC_HITS", "--", "prog"], timeout=30)
    assert e.value.missing == ["FOO_BAR", "TCC_HITS"]


def test_rocprofv3_no_kernel_matched(fake_bin, tmp_path):
    cs = P.load_counter_set("rocprofv3", ["waves"])
    # rocprofv3 writes nothing when no dispatch matched the filter ...
    fake_bin("rocprofv3", "exit 0\n")
    with pytest.raises(P.NoKernelsProfiledError, match="no kernel matched --kernel-include-regex 'nomatch'"):
        P.profile_rocprofv3(cs, "nomatch", tmp_path / "a", "run", ["true"], timeout=30)
    # ... or a file with the header only
    header = ",".join(f'"{c}"' for c in P.ROCPROFV3_COUNTER_COLUMNS)
    fake_bin("rocprofv3", 'while [ "$1" != "-d" ]; do shift; done; mkdir -p "$2"\n'
                          f"echo '{header}' > \"$2/run_counter_collection.csv\"\n")
    with pytest.raises(P.NoKernelsProfiledError, match="pass 1"):
        P.profile_rocprofv3(cs, "nomatch", tmp_path / "b", "run", ["true"], timeout=30)


def test_rocprofv3_program_failed(fake_rocprofv3, tmp_path):
    program = ["sh", "-c", "echo 'Traceback (most recent call last):' >&2; echo 'RuntimeError: HIP error' >&2; exit 2"]
    with pytest.raises(P.ProfiledProgramFailedError, match="RuntimeError: HIP error") as e:
        P.profile_rocprofv3(P.load_counter_set("rocprofv3", ["waves"]), "k", tmp_path / "o", "run", program,
                            timeout=30)
    assert e.value.returncode == 2


def test_rocprofv3_dispatch_fields_alone_are_refused():
    with pytest.raises(ValueError, match="only dispatch fields"):
        P.profile_rocprofv3(P.load_counter_set("rocprofv3", ["vgprs"]), "k", "/nonexistent", "run", ["true"],
                            timeout=1)


def test_ncu_pages_printed_with_scaled_units_read_as_base_units():
    """ncu's default unit scaling (usecond, Mbyte, Gbyte/s, ...) would give values 10^3-10^6 off
    a formula written for base units: the parser converts every prefixed unit it knows (ncu's
    prefixes are SI) and keeps the others as printed."""
    def page(units, values):
        head = '"ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum","dram__bytes_read.sum.per_second",' \
               '"sm__cycles_elapsed.avg.per_second","sm__warps_active.avg.pct_of_peak_sustained_active"\n'
        row = lambda cells: ",".join(f'"{c}"' for c in cells) + "\n"  # noqa: E731
        return "==PROF== Connected\n" + head + row(["", "", *units]) + row(["0", "paged_attention_kernel", *values])

    base = P.parse_ncu_raw_csv(page(["ns", "byte", "byte/s", "hz", "%"],
                                    ["125,760", "537,395,200", "4,273,180,000,000", "1,755,000,000", "12.5"]))
    scaled = P.parse_ncu_raw_csv(page(["usecond", "Mbyte", "Tbyte/second", "Ghz", "%"],
                                      ["125.76", "537.3952", "4.27318", "1.755", "12.5"]))
    assert list(scaled.unit) == list(base.unit) == ["ns", "byte", "byte/s", "hz", "%"]
    for a, b in zip(base.value, scaled.value):
        assert a == pytest.approx(b, rel=1e-9)
    assert P._unit_scale("msecond") == (1e6, "ns") and P._unit_scale("Kbyte/usecond") == (1e9, "byte/s")
    assert P._unit_scale("inst/cycle") == (1.0, "inst/cycle") and P._unit_scale("%/register") == (1.0, "%/register")


# ------------------------------------------------------------ the sweep/profile audit
def test_launch_order_renumbers_rocprofv3_dispatch_ids():
    """rocprofiler-sdk counts every dispatch of the process (torch's fills too) from 1; the
    harness maps its k-th profiled launch to dispatch k."""
    tidy = pd.DataFrame({"dispatch": [7, 7, 3, 12], "kernel": ["a", "a", "a", "a"], "metric": ["x", "y", "x", "x"],
                         "value": [1.0, 2.0, 3.0, 4.0], "unit": [""] * 4})
    got = P.launch_order(tidy)
    assert list(got.dispatch) == [1, 1, 0, 2] and list(got.value) == [1.0, 2.0, 3.0, 4.0]


def test_ctrl_c_takes_the_profiler_and_its_program_down(fake_bin, monkeypatch, tmp_path):
    """The profiler runs in its own session (so a timeout can kill its whole group), which keeps
    the terminal's SIGINT from it: an interrupt in cpa must kill the group itself."""
    import subprocess as sp

    pidfile = tmp_path / "pid"
    fake_bin("ncu", f"echo $$ > {pidfile}\nsleep 60\n")
    real = sp.Popen

    class Interrupted(real):
        def communicate(self, *a, **k):
            if k.get("timeout"):
                for _ in range(100):  # (once the script has started)
                    if pidfile.exists() and pidfile.read_text().strip():
                        break
                    time.sleep(0.05)
                raise KeyboardInterrupt
            return super().communicate(*a, **k)

    monkeypatch.setattr(P.subprocess, "Popen", Interrupted)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        P.run_profiler(["ncu", "--csv", "true"], timeout=120)
    assert time.monotonic() - t0 < 20, "the interrupt waited for the profiler to finish its run"
    pid = int(pidfile.read_text())
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the profiler (pid {pid}) outlived the interrupt")


def test_harness_launches_what_the_sweep_timed():
    """fp8 points with an fp8 cache and the reduce as its own launch (no cluster or fused combine),
    as the sweep's CUDA runner: the profiled kernel is the one whose time the counters sit beside."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("harness", P.HARNESS)
    h = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(h)
    from cpa import sweep as S

    base = {"num_seqs": 1, "num_heads": 64, "num_kv_heads": 8, "head_size": 128, "block_size": 16, "max_seq_len": 32768}
    auto, fp8 = S.make_point(base), S.make_point({**base, "kv_cache_dtype": "fp8"})
    assert h.launch_kwargs(auto) == {"fused_reduce": False, "cluster_reduce": False}
    assert h.launch_kwargs(fp8) == {"fused_reduce": False, "cluster_reduce": False, "kv_cache_dtype": "fp8",
                                    "k_scale": 1.0, "v_scale": 1.0}
    text = P.HARNESS.read_text()
    assert "S._fp8_sets(sets)" in text and "**kv_kw" in text
