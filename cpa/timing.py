"""Device timing: CUDA-graph replay over rotating input sets, device events, medians.

One graph holds one launch per input set (sets differ in memory, so the L2 cannot serve a
later set from an earlier one); a replay's time over the number of sets is one call. This is
how serving engines run decode (graphs, no launch gaps), and it is what the shared peer
numbers were measured with.
"""

from __future__ import annotations

import statistics
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


def time_graph(calls: Sequence[Callable[[], None]], *, replays: int = 30, warmup: int = 3,
               use_graph: bool = True) -> Timing:
    """Median device time of one call, each call run once per replay (rotating sets)."""
    import torch

    if not calls:
        raise ValueError("time_graph needs at least one call")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in calls:  # warm-up outside capture: lazy inits, module loads
            f()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
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
