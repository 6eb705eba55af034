"""cpa.readpattern: the K/V bytes of a decode step read in three layouts by one streaming
reader. CPU: the work plans (same bytes and programs in every pattern) and the refusals; GPU:
every reader's checksum matches torch's sum of the words it must read, and a reader that
misses a block fails it."""

from __future__ import annotations

import pytest

from cpa import readpattern as RP

SHAPE = dict(num_seqs=8, seq_len=32768, num_kv_heads=8, head_size=128, block_size=16, elem_bytes=2)


def test_plans_read_the_same_bytes_with_the_same_programs():
    plans = {p: RP.plan(p, partition_size=8192, **SHAPE) for p in RP.PATTERNS}
    kv_bytes = 2 * 8 * 32768 * 8 * 128 * 2
    for p, pl in plans.items():
        assert pl["bytes"] == kv_bytes, p
        n = pl["grid"][0] * pl["grid"][1] * pl["grid"][2]
        assert n == 256, p  # 8 sequences x 4 partitions x 8 heads: cuDNN's split grid too
        assert n * pl["blocks_per_program"] * pl["words_per_run"] * 4 * 2 == kv_bytes, p
    assert plans["paged"]["grid"] == plans["contiguous"]["grid"] == (8, 4, 8)
    assert plans["paged"]["words_per_run"] == 128 * 16 * 2 // 4  # one head of one block: 4 KB
    assert plans["paged_all_heads"]["grid"] == (8, 32, 1)
    assert plans["paged_all_heads"]["words_per_run"] == 8 * 1024  # all heads of a block: 32 KB
    assert plans["paged_all_heads"]["tokens_per_program"] == 1024


@pytest.mark.parametrize("pattern,kw,match", [
    ("strided", {}, "expected one of"),
    ("paged", dict(num_seqs=0), "num_seqs=0"),
    ("contiguous", dict(seq_len=-16), "seq_len=-16"),
    ("paged", dict(partition_size=8200), "multiple of block_size"),
    ("paged_all_heads", dict(partition_size=64), "multiple of block_size x heads"),
    ("paged", dict(partition_size=8192, seq_len=12288), "multiple of the program's"),
    ("paged", dict(partition_size=256, head_size=5, block_size=2, elem_bytes=1), "32-bit words"),
    ("paged", dict(partition_size=256, head_size=24, block_size=16, elem_bytes=2), "power-of-two"),
])
def test_plan_refuses_shapes_the_reader_cannot_split_evenly(pattern, kw, match):
    args = {**SHAPE, "partition_size": 4096, **kw}
    with pytest.raises(ValueError, match=match):
        RP.plan(pattern, **args)


def test_run_refuses_before_any_gpu_work():
    with pytest.raises(ValueError, match="expected one of"):
        RP.run(patterns=("paged", "strided"), progress=False)
    with pytest.raises(ValueError, match="block_order"):
        RP.run(block_order="random", progress=False)
    with pytest.raises(ValueError, match="load_only=\\[3\\]"):
        RP.run(load_only=(1, 3), progress=False)


def test_cli_refuses_a_load_only_level_before_any_gpu_work(tmp_path):
    from typer.testing import CliRunner

    from cpa.cli import app

    out = tmp_path / "rp.csv"
    res = CliRunner().invoke(app, ["read-patterns", "--load-only", "3", "--out", str(out)])
    assert res.exit_code == 2 and "load_only" in res.output and not out.exists(), res.output


def test_reader_shapes_parse_or_refuse(tmp_path):
    """--reader-shapes "2x8,16x8" -> reader configs; a malformed one is refused before any GPU
    work, by the function and by the command."""
    from typer.testing import CliRunner

    from cpa.cli import app

    assert RP.parse_reader_shape("2x8") == (2, 8, 1) and RP.parse_reader_shape(" 16x4 ") == (16, 4, 1)
    assert all(RP.parse_reader_shape(f"{nb}x{w}") == (nb, w, st) for nb, w, st in RP.READER_CONFIGS)
    for bad in ("2", "2x3", "0x8", "x8", "2x8x1", "ax8"):
        with pytest.raises(ValueError, match="reader shape"):
            RP.parse_reader_shape(bad)
    out = tmp_path / "rp.csv"
    res = CliRunner().invoke(app, ["read-patterns", "--reader-shapes", "2x8,2x3", "--out", str(out)])
    assert res.exit_code == 2 and "reader shape '2x3'" in res.output and not out.exists(), res.output


def test_checksum_wraps_like_int32():
    import torch

    words = torch.tensor([2**31 - 1, 1, -(2**31), -1], dtype=torch.int32)
    assert RP.checksum(words[:2]) == -(2**31)
    assert RP.checksum(words[2:]) == 2**31 - 1
    assert RP.checksum(words) == -1


def test_byte_sets_hold_the_layouts_the_plans_read():
    import torch

    for elem in (2, 1):
        sets = RP.make_byte_sets(2, 256, num_kv_heads=4, head_size=64, block_size=16, elem_bytes=elem,
                                 device="cpu", pool_bytes=1 << 20)
        run = 64 * 16 * elem
        k, v, bt = sets["paged"][0]
        assert k.shape == v.shape == (k.shape[0], 4, run) and k.dtype == torch.uint8
        assert bt.shape == (2, 16) and bt.dtype == torch.int32
        used = torch.cat([b.reshape(-1) for _, _, b in sets["paged"]])
        assert len(sets["paged"]) > 1 and used.unique().numel() == used.numel()  # disjoint sets
        ck, cv, _ = sets["contiguous"][0]
        assert ck.shape == cv.shape == (2, 4, 256 * 64 * elem)
        assert sets["paged_all_heads"] is sets["paged"]
        # the checksum of a pattern is the wrapped sum of exactly the words it must read
        want = RP._wrap(int(k[bt.reshape(-1).long()].view(torch.int32).to(torch.int64).sum())
                        + int(v[bt.reshape(-1).long()].view(torch.int32).to(torch.int64).sum()))
        assert RP.expected_total("paged", k, v, bt, block_size=16, seq_len=256) == want
    seq = RP.make_byte_sets(2, 256, num_kv_heads=4, head_size=64, block_size=16, elem_bytes=2, device="cpu",
                            pool_bytes=1 << 20, block_order="sequential")
    assert seq["paged"][0][2].reshape(-1).tolist() == list(range(32))


def test_run_refuses_an_unknown_cache_dtype_before_any_gpu_work():
    with pytest.raises(ValueError, match="kv_cache_dtype='int4'"):
        RP.run(kv_cache_dtype="int4", progress=False)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("pattern", RP.PATTERNS)
def test_reader_reads_every_word_once(pattern, kv_cache_dtype):
    import torch

    S, ctx, elem = 2, 2048, RP.KV_BYTES[kv_cache_dtype]
    shape = dict(num_seqs=S, seq_len=ctx, num_kv_heads=8, head_size=128, block_size=16, elem_bytes=elem)
    sets = RP.make_byte_sets(**shape)
    t = sets[pattern][0]
    want = RP.expected_total(pattern, *t, block_size=16, seq_len=ctx)
    for nb, warps, stages in ((1, 4, 1), (2, 8, 3)):
        r = RP.Reader(pattern, t, partition_size=1024, blocks_per_iter=nb, num_warps=warps, num_stages=stages, **shape)
        r.out.fill_(0x5A5A5A5A)
        r()
        torch.cuda.synchronize()
        assert r.total() == want, (nb, warps, stages)
    if pattern != "contiguous":  # one block read twice, another never: the checksum says so
        bad = t[2].clone()
        bad[1, 5] = t[2][1, 4]
        r = RP.Reader(pattern, (t[0], t[1], bad), partition_size=1024, **shape)
        r()
        torch.cuda.synchronize()
        assert r.total() != want


def test_summaries_of_a_run_table():
    import pandas as pd

    rows = []
    for pattern, nb, warps, us in (("paged", 8, 4, 250.0), ("paged", 8, 8, 240.0), ("paged", 16, 8, 235.0),
                                   ("contiguous", 8, 8, 233.0), ("paged_all_heads", 1, 8, 238.0)):
        rows.append(dict(kind="reader", pattern=pattern, partition_size=8192, blocks_per_iter=nb, num_warps=warps,
                         num_stages=1, num_seqs=8, max_seq_len=32768, num_kv_heads=8, head_size=128, block_size=16,
                         bytes=2 * 8 * 32768 * 8 * 128 * 2, time_us=us, verified=True))
    rows.append(dict(rows[0], pattern="paged", blocks_per_iter=4, time_us=100.0, verified=False))  # failed checksum
    rows.append(dict(kind="kernel", pattern="sdpa_cudnn", partition_size=0, time_us=239.0, verified=True))
    df = pd.DataFrame(rows)
    df["gbps"] = df.bytes / (df.time_us * 1e-6) / 1e9
    best = RP.best_per_pattern(df)
    paged = best[(best.kind == "reader") & (best.pattern == "paged")]
    assert len(paged) == 1 and paged.time_us.iloc[0] == 235.0  # the unverified 100 us row is not a rate
    assert set(best.pattern) == {"paged", "contiguous", "paged_all_heads", "sdpa_cudnn"}
    table = RP.rate_by_bytes_in_flight(df)
    # 8 blocks x 4 KB x 2 = 64 KB per program (one CPA workgroup's step), 16 blocks 128 KB; all heads: 64 KB per block
    assert list(table.columns) == [64, 128]
    assert table.loc[("paged", 8192), 64] == round(df.gbps[1]) and table.loc[("paged", 8192), 128] == round(df.gbps[2])
    assert table.loc[("paged_all_heads", 8192), 64] == round(df.gbps[4])


def _synthetic_run(run="r1"):
    import pandas as pd

    rows = []
    kv_bytes = 2 * 8 * 32768 * 8 * 128 * 2
    for pattern, part, nb, warps, us in (("paged", 8192, 8, 4, 250.0), ("paged", 8192, 8, 8, 245.0),
                                         ("paged", 8192, 16, 8, 235.0), ("contiguous", 8192, 8, 8, 240.0),
                                         ("contiguous", 8192, 16, 8, 233.0), ("paged", 4096, 8, 8, 242.0),
                                         ("contiguous", 4096, 8, 8, 238.0)):
        rows.append(dict(kind="reader", pattern=pattern, partition_size=part, blocks_per_iter=nb, num_warps=warps,
                         num_stages=1, num_seqs=8, max_seq_len=32768, num_kv_heads=8, head_size=128, block_size=16,
                         kv_cache_dtype="auto", bytes=kv_bytes, time_us=us, verified=True, programs=256,
                         read_gbps_ceiling=4500.0, device_name="NVIDIA H200", git_commit="a" * 40,
                         timestamp="2026-12-05T00:00:00+00:00", run=run))
    rows.append(dict(rows[0], blocks_per_iter=4, time_us=50.0, verified=False))  # a failed checksum: no rate
    rows.append(dict(kind="kernel", pattern="mfma16", partition_size=8192, time_us=244.0, bytes=kv_bytes, run=run,
                     verified=True, device_name="NVIDIA H200"))
    rows.append(dict(rows[-1], pattern="mfma4", time_us=246.0))  # a slower tiling at the same size
    rows.append(dict(kind="kernel", pattern="sdpa_cudnn", partition_size=0, time_us=239.0, bytes=kv_bytes, run=run,
                     verified=True, device_name="NVIDIA H200"))
    df = pd.DataFrame(rows)
    df["gbps"] = df.bytes / (df.time_us * 1e-6) / 1e9
    return df


def test_in_flight_rows_keep_the_best_reader_shape_per_point():
    rows = RP.in_flight_rows(_synthetic_run())
    paged = rows[(rows.pattern == "paged") & (rows.partition_size == 8192)].set_index("kb_in_flight")
    # 8 blocks x 4 KB x 2 tensors = 64 KB (two reader shapes: the faster, 245 us, is kept); 16 blocks = 128 KB;
    # the unverified 4-block row (50 us) is no point at all
    assert list(paged.index) == [64, 128]
    assert paged.loc[64, "time_us"] == 245.0 and paged.loc[128, "time_us"] == 235.0
    assert (rows.kind == "reader").all() and rows.verified.all()


def test_layout_cost_compares_within_a_run():
    import pandas as pd

    df = pd.concat([_synthetic_run("r1"), _synthetic_run("r2").assign(time_us=lambda d: d.time_us * 2)])
    cost = RP.layout_cost(df).set_index(["run", "partition_size"])
    assert cost.loc[("r1", 8192), "paged_over_contiguous"] == 235.0 / 233.0
    assert cost.loc[("r1", 4096), "paged_over_contiguous"] == 242.0 / 238.0
    assert cost.loc[("r2", 8192), "paged_us"] == 470.0  # each run's own rows
    assert cost.loc[("r1", 8192), "kernel_us"] == 244.0 and cost.loc[("r2", 8192), "kernel_us"] == 488.0
    assert cost.loc[("r1", 8192), "sdpa_us"] == 239.0
    assert pd.isna(cost.loc[("r1", 4096), "kernel_us"])  # no kernel row at that partition size


def test_shipped_runs_load_with_their_provenance():
    df = RP.load_shipped()
    # (load_only: the kernel's loads alone, `--load-only`, in the runs that time them)
    assert df.run.nunique() >= 1 and set(df.kind) <= {"reader", "kernel", "load_only"}
    readers = df[df.kind == "reader"]
    assert readers.verified.all(), "a shipped reader row whose checksum failed"
    assert (df.device_name == "NVIDIA H200").all() and df.git_commit.notna().all() and df.command.notna().all()
    text = RP.banner(df)
    assert "NVIDIA H200" in text and "cpa read-patterns" in text and str(df.git_commit.iloc[0])[:7] in text
    cost = RP.layout_cost(df)
    # the paged layout is slower than contiguous rows for a reader of the same programs and bytes in every run
    assert len(cost) >= 2 and (cost.paged_over_contiguous > 1.0).all()


def test_read_patterns_figure():
    pytest.importorskip("plotly")
    from cpa import plots

    fig = plots.read_patterns(_synthetic_run())
    names = [t.name for t in fig.data]
    assert {"paged, P 8192", "contiguous, P 8192", "paged, P 4096", "contiguous, P 4096"} <= set(names)
    assert {"CPA mfma16, P 8192", "CPA mfma4, P 8192", "cuDNN SDPA (whole attention)"} <= set(names)
    assert "measured on NVIDIA H200" in fig.layout.title.text and "8 x 32k" in fig.layout.title.text
    paged = next(t for t in fig.data if t.name == "paged, P 8192")
    assert list(paged.x) == [64, 128]


def test_against_sdpa_takes_the_best_of_each_per_run():
    import pandas as pd

    slow = _synthetic_run("r2").assign(time_us=lambda d: d.time_us * 2, max_seq_len=131072)
    df = pd.concat([_synthetic_run("r1"), slow])
    t = RP.against_sdpa(df).set_index("run")
    # r1: best paged reader 235 (P 8192, the unverified 50 us row is no rate), contiguous 233, the
    # faster tiling 244, SDPA 239
    assert t.loc["r1", "paged_reader_us"] == 235.0 and t.loc["r1", "contiguous_reader_us"] == 233.0
    assert t.loc["r1", "kernel_us"] == 244.0 and t.loc["r1", "sdpa_us"] == 239.0
    assert t.loc["r1", "sdpa_over_paged_reader"] == 239.0 / 235.0
    assert t.loc["r1", "sdpa_over_kernel"] == 239.0 / 244.0
    assert t.loc["r2", "max_seq_len"] == 131072 and t.loc["r2", "sdpa_us"] == 478.0  # each run's own rows
    assert list(t.index) == ["r1", "r2"]


def test_shipped_h100_bound_at_long_contexts():
    """The H100 runs of c60f99f (readers beside the kernel and SDPA at the target's long shapes,
    one call each): a reader that only reads the paged cache in the kernel's decomposition is
    faster than cuDNN's whole attention where the batch has at most 128k tokens, level at 256k
    and slower at 512k-1M; the kernel trails that reader at every shape. What notes and README
    say of where target 2 can and cannot be met on this layout."""
    df = RP.load_shipped(gpu="h100", commit="c60f99f")
    assert (df.device_name == "NVIDIA H100 80GB HBM3").all() and df.git_commit.str.startswith("c60f99f").all()
    assert df[df.kind == "reader"].verified.all() and df.command.str.startswith("python3 -m cpa read-patterns").all()
    t = RP.against_sdpa(df).set_index(["num_seqs", "max_seq_len", "block_order"])
    assert len(t) == 8
    tokens = t.index.get_level_values(0) * t.index.get_level_values(1)
    small, large = t[tokens <= 131072], t[tokens >= 524288]
    assert (small.sdpa_over_paged_reader > 1.01).all() and (large.sdpa_over_paged_reader < 1.0).all()
    assert t.loc[(8, 131072, "shuffled"), "sdpa_over_paged_reader"] < 0.99
    assert (t.kernel_us > t.paged_reader_us * 1.015).all()  # the kernel trails the reader everywhere
    assert (t.contiguous_reader_us < t.paged_reader_us).all()  # and the layout costs the reader
    # one line per arm through the seven shuffled shapes (time = fixed + bytes / rate): the
    # contiguous reader streams at SDPA's rate, the paged layout costs a reader 1-2% of it and
    # the kernel as much again; the kernel's fixed cost is below SDPA's
    lines = RP.against_sdpa_lines(RP.against_sdpa(df)).set_index("arm")
    assert (lines.shapes == 7).all() and (lines.max_rel_residual < 0.01).all()
    assert abs(lines.loc["contiguous_reader", "rate_vs_sdpa"] - 1) < 0.005
    assert 0.98 < lines.loc["paged_reader", "rate_vs_sdpa"] < 0.99
    assert 0.965 < lines.loc["kernel", "rate_vs_sdpa"] < lines.loc["paged_reader", "rate_vs_sdpa"] - 0.01
    assert lines.loc["paged_reader", "fixed_us"] < lines.loc["kernel", "fixed_us"] < lines.loc["sdpa", "fixed_us"]
    # consecutive physical blocks: the reader and the kernel both about 1% faster at 8 x 128k
    seq, shuf = t.loc[(8, 131072, "sequential")], t.loc[(8, 131072, "shuffled")]
    assert 0.985 < seq.paged_reader_us / shuf.paged_reader_us < 0.995
    assert 0.985 < seq.kernel_us / shuf.kernel_us < 0.995


def test_shipped_h100_loads_alone_split_the_kernels_gap():
    """The H100 runs of 1941857 (another H100 of the pool, read ceiling 3226 GB/s): the same
    readers with the kernel's loads alone (-DCPA_LOAD_ONLY=1, 2) at four shapes. Per byte the
    loads alone sit between the paged reader and the kernel: of the kernel's gap to the reader,
    about 0.9% is how its loads stream and 0.6% its math; the layout's own 1.4% is below both."""
    df = RP.load_shipped(gpu="h100", commit="1941857")
    assert (df.device_name == "NVIDIA H100 80GB HBM3").all() and (df.read_gbps_ceiling > 3200).all()
    assert df[df.kind == "reader"].verified.all() and not df[df.kind == "load_only"].verified.any()
    assert set(df[df.kind == "load_only"].build_flags) == {"-DCPA_LOAD_ONLY=1", "-DCPA_LOAD_ONLY=2"}
    t = RP.against_sdpa(df)
    assert len(t) == 4 and t.load_only_us.notna().all()
    # at every shape: the reader, then the loads alone, then the kernel
    assert (t.paged_reader_us < t.load_only_us).all() and (t.load_only_us < t.kernel_us).all()
    lines = RP.against_sdpa_lines(t).set_index("arm")
    assert (lines.shapes == 4).all() and (lines.max_rel_residual < 0.005).all()
    r = lines.rate_vs_sdpa
    assert abs(r["contiguous_reader"] - 1) < 0.005 and 0.98 < r["paged_reader"] < 0.99
    assert 0.005 < r["paged_reader"] - r["load_only"] < 0.015  # the loads' own pattern
    assert 0.003 < r["load_only"] - r["kernel"] < 0.01  # the math


def test_against_sdpa_reports_the_loads_alone_where_a_run_has_them():
    import pandas as pd

    df = _synthetic_run("r1")
    lo = pd.DataFrame([dict(kind="load_only", pattern="mfma16 loads only (1)", partition_size=8192, time_us=241.0,
                            verified=False, run="r1"),
                       dict(kind="load_only", pattern="mfma16 loads only (2)", partition_size=4096, time_us=243.0,
                            verified=False, run="r1")])
    t = RP.against_sdpa(pd.concat([df, lo], ignore_index=True)).set_index("run")
    assert t.loc["r1", "load_only_us"] == 241.0 and t.loc["r1", "sdpa_over_load_only"] == 239.0 / 241.0
    assert t.loc["r1", "kernel_us"] == 244.0  # unverified load-only rows are never the kernel's
    assert "load_only_us" not in RP.against_sdpa(df).columns  # a run without them: no column
    best = RP.best_per_pattern(pd.concat([df, lo], ignore_index=True))
    assert set(best[best.kind == "load_only"].pattern) == {"mfma16 loads only (1)", "mfma16 loads only (2)"}


@pytest.mark.gpu
def test_load_only_rows_on_the_gpu(monkeypatch):
    """RP.run with load_only: the -DCPA_LOAD_ONLY build's rows beside the reader and the kernel,
    never verified, with their flags, and CPA_NVCC_FLAGS as it was afterwards."""
    import os

    monkeypatch.delenv("CPA_NVCC_FLAGS", raising=False)
    df, _ = RP.run(num_seqs=1, seq_len=4096, partition_sizes=(1024,), patterns=("paged",), configs=((1, 4, 1),),
                   replays=3, progress=False, load_only=(1,))
    lo = df[df.kind == "load_only"]
    assert len(lo) == 1 and lo.time_us.iloc[0] > 0 and not lo.verified.any()
    assert lo.build_flags.iloc[0] == "-DCPA_LOAD_ONLY=1" and lo.pattern.iloc[0] == "mfma16 loads only (1)"
    assert "CPA_NVCC_FLAGS" not in os.environ
    k = df[(df.kind == "kernel") & (df.pattern == "mfma16")]
    assert len(k) == 1 and k.verified.all()  # the real kernel, built without the flag
    t = RP.against_sdpa(df.assign(run="r"))
    assert t.load_only_us.iloc[0] == lo.time_us.iloc[0]


def test_load_only_rows_build_with_the_flag_and_restore_it(monkeypatch):
    """_load_only_rows on the CPU, the bench replaced: it runs mfma16 at the readers' shape with
    -DCPA_LOAD_ONLY appended to the caller's flags, labels the rows, and leaves CPA_NVCC_FLAGS as
    it found it (also when the bench fails)."""
    import os
    import types

    import pandas as pd

    seen = []

    def fake_run(**kw):
        seen.append((os.environ.get("CPA_NVCC_FLAGS"), kw))
        if kw["partition_sizes"] == (0,):
            raise RuntimeError("build failed")
        return pd.DataFrame([dict(tiling="mfma16", partition_size=4096, time_us=100.0, verified=False)]), {}

    B = types.SimpleNamespace(run=fake_run)
    monkeypatch.setenv("CPA_NVCC_FLAGS", "-DCPA_MIN_BLOCKS=1")
    rows = RP._load_only_rows(B, 2, num_seqs=8, seq_len=131072, partition_sizes=(4096,), block_order="shuffled")
    flags, kw = seen[0]
    assert flags == "-DCPA_MIN_BLOCKS=1 -DCPA_LOAD_ONLY=2" and os.environ["CPA_NVCC_FLAGS"] == "-DCPA_MIN_BLOCKS=1"
    assert kw["tilings"] == ("mfma16",) and kw["batches"] == (8,) and kw["contexts"] == (131072,) and not kw["sdpa"]
    assert list(rows.pattern) == ["mfma16 loads only (2)"] and list(rows.kind) == ["load_only"]
    assert not rows.verified.any() and list(rows.build_flags) == [flags]
    monkeypatch.delenv("CPA_NVCC_FLAGS")
    with pytest.raises(RuntimeError, match="build failed"):
        RP._load_only_rows(B, 1, num_seqs=1, seq_len=4096, partition_sizes=(0,), block_order="shuffled")
    assert seen[-1][0] == "-DCPA_LOAD_ONLY=1" and "CPA_NVCC_FLAGS" not in os.environ


def test_reader_profile_targets_parse_or_refuse():
    """`scripts/h200.sh stalls` profiles a reader as target reader-<pattern>-<blocks>x<warps>;
    a malformed one is refused before any GPU work, a kernel tiling is not a reader."""
    from cpa import jobs as J

    assert J.reader_target("reader-paged-2x8") == ("paged", 2, 8)
    assert J.reader_target("reader-paged_all_heads-16x4") == ("paged_all_heads", 16, 4)
    assert J.reader_target("mfma16") is None and J.reader_target("sdpa_cudnn") is None
    for bad in ("reader-paged", "reader-strided-2x8", "reader-paged-2x3", "reader-paged-0x8", "reader-paged-2x"):
        with pytest.raises(ValueError, match="reader-<"):
            J.reader_target(bad)


@pytest.mark.gpu
def test_reader_profile_target_runs():
    """profile_one with a reader target: builds the reader over the decode shape and launches it
    (outside ncu the profiler range is a no-op); a reader shape that does not divide the
    program's blocks is refused."""
    from cpa import jobs as J

    J.profile_one("reader-paged-2x8", 1024, 1, 8192)
    with pytest.raises(ValueError, match="blocks_per_iter"):
        J.profile_one("reader-paged-3x8", 1024, 1, 8192)


def test_reader_profile_target_wiring(monkeypatch):
    """On the CPU, the readers replaced: profile_one builds one reader per input set with the
    target's pattern, blocks and warps at the decode shape, and launches the sets in turn."""
    from cpa import jobs as J

    made, calls = [], []

    class FakeReader:
        def __init__(self, pattern, tensors, **kw):
            made.append((pattern, tensors, kw))
            self.tensors = tensors

        def __call__(self):
            calls.append(self.tensors)

    def fake_sets(num_seqs, seq_len, **shape):
        assert (num_seqs, seq_len) == (2, 16384) and shape["elem_bytes"] == 2 and shape["head_size"] == 128
        return {"paged": ["set0", "set1", "set2"], "contiguous": ["c0"], "paged_all_heads": ["set0", "set1", "set2"]}

    monkeypatch.setattr(RP, "Reader", FakeReader)
    monkeypatch.setattr(RP, "make_byte_sets", fake_sets)
    monkeypatch.setattr(J, "launch_and_profile", lambda launch: [launch() for _ in range(4)])
    J.profile_one("reader-paged-4x8", 2048, 2, 16384)
    assert [m[1] for m in made] == ["set0", "set1", "set2"] and {m[0] for m in made} == {"paged"}
    kw = made[0][2]
    assert (kw["blocks_per_iter"], kw["num_warps"], kw["partition_size"]) == (4, 8, 2048)
    assert (kw["num_seqs"], kw["seq_len"], kw["num_kv_heads"], kw["block_size"]) == (2, 16384, 8, 16)
    assert calls == ["set0", "set1", "set2", "set0"]
