"""`cpa profile` end to end on the CPU: the harness's launch plan, its command line, and the
whole flow (profiler run, parse, derive, join to the harness's dispatch mapping, parquet) with a
fake `ncu` on PATH that writes a mapping as the harness would and prints the real H200 sample.
On an NVIDIA GPU with ncu, the real thing runs (marked gpu)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from cpa import profile as PR
from cpa import sweep as S
from cpa.cli import app

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "tests" / "data" / "ncu_raw_sample.csv"
sys.path.insert(0, str(ROOT / "profiling"))
import harness as H  # noqa: E402


def test_harness_plan_and_point_selection():
    grid = S.load_grid("llama70b-decode")
    pts = H.select_points(grid, "0,9")
    assert [p.point_id for p in pts] == [grid.points[0].point_id, grid.points[9].point_id]
    todo = H.plan(grid, pts, ["mfma16", "scalar"], [256, 1024], repeats=2)
    assert len(todo) == 2 * 2 * 2 * 2
    assert [(v.label, r) for _, v, r in todo[:3]] == [("mfma16/256", 0), ("mfma16/256", 1), ("mfma16/1024", 0)]
    with pytest.raises(ValueError, match="has points 0..55"):
        H.select_points(grid, "56")


def test_harness_argv():
    argv = PR.harness_argv("gqa-scan", "/tmp/m.csv", points="1,2", tilings=["mfma16"], partition_sizes=[256, 512],
                           repeats=3, python="py")
    assert argv == ["py", str(PR.HARNESS), "--grid", "gqa-scan", "--mapping", "/tmp/m.csv", "--repeats", "3",
                    "--points", "1,2", "--tilings", "mfma16", "--partition-sizes", "256,512"]


FAKE_NCU = r"""#!/usr/bin/env python3
# stands in for ncu: writes the mapping the harness would write (6 launches: 3 variants x 2
# repeats of one point), then prints a real H200 `ncu --csv --page raw` capture of 6 launches
import sys
argv = sys.argv[1:]
mapping = argv[argv.index("--mapping") + 1]
cols = "dispatch,point_id,tiling,partition_size,num_seqs,max_seq_len,num_heads,num_kv_heads,head_size,dtype,kv_cache_dtype,repeat"
rows = [f"{d},s1-pt,{t},{p},1,512,64,8,128,fp16,auto,{r}" for d, (t, p, r) in enumerate(
    [("mfma16", 256, 0), ("mfma16", 256, 1), ("mfma16", 512, 0), ("mfma16", 512, 1), ("scalar", 256, 0), ("scalar", 256, 1)])]
open(mapping, "w").write(cols + "\n" + "\n".join(rows) + "\n")
sys.stdout.write(open(SAMPLE).read())
"""


def test_cpa_profile_flow_with_a_fake_ncu(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "ncu"
    exe.write_text(FAKE_NCU.replace("SAMPLE", repr(str(SAMPLE))))
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "c.parquet"
    r = CliRunner().invoke(app, ["profile", "--profiler", "ncu", "--counters", "basic", "--grid", "llama70b-decode",
                                 "--points", "0", "--out", str(out)])
    assert r.exit_code == 0, r.output
    df = pd.read_parquet(out)
    assert len(df) == 3  # one row per (point, variant): the two repeats are combined
    assert set(df.tiling + "/" + df.partition_size.astype(str)) == {"mfma16/256", "mfma16/512", "scalar/256"}
    assert (df.profiled_dispatches == 2).all()
    raw = PR.wide(PR.parse_ncu_raw_csv(SAMPLE.read_text()))
    # dispatches 0 and 1 are mfma16/256: its duration is their median
    first = df[(df.tiling == "mfma16") & (df.partition_size == 256)].iloc[0]
    assert first.duration_ns == pytest.approx(raw["gpu__time_duration.sum"].iloc[:2].median())
    assert first.dram_bandwidth == pytest.approx(
        ((raw["dram__bytes_read.sum"] + raw["dram__bytes_write.sum"]) / (raw["gpu__time_duration.sum"] * 1e-9))
        .iloc[:2].median())
    for col in ("profiler", "counter_set", "device_name", "git_commit", "timestamp"):
        assert df[col].notna().all()
    assert (df.profiler == "ncu").all() and (df.counter_set == "basic").all()


def test_cpa_profile_rejects_an_unknown_profiler_before_running_anything(tmp_path):
    with pytest.raises(ValueError, match="expected ncu or rocprofv3"):
        PR.profile_grid("nsys", "basic", "llama70b-decode", tmp_path / "x.parquet")


@pytest.mark.gpu
def test_real_ncu_on_the_gpu(tmp_path):
    import torch

    if getattr(torch.version, "hip", None) or not shutil.which("ncu"):
        pytest.skip("needs an NVIDIA GPU with ncu on PATH")
    df = PR.profile_grid("ncu", "basic", "llama70b-decode", tmp_path / "c.parquet", points="13",
                         tilings=["mfma16"], partition_sizes=[256, 1024], timeout=600)
    assert len(df) == 2 and (df.duration_ns > 0).all()
    # point 13 is batch 4 x 8192; K+V read once = 2 x seqs x len x 8 KV heads x 128 x 2 bytes
    kv = 2 * df.num_seqs * df.max_seq_len * 8 * 128 * 2
    assert ((df.dram_read_bytes > 0.8 * kv) & (df.dram_read_bytes < 1.5 * kv)).all()
