"""Device timing: CUDA-graph replay over rotating input sets, device events, medians.

One graph holds one launch per input set (sets differ in memory, so the L2 cannot serve a
later set from an earlier one), cycled to at least MIN_CALLS launches; a replay's time over
the number of launches is one call. This is
how serving engines run decode (graphs, no launch gaps), and it is what the shared peer
numbers were measured with.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass
class Timing:
    median_us: float
    p25_us: float
    p75_us: float
    samples: int

    def as_dict(self, prefix: str = "time_us") -> dict:
        return {prefix: self.median_us, f"{prefix}_p25": self.p25_us, f"{prefix}_p75": self.p75_us}


def _quantiles(xs: Sequence[float]) -> tuple[float, float, float]:
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return statistics.median(xs), q[0], q[2]


# Launches per replay at least, where one pass over the sets is short: a replay has a fixed
# cost (the graph launch, the event pair; and when a replay is shorter than the host needs to
# submit one, the host's pace), which should be shared by many calls rather than land on one.
# Where few input sets fit in memory (a set of >= 64 MB is past the L2 anyway) the sets are
# cycled; a pass over the sets that already takes SHORT_PASS_US or more is left as it is.
MIN_CALLS = 8
SHORT_PASS_US = 500.0
# Warm-up before the timed replays: at least `warmup` replays and at least WARMUP_US of them.
# Three replays of a short shape (~2 ms at 1 x 16k) were too few to start the timed replays warm;
# 20 ms costs little. (The default_path rows' 1-1.6% lead over the same launch named earlier at
# the shortest target-2 shapes is not a warm-up effect: neither 20 ms nor SETTLE_US moved it.
# Identical launches with another allocation history differ by up to 1.5% there: placement;
# data/bench/README.md.)
WARMUP_US = 20_000.0
MAX_WARMUP_REPLAYS = 2000  # (per WARMUP_US: a longer warm-up asked for may run proportionally more)
# The first timing after a shape's inputs are written: a longer warm-up. On an H100 (e0c001c,
# data/bench/experiments/h100-firstlaunch-*) the first timing of a shape read 1.4-1.5% slow at
# 1 x 8k with the 20 ms warm-up, 0.4% with 300 ms, 0.1% with 1 s (the SM clock at 1980 MHz
# throughout); the later timings of the shape were level. `cpa.bench` applies it (SETTLE).
SETTLE_US = 1_000_000.0


class Settling:
    """The warm-up of a run of timings that share a set-up (a bench shape, a sweep point): the
    first asked for settles for SETTLE_US, the rest warm up as usual (None: WARMUP_US). With
    ``settle=False`` none settles."""

    def __init__(self, settle: bool = True):
        self.pending = settle

    def warmup_us(self) -> float | None:
        us = SETTLE_US if self.pending else None
        self.pending = False
        return us


def settle_read(tensors: Sequence, us: float = SETTLE_US) -> int:
    """Read `tensors` (a shape's K/V pool) on the device again and again for about `us`
    microseconds; the number of passes. (An experiment's arm of bench.SETTLE: is reading the
    fresh inputs what the first timing's long warm-up does?)"""
    import torch

    passes, t0 = 0, time.perf_counter()
    while (time.perf_counter() - t0) * 1e6 < us:
        for t in tensors:
            t.view(torch.uint8).sum(dtype=torch.int64)
        torch.cuda.synchronize()
        passes += 1
    return passes


def cycled(calls: Sequence, min_calls: int, pass_us: float) -> list:
    """The calls to put in one replay: `calls` repeated in order to at least `min_calls`
    entries when one pass over them (`pass_us`, measured) is shorter than SHORT_PASS_US."""
    calls = list(calls)
    if len(calls) >= min_calls or pass_us >= SHORT_PASS_US:
        return calls
    return [calls[i % len(calls)] for i in range(min_calls)]


def warmup_replays(replay_us: float, warmup_us: float | None = None) -> int:
    """Replays to run after the counted warm-up so that about `warmup_us` (None: WARMUP_US) more
    of them run, a replay taking `replay_us`; at most MAX_WARMUP_REPLAYS per WARMUP_US asked for
    (the cap scales with a longer warm-up; with WARMUP_US set to 0 it is MAX_WARMUP_REPLAYS)."""
    warm_us = WARMUP_US if warmup_us is None else float(warmup_us)
    cap = int(MAX_WARMUP_REPLAYS * max(1.0, warm_us / WARMUP_US if WARMUP_US > 0 else 1.0))
    return min(cap, int(warm_us / max(replay_us, 1.0)))


def time_graph(calls: Sequence[Callable[[], None]], *, replays: int = 30, warmup: int = 3,
               use_graph: bool = True, min_calls: int = MIN_CALLS, warmup_us: float | None = None) -> Timing:
    """Median device time of one call, each call run once per replay (rotating sets); a list
    of fewer than ``min_calls`` whose pass takes under SHORT_PASS_US is cycled to that many."""
    import torch

    if not calls:
        raise ValueError("time_graph needs at least one call")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in calls:  # warm-up outside capture: lazy inits, module loads
            f()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for f in calls:  # one timed pass: is the per-replay fixed cost a visible share?
            f()
        t1.record()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    calls = cycled(calls, min_calls, t0.elapsed_time(t1) * 1e3)
    if use_graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for f in calls:
                f()
        run = g.replay
    else:
        def run():
            for f in calls:
                f()
    for _ in range(warmup):
        run()
    w0, w1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    w0.record()
    run()
    w1.record()
    torch.cuda.synchronize()
    for _ in range(warmup_replays(w0.elapsed_time(w1) * 1e3, warmup_us)):
        run()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for s, e in zip(starts, ends):
        s.record()
        run()
        e.record()
    torch.cuda.synchronize()
    per_call = [s.elapsed_time(e) * 1e3 / len(calls) for s, e in zip(starts, ends)]
    med, p25, p75 = _quantiles(per_call)
    return Timing(med, p25, p75, len(per_call))
