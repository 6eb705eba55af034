"""The CLI: ``cpa compare``, ``python -m cpa``, bad input as usage errors, the help texts."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cpa.cli import app


def _words(text: str) -> list:
    # the rendered help: box drawing, markdown's code backticks and line wrapping are layout
    return re.sub(r"[│╭╮╰╯─]+", " ", text.replace("`", "")).split()


def test_compare_small():
    args = ["compare", "--seq-lens", "40,300", "--partition-sizes", "none,16,64", "--num-heads", "8",
            "--num-kv-heads", "2", "--head-size", "64", "--repeats", "1"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    out = res.output
    assert "REFERENCE" in out and "not a kernel" in out
    for col in ("partition_size", "max_num_partitions", "time_ms", "max_rel_err"):
        assert col in out
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0] in ("40", "300")]
    assert len(rows) == 6
    # seq_len, partition_size, max_num_partitions, time_ms, max_rel_err
    assert [r[2] for r in rows] == ["1", "3", "1", "1", "19", "5"]
    assert all(float(r[4]) < 1e-5 for r in rows)
    assert float(rows[0][4]) == 0.0


def test_python_m_cpa_help():
    res = subprocess.run([sys.executable, "-m", "cpa", "--help"], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr
    assert "compare" in res.stdout


def test_static_refuses_an_unknown_arch_before_compiling(tmp_path):
    out = tmp_path / "x.csv"
    res = CliRunner().invoke(app, ["static", "--arch", "gfx924", "--out", str(out)])
    text = " ".join(res.output.replace("│", " ").split())  # the error box wraps lines
    assert res.exit_code == 2 and "gfx942, gfx90a, sm_90" in text, res.output
    assert not out.exists()


def test_bench_prints_the_shape_chosen_default(monkeypatch, tmp_path):
    """`cpa bench`'s closing tables, over the shipped H200 CSV (the GPU run itself replaced):
    the best fixed choices and what the sm_90 default picks per shape, with the device's
    occupancy query answered as the shipped static table does (2 per SM)."""
    import pandas as pd

    from cpa import bench as B
    from cpa import ops

    shipped = pd.read_csv(Path(__file__).resolve().parents[1] / "data" / "bench" / "h200-kernel.csv")
    monkeypatch.setattr(B, "run", lambda **kw: (shipped, {}))
    asked = []
    monkeypatch.setattr(ops, "resident_per_sm", lambda v, device: asked.append(v) or 2)
    res = CliRunner().invoke(app, ["bench", "--out", str(tmp_path / "b.csv")])
    assert res.exit_code == 0, res.output
    assert "best single (tiling, partition, combine)" in res.output
    want = B.geomean(B.by_shape_choice(shipped, fused=True).slowdown)
    assert f"the sm_90 default (partition size by shape, cpa.variants.BY_SHAPE): geomean {want:.3f}x" in res.output
    assert asked and all(v.tiling == "mfma16" for v in asked)
    line = [ln.split() for ln in res.output.splitlines() if ln.split()[:2] == ["8", "32768"] and "mfma16" in ln]
    assert line and line[-1][3] == "8192"  # 8 x 32k: 256 workgroups of 8192 tokens, one wave
    # the gap table: one line per shape with SDPA, the 8 x 32k one as cpa.bench.sdpa_gap says
    assert "against SDPA, reduce-launch rows" in res.output
    gap = B.sdpa_gap(shipped).set_index(["num_seqs", "max_seq_len"])
    assert len(gap) == 16
    row = gap.loc[(8, 32768)]
    assert f"{row.combine_us:.3f}".rstrip("0").rstrip(".") in res.output
    # the two lines through the run's shapes
    assert "time = fixed + K/V bytes / rate" in res.output
    fit = B.streaming_fit(shipped).set_index("arm")
    assert f"{fit.loc['sdpa_cudnn', 'fixed_us']:.4f}".rstrip("0").rstrip(".") in res.output


def test_host_profile_refuses_a_mode_it_cannot_profile(tmp_path):
    out = tmp_path / "p.csv"
    res = CliRunner().invoke(app, ["host-profile", "--mode", "graph", "--out", str(out)])
    text = res.output + str(res.stderr if res.stderr_bytes else "")
    assert res.exit_code == 2 and "graph" in text and not out.exists(), res.output


def _blocked_path(tmp_path, name):
    """A path whose folder cannot exist: it would be inside a regular file."""
    (tmp_path / "a-file").write_text("x")
    return str(tmp_path / "a-file" / name)


BAD_INPUT = [
    (["compare", "--seq-lens", "0"], "must be positive"),
    (["compare", "--num-kv-heads", "0"], "must be positive"),
    (["compare", "--partition-sizes", "256,,512"], "is not 'none' or a positive size"),
    (["compare", "--partition-sizes", "8"], "partition_size"),
    (["compare", "--block-size", "7"], "block_size"),
    (["compare", "--seq-lens", "a"], "comma-separated integers"),
    (["compare", "--dtype", "fp64"], "dtype: got 'fp64'; allowed: fp32, fp16, bf16"),
    (["prebuild", "--grid", "nosuch"], "'tests' or 'bench'"),
    (["prebuild", "--jobs", "0"], "at least 1"),
    (["static", "--arch", "gfx942", "--out", "{tmp}/s.csv", "--tilings", "nosuch"], "not one of"),
    (["static", "--arch", "gfx942", "--out", "{tmp}/s.csv", "--head-sizes", "100"], "no gfx942 variant"),
    (["static", "--arch", "gfx942", "--out", "{tmp}/s.csv", "--jobs", "-1"], "at least 1"),
    (["static", "--arch", "gfx942", "--out", "{blocked}"], "cannot create its folder"),
    (["emu", "--tilings", "nosuch"], "--tilings"),
    (["export", "--model", "gfx942", "--json", "{tmp}/e.json", "--fixed-cost-scale", "-1"], ">= 0"),
    (["export", "--model", "gfx942", "--json", "{blocked}"], "cannot create its folder"),
    (["sweep", "--grid", "nosuch", "--out", "{tmp}/s.parquet"], "nosuch"),
    (["sweep-spread", "{tmp}/none-a.parquet", "{tmp}/none-b.parquet"], "none-a.parquet (FileNotFoundError"),
    (["read-patterns", "--partition-sizes", "", "--out", "{tmp}/r.csv"], "at least one size"),
]


@pytest.mark.parametrize("args,message", BAD_INPUT, ids=[" ".join(a[:3]) for a, _ in BAD_INPUT])
def test_bad_input_is_a_usage_error_not_a_traceback(tmp_path, args, message):
    """Every command turns a refused value, a path it cannot use or an unknown name into exit
    code 2 and one message -- before any long work, and never a Python traceback."""
    args = [a.format(tmp=tmp_path, blocked=_blocked_path(tmp_path, "x.out")) for a in args]
    res = CliRunner().invoke(app, args)
    text = " ".join(_words(res.output))  # (typer's error box wraps lines)
    assert res.exit_code == 2, res.output
    assert message in text and "Traceback" not in res.output, res.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message for a machine without a GPU")
@pytest.mark.parametrize("args", [["compare", "--device", "cuda"],
                                  ["bench", "--batches", "1", "--contexts", "512", "--out", "{tmp}/b.csv"],
                                  ["read-patterns", "--out", "{tmp}/r.csv"],
                                  ["sweep", "--grid", "llama70b-decode", "--runner", "cuda", "--out", "{tmp}/s.parquet"]],
                         ids=["compare", "bench", "read-patterns", "sweep"])
def test_gpu_commands_without_a_gpu_say_so(tmp_path, args):
    res = CliRunner().invoke(app, [a.format(tmp=tmp_path) for a in args])
    assert res.exit_code == 2, res.output
    assert "GPU" in res.output and "Traceback" not in res.output, res.output


def test_prebuild_exits_nonzero_when_a_variant_fails(monkeypatch):
    """A prebuild with failed variants prints them and exits 1 (it exited 0, so scripts went on)."""
    import cpa.jobs as J

    rows = [{"variant": "a", "from_cache": False, "build_seconds": 1.0, "error": None},
            {"variant": "b", "from_cache": False, "build_seconds": 0.0, "error": "RuntimeError: nvcc failed"}]
    monkeypatch.setattr(J, "prebuild_main", lambda *a, **k: rows)
    assert CliRunner().invoke(app, ["prebuild", "--grid", "bench"]).exit_code == 1
    monkeypatch.setattr(J, "prebuild_main", lambda *a, **k: rows[:1])
    assert CliRunner().invoke(app, ["prebuild", "--grid", "bench"]).exit_code == 0


def _commands() -> dict:
    import typer.main

    return typer.main.get_command(app).commands


def _wide_help(*args) -> str:
    """``cpa ARGS --help`` at 400 columns, so that no summary needs wrapping."""
    res = CliRunner().invoke(app, [*args, "--help"], terminal_width=400, env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    return res.output


def test_help_shows_every_word_of_every_help_text():
    """Every command's docstring and every option's help reach ``--help`` whole: the markdown
    markup mode (which joins a summary's hard-wrapped lines) would drop an ``<angle>`` word as
    an HTML tag."""
    for name, cmd in _commands().items():
        shown = " ".join(_words(_wide_help(name)))
        texts = [cmd.help or ""] + [p.help for p in cmd.params if getattr(p, "help", None)]
        for text in texts:
            for para in text.split("\n\n"):
                want = " ".join(_words(para))
                assert want in shown, f"cpa {name} --help lost part of: {want!r}"


def test_command_list_gives_each_summary_one_row():
    """``cpa --help`` lists each command with its docstring's first paragraph on one row at a
    wide terminal: the hard wraps of the source are not kept."""
    rows = [line for line in _wide_help().splitlines() if line.startswith("│")]
    for name, cmd in _commands().items():
        summary = " ".join(_words(cmd.help.split("\n\n")[0]))
        row = [r for r in rows if r.split()[1:2] == [name]]
        assert len(row) == 1, f"{name}: {row}"
        assert summary in " ".join(_words(row[0])), f"{name}'s summary is not on its row: {row[0]!r}"
