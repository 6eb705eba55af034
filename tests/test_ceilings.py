"""The memory ceilings every bench and sweep row is read against (cpa.ceilings)."""

import pytest

from cpa import ceilings as C


def test_read_shapes_are_distinct_and_the_old_one_is_kept():
    # the single shape used before 2026-12-06 stays in the set, so a new ceiling is never below it
    assert C.READ_CONFIGS[0] == (4096, 16, 4)
    assert len(set(C.READ_CONFIGS)) == len(C.READ_CONFIGS) >= 2
    assert all(b % (32 * w) == 0 for b, _, w in C.READ_CONFIGS)  # whole elements per thread


@pytest.mark.gpu
def test_read_ceiling_is_the_fastest_shape():
    c = C.measure(nbytes=512 << 20, replays=5)
    shapes = c["read_gbps_by_shape"]
    assert len(shapes) == len(C.READ_CONFIGS) and all(v > 0 for v in shapes.values())
    assert c["read_gbps"] == max(shapes.values()) and c["copy_gbps"] > 0
    fastest = max(shapes, key=shapes.get)
    block, rest = fastest.split("x")
    assert f"{block} x {rest.split('/')[0]} elements per program" in c["read_method"]
