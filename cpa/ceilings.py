"""Memory ceilings measured on the device in the same run: read-only and copy bandwidth."""

from __future__ import annotations


def _triton_read_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def read_sum(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        base = pid * BLOCK * ITERS
        for i in range(ITERS):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))

    return read_sum


# Reader shapes for the read ceiling: (fp16 elements per program and iteration, iterations,
# warps). The first is the single shape used before 2026-12-06; cuDNN's SDPA read its K/V at up
# to 101% of that one and a paged reader with 128 KB in flight per iteration at 100.4%, so the
# ceiling is the fastest of a few shapes with more bytes in flight per program.
READ_CONFIGS = ((4096, 16, 4), (8192, 16, 4), (8192, 16, 8), (16384, 8, 8))  # sm_90: 56-127 registers, no spills


def measure(nbytes: int = 4 << 30, replays: int = 20, configs=READ_CONFIGS) -> dict:
    """{'read_gbps', 'copy_gbps', 'read_method', 'read_gbps_by_shape', 'bytes'} over an `nbytes`
    fp16 buffer (random data): copy is torch's device copy (2 x nbytes moved), read the fastest
    of the streaming read shapes in `configs` (named in `read_method`; each shape's GB/s in
    `read_gbps_by_shape`)."""
    import torch

    from .jit import require_gpu
    from .timing import time_graph

    require_gpu("measuring the read and copy ceilings")
    n = nbytes // 2
    x = torch.randn(n, device="cuda", dtype=torch.float16)
    y = torch.empty_like(x)
    copy = time_graph([lambda: y.copy_(x)], replays=replays, use_graph=False)
    res = {"copy_gbps": 2 * nbytes / (copy.median_us * 1e-6) / 1e9, "bytes": nbytes}
    best, errors, by_shape = None, [], {}
    try:
        kern = _triton_read_kernel()
    except Exception as e:  # no triton
        kern, errors = None, [f"triton unavailable: {type(e).__name__}"]
    for block, iters, warps in configs if kern is not None else ():
        try:
            grid = (triton_cdiv(n, block * iters),)
            out = torch.empty(grid[0], device="cuda", dtype=torch.float32)
            t = time_graph([lambda: kern[grid](x, out, n, BLOCK=block, ITERS=iters, num_warps=warps)],
                           replays=replays, use_graph=False)
        except Exception as e:  # a shape this Triton or GPU refuses: the others still count
            errors.append(f"{block}x{iters}/{warps}w: {type(e).__name__}")
            continue
        gbps = nbytes / (t.median_us * 1e-6) / 1e9
        by_shape[f"{block}x{iters}/{warps}w"] = gbps
        if best is None or gbps > best[0]:
            best = (gbps, f"triton streaming read (fp16), fastest of {len(configs)} shapes: "
                          f"{block} x {iters} elements per program, {warps} warps")
    if best is None:  # a torch reduction reads every byte once too
        read = time_graph([lambda: x.sum(dtype=torch.float32)], replays=replays, use_graph=False)
        best = (nbytes / (read.median_us * 1e-6) / 1e9, f"torch.sum ({'; '.join(errors)})")
    res.update(read_gbps=best[0], read_method=best[1], read_gbps_by_shape=by_shape)
    x = y = None  # (free the 8 GB before empty_cache; the timing closures hold these cells)
    torch.cuda.empty_cache()
    return res


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
