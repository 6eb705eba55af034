"""cpa.timing: which launches one graph replay holds (the GPU part runs in the GPU tests)."""

import pytest

from cpa import timing


def test_short_passes_are_cycled_to_min_calls_in_order():
    calls = ["a", "b", "c"]
    assert timing.cycled(calls, 8, 30.0) == ["a", "b", "c", "a", "b", "c", "a", "b"]


def test_long_passes_and_many_sets_are_left_alone():
    assert timing.cycled(["a"], 8, timing.SHORT_PASS_US) == ["a"]
    sets = list(range(16))
    assert timing.cycled(sets, 8, 1.0) == sets


def test_warmup_replays_fill_the_warmup_time_up_to_a_cap_that_scales_with_it(monkeypatch):
    monkeypatch.setattr(timing, "WARMUP_US", 20_000.0)
    assert timing.warmup_replays(1_000.0) == 20  # 20 ms of 1 ms replays
    assert timing.warmup_replays(1_000.0, 100_000.0) == 100
    assert timing.warmup_replays(1.0) == timing.MAX_WARMUP_REPLAYS  # tiny replays: capped
    assert timing.warmup_replays(1.0, 4 * 20_000.0) == 4 * timing.MAX_WARMUP_REPLAYS
    assert timing.warmup_replays(0.0) == timing.MAX_WARMUP_REPLAYS  # (a 0 us reading counts as 1 us)
    # WARMUP_US set to 0 (a test's "no time-based warm-up"): none, and an asked-for one still
    # runs, capped at MAX_WARMUP_REPLAYS (the GPU test found a division by zero here, eea9729)
    monkeypatch.setattr(timing, "WARMUP_US", 0.0)
    assert timing.warmup_replays(10.0) == 0
    assert timing.warmup_replays(10.0, 50_000.0) == timing.MAX_WARMUP_REPLAYS


@pytest.mark.gpu
def test_time_graph_runs_each_cycled_call(monkeypatch):
    import torch

    x = torch.randn(1 << 20, device="cuda")
    seen = []

    def call(i):
        def f():
            seen.append(i)
            x.mul_(1.0)
        return f

    monkeypatch.setattr(timing, "WARMUP_US", 0.0)  # (the time-based warm-up counted below)
    t = timing.time_graph([call(0), call(1)], replays=5, warmup=1, use_graph=False, min_calls=4)
    assert t.samples == 5 and 0 < t.p25_us <= t.median_us <= t.p75_us
    # warm-up pass, timed pass, then (1 warm-up + 1 measured warm-up + 5 replays) x the 4 cycled calls
    assert seen == [0, 1, 0, 1] + [0, 1, 0, 1] * 7

    # the time-based warm-up: a replay of two tiny launches takes far under WARMUP_US, so it
    # adds replays, at most MAX_WARMUP_REPLAYS, each of the whole cycled list
    monkeypatch.setattr(timing, "WARMUP_US", 20_000.0)
    seen.clear()
    timing.time_graph([call(0), call(1)], replays=5, warmup=1, use_graph=False, min_calls=4)
    extra, rest = divmod(len(seen) - 4, 4)
    extra -= 7
    assert rest == 0 and seen == [0, 1] * (len(seen) // 2)
    assert 1 <= extra <= timing.MAX_WARMUP_REPLAYS

    # a longer warm-up asked for (bench's first timing of a shape: SETTLE_US) runs more of them,
    # its cap scaled with it
    seen.clear()
    timing.time_graph([call(0), call(1)], replays=5, warmup=1, use_graph=False, min_calls=4,
                      warmup_us=4 * 20_000.0)
    longer = (len(seen) - 4) // 4 - 7
    assert extra < longer <= 4 * timing.MAX_WARMUP_REPLAYS
