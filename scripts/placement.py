"""Which buffer's placement moves a short shape's time? (notes/kernel-notes.md, "Open")

Identical launches timed in runs with another allocation history differed by up to 1.5% at the
shortest target-2 shapes on an H100 (data/bench/experiments/h100-drift-*). This moves one buffer
group at a time and times the same launch (graph replay over rotating sets, cpa.timing):

  partials  the K/V sets stay; torch's cache is emptied, a spacer of k x 2 MiB (k random in
            0..spacer_max) allocated, then the launches (their outputs and partition buffers come
            from new device memory after it)
  pool      before each trial the spacer, then new K/V sets (the pool lands after it), then the
            launches
  none      neither moves: the same launches timed again (the method's own spread)

Each trial writes a row: arm, trial, spacer_mib, time_us (median), attn_time_us, the first
set's tmp_out / key_cache addresses, and provenance. The spread of time_us within an arm says
whether that buffer group's placement matters.

Run on an H100 (data/bench/experiments/h100-placement-*-eea9729.csv): the pool arm moved the
K/V pool's virtual address and not the time; the partials arm moved the time (up to 1.5%) but
not the partial buffers' virtual address -- torch's allocator hands the same addresses back
after empty_cache, so what the spacer moves there is the physical backing only.

    python3 scripts/placement.py --out $OUT/h100-placement.csv [--batch 2 --context 16384
        --partition-size 1024 --trials 8 --spacer-max 256]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _spacer(nbytes: int):
    """`nbytes` of device memory held through a trial (None for 0): what comes after it moves."""
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, device="cuda") if nbytes else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--partition-size", type=int, default=1024)
    ap.add_argument("--tiling", default="mfma16")
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--spacer-max", type=int, default=256, help="largest spacer, in 2 MiB units")
    ap.add_argument("--arms", default="none,partials,pool")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    arms = [x for x in a.arms.split(",") if x]
    if set(arms) - {"none", "partials", "pool"} or a.trials < 1 or a.spacer_max < 0:
        ap.error("--arms: none, partials, pool; --trials >= 1; --spacer-max >= 0")

    import pandas as pd
    import torch

    from cpa import bench as B
    from cpa import reference
    from cpa.fsio import write_csv_atomic
    from cpa import jit
    from cpa import ops
    from cpa import provenance, timing

    jit.require_gpu("scripts/placement.py")
    rng = random.Random(a.seed)
    prov = provenance.provenance()

    def new_sets(seed):
        return B.make_sets(a.batch, a.context, dtype=torch.float16, seed=seed, **B.LLAMA70B)

    def launches(sets):
        return [ops.prepare(query=q, key_cache=sets.key_cache, value_cache=sets.value_cache, block_tables=bt,
                        seq_lens=sets.seq_lens, scale=sets.scale, max_seq_len=a.context, check_values=(i == 0),
                        partition_size=a.partition_size, tiling=a.tiling, fused_reduce=False, cluster_reduce=False)
                for i, (q, bt) in enumerate(zip(sets.queries, sets.block_tables))]

    sets = new_sets(a.seed)
    ref = reference.paged_attention(query=sets.queries[0], key_cache=sets.key_cache, value_cache=sets.value_cache,
                                    block_tables=sets.block_tables[0], seq_lens=sets.seq_lens, scale=sets.scale)
    tol = reference.REL_ERR_TOL[torch.float16]
    rows, settling = [], timing.Settling()
    for trial in range(a.trials):
        for arm in arms:
            k = rng.randint(0, a.spacer_max) if arm != "none" else 0
            # (emptying torch's cache makes the next allocations new device memory, so the spacer
            # moves them; without it they would reuse the previous trial's freed blocks)
            if arm == "pool":  # the old pool freed, the spacer, then the new pool after it
                sets = None
            if arm != "none":
                torch.cuda.empty_cache()
            spacer = _spacer(k * (1 << 21))
            if arm == "pool":
                sets = new_sets(a.seed)  # (the same values: the reference still holds)
            ls = launches(sets)  # (partials: after the spacer; pool / none: where the allocator has room)
            out = ls[0]()
            torch.cuda.synchronize()
            err = reference.relative_error(out, ref, per_seq=True)
            t = timing.time_graph([l.__call__ for l in ls], warmup_us=settling.warmup_us())
            ta = timing.time_graph([l.attention for l in ls])
            rows.append(dict(arm=arm, trial=trial, spacer_mib=2 * k, time_us=t.median_us, time_us_p25=t.p25_us,
                             time_us_p75=t.p75_us, attn_time_us=ta.median_us, verified=bool(err <= tol),
                             max_rel_err=err, tmp_out_addr=ls[0].tmp_out.data_ptr() if ls[0].tmp_out is not None
                             else 0, key_cache_addr=sets.key_cache.data_ptr(), num_seqs=a.batch,
                             max_seq_len=a.context, partition_size=a.partition_size, tiling=a.tiling,
                             n_sets=len(ls), **prov))
            del ls, out, spacer
            write_csv_atomic(pd.DataFrame(rows), a.out)  # (after every trial: an interrupted run keeps them)
            print(f"{arm:>8} trial {trial} spacer {2 * k:4d} MiB: {t.median_us:8.3f} us (attn {ta.median_us:8.3f})",
                  flush=True)
    df = pd.DataFrame(rows)
    print(df.groupby("arm").time_us.agg(["median", "min", "max", "count"]).assign(
        spread=lambda g: g["max"] / g["min"] - 1).to_string())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
