"""The notebooks and `cpa report`: jupytext pairs, headless execution from the shipped data,
a static HTML report with interactive plotly figures, and the tables behind the figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cpa import analysis as A
from cpa import variants as V

ROOT = Path(__file__).resolve().parents[1]


def test_notebooks_are_jupytext_pairs_without_outputs_in_git():
    from cpa import report as R

    srcs = R.notebook_sources()
    assert [p.name for p in srcs][:1] == ["01_partition_sweep.py"]
    for p in srcs:
        assert "format_name: percent" in p.read_text()[:600], p
    try:
        tracked = subprocess.run(["git", "ls-files", "notebooks"], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    assert not [t for t in tracked if t.endswith(".ipynb")], "executed notebooks must stay out of git"


def test_import_cpa_and_cli_need_no_notebook_packages():
    code = ("import sys, cpa, cpa.cli, cpa.sweep, cpa.analysis; "
            "bad = [m for m in ('plotly', 'ipywidgets', 'nbclient', 'nbconvert', 'jupytext') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# ------------------------------------------------------------------------- analysis tables
@pytest.fixture(scope="module")
def llama():
    return A.sweep_results("llama70b-decode", mode="shipped")


def test_shipped_source_and_banner(llama):
    assert llama.source == "shipped" and llama.path == A.shipped_path("llama70b-decode")
    b = llama.banner()
    assert "Shipped dataset" in b and "NVIDIA H200" in b and "0d83a2d" in b and "e7697f4" in b  # FlashInfer rows merged
    c = llama.ceilings()
    assert 4000 < c["read_gbps"] < 5000 and 4000 < c["copy_gbps"] < 5000


def test_best_by_point_and_speedups(llama):
    df = llama.df
    best = A.best_by_point(df)
    assert len(best) == df.point_id.nunique() == 56
    cpa = A.cpa_rows(df)
    for _, r in best.sample(8, random_state=0).iterrows():
        assert r.time_us == cpa[cpa.point_id == r.point_id].time_us.min()
    sp = A.speedups(df, baseline_partition=256)
    # the best over every partition size can never lose to the best at 256 alone
    assert (sp.vs_p256 >= 1.0).all() and (sp.vs_p256 > 1.0).any()
    row = sp.iloc[0]
    sdpa = df[(df.point_id == row.point_id) & (df.tiling == "sdpa")].time_us.iloc[0]
    assert row.vs_sdpa == pytest.approx(sdpa / row.time_us)
    assert {"vs_sdpa", "vs_flex", "vs_flashinfer"} <= set(sp.columns)


def test_partition_table(llama):
    t = A.partition_table(llama.df, "mfma16")
    assert t.shape == (56, 8) and list(t.columns) == list(V.PARTITION_SIZES)
    assert t.notna().all().all()


def test_kv_dtype_table():
    d = A.sweep_results("kv-dtype-scan", mode="shipped")
    t = A.kv_dtype_table(d.df)
    assert len(t) == 8 and set(t.dtype) == {"fp16", "bf16"}  # 2 dtypes x 2 batches x 2 contexts
    cpa = A.cpa_rows(d.df)
    r = t.iloc[0]
    fp8 = cpa[(cpa.dtype == r["dtype"]) & (cpa.kv_cache_dtype == "fp8") & (cpa.num_seqs == r.num_seqs)
              & (cpa.max_seq_len == r.max_seq_len)]
    assert r.fp8_us == fp8.time_us.min() and r.fp8_over_auto == pytest.approx(r.fp8_us / r.auto_us)
    # half the bytes: the fp8 cache is faster at every shape, and cannot beat half the time by much
    assert (t.fp8_over_auto < 1.0).all() and (t.fp8_over_auto > 0.45).all()


def test_live_mode_without_gpu_is_an_error():
    if A.has_gpu():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="no GPU"):
        A.sweep_results("gqa-scan", mode="live")
    with pytest.raises(ValueError, match="expected auto"):
        A.sweep_results("gqa-scan", mode="sometimes")


# ------------------------------------------------------------------------------- the report
@pytest.fixture(scope="module")
def report(tmp_path_factory):
    import os

    from cpa import report as R

    out = tmp_path_factory.mktemp("report")
    old = os.environ.get("CPA_DATA")
    os.environ["CPA_DATA"] = "shipped"  # the kernels inherit it: CI-like even on a GPU machine
    try:
        pages = R.build_report(out, timeout=600, echo=lambda m: None)
    finally:
        if old is None:
            os.environ.pop("CPA_DATA")
        else:
            os.environ["CPA_DATA"] = old
    return out, pages


def test_every_notebook_runs_headless(report):
    out, pages = report
    assert pages and all(p.error is None for p in pages), [(p.name, p.error) for p in pages]
    for p in pages:
        nb = json.loads((out / f"{p.name}.ipynb").read_text())
        errors = [o for c in nb["cells"] for o in c.get("outputs", []) if o["output_type"] == "error"]
        assert not errors, errors[:1]


def test_report_pages(report):
    out, pages = report
    index = (out / "index.html").read_text()
    for p in pages:
        assert f'href="{p.html}"' in index
        page = (out / p.html).read_text()
        assert "Plotly.newPlot" in page  # interactive figures, plotly.js inlined once
        assert page.count("plotly.js v") <= 2
        assert "every number on this page is from the dataset shipped" in page
    first = (out / pages[0].html).read_text()
    assert "measured on NVIDIA H200" in first
    assert "Fastest partition size" in first and "Bandwidth against the roof" in first
    occ = (out / "02_occupancy.html").read_text()
    assert "compiled: clang-19 gfx942, nvcc sm_90" in occ and "MI300X modeled" in occ
    assert "MI300X measured" not in occ and "measured on AMD" not in occ


def test_report_exports_the_tuned_parameters(report):
    """`cpa report` ends with `cpa export` of what it read: the shipped H200 sweeps (no GPU: a
    measured export equal to data/export/h200-measured.json) and MI300X modeled, linked from
    the index with how each was obtained."""
    from cpa import export as E

    out, _ = report
    index = (out / "index.html").read_text()
    measured, modeled = E.load(out / "tuned" / "shipped-measured.json"), E.load(out / "tuned" / "mi300x-modeled.json")
    assert measured["evidence"] == "measured" and modeled["evidence"] == "modeled"
    assert measured["configs"] == E.load(ROOT / "data" / "export" / "h200-measured.json")["configs"]
    for name in ("shipped-measured", "mi300x-modeled"):
        assert f'href="tuned/{name}.json"' in index and f'href="tuned/{name}.h"' in index
        assert (out / "tuned" / f"{name}.h").read_text().count("namespace cpa_tuned {") == 1
    assert "modeled for gfx942 (AMD Instinct MI300X), not measured there" in index
    assert "measured on NVIDIA H200 (sm_90)" in index


def test_a_cell_that_times_out_fails_its_page_not_the_report(tmp_path):
    """nbclient's cell timeout is not a CellExecutionError: it used to escape run_notebook and
    lose every page of the report."""
    import time

    from cpa import report as R

    src = tmp_path / "slow.py"
    src.write_text("# %%\nimport time\ntime.sleep(30)\n")
    t0 = time.monotonic()
    nb, error = R.run_notebook(src, tmp_path, timeout=2)
    took = time.monotonic() - t0
    # the page's error names the timeout (not the last line of nbclient's message, a dashed rule)
    # ("A cell timed out while it was being executed, after 2 seconds.")
    assert "timed out" in error and "after 2 seconds" in error, error
    assert took < 20, f"run_notebook took {took:.1f} s: the 2 s cell timeout did not stop the 30 s cell"
    assert (tmp_path / "slow.ipynb").exists()
