"""`cpa bench --resume`: a bench longer than one sitting (or one device call) runs in pieces.
A resumed run keeps the finished shapes, measures the others, and refuses -- before any GPU
work -- a file written with other options or by other code."""

from __future__ import annotations

import pandas as pd
import pytest
from typer.testing import CliRunner

from cpa import bench as B
from cpa.cli import app
from cpa.provenance import git_commit

OPTS = dict(tilings=("mfma16",), partition_sizes=(256,), dtype_name="fp16", replays=5, sdpa=True, fused=False,
            cluster=False, shared=False, block_order="shuffled")
RUN_OPTS = dict(batches=(1,), contexts=(512, 2048), tilings=("mfma16",), partition_sizes=(256,), replays=5,
                sdpa=True, fused=False, cluster=False, shared=False, progress=False, default=False)


def _rows(config, commit, shapes=((1, 512),)):
    rows = []
    for b, c in shapes:
        for tiling, p in (("mfma16", 256), ("sdpa_cudnn", 0)):
            rows.append(dict(tiling=tiling, partition_size=p, num_seqs=b, max_seq_len=c, time_us=10.0, gbps=1.0,
                             frac_peak_bw=0.5, verified=True, device_name="NVIDIA H200", git_commit=commit,
                             timestamp="2026-12-04T00:00:00+00:00", command="cpa bench", read_gbps_ceiling=4600.0,
                             copy_gbps_ceiling=4000.0, bench_config=config))
    return pd.DataFrame(rows)


def test_config_names_every_option_that_changes_the_rows():
    base = B.bench_config(**OPTS)
    for key, other in (("tilings", ("mfma4",)), ("partition_sizes", (512,)), ("dtype_name", "bf16"),
                       ("replays", 30), ("sdpa", False), ("fused", True), ("cluster", True), ("shared", True),
                       ("block_order", "sequential"), ("default", True)):
        assert B.bench_config(**{**OPTS, key: other}) != base, key
    assert B.bench_config(**OPTS) == base  # deterministic (stored in every row, compared as text)


def test_config_names_how_each_shape_settles(monkeypatch):
    """cpa.bench.SETTLE (how a shape's first timing settles) changes the times, so it is in the
    config; a value that is none of SETTLES is refused before any GPU work."""
    base = B.bench_config(**OPTS)
    assert '"settle": "warmup"' in base
    monkeypatch.setattr(B, "SETTLE", "none")
    assert B.bench_config(**OPTS) != base
    monkeypatch.setattr(B, "SETTLE", "later")
    with pytest.raises(ValueError, match="SETTLE"):
        B.run(batches=[1], contexts=[512], out_csv=None)


def test_resume_state_lists_the_finished_shapes(tmp_path):
    cfg = B.bench_config(**OPTS)
    out = tmp_path / "b.csv"
    assert B.resume_state(str(out), cfg, "abc")[1] == set()  # nothing yet: start from scratch
    _rows(cfg, "abc", shapes=((1, 512), (8, 2048))).to_csv(out, index=False)
    old, done = B.resume_state(str(out), cfg, "abc")
    assert done == {(1, 512), (8, 2048)}
    assert len(old) == 4


@pytest.mark.parametrize("what", ["options", "commit", "no-config", "no-out", "torn", "not-csv"])
def test_resume_refuses_a_foreign_file_before_any_gpu_work(tmp_path, what):
    cfg = B.bench_config(**OPTS)
    out = tmp_path / "b.csv"
    commit = git_commit()
    if what == "options":
        _rows(B.bench_config(**{**OPTS, "replays": 30}), commit).to_csv(out, index=False)
        match = "other options"
    elif what == "commit":
        _rows(cfg, "0" * 40).to_csv(out, index=False)
        match = "one commit"
    elif what == "no-config":
        _rows(cfg, commit).drop(columns="bench_config").to_csv(out, index=False)
        match = "no bench_config"
    elif what == "torn":  # the last row cut off before its provenance (a damaged file)
        text = _rows(cfg, commit, shapes=((1, 512), (1, 2048))).to_csv(index=False)
        out.write_text(text[:text.rindex("NVIDIA H200")])
        match = r"rows without bench_config or git_commit .* at shapes \[\(1, 2048\)\]"
    elif what == "not-csv":
        out.write_bytes(b"\x00\xff\xfe garbage \x00\n\"unclosed")
        match = "not a bench CSV"
    else:
        match = "needs the CSV"
    with pytest.raises(ValueError, match=match):
        B.run(**RUN_OPTS, out_csv=None if what == "no-out" else str(out), resume=True)


@pytest.mark.parametrize("batches,contexts", [((0,), (512,)), ((1,), (512, -1)), ((), (512,))])
def test_run_refuses_empty_or_non_positive_shapes_before_any_gpu_work(batches, contexts):
    with pytest.raises(ValueError, match="expected positive sizes"):
        B.run(**{**RUN_OPTS, "batches": batches, "contexts": contexts})


def test_cli_resume_refusal_is_a_usage_error(tmp_path):
    out = tmp_path / "b.csv"
    _rows(B.bench_config(**OPTS), "0" * 40).to_csv(out, index=False)
    res = CliRunner().invoke(app, ["bench", "--out", str(out), "--batches", "1", "--contexts", "512,2048",
                                   "--tilings", "mfma16", "--partition-sizes", "256", "--replays", "5",
                                   "--no-fused", "--no-cluster", "--no-shared", "--no-default", "--resume"])
    assert res.exit_code == 2, res.output
    assert "one commit" in " ".join(res.output.replace("│", " ").split())  # the error box wraps lines


def test_frame_keeps_resumed_rows_and_their_provenance():
    cfg = B.bench_config(**OPTS)
    old = _rows(cfg, "abc")
    new = [dict(tiling="mfma16", partition_size=256, num_seqs=1, max_seq_len=2048, time_us=20.0, gbps=2.0,
                frac_peak_bw=0.4)]
    prov = dict(device_name="NVIDIA H200", git_commit="abc", timestamp="2026-12-05T00:00:00+00:00",
                command="cpa bench --resume")
    df = B._frame(new, prov, dict(read_gbps=4500.0, copy_gbps=3900.0), "sm_90", cfg, old)
    assert len(df) == 3
    assert list(df.timestamp) == ["2026-12-04T00:00:00+00:00"] * 2 + ["2026-12-05T00:00:00+00:00"]
    assert list(df.read_gbps_ceiling) == [4600.0, 4600.0, 4500.0]  # each row against its own run's ceiling
    assert set(df.bench_config) == {cfg}


@pytest.mark.gpu
def test_resume_measures_only_the_missing_shapes(tmp_path):
    out = str(tmp_path / "b.csv")
    first, _ = B.run(**{**RUN_OPTS, "contexts": (512,)}, out_csv=out)
    assert set(zip(first.num_seqs, first.max_seq_len)) == {(1, 512)}
    both, _ = B.run(**RUN_OPTS, out_csv=out, resume=True)
    on_disk = pd.read_csv(out)
    assert len(on_disk) == len(both) == 2 * len(first)
    kept = on_disk[on_disk.max_seq_len == 512].reset_index(drop=True)
    pd.testing.assert_series_equal(kept.timestamp, first.timestamp.reset_index(drop=True), check_names=False)
    pd.testing.assert_series_equal(kept.time_us, first.time_us.reset_index(drop=True), check_names=False)
    assert on_disk.verified.all()
    again, _ = B.run(**RUN_OPTS, out_csv=out, resume=True)  # nothing left: no GPU work, same table
    assert len(again) == len(both)


@pytest.mark.gpu
def test_bench_default_path_row_is_the_launchers_pick():
    """`cpa bench` times, per shape, the launch with nothing chosen; its row names what the
    launcher picked (the same prepare() gives), and it is verified like every row."""
    from cpa.bench import LLAMA70B, make_sets
    from cpa.ops import prepare

    df, _ = B.run(batches=(2,), contexts=(4096,), tilings=("mfma16",), partition_sizes=(256,), replays=5, sdpa=False,
                  fused=False, cluster=False, shared=False, progress=False, default=True)
    d = df[df.default_path.fillna(False).astype(bool)]
    assert len(d) == 1 and len(df) == 2 and bool(d.verified.iloc[0])
    import torch

    sets = make_sets(2, 4096, dtype=torch.float16, **LLAMA70B)
    launch = prepare(query=sets.queries[0], key_cache=sets.key_cache, value_cache=sets.value_cache,
                     block_tables=sets.block_tables[0], seq_lens=sets.seq_lens, scale=sets.scale)
    r = d.iloc[0]
    assert (r.tiling, int(r.partition_size), bool(r.fused_reduce), bool(r.cluster_reduce)) == \
        (launch.kernel.variant.tiling, launch.shape.partition_size, launch.fused_reduce, launch.cluster > 0)
    assert len(B.default_path(df)) == 1


def test_run_rows_on_a_stand_in_device(monkeypatch, tmp_path):
    """The bench loop itself, on the CPU: every GPU call replaced by a stand-in (sets, ceilings,
    prepare, timing, SDPA), so the rows a shape gets -- named variants per mode, the skipped
    ones, one default_path row with the launcher's picks, SDPA -- and the CSV are checked
    without a device. One stand-in variant (mfma4) returns a perturbed output: its rows must
    fail verification against the reference, the others pass."""
    import types

    import torch

    import cpa.ceilings
    import cpa.jit
    import cpa.ops
    import cpa.provenance
    import cpa.reference
    import cpa.timing

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: None)
    monkeypatch.setattr(cpa.provenance, "provenance", lambda: dict(
        device_name="stand-in", driver_version="0", torch_version=torch.__version__, git_commit=git_commit(),
        timestamp="2026-12-05T00:00:00+00:00", command="test"))
    monkeypatch.setattr(cpa.jit, "device_arch", lambda *a: ("cuda", "sm_90"))
    monkeypatch.setattr(cpa.ceilings, "measure", lambda: dict(read_gbps=4500.0, copy_gbps=4000.0,
                                                              read_method="stand-in"))

    def sets(b, ctx, **kw):
        q = torch.randn(b, 64, 128, generator=torch.Generator().manual_seed(b * ctx))
        return B.DeviceSets(None, None, [q, q], [None, None], None, 0.1, 2 * b * ctx * 8 * 128 * 2)

    monkeypatch.setattr(B, "make_sets", sets)
    monkeypatch.setattr(cpa.reference, "paged_attention", lambda **kw: kw["query"])
    warmups = []

    def time_graph(fns, replays, warmup_us=None):
        warmups.append(warmup_us)
        return cpa.timing.Timing(10.0, 9.0, 11.0, 5)

    monkeypatch.setattr(cpa.timing, "time_graph", time_graph)
    monkeypatch.setattr(B, "_sdpa_row", lambda sets, ctx, base, *a: dict(base, tiling="sdpa_cudnn", partition_size=0,
                                                                         time_us=12.0, verified=True))
    asked = []

    def prepare(query, max_seq_len, partition_size=None, tiling=None, fused_reduce=None, cluster_reduce=None,
                shared_steps=False, **kw):
        asked.append(dict(partition_size=partition_size, tiling=tiling, fused_reduce=fused_reduce))
        P = partition_size or 1024  # the stand-in launcher's picks
        n = -(-max_seq_len // P)
        fused = bool(fused_reduce if fused_reduce is not None else 5 <= n <= 8)
        kernel = types.SimpleNamespace(variant=types.SimpleNamespace(tiling=tiling or "mfma16"), from_cache=True,
                                       build_seconds=0.0)
        return types.SimpleNamespace(kernel=kernel, shape=types.SimpleNamespace(partition_size=P),
                                     fused_reduce=fused and n > 1, cluster=n if cluster_reduce else 0,
                                     num_partitions=n, reduce_args=None if (fused or cluster_reduce or n == 1) else (),
                                     attention=lambda: None, reduce=lambda: None,
                                     out=query * 1.01 if tiling == "mfma4" else query)  # mfma4: 1% off

    class Launch(types.SimpleNamespace):
        def __call__(self):
            return self.out

    monkeypatch.setattr(cpa.ops, "prepare", lambda **kw: Launch(**vars(prepare(**kw))))
    out = tmp_path / "b.csv"
    df, _ = B.run(batches=(1, 2), contexts=(512, 8192), tilings=("mfma16", "mfma4"), partition_sizes=(256, 512),
                  replays=5, sdpa=True, fused=True, cluster=False, shared=False, progress=False, out_csv=str(out))
    on_disk = pd.read_csv(out)
    assert len(on_disk) == len(df)
    for (b, ctx), g in df.groupby(["num_seqs", "max_seq_len"]):
        named = g[(g.tiling != "sdpa_cudnn") & ~g.default_path.fillna(False).astype(bool)]
        # 2 tilings x 2 sizes, each with the reduce launch and (where > 1 partition) fused
        multi = sum(ctx > p for p in (256, 512))
        assert len(named) == 2 * (2 + multi), (b, ctx)
        d = g[g.default_path.fillna(False).astype(bool)]
        assert len(d) == 1 and d.partition_size.iloc[0] == 1024 and d.tiling.iloc[0] == "mfma16"
        assert bool(d.fused_reduce.iloc[0]) == (ctx == 8192)  # 8 partitions of 1024
        assert (g.tiling == "sdpa_cudnn").sum() == 1
    assert (df.time_us > 0).all()
    # verified is the stand-in launch's output checked against the reference (the query here):
    # exact for mfma16 and the default path, 1% off (above the fp16 tolerance) for mfma4
    tol = cpa.reference.REL_ERR_TOL[torch.float16]
    assert 1e-6 < tol < 0.01
    bad = df[df.tiling == "mfma4"]
    good = df[(df.tiling != "mfma4") & (df.tiling != "sdpa_cudnn")]
    assert len(bad) == len(good) - 4 and len(good) > 4  # (the 4 default-path rows are mfma16)
    assert not bad.verified.astype(bool).any(), bad[["num_seqs", "max_seq_len", "partition_size", "verified"]]
    assert (bad.max_rel_err > tol).all() and bad.max_rel_err.to_numpy() == pytest.approx(0.01, rel=1e-6)
    assert good.verified.astype(bool).all() and (good.max_rel_err == 0).all()
    assert on_disk.verified.astype(bool).tolist() == df.verified.astype(bool).tolist()
    assert sum(a["partition_size"] is None for a in asked) == 4 * 2  # the default path: 2 sets per shape
    # each shape's first timing settles (B.SETTLE "warmup"), the others warm up as usual
    assert warmups.count(cpa.timing.SETTLE_US) == 4 and warmups.count(None) == len(warmups) - 4
    assert warmups[0] == cpa.timing.SETTLE_US
    assert len(B.default_path(df)) == 4


def test_a_bench_table_tracked_by_git_does_not_make_its_own_resume_dirty(tmp_path, monkeypatch):
    """`cpa bench --out data/bench/h200-kernel.csv` rewrites a tracked file, so the tree is dirty
    when the next part starts: the commit a bench compares and records ignores its own table."""
    import subprocess

    from cpa import provenance as PV

    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    table, code = repo / "data" / "t.csv", repo / "code.py"
    table.write_text("a\n1\n")
    code.write_text("x = 1\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "t"], check=True)
    monkeypatch.setattr(PV, "REPO", repo)
    monkeypatch.delenv("CPA_GIT_COMMIT", raising=False)
    PV.git_commit.cache_clear()
    try:
        table.write_text("a\n1\n2\n")  # the first part of the bench wrote its table
        clean = PV.git_commit(ignore=(str(table),))
        assert len(clean) == 40 and PV.git_commit() == clean + "-dirty"
        code.write_text("x = 2\n")  # a code change still counts
        PV.git_commit.cache_clear()
        assert PV.git_commit(ignore=(str(table),)) == clean + "-dirty"
    finally:
        PV.git_commit.cache_clear()
