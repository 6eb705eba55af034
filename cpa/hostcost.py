"""What one decode call costs the host, by the way a caller launches the kernel.

Decode runs one attention call per layer and token; at small batches the kernel takes 10-30 us,
so a launch path whose host work takes longer leaves the GPU idle between calls. Every mode
launches the same work (the attention kernel and its combine, the launcher's default variant):

  checked         ``cpa.paged_attention(...)`` as is: ``check_values=True`` reads ``seq_lens`` and
                  ``block_tables`` back to check them (one device sync per call)
  unchecked       ``cpa.paged_attention(..., check_values=False, max_seq_len=L)``: no sync
  fresh_counters  ``cpa.ops.prepare(..., check_values=False)()`` per call: as ``unchecked``, but
                  where the fused reduce runs its counters are a new zeroed tensor (a fill kernel)
                  instead of the stream's shared ones
  prepared        ``launch = cpa.ops.prepare(...)`` once, ``launch()`` per call
  graph           ``launch()`` captured into a CUDA graph once, ``replay()`` per call (how serving
                  engines run decode)
  sdpa_cudnn      torch SDPA (cuDNN) over contiguous K/V: the peer's own host cost

Numbers per mode (medians over ``repeats`` runs of ``calls`` calls):

  host_us    host time per call while the GPU is kept busy (a spin kernel queued ahead of the
             calls), so the issuing loop never waits for the device: the launch path's own CPU
             cost. NaN for ``checked``, whose sync waits for the device by design.
  wall_us    the calls back to back from an idle GPU, one synchronize at the end, per call:
             what an eager decode loop sees (about max(host, device), plus every sync).
  device_us  the same launch's device time under graph replay over rotating input sets
             (``cpa.timing.time_graph``, as ``cpa bench`` times it).
  vs_sdpa    host_us (wall_us for ``checked``) over SDPA's eager host_us of the same shape and
             run: host times move 1.5-2x between runs and machines, this ratio far less.

Every call passes ``out=`` (vLLM's op writes into a given output). Each mode's output is checked
against ``cpa.reference`` once, into a NaN-poisoned ``out``, before it is timed.
"""

from __future__ import annotations

import math
import statistics
import time

from .fsio import write_csv_atomic

MODES = ("checked", "unchecked", "fresh_counters", "prepared", "graph", "sdpa_cudnn")
BATCHES = (1, 8)
CONTEXTS = (2048, 32768)
# the spin kernel ahead of a host measurement: at least this many device us per timed call,
# raised (x4) until the GPU is still busy when the last call has been issued
SPIN_US_PER_CALL = 100.0
MAX_SPIN_TRIES = 4


def _median(xs) -> float:
    return float(statistics.median(xs))


def spin_cycles_per_us() -> float:
    """Clock cycles of ``torch.cuda._sleep`` per microsecond, measured with device events."""
    import torch

    cycles = 20_000_000
    torch.cuda._sleep(1000)
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    torch.cuda._sleep(cycles)
    t1.record()
    torch.cuda.synchronize()
    return cycles / (t0.elapsed_time(t1) * 1e3)


def host_us(call, calls: int, cycles_per_us: float) -> float:
    """Host time per call of ``call`` issued ``calls`` times behind a spin kernel that outlasts
    the issue loop (checked after it: the stream must still be busy, else the spin is lengthened
    and the loop run again)."""
    import torch

    spin_us = SPIN_US_PER_CALL * calls
    stream = torch.cuda.current_stream()
    for _ in range(MAX_SPIN_TRIES):
        torch.cuda._sleep(int(spin_us * cycles_per_us))
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        t1 = time.perf_counter()
        still_busy = not stream.query()
        torch.cuda.synchronize()
        if still_busy:
            return (t1 - t0) * 1e6 / calls
        spin_us *= 4
    raise RuntimeError(f"the GPU went idle before {calls} calls were issued, with a {spin_us / 4:.0f} us spin: "
                       "the host measurement would include device time")


def wall_us(call, calls: int) -> float:
    """Per-call time of ``calls`` back-to-back calls from an idle GPU, synchronized at the end."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / calls


def _calls(sets, seq_len, out):
    """(modes, launch, keep): modes maps a mode to (call, check): call() runs the mode's launch
    into ``out``, check(poisoned) runs it once into a poisoned output and returns that output;
    launch is the prepared Launch; keep holds what the captured graph's pointers point into."""
    import torch

    from . import bench as B
    from . import ops

    kw = dict(query=sets.queries[0], key_cache=sets.key_cache, value_cache=sets.value_cache,
              block_tables=sets.block_tables[0], seq_lens=sets.seq_lens, scale=sets.scale)
    unchecked = dict(kw, check_values=False, max_seq_len=seq_len)
    modes = {}

    modes["checked"] = (lambda: ops.paged_attention(**kw, out=out),
                        lambda o: ops.paged_attention(**kw, out=o))
    modes["unchecked"] = (lambda: ops.paged_attention(**unchecked, out=out),
                          lambda o: ops.paged_attention(**unchecked, out=o))
    modes["fresh_counters"] = (lambda: ops.prepare(**unchecked, out=out)(),
                               lambda o: ops.prepare(**unchecked, out=o)())
    launch = ops.prepare(**kw, out=out)
    modes["prepared"] = (launch, lambda o: ops.prepare(**kw, out=o)())

    def graph_of(o):
        g_launch = ops.prepare(**kw, out=o)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            g_launch()  # lazy inits outside the capture
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            g_launch()
        return g, g_launch

    g, _g_launch = graph_of(out)

    def graph_check(o):
        g2, _keep = graph_of(o)
        o.fill_(float("nan"))
        g2.replay()
        torch.cuda.synchronize()
        return o

    modes["graph"] = (g.replay, graph_check)

    k, v = B.contiguous_kv(sets, 0, seq_len)
    q4 = sets.queries[0].unsqueeze(2)
    modes["sdpa_cudnn"] = (lambda: B.sdpa_cudnn(q4, k, v, sets.scale),
                           lambda o: o.copy_(B.sdpa_cudnn(q4, k, v, sets.scale).squeeze(2)))
    return modes, launch, (g, _g_launch)


def _shape(num_seqs, seq_len, *, num_heads, num_kv_heads, head_size, block_size):
    """One shape's inputs and launch paths: (sets, ref, out, table, launch, keep) -- the fp16
    reference output, the ``out`` every timed call writes, and _calls' (modes, launch, keep)."""
    import torch

    from . import bench as B
    from . import reference

    sets = B.make_sets(num_seqs, seq_len, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                       block_size=block_size, dtype=torch.float16)
    ref = reference.paged_attention(sets.queries[0], sets.key_cache, sets.value_cache, sets.block_tables[0],
                                    sets.seq_lens, sets.scale).to(torch.float16)
    out = torch.empty_like(sets.queries[0])
    table, launch, keep = _calls(sets, seq_len, out)
    return sets, ref, out, table, launch, keep


def _error(check, out, ref) -> float:
    """The relative error of one mode's output, run once into a NaN-poisoned copy of ``out``."""
    import torch

    from . import reference

    got = check(torch.full_like(out, float("nan")))
    torch.cuda.synchronize()
    return float(reference.relative_error(got, ref, per_seq=True))


def run(*, batches=BATCHES, contexts=CONTEXTS, modes=MODES, calls: int = 100, repeats: int = 7,
        replays: int = 30, num_heads: int = 64, num_kv_heads: int = 8, head_size: int = 128, block_size: int = 16,
        out_csv=None, progress: bool = True):
    """One row per (shape, mode): host_us, wall_us, device_us, the launch's variant, verified.
    ``out_csv`` is rewritten (atomically) after every shape: an interrupted run keeps the shapes done."""
    import pandas as pd
    import torch
    from tqdm.auto import tqdm

    from . import bench as B
    from . import ops
    from . import reference
    from .provenance import provenance
    from .timing import time_graph

    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"modes: unknown {bad}; expected some of {MODES}")
    if calls < 1 or repeats < 1:
        raise ValueError("calls and repeats must be at least 1")
    if not torch.cuda.is_available():
        raise RuntimeError("cpa host-cost needs a GPU")
    cyc = spin_cycles_per_us()
    prov = provenance()
    rows = []
    shapes = [(b, c) for b in batches for c in contexts]
    bar = tqdm(total=len(shapes) * len(modes), desc="host-cost", disable=not progress)
    for num_seqs, seq_len in shapes:
        sets, ref, out, table, launch, _keep = _shape(num_seqs, seq_len, num_heads=num_heads,
                                                      num_kv_heads=num_kv_heads, head_size=head_size,
                                                      block_size=block_size)
        tol = reference.REL_ERR_TOL[torch.float16]
        # the launch's device time, rotating sets as cpa bench does (the default variant of the shape)
        per_set = [ops.prepare(sets.queries[i], sets.key_cache, sets.value_cache, sets.block_tables[i],
                               sets.seq_lens, sets.scale) for i in range(len(sets.queries))]
        dev_t = time_graph(per_set, replays=replays)
        sdpa_t = None
        base = dict(num_seqs=num_seqs, max_seq_len=seq_len, num_heads=num_heads, num_kv_heads=num_kv_heads,
                    head_size=head_size, block_size=block_size, dtype="fp16",
                    tiling=launch.kernel.variant.tiling, partition_size=launch.shape.partition_size,
                    num_partitions=launch.num_partitions, fused_reduce=bool(launch.fused_reduce),
                    cluster_reduce=int(launch.cluster or 0), calls=calls, repeats=repeats)
        for mode in modes:
            call, check = table[mode]
            err = _error(check, out, ref)
            for _ in range(3):  # warm: builds, allocator, cuDNN plans
                call()
            torch.cuda.synchronize()
            hosts = [] if mode == "checked" else [host_us(call, calls, cyc) for _ in range(repeats)]
            walls = [wall_us(call, calls) for _ in range(repeats)]
            if mode == "sdpa_cudnn":
                if sdpa_t is None:  # over every set's contiguous K/V, as the kernel's (one set can sit in L2)
                    sdpa_t = time_graph(B.sdpa_calls(sets, seq_len)[0], replays=replays)
                device = sdpa_t.median_us
            else:
                device = dev_t.median_us
            row = dict(base, mode=mode, host_us=_median(hosts) if hosts else math.nan,
                       host_us_min=min(hosts) if hosts else math.nan, wall_us=_median(walls),
                       wall_us_min=min(walls), device_us=device, verified=bool(err <= tol), max_rel_err=float(err))
            if mode == "sdpa_cudnn":
                row.update(tiling="sdpa_cudnn", partition_size=0, num_partitions=1, fused_reduce=False,
                           cluster_reduce=0)
            rows.append(dict(row, **prov))
            bar.update(1)
        with_sdpa_ratio(rows[-len(modes):])
        if out_csv is not None:
            write_csv_atomic(pd.DataFrame(rows), out_csv)
        del table, launch, _keep, per_set, sets
        torch.cuda.empty_cache()
    bar.close()
    return pd.DataFrame(rows)


def with_sdpa_ratio(shape_rows: list[dict]) -> None:
    """Adds ``vs_sdpa`` to one shape's rows: the mode's host time (wall time for ``checked``,
    whose host time includes its sync) over SDPA's eager host time in the same run. Host times
    move 1.5-2x between runs and machines (CPU clocks, other tenants); this ratio moves far less,
    so it is the number to compare across runs. NaN without an ``sdpa_cudnn`` row."""
    sdpa = [r["host_us"] for r in shape_rows if r["mode"] == "sdpa_cudnn"]
    ref = sdpa[0] if sdpa and sdpa[0] > 0 else math.nan
    for r in shape_rows:
        own = r["wall_us"] if r["mode"] == "checked" else r["host_us"]
        r["vs_sdpa"] = own / ref


def summary(df):
    """One line per shape: each mode's host and wall time per call, and the device time."""
    import pandas as pd

    keys = ["num_seqs", "max_seq_len"]
    out = []
    for (s, c), g in df.groupby(keys, sort=True):
        row = {"num_seqs": s, "max_seq_len": c}
        cpa = g[g["mode"] != "sdpa_cudnn"]
        if len(cpa):
            row["device_us"] = float(cpa["device_us"].iloc[0])
        for _, r in g.iterrows():
            row[f"{r['mode']}_host"] = r["host_us"]
            row[f"{r['mode']}_wall"] = r["wall_us"]
        out.append(row)
    return pd.DataFrame(out)


PROFILE_MODES = ("checked", "unchecked", "fresh_counters", "prepared")


def _where(filename: str, line: int, func: str) -> str:
    """A profile entry's place, short: the path from the package root (cpa/..., torch/...)."""
    import os

    if filename.startswith("~") or filename.startswith("<"):
        return func  # a builtin or C function: '{method ...}' as cProfile names it
    parts = filename.replace(os.sep, "/").split("/")
    for root in ("cpa", "torch", "triton", "typing", "functools", "dataclasses"):
        if root in parts[:-1]:
            parts = parts[len(parts) - 1 - parts[::-1].index(root):]
            break
    else:
        parts = parts[-1:]
    return f"{'/'.join(parts)}:{line}({func})"


def profile(*, num_seqs: int = 8, seq_len: int = 32768, mode: str = "unchecked", calls: int = 200,
            top: int = 30, num_heads: int = 64, num_kv_heads: int = 8, head_size: int = 128, block_size: int = 16):
    """Where an eager call's host time goes: cProfile over ``calls`` calls of ``mode``.

    One row per function among the ``top`` by own time and the ``top`` by cumulative time, per
    call: ``ncalls`` (times it ran per decode call), ``self_us`` and ``cum_us``; the first row,
    ``<total>``, is the profiled time per call, beside ``host_us``, the same calls' time
    without the profiler (cProfile's hooks inflate Python-heavy paths: compare shares, not
    absolute numbers). The output of the mode is checked against the reference first."""
    import cProfile
    import pstats

    import pandas as pd
    import torch

    from . import reference
    from .provenance import provenance

    if mode not in PROFILE_MODES:
        raise ValueError(f"mode: {mode!r}; profile one of {PROFILE_MODES} (graph and sdpa_cudnn spend "
                         "their host time outside Python)")
    if calls < 1 or top < 1:
        raise ValueError("calls and top must be at least 1")
    if not torch.cuda.is_available():
        raise RuntimeError("cpa host-profile needs a GPU")
    _sets, ref, out, table, launch, _keep = _shape(num_seqs, seq_len, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                                   head_size=head_size, block_size=block_size)
    call, check = table[mode]
    err = _error(check, out, ref)
    if not err <= reference.REL_ERR_TOL[torch.float16]:
        raise RuntimeError(f"{mode}: output differs from the reference (relative error {err:.3g})")
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    cyc = spin_cycles_per_us()
    plain = _median([host_us(call, calls, cyc) if mode != "checked" else wall_us(call, calls) for _ in range(5)])

    prof = cProfile.Profile()
    if mode != "checked":  # (the checked call syncs: a spin ahead of it would be profiled as its wait)
        torch.cuda._sleep(int(SPIN_US_PER_CALL * calls * cyc))  # keeps the launches from waiting on the device
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats  # {(file, line, func): (primitive calls, calls, own s, cumulative s, callers)}
    merged: dict[str, list] = {}  # (two builtins of one name are one row)
    for k, (_cc, nc, tt, ct, _callers) in stats.items():
        m = merged.setdefault(_where(*k), [0.0, 0.0, 0.0])
        m[0] += nc / calls
        m[1] += tt * 1e6 / calls
        m[2] += ct * 1e6 / calls
    entries = [(f, n, s, c) for f, (n, s, c) in merged.items()]
    total = sum(e[2] for e in entries)
    keep = {e[0] for e in sorted(entries, key=lambda e: -e[2])[:top]}
    keep |= {e[0] for e in sorted(entries, key=lambda e: -e[3])[:top]}
    rows = [dict(function="<total>", ncalls=1.0, self_us=total, cum_us=total)]
    rows += [dict(function=f, ncalls=n, self_us=s, cum_us=c) for f, n, s, c in
             sorted((e for e in entries if e[0] in keep), key=lambda e: -e[3])]
    base = dict(num_seqs=num_seqs, max_seq_len=seq_len, num_heads=num_heads, num_kv_heads=num_kv_heads,
                head_size=head_size, block_size=block_size, dtype="fp16", mode=mode, calls=calls,
                tiling=launch.kernel.variant.tiling, partition_size=launch.shape.partition_size,
                host_us=plain, max_rel_err=float(err))
    prov = provenance()
    return pd.DataFrame([dict(base, **r, **prov) for r in rows])
