"""The shipped H200 benchmark: complete, verified, with provenance, and the sm_90 default
in cpa.variants is what it measured."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from cpa import bench as B
from cpa import variants as V

CSV = Path(__file__).resolve().parent.parent / "data" / "bench" / "h200-kernel.csv"
REQUIRED = ["tiling", "partition_size", "num_seqs", "max_seq_len", "time_us", "gbps", "frac_peak_bw",
            "device_name", "driver_version", "torch_version", "git_commit", "timestamp", "command"]


@pytest.fixture(scope="module")
def df():
    if not CSV.exists():
        pytest.skip("no shipped benchmark")
    return pd.read_csv(CSV)


def test_columns_and_provenance(df):
    missing = [c for c in REQUIRED if c not in df]
    assert not missing, missing
    assert (df.device_name == "NVIDIA H200").all()
    assert df.git_commit.str.fullmatch(r"[0-9a-f]{40}(-dirty)?").all()


def test_grid_complete_and_verified(df):
    cpa_rows = df[df.tiling != "sdpa_cudnn"]
    shapes = set(zip(cpa_rows.num_seqs, cpa_rows.max_seq_len))
    assert shapes == {(b, c) for b in B.BATCHES for c in B.CONTEXTS}
    for t in V.TILINGS:
        for p in V.PARTITION_SIZES:
            assert len(cpa_rows[(cpa_rows.tiling == t) & (cpa_rows.partition_size == p)]) >= len(shapes)
    assert cpa_rows.verified.all()
    assert len(df[df.tiling == "sdpa_cudnn"]) == len(shapes)
    assert ((df.frac_peak_bw > 0) & (df.frac_peak_bw < 1.1)).all()


def test_sm90_default_is_the_measured_best_single_choice(df):
    d = df[df.get("fused_reduce", pd.Series(False, index=df.index)).fillna(False).astype(bool) == False]  # noqa: E712
    choice, _ = B.best_fixed_choice(d)
    tiling, partition, source = V.default_choice("sm_90", 8)
    assert (tiling, partition) == (choice["tiling"], choice["partition_size"])
    assert "measured" in source


@pytest.mark.parametrize("call", ["make_sets", "run"])
def test_unknown_block_order_refused_before_any_gpu_work(call):
    """`cpa bench --block-order` takes shuffled or sequential; anything else is a ValueError
    raised before a CUDA tensor, the ceilings or a build (so it holds on a CPU machine too)."""
    import torch

    with pytest.raises(ValueError, match="block_order='random'"):
        if call == "make_sets":
            B.make_sets(1, 64, dtype=torch.float16, block_order="random", **B.LLAMA70B)
        else:
            B.run(batches=(1,), contexts=(64,), block_order="random", progress=False)
    assert B.BLOCK_ORDERS == ("shuffled", "sequential")
