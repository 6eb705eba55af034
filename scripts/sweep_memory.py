"""Device memory and timing of the sweep's point set-up (a diagnostic; prints a table).

  python3 scripts/sweep_memory.py leak 256x8192,256x16384     memory after each row and point
  python3 scripts/sweep_memory.py holders 64x32768,128x32768  as leak, and after a point closes with
                                                              memory still allocated, who refers to
                                                              each CUDA tensor left (gc referrers)
  python3 scripts/sweep_memory.py ab 32x8192,128x32768        one variant and SDPA timed on make_sets'
                                                              sets and on the verification inputs, alternated
"""
import gc
import os
import statistics
import sys
import types

import torch

from cpa import sweep as S

GiB = 1 << 30


def mem(tag):
    torch.cuda.synchronize()
    print(f"{tag:58s} alloc {torch.cuda.memory_allocated() / GiB:6.2f} GiB  peak {torch.cuda.max_memory_allocated() / GiB:6.2f}",
          flush=True)


def describe(o) -> str:
    if isinstance(o, types.FrameType):
        return f"frame {o.f_code.co_qualname} ({o.f_code.co_filename.rsplit('/', 3)[-1]}:{o.f_lineno})"
    if isinstance(o, dict) and "__name__" in o and "__builtins__" in o:
        return f"globals of {o['__name__']}"
    if isinstance(o, dict):
        return f"dict({len(o)} keys: {', '.join(map(str, list(o)[:6]))})"
    if isinstance(o, (list, tuple, set)):
        return f"{type(o).__name__}(len {len(o)})"
    if isinstance(o, types.CellType):
        return "cell"
    if isinstance(o, BaseException):
        return f"exception {type(o).__name__}"
    return f"{type(o).__module__}.{type(o).__qualname__}"


def holders(depth=6, width=4):
    """Referrer chains of every CUDA tensor still alive (>= 64 MiB), `depth` levels up."""
    from torch._subclasses.fake_tensor import FakeTensor
    gc.collect()
    here = sys._getframe()
    skip = {id(here)}
    def big(o):
        try:
            # real device tensors only: Inductor keeps fake ones (no memory) in its pattern tables
            return (isinstance(o, torch.Tensor) and not isinstance(o, FakeTensor) and o.is_cuda
                    and o.untyped_storage().nbytes() >= 64 << 20)
        except Exception:  # wrapper tensors without a storage (functorch's batched ones)
            return False

    live = [o for o in gc.get_objects() if big(o)]
    skip.add(id(live))
    print(f"  {len(live)} CUDA tensors >= 64 MiB alive:", flush=True)
    for t in live:
        print(f"    tensor {tuple(t.shape)} {t.dtype} {t.untyped_storage().nbytes() / GiB:.2f} GiB "
              f"storage {t.untyped_storage().data_ptr():#x}")
        frontier = [(t, 0)]
        seen = set(skip) | {id(frontier)}
        while frontier:
            o, d = frontier.pop()
            if d >= depth:
                continue
            refs = [r for r in gc.get_referrers(o) if id(r) not in seen and r is not frontier]
            seen.add(id(refs))  # this list refers to them too
            for r in refs[:width]:
                seen.add(id(r))
                print(f"      {'  ' * d}<- {describe(r)}")
                if isinstance(r, types.ModuleType):
                    continue
                frontier.append((r, d + 1))
        del frontier
    del live


def main():
    mode = sys.argv[1]
    if mode in ("leak", "holders"):  # the failure under study: the flex peer refuses it otherwise
        os.environ["CPA_FLEX_LARGE"] = "1"
    shapes = [tuple(map(int, s.split("x"))) for s in sys.argv[2].split(",")]
    grid = S.load_grid("llama70b-decode")
    pts = [p for p in grid.points if (p.num_seqs, p.max_seq_len) in shapes]
    runner = S.make_runner("cuda")
    runner.begin()
    peers, skipped = runner.peer_variants()
    cpa_vs = [S.RowVariant("mfma16", 512)]
    vs = cpa_vs + [p for p in peers if mode != "ab" or p.tiling == "sdpa"]
    print(runner.prebuild([(pt, v) for pt in pts for v in cpa_vs]), flush=True)
    on_inputs = S.times_on_inputs
    times = {}  # (point, variant, arm) -> [median us of each repetition]

    for pt in pts:
        for rep, shared in ([(0, False), (0, True), (1, False), (1, True)] if mode == "ab" else [(0, None)]):
            if shared is not None:
                S.times_on_inputs = (lambda p, i: True) if shared else (lambda p, i: False)
            torch.cuda.reset_peak_memory_stats()
            st = runner.open_point(pt, grid.point_seed(pt))
            S.times_on_inputs = on_inputs
            mem(f"open {pt.point_id} {'' if shared is None else ('inputs' if shared else 'sets')}")
            for v in vs:
                res = S._run_row(runner, st, v)
                err = res.get("error")
                if shared is not None and not err:
                    times.setdefault((pt.point_id, v.label, shared), []).append(res["time_us"])
                print(f"  {pt.num_seqs}x{pt.max_seq_len} rep {rep} {'inputs' if shared else 'sets':6s} {v.label:12s} "
                      f"{'ERR ' + err[:50] if err else ''} time_us {res.get('time_us', float('nan')):9.2f} "
                      f"verified {res.get('verified')} n_sets {res.get('n_sets')}", flush=True)
                if mode != "ab":
                    mem(f"    after {v.label}")
            runner.close_point(st)
            del st
            gc.collect()
            torch.cuda.empty_cache()
            mem(f"closed {pt.point_id}")
            if mode == "holders" and torch.cuda.memory_allocated() >= GiB:
                holders()

    if times:
        print("point / variant: time on the verification inputs / time on make_sets' sets (median of the repetitions)")
        for (pid, label, shared), ts in sorted(times.items()):
            if shared and (pid, label, False) in times:
                a, b = statistics.median(ts), statistics.median(times[(pid, label, False)])
                print(f"  {pid} {label:12s} inputs {a:9.2f} us  sets {b:9.2f} us  ratio {a / b:.4f}")


if __name__ == "__main__":  # the prebuild's worker processes import this file
    main()
