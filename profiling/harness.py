"""The program a profiler launches: chosen CPA variants x points of a sweep grid, each
attention-kernel launch identifiable.

    ncu ... --kernel-name regex:paged_attention_kernel python profiling/harness.py \
        --grid llama70b-decode --points 0,7,15 --tilings mfma16 --partition-sizes 256,1024 \
        --repeats 1 --mapping /tmp/mapping.csv

Every (point, variant) is built first (``cpa.ops.prepare``: the build and the argument checks
happen before any profiled launch), then its attention kernel is launched ``--repeats`` times,
alone (the reduce kernel is not launched, so the only kernels matching
``paged_attention_kernel`` are these). The mapping file lists, for the k-th launch, dispatch k
and the sweep keys of its row: ncu's ``ID`` counts the profiled kernels in launch order; rocprofv3's
``Dispatch_Id`` counts every dispatch of the process, so cpa.profile renumbers its rows in launch
order (``launch_order``) before the join. Each launch is the sweep's: the point's KV cache dtype
(fp8 caches as the sweep makes them, scales 1) and the reduce as a separate launch (no fused or
cluster combine), so the profiled kernel is the one the sweep timed. The harness prints nothing
to stdout (ncu's CSV goes there); progress goes to stderr.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# prepare()'s options for a point as the sweep's CUDA runner launches it (the fused and cluster
# combines would profile another attention kernel than the one the sweep timed)
from cpa.sweep import launch_kwargs  # noqa: E402

MAPPING_COLUMNS = ("dispatch", "point_id", "tiling", "partition_size", "num_seqs", "max_seq_len", "num_heads",
                   "num_kv_heads", "head_size", "dtype", "kv_cache_dtype", "repeat")


def select_points(grid, points: str | None):
    """Points of a grid by index list ("0,3,9"), or all of them."""
    if not points:
        return list(grid.points)
    idx = [int(x) for x in points.split(",") if x.strip()]
    bad = [i for i in idx if not 0 <= i < len(grid.points)]
    if bad:
        raise ValueError(f"--points {bad}: grid {grid.name} has points 0..{len(grid.points) - 1}")
    return [grid.points[i] for i in idx]


def plan(grid, points, tilings, partition_sizes, repeats: int):
    """[(point, RowVariant, repeat)] in launch order (one kernel launch each)."""
    g = grid.with_variants(tilings, partition_sizes)
    return [(pt, v, r) for pt in points for v in g.variants() for r in range(repeats)]



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grid", required=True)
    ap.add_argument("--points", default=None, help="comma-separated point indices (default: all)")
    ap.add_argument("--tilings", default=None)
    ap.add_argument("--partition-sizes", default=None)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--mapping", required=True, help="CSV written: dispatch -> sweep keys")
    a = ap.parse_args(argv)

    import torch

    from cpa import sweep as S
    from cpa.bench import make_sets
    from cpa.ops import prepare

    grid = S.load_grid(a.grid)
    tilings = [t for t in a.tilings.split(",")] if a.tilings else None
    parts = [int(p) for p in a.partition_sizes.split(",")] if a.partition_sizes else None
    todo = plan(grid, select_points(grid, a.points), tilings, parts, a.repeats)
    rows, dispatch = [], 0
    by_point: dict = {}
    for pt, v, r in todo:
        by_point.setdefault(pt.point_id, (pt, []))[1].append((v, r))
    for pt, runs in by_point.values():
        sets = make_sets(pt.num_seqs, pt.max_seq_len, num_heads=pt.num_heads, num_kv_heads=pt.num_kv_heads,
                         head_size=pt.head_size, block_size=pt.block_size, dtype=pt.torch_dtype(), seed=0)
        kv_kw = launch_kwargs(pt)
        if pt.kv_cache_dtype == "fp8":
            sets = S._fp8_sets(sets)  # (as the sweep's CUDA runner: e4m3 bytes, scales 1)
        seq_lens = torch.tensor(pt.seq_lens, dtype=torch.int32, device="cuda")
        launches = {}
        for v, _ in runs:  # build and check everything before the first profiled launch of the point
            if v.label in launches:
                continue
            try:
                launches[v.label] = prepare(query=sets.queries[0], key_cache=sets.key_cache,
                                            value_cache=sets.value_cache, block_tables=sets.block_tables[0],
                                            seq_lens=seq_lens, scale=sets.scale, partition_size=v.partition_size,
                                            tiling=v.tiling, max_seq_len=pt.max_seq_len, **kv_kw)
            except ValueError as e:  # not a variant of this platform / shape: nothing launched, nothing mapped
                print(f"harness: skip {pt.point_id} {v.label}: {e}", file=sys.stderr)
                launches[v.label] = None
        for v, r in runs:
            launch = launches[v.label]
            if launch is None:
                continue
            launch.attention()
            rows.append(dict(dispatch=dispatch, point_id=pt.point_id, tiling=v.tiling, partition_size=v.partition_size,
                             num_seqs=pt.num_seqs, max_seq_len=pt.max_seq_len, num_heads=pt.num_heads,
                             num_kv_heads=pt.num_kv_heads, head_size=pt.head_size, dtype=pt.dtype,
                             kv_cache_dtype=pt.kv_cache_dtype, repeat=r))
            dispatch += 1
        torch.cuda.synchronize()
        del sets, launches
        torch.cuda.empty_cache()
        print(f"harness: {pt.point_id}: {len(runs)} launches", file=sys.stderr)
    tmp = a.mapping + ".tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=MAPPING_COLUMNS)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, a.mapping)
    return 0


if __name__ == "__main__":
    sys.exit(main())
