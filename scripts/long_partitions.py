"""Experiment: partitions longer than cpa.variants.PARTITION_SIZES allows (16384, 32768 tokens).

Why: at batch <= 8 and 32k-128k tokens the kernel's time falls as partitions grow (H100,
h100-target2-8cb0af6: 8 x 128k 1510 us at P 512 -> 1427 at P 4096), and cuDNN's split kernel
runs one wave of 256 long-lived CTAs at every such shape (ncu: grid 256 at 8 x 32k and at
8 x 128k). P 16384 / 32768 give the kernel that decomposition (8 x 128k at P 32768: 256
workgroups). The sizes are added to the variant table for this process only; the kernel
source takes any multiple of a step. Every row is verified against cpa.reference as in
`cpa bench`, SDPA in the same run.

    python3 scripts/long_partitions.py OUT.csv [--batches 1,2,4,8] [--contexts 32768,131072]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from cpa import variants as V  # noqa: E402

LONG = (16384, 32768)
V.PARTITION_SIZES = tuple(sorted(set(V.PARTITION_SIZES) | set(LONG)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--contexts", default="32768,65536,131072")
    ap.add_argument("--tilings", default="mfma16")
    ap.add_argument("--partition-sizes", default="4096,8192,16384,32768")
    a = ap.parse_args()
    ints = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    tilings, sizes = tuple(a.tilings.split(",")), ints(a.partition_sizes)

    from cpa import bench
    from concurrent.futures import ThreadPoolExecutor

    from cpa.jit import compile_variant, device_arch

    platform, arch = device_arch()
    vs = [V.variant_for(tiling=t, partition_size=p, platform=platform, **bench.VARIANT_AXES)
          for t in tilings for p in sizes]
    # nvcc runs in subprocesses: threads compile in parallel (cpa.jit.prebuild's spawned workers
    # would re-import the variant table without the long sizes)
    with ThreadPoolExecutor(len(vs)) as pool:
        print("built", [round(s, 1) for _, _, s in pool.map(lambda v: compile_variant(v, arch), vs)], "s")
    df, _ = bench.run(batches=ints(a.batches), contexts=ints(a.contexts), tilings=tilings, partition_sizes=sizes,
                      sdpa=True, fused=True, cluster=False, shared=True, out_csv=a.out, progress=False)
    ok = df[df.tiling != "sdpa_cudnn"]
    print(f"rows {len(ok)}, verified {int(ok.verified.sum())}")
    sdpa = df[df.tiling == "sdpa_cudnn"].set_index(["num_seqs", "max_seq_len"]).time_us
    ok = ok.assign(mode=ok.fused_reduce.map({True: "+fused", False: ""}).fillna("")
                   + ok.shared_steps.map({True: "+shared", False: ""}).fillna(""))
    t = ok.pivot_table(index=["num_seqs", "max_seq_len"], columns=["partition_size", "mode"], values="time_us")
    print(t.round(1).to_string())
    best = ok.groupby(["num_seqs", "max_seq_len"]).time_us.min()
    short = ok[ok.partition_size <= 8192].groupby(["num_seqs", "max_seq_len"]).time_us.min()
    import pandas as pd

    print(pd.DataFrame({"sdpa_us": sdpa, "best_p8192_us": short, "best_us": best,
                        "sdpa/best_p8192": sdpa / short, "sdpa/best": sdpa / best}).round(3).to_string())


if __name__ == "__main__":
    main()
