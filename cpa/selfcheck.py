"""A small, fast kernel-vs-reference check, meant to run under compute-sanitizer:

    compute-sanitizer --tool memcheck python -m cpa.selfcheck --small

and the record of such a run (``--record-sanitizer TOOL RC LOG CSV``, outside the sanitizer:
one row with the cases, the sanitizer's summary and the provenance, appended to CSV).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch


SANITIZER_FIELDS = ("tool", "exit_code", "cases_passed", "cases_failed", "sanitizer_errors", "sanitizer_summary")


def sanitizer_record(tool: str, exit_code: int, log: str) -> dict:
    """What one `compute-sanitizer --tool TOOL python -m cpa.selfcheck` run printed: the cases
    (the "N passed, M failed" line) and the sanitizer's summary line with its error (memcheck)
    or hazard (racecheck) count. A log without either line (a crash, a timeout) records -1 there,
    never a clean run."""
    cases = re.findall(r"^(\d+) passed, (\d+) failed$", log, re.M)
    summary = re.findall(r"^=+ ((?:ERROR|RACECHECK|INITCHECK|SYNCCHECK) SUMMARY: .*)$", log, re.M)
    errors = -1
    if summary:
        m = re.search(r"SUMMARY: (\d+) (?:errors?|hazards?)", summary[-1])
        errors = int(m[1]) if m else -1
    return dict(tool=tool, exit_code=int(exit_code), cases_passed=int(cases[-1][0]) if cases else -1,
                cases_failed=int(cases[-1][1]) if cases else -1, sanitizer_errors=errors,
                sanitizer_summary=summary[-1] if summary else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="the sanitizer subset (few variants, short contexts)")
    ap.add_argument("--record-sanitizer", nargs=4, metavar=("TOOL", "RC", "LOG", "CSV"),
                    help="append the record of a sanitizer run of this check (its exit code and log) to CSV")
    args = ap.parse_args(argv)
    if args.record_sanitizer:
        from .provenance import provenance

        import pandas as pd

        from .fsio import write_csv_atomic

        tool, rc, log, out = args.record_sanitizer
        row = {**sanitizer_record(tool, int(rc), Path(log).read_text(errors="replace")), **provenance()}
        earlier = [pd.read_csv(out)] if Path(out).exists() else []  # appended: the file is rewritten whole
        write_csv_atomic(pd.concat([*earlier, pd.DataFrame([row])], ignore_index=True), out)
        print(", ".join(f"{k}={row[k]}" for k in SANITIZER_FIELDS))
        return 0
    import cpa
    from cpa import ops, reference
    from cpa.inputs import make_paged_inputs

    cases = [(t, p, dt, kv, g, None) for t in cpa.variants.TILINGS for p in (64, 256) for dt, kv in
             (("fp16", "auto"), ("bf16", "fp8")) for g in ((8,) if args.small else (1, 8, 16))]
    # 4500 tokens at partition 64: more partitions than one round of the reduce kernel's loads
    lens = [1, 17, 63, 64, 65, 300, 4500] if args.small else [1, 17, 255, 256, 257, 4093]
    # the largest partitions: the second (fourth) block-table entry per lane past 2048 (6144) tokens
    cases += [("mfma16", 4096, "fp16", "auto", 8, None), ("mfma4", 8192, "bf16", "auto", 8, None)]
    # the cluster combine (sm_90+): clusters of 5 (odd, with empty workgroups) and of 16
    from cpa.jit import device_arch, staged_loops_flagged

    if cpa.variants.cluster_unsupported(device_arch()[1], 2) is None:
        cases += [("mfma16", 64, "fp16", "auto", 8, 5), ("mfma4", 256, "bf16", "fp8", 8, 16)]
    # shared steps: the step counters (tickets past the end, the reset), fp8 and the scalar tiling
    # (not in a staged-loop knob build, which keeps fixed partitions)
    if not staged_loops_flagged():
        cases += [("mfma16", 256, "fp16", "auto", 8, "shared"), ("scalar", 512, "bf16", "fp8", 8, "shared")]
    # the fused reduce: the last workgroup's combine (8 partitions per round, clamped indices;
    # 71 partitions at 4500 tokens) and the counter's reset, by launching one Launch twice
    cases += [("mfma16", 64, "fp16", "auto", 8, "fused"), ("scalar", 256, "bf16", "fp8", 8, "fused")]
    failed = 0
    for t, p, dt, kv, g, cl in cases:
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dt]
        ls = [1, 2047, 2048, 2049, 4096, 4097, 6000] if p == 4096 else lens
        if p == 8192:
            ls = [1, 6143, 6144, 6145, 8192, 9000]
        shared, fused = cl == "shared", cl == "fused"
        if shared or fused:
            cl = 0
            ls = [1, 17, p - 1, p, p + 1, 2000, 4500]
        if cl:  # cluster size = partitions of the longest sequence
            ls = [1, p - 1, p + 1, 2 * p, (cl - 1) * p + 1, cl * p]
        inp = make_paged_inputs(len(ls), 2 * g, 2, 128, 16, ls, dtype=dtype, kv_cache_dtype=kv, device="cuda",
                                seed=p + g)
        launch = ops.prepare(**inp.as_kwargs(), out=torch.full_like(inp.query, float("nan")), tiling=t,
                             partition_size=p, cluster_reduce=bool(cl), shared_steps=shared, fused_reduce=fused)
        out = launch()  # (into a NaN-poisoned out: an element the launch leaves unwritten shows)
        ref = reference.paged_attention(**inp.as_kwargs())
        err = reference.relative_error(out, ref, per_seq=True)
        if fused:  # the same launch again: its counters are the ones the first launch reset
            out.fill_(float("nan"))
            err = max(err, reference.relative_error(launch(), ref, per_seq=True))
        ok = err <= reference.REL_ERR_TOL[dtype]
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {t:7s} p{p:<5d} {dt} kv{kv:5s} gqa{g:<3d} "
              f"{f'cluster {cl}' if cl else 'shared' if shared else 'fused' if fused else 'reduce':10s} rel_err {err:.2e}")
    # the default path: paged_attention with the combine left to the launcher, twice in a row --
    # at 8 partitions on sm_90 the fused reduce, with the stream's shared counters
    ls = [1, 17, 511, 512, 513, 2000, 4000]
    inp = make_paged_inputs(len(ls), 16, 2, 128, 16, ls, dtype=torch.float16, device="cuda", seed=7)
    ref = reference.paged_attention(**inp.as_kwargs())
    fused = ops.prepare(**inp.as_kwargs(), tiling="mfma16", partition_size=512).fused_reduce
    for _ in range(2):
        err = reference.relative_error(cpa.paged_attention(**inp.as_kwargs(), tiling="mfma16", partition_size=512,
                                                           out=torch.full_like(inp.query, float("nan"))),
                                       ref, per_seq=True)
        ok = err <= reference.REL_ERR_TOL[torch.float16]
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} mfma16  p512   fp16 kvauto gqa8   "
              f"{'default: fused' if fused else 'default':15s} rel_err {err:.2e}")
    # launches replayed after their sequences grew past what they were sized for (a graph
    # captured too short): attended to over the grid's 1024 tokens, nothing read past it, and
    # each combine's counters left at zero. Then a grid of 3072 tokens with one sequence (2600)
    # longer than its block-table row (2048): attended to over the row, the reduce combining
    # only the partitions the attention kernel wrote
    ls = [1, 700, 1500, 2048, 2048]
    inp = make_paged_inputs(len(ls), 16, 2, 128, 16, ls, dtype=torch.float16, device="cuda", seed=9)
    kw = inp.as_kwargs()
    grown = torch.tensor([1, 700, 1500, 2048, 2600], dtype=torch.int32, device="cuda")  # 2600 > the row's 2048
    combines = {"reduce": dict(fused_reduce=False, cluster_reduce=False),
                "fused": dict(fused_reduce=True, cluster_reduce=False),
                "shared": dict(shared_steps=True, fused_reduce=False, cluster_reduce=False),
                "cluster": dict(cluster_reduce=True, fused_reduce=False)}
    if staged_loops_flagged():
        del combines["shared"]
    truncated = {1024: reference.paged_attention(**dict(kw, seq_lens=kw["seq_lens"].clamp(max=1024))),
                 3072: reference.paged_attention(**kw)}
    runs = [(tokens, name, opts) for tokens in truncated for name, opts in combines.items()
            if name != "cluster" or cpa.variants.cluster_unsupported(device_arch()[1], tokens // 256) is None]
    for tokens, name, opts in runs:
        seq_lens = kw["seq_lens"].clamp(max=tokens)
        launch = ops.prepare(**dict(kw, seq_lens=seq_lens), tiling="mfma16", partition_size=256, check_values=False,
                             max_seq_len=tokens, **opts)
        seq_lens.copy_(grown)

        def poisoned_run():  # each replay into a NaN-poisoned out: the first's result cannot hide the second's
            launch.out.fill_(float("nan"))
            return launch()

        err = max(reference.relative_error(poisoned_run(), truncated[tokens], per_seq=True) for _ in range(2))
        counters = launch.fused_counters if name == "fused" else launch.steal_counters
        ok = err <= reference.REL_ERR_TOL[torch.float16] and (counters is None or int(counters.abs().sum()) == 0)
        failed += not ok
        case = ("grown: " if tokens == 1024 else "past row: ") + name
        print(f"{'ok  ' if ok else 'FAIL'} mfma16  p256   fp16 kvauto gqa8   {case:17s} rel_err {err:.2e}")
    torch.cuda.synchronize()
    print(f"{len(cases) + 2 + len(runs) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
