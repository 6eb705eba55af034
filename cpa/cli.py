"""Command line: ``cpa compare`` (and ``python -m cpa compare``)."""

from __future__ import annotations

import statistics
import time
from typing import Optional

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="cpa: a workbench for paged-attention decode kernels.",
)

_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


@app.callback()
def _main() -> None:
    """cpa: a workbench for paged-attention decode kernels."""


def _parse_partitions(text: str) -> list[Optional[int]]:
    out: list[Optional[int]] = []
    for tok in text.split(","):
        tok = tok.strip().lower()
        if tok in ("none", "single", "0", ""):
            out.append(None)
        else:
            out.append(int(tok))
    return out


@app.command()
def compare(
    device: str = typer.Option("cpu", help="torch device for the reference (cpu, cuda, ...)."),
    seq_lens: str = typer.Option("1024,4096,16384", help="comma-separated context lengths; one batch each."),
    partition_sizes: str = typer.Option(
        "none,64,128,256,512,1024", help="comma-separated partition sizes; 'none' = single pass."
    ),
    num_seqs: int = typer.Option(2, help="sequences per batch (all of the same context length)."),
    num_heads: int = typer.Option(64, help="query heads."),
    num_kv_heads: int = typer.Option(8, help="KV heads."),
    head_size: int = typer.Option(128, help="head size."),
    block_size: int = typer.Option(16, help="KV-cache block size."),
    dtype: str = typer.Option("fp16", help="query/cache dtype: fp32, fp16 or bf16."),
    kv_cache_dtype: str = typer.Option("auto", help="auto or fp8."),
    repeats: int = typer.Option(3, help="timed runs per point (median reported), after one warm-up."),
    seed: int = typer.Option(0, help="input seed."),
) -> None:
    """Partition-size comparison of the torch reference (Llama-70B-like decode shape by default).

    For each context length and partition size: max_num_partitions, the median wall time of
    cpa.reference.paged_attention, and the largest per-(sequence, head) relative error of its
    float32 output against the single-pass float32 output.
    """
    import torch

    from .inputs import make_paged_inputs
    from .reference import paged_attention, reduce_partitions

    if dtype not in _DTYPES:
        raise typer.BadParameter(f"dtype: got {dtype!r}; allowed: {', '.join(_DTYPES)}")
    tdtype = getattr(torch, _DTYPES[dtype])
    lens = [int(v) for v in seq_lens.split(",") if v.strip()]
    parts = _parse_partitions(partition_sizes)
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)

    typer.echo(
        f"cpa compare -- the pure-torch REFERENCE on {dev} (cpa.reference.paged_attention), not a kernel:\n"
        f"times are of the reference implementation and say nothing about GPU kernel speed.\n"
        f"shape: num_seqs={num_seqs} num_heads={num_heads} num_kv_heads={num_kv_heads} "
        f"head_size={head_size} block_size={block_size} dtype={dtype} kv_cache_dtype={kv_cache_dtype}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads\n"
        f"max_rel_err: max over (seq, head) of ||out_P - out_single|| / ||out_single||, float32 outputs\n"
    )
    header = f"{'seq_len':>8} {'partition_size':>14} {'max_num_partitions':>18} {'time_ms':>10} {'max_rel_err':>12}"
    typer.echo(header)
    typer.echo("-" * len(header))
    for L in lens:
        inp = make_paged_inputs(num_seqs, num_heads, num_kv_heads, head_size, block_size, L, dtype=tdtype,
                                kv_cache_dtype=kv_cache_dtype, seed=seed, device=dev)
        kw = inp.as_kwargs()
        single = None
        for p in parts:
            _, es, ml, to = paged_attention(**kw, partition_size=p, return_intermediates=True)
            out32 = reduce_partitions(es, ml, to).double()
            if single is None:
                single = paged_attention(**kw, return_intermediates=True)[3][:, :, 0].double()
            num = torch.linalg.vector_norm(out32 - single, dim=-1)
            den = torch.linalg.vector_norm(single, dim=-1)
            err = float((num / den).max())
            times = []
            paged_attention(**kw, partition_size=p)  # warm-up
            for _ in range(max(1, repeats)):
                sync()
                t0 = time.perf_counter()
                paged_attention(**kw, partition_size=p)
                sync()
                times.append((time.perf_counter() - t0) * 1e3)
            nparts = 1 if p is None else -(-L // p)
            typer.echo(f"{L:>8} {str(p):>14} {nparts:>18} {statistics.median(times):>10.2f} {err:>12.2e}")
