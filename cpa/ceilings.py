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


def measure(nbytes: int = 4 << 30, replays: int = 20) -> dict:
    """{'read_gbps', 'copy_gbps', 'read_method'} over an `nbytes` fp16 buffer (random data)."""
    import torch

    from .timing import time_graph

    n = nbytes // 2
    x = torch.randn(n, device="cuda", dtype=torch.float16)
    y = torch.empty_like(x)
    copy = time_graph([lambda: y.copy_(x)], replays=replays, use_graph=False)
    res = {"copy_gbps": 2 * nbytes / (copy.median_us * 1e-6) / 1e9, "bytes": nbytes}
    try:
        kern = _triton_read_kernel()
        BLOCK, ITERS = 4096, 16
        grid = (triton_cdiv(n, BLOCK * ITERS),)
        out = torch.empty(grid[0], device="cuda", dtype=torch.float32)
        read = time_graph([lambda: kern[grid](x, out, n, BLOCK=BLOCK, ITERS=ITERS)], replays=replays, use_graph=False)
        res.update(read_gbps=nbytes / (read.median_us * 1e-6) / 1e9, read_method="triton streaming read (fp16)")
    except Exception as e:  # no triton: a torch reduction reads every byte once too
        read = time_graph([lambda: x.sum(dtype=torch.float32)], replays=replays, use_graph=False)
        res.update(read_gbps=nbytes / (read.median_us * 1e-6) / 1e9,
                   read_method=f"torch.sum (triton unavailable: {type(e).__name__})")
    del x, y
    torch.cuda.empty_cache()
    return res


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
