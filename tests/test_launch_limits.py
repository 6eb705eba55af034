"""What cpa.ops refuses before a launch that the shared validation cannot know: grid extents,
scale factors that overflow the kernel's float32, and which device a launch runs on (CPU)."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from cpa import ops
from cpa.inputs import make_paged_inputs
from cpa.validation import validate_paged_attention_args


def shape(**over):
    inp = make_paged_inputs(2, 8, 2, 128, 16, [40, 100], dtype=torch.float16)
    return dataclasses.replace(validate_paged_attention_args(**inp.as_kwargs()), **over)


def test_grid_limits():
    s = shape()
    assert ops.grid_limit_error(s, 65535, 256, reduce_launch=True) is None
    assert "65535" in ops.grid_limit_error(s, 65536, 256, reduce_launch=False)
    assert ops.grid_limit_error(shape(num_kv_heads=65536), 1, 256, reduce_launch=False).startswith("key_cache")
    wide = shape(num_seqs=65536)
    assert ops.grid_limit_error(wide, 2, 256, reduce_launch=True).startswith("query: num_seqs 65536")
    # without a reduce launch (one partition, the fused reduce or the cluster combine) the
    # sequences are the attention grid's x extent, which has room
    assert ops.grid_limit_error(wide, 2, 256, reduce_launch=False) is None


def test_scales_that_overflow_float32_are_refused():
    ops.kernel_scalars(shape(), 0.088, 1.0, 1.0, 2)
    with pytest.raises(ValueError, match="^scale: .*overflows"):
        ops.kernel_scalars(shape(), 1e39, 1.0, 1.0, 2)  # finite in Python, inf in the kernel
    fp8 = shape(kv_cache_dtype="fp8")
    ops.kernel_scalars(fp8, 0.088, 1e30, 1e30, 1)
    with pytest.raises(ValueError, match="^scale x k_scale"):
        ops.kernel_scalars(fp8, 0.088, 1e38, 1.0, 1)  # 0.088 x log2(e) x 256 x 1e38: past float32
    with pytest.raises(ValueError, match="^v_scale"):
        ops.kernel_scalars(fp8, 0.088, 1.0, 2e36, 1)


def test_a_launch_runs_on_its_tensors_device(monkeypatch):
    monkeypatch.setattr(ops, "_current_device", lambda: 0)
    assert isinstance(ops.on_device(0), contextlib.nullcontext)
    guard = ops.on_device(1)  # (not entered: no GPU here)
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1


def test_fp8_decode_factor_follows_the_encoding():
    """The kernel's bit conversion gives e4m3fn / 256 and e4m3fnuz / 128: the host folds that in."""
    fn = shape(kv_cache_dtype="fp8", fp8_format="e4m3fn")
    uz = shape(kv_cache_dtype="fp8", fp8_format="e4m3fnuz")
    a, b = ops.kernel_scalars(fn, 0.1, 1.0, 1.0, 1), ops.kernel_scalars(uz, 0.1, 1.0, 1.0, 1)
    assert a[0] == pytest.approx(2 * b[0]) and a[1] == 256.0 and b[1] == 128.0
    assert ops.fp8_format_unsupported("hip", "e4m3fnuz") is None and ops.fp8_format_unsupported("cuda", "e4m3fn") is None
    assert "NVIDIA" in ops.fp8_format_unsupported("cuda", "e4m3fnuz")
