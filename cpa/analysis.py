"""Sweep tables for the notebooks and the report: where the data comes from, and the derived
tables (best variant per shape, best partition size, speed-ups). pandas only; the figures
are in :mod:`cpa.plots`.

Data source: with a GPU, :func:`sweep_results` runs (or resumes) the grid live into
``build/sweeps/<device>-<grid>.parquet``; without one it reads the dataset shipped in
``data/sweeps/h200-<grid>.parquet``. ``CPA_DATA=shipped`` forces the shipped data on a GPU
machine, ``CPA_DATA=live`` refuses to fall back.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "data" / "sweeps"
LIVE = ROOT / "build" / "sweeps"


@dataclass
class SweepData:
    """A sweep table and where it came from (for the banner of every page)."""

    grid: str
    df: object  # pandas DataFrame
    source: str  # "shipped" | "live"
    path: Path
    runs: list = field(default_factory=list)

    @property
    def device(self) -> str:
        names = sorted(set(self.df.device_name.dropna())) if len(self.df) else []
        return ", ".join(names) or "?"

    @property
    def commits(self) -> list[str]:
        return sorted({str(c)[:7] for c in self.df.git_commit.dropna()})

    @property
    def dates(self) -> list[str]:
        return sorted({str(t)[:10] for t in self.df.timestamp.dropna()})

    def ceilings(self) -> dict:
        """The read / copy ceilings of the run(s) behind the table (medians if several)."""
        r = self.df.read_gbps_ceiling.dropna()
        c = self.df.copy_gbps_ceiling.dropna()
        return {"read_gbps": float(r.median()) if len(r) else math.nan,
                "copy_gbps": float(c.median()) if len(c) else math.nan}

    def banner(self) -> str:
        """One Markdown line saying what the numbers are."""
        what = ("**Shipped dataset** (no GPU here, or CPA_DATA=shipped): measured earlier"
                if self.source == "shipped" else "**Live run** on this machine's GPU")
        rel = os.path.relpath(self.path, ROOT) if self.path.is_absolute() else str(self.path)
        return (f"{what} on {self.device}; grid `{self.grid}`, {len(self.df)} rows from `{rel}`, "
                f"commit {', '.join(self.commits) or '?'}, {', '.join(self.dates) or '?'}.")


def has_gpu() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def shipped_path(grid: str) -> Path:
    return SHIPPED / f"h200-{grid}.parquet"


def _device_slug() -> str:
    import torch

    return torch.cuda.get_device_name().lower().replace("nvidia ", "").replace(" ", "-")


def data_source(mode: str | None = None) -> str:
    """"live" or "shipped": `mode` (else CPA_DATA, else auto), auto being live where torch sees
    a GPU. (Whether a live source has its GPU is the caller's to check.)"""
    mode = (mode or os.environ.get("CPA_DATA") or "auto").lower()
    if mode not in ("auto", "live", "shipped"):
        raise ValueError(f"CPA_DATA / mode={mode!r}: expected auto, live or shipped")
    return "live" if mode == "live" or (mode == "auto" and has_gpu()) else "shipped"


def sweep_results(grid: str, *, mode: str | None = None, progress: bool = True, **sweep_kw) -> SweepData:
    """The table of a named grid: live on a GPU (run or resumed), else the shipped one."""
    from . import sweep as S

    if data_source(mode) == "live":
        if not has_gpu():
            raise RuntimeError("CPA_DATA=live, but no GPU is visible to torch")
        out = LIVE / f"{_device_slug()}-{grid}.parquet"
        df = S.run_sweep(grid, out, resume=True, progress=progress, echo=lambda m: None, **sweep_kw)
        return SweepData(grid, df[df.grid == grid].reset_index(drop=True), "live", out, S.read_results(out)[1]["runs"])
    path = shipped_path(grid)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no shipped dataset for grid {grid!r} (have: "
                                f"{', '.join(p.stem[5:] for p in sorted(SHIPPED.glob('h200-*.parquet')))})")
    df, meta = S.read_results(path)
    return SweepData(grid, df, "shipped", path, meta["runs"])


def sweep_tables(mode: str | None = None) -> tuple[str, list[Path]]:
    """("live" | "shipped", the sweep parquets that source holds): the live tables of this GPU
    under build/sweeps (those the notebooks ran), else the shipped H200 ones -- the same choice
    as :func:`sweep_results`, without running anything."""
    if data_source(mode) == "live":
        return "live", sorted(LIVE.glob(f"{_device_slug()}-*.parquet")) if has_gpu() else []
    return "shipped", sorted(SHIPPED.glob("h200-*.parquet"))


def shipped_sweep_on(grid: str, gpu: str) -> SweepData:
    """A grid's shipped run on another card (``gpu``: the file prefix, e.g. "h100"), kept in
    data/sweeps/experiments as ``<gpu>-<grid>-<commit>.parquet``; the newest run where there are
    several. Tables of some points only (``<gpu>-<grid>-<points>-<commit>.parquet``, e.g. points
    re-measured on another card of the same model) are not a grid's run. Measured on that card:
    compare it with the H200 tables only shape by shape."""
    import re

    from . import sweep as S

    found = []
    whole = re.compile(rf"{re.escape(gpu)}-{re.escape(grid)}-[0-9a-f]{{7,40}}\.parquet")
    for path in sorted((SHIPPED / "experiments").glob(f"{gpu}-{grid}-*.parquet")):
        if not whole.fullmatch(path.name):
            continue
        df, meta = S.read_results(path)
        found.append((df.timestamp.max(), path, df, meta))
    if not found:
        raise FileNotFoundError(f"no shipped {gpu} sweep of grid {grid!r} in {SHIPPED / 'experiments'}")
    _, path, df, meta = max(found, key=lambda f: f[0])
    return SweepData(grid, df, "shipped", path, meta["runs"])


def shipped_sweep_at(grid: str, commits) -> SweepData:
    """The shipped table of a grid whose CPA rows were measured at one of ``commits`` (full or
    abbreviated hashes): the current file, else the earlier run kept in data/sweeps/experiments.
    Counters of an older kernel are joined to the sweep of that kernel, not to today's."""
    from . import sweep as S
    from . import variants as V

    trees = kernel_trees()
    # a commit stands for its kernel sources where they are listed (data/kernel-sources.json)
    key = lambda c: trees.get(str(c)[:7], str(c)[:7])  # noqa: E731
    want = {key(c) for c in commits}
    for path in [shipped_path(grid), *sorted((SHIPPED / "experiments").glob(f"h200-{grid}-*.parquet"))]:
        if not path.exists():
            continue
        df, meta = S.read_results(path)
        if want & {key(c) for c in df[df.tiling.isin(V.TILINGS)].git_commit.dropna()}:
            return SweepData(grid, df, "shipped", path, meta["runs"])
    raise FileNotFoundError(f"no shipped {grid!r} sweep measured at {sorted(str(c)[:7] for c in commits)}")


KERNEL_SOURCES = Path(__file__).resolve().parent.parent / "data" / "kernel-sources.json"


def kernel_trees() -> dict[str, str]:
    """Abbreviated commit -> git tree of its cpa/csrc, for the commits of the shipped datasets
    (data/kernel-sources.json): two commits with the same tree ran the same kernel, so counters
    of one join the sweep of the other."""
    import json

    if not KERNEL_SOURCES.exists():
        return {}
    return {c[:7]: t for c, t in json.loads(KERNEL_SOURCES.read_text())["cpa/csrc"].items()}


# ---------------------------------------------------------------------------- derived tables
def cpa_rows(df):
    """Verified, timed rows of the CPA kernel (not the peers)."""
    from .sweep import timed_rows
    from .variants import TILINGS

    ok = timed_rows(df)
    return ok[ok.tiling.isin(TILINGS)]


def peer_names(df) -> list[str]:
    from .variants import TILINGS

    return [t for t in dict.fromkeys(df.tiling) if t not in TILINGS]


def best_by_point(df, tiling: str | None = None):
    """One row per point: the fastest verified CPA variant (of one tiling, if given)."""
    d = cpa_rows(df)
    if tiling:
        d = d[d.tiling == tiling]
    return d.loc[d.groupby("point_id", sort=False).time_us.idxmin()].reset_index(drop=True)


def speedups(df, baseline_partition: int = 256):
    """Per point: the best CPA variant, the best at a fixed partition size, each peer.

    ``vs_p<N>`` = time of the best tiling at partition N / time of the best variant (> 1:
    choosing the partition size per shape pays); ``vs_<peer>`` = peer time / best CPA time
    (> 1: CPA is faster); ``<peer>_same_run``: the peer row was timed in the best CPA row's run
    (False for rows merged from another run, e.g. the shipped FlashInfer rows: the same code can
    run ~1% apart between runs, so such a ratio is not like for like)."""
    import pandas as pd

    d = cpa_rows(df)
    best = best_by_point(df).set_index("point_id")
    fixed = d[d.partition_size == baseline_partition]
    fixed = fixed.loc[fixed.groupby("point_id").time_us.idxmin()].set_index("point_id")
    out = best[["num_seqs", "max_seq_len", "mean_seq_len", "num_heads", "num_kv_heads", "head_size", "tiling",
                "partition_size", "time_us", "gbps", "frac_peak_bw"]].copy()
    out[f"p{baseline_partition}_us"] = fixed.time_us
    out[f"vs_p{baseline_partition}"] = fixed.time_us / best.time_us
    from .sweep import timed_rows

    ok = timed_rows(df)
    for p in peer_names(df):
        rows = ok[ok.tiling == p].set_index("point_id")
        out[f"{p}_us"] = rows.time_us
        out[f"vs_{p}"] = rows.time_us / best.time_us
        if "run_id" in rows and "run_id" in best:
            rid = rows.run_id.reindex(best.index)
            out[f"{p}_same_run"] = (rid == best.run_id).astype("boolean").where(rid.notna())
    return pd.DataFrame(out).reset_index()


def kv_dtype_table(df):
    """Per (query dtype, batch, context): the best verified CPA variant with the 16-bit KV cache
    (``auto``) and with the fp8 e4m3 cache, and ``fp8_over_auto`` = fp8 time / 16-bit time (0.5
    where halving the bytes read turns fully into time; 1.0 where the fp8 decode eats all of it)."""
    import pandas as pd

    best = best_by_point(df)
    keys = ["dtype", "num_seqs", "max_seq_len"]
    cols = {}
    for kv in ("auto", "fp8"):
        b = best[best.kv_cache_dtype == kv].set_index(keys)
        cols[f"{kv}_variant"] = b.tiling + "/" + b.partition_size.astype(str)
        cols[f"{kv}_us"] = b.time_us
        cols[f"{kv}_frac_peak_bw"] = b.frac_peak_bw
    out = pd.DataFrame(cols)
    out["fp8_over_auto"] = out.fp8_us / out.auto_us
    return out.reset_index().sort_values(keys).reset_index(drop=True)


def partition_table(df, tiling: str, value: str = "time_us"):
    """(batch, context) x partition size of one tiling: `value` (time_us, gbps, ...)."""
    d = cpa_rows(df)
    d = d[d.tiling == tiling]
    return d.pivot_table(index=["num_seqs", "max_seq_len"], columns="partition_size", values=value)


def choices(df) -> dict[str, list]:
    """The values a notebook's controls can offer for this table."""
    d = cpa_rows(df)
    return {"tiling": sorted(d.tiling.unique()), "dtype": sorted(d.dtype.unique()),
            "kv_cache_dtype": sorted(d.kv_cache_dtype.unique())}
