"""Counter tables for notebook 03 and the report: the recorded profiler runs, joined to the
sweep of the same grid, with the derived comparisons (counter DRAM bandwidth against the
sweep's bytes / time, theoretical against achieved occupancy, a roofline). pandas only; the
figures are in :mod:`cpa.plots`.

Data source: ``data/counters/h200-<grid>.parquet`` as ``cpa profile`` wrote it on the H200
(``CPA_COUNTERS_PATH`` points elsewhere, e.g. at a live run). The counters are of the
attention kernel alone (the profiling harness launches no reduce), so they are compared with
the sweep's ``attn_time_us`` and the bytes that kernel moves, not with the whole call.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "data" / "counters"

#: the columns that identify a (point, variant) in both tables
KEYS = ("tiling", "partition_size", "num_seqs", "max_seq_len", "num_heads", "num_kv_heads", "head_size", "dtype",
        "kv_cache_dtype")
#: portable metrics (profiling/<profiler>.yaml) a counter table may carry
METRICS = ("duration_ns", "achieved_occupancy", "dram_read_bytes", "dram_write_bytes", "dram_bandwidth",
           "l2_hit_rate", "matrix_core_busy", "valu_busy", "lds_bank_conflict_rate", "registers_per_thread",
           "occupancy_limit_registers", "shared_memory_bytes", "block_size", "grid_size")
_ELEM = {"fp16": 2, "bf16": 2}
_KV_ELEM = {"auto": None, "fp8": 1}


@dataclass
class CounterData:
    df: object  # pandas DataFrame, one row per (point, variant)
    path: Path

    @property
    def device(self) -> str:
        return ", ".join(sorted(set(self.df.device_name.dropna()))) or "?"

    @property
    def metrics(self) -> list[str]:
        return [m for m in METRICS if m in self.df.columns and self.df[m].notna().any()]

    def banner(self) -> str:
        rel = os.path.relpath(self.path, ROOT) if self.path.is_absolute() else str(self.path)
        commits = sorted({str(c)[:7] for c in self.df.git_commit.dropna()})
        dates = sorted({str(t)[:10] for t in self.df.timestamp.dropna()})
        sets = sorted(set(self.df.counter_set.dropna())) if "counter_set" in self.df else []
        prof = sorted(set(self.df.profiler.dropna())) if "profiler" in self.df else []
        return (f"**Recorded counters** ({', '.join(prof) or '?'}, set {', '.join(sets) or '?'}) measured on "
                f"{self.device}: {len(self.df)} (point, variant) rows from `{rel}`, commit "
                f"{', '.join(commits) or '?'}, {', '.join(dates) or '?'}.")


#: recorded counter tables by grid (the name issue 6 asked for)
SHIPPED_FILES = {"llama70b-decode": "h200-llama70b.parquet"}


def shipped_path(grid: str = "llama70b-decode") -> Path:
    return SHIPPED / SHIPPED_FILES.get(grid, f"h200-{grid}.parquet")


def load(grid: str = "llama70b-decode", path=None) -> CounterData:
    """The recorded counter table of a grid (``CPA_COUNTERS_PATH`` overrides the path)."""
    import pandas as pd

    p = Path(path or os.environ.get("CPA_COUNTERS_PATH") or shipped_path(grid))
    if not p.exists():
        have = ", ".join(q.name for q in sorted(SHIPPED.glob("*.parquet"))) or "none"
        raise FileNotFoundError(f"{p}: no counter table (shipped: {have}); record one with `cpa profile`")
    return CounterData(pd.read_parquet(p), p)


# --------------------------------------------------------------------------- bytes and flops
def attention_bytes(r) -> float:
    """Bytes the attention kernel must move for one row (a sweep or counter row): K and V
    read once, q read, and either `out` written (one partition) or the partials written
    (tmp_out in fp32 plus max logit and exp sum per partition). The reduce's reads of the
    partials are not part of this kernel."""
    elem = _ELEM[r["dtype"]]
    kv_elem = _KV_ELEM[r["kv_cache_dtype"]] or elem
    total_tokens = r["num_seqs"] * r["mean_seq_len"]
    kv = 2 * total_tokens * r["num_kv_heads"] * r["head_size"] * kv_elem
    q = r["num_seqs"] * r["num_heads"] * r["head_size"] * elem
    parts = math.ceil(r["max_seq_len"] / r["partition_size"])
    if parts <= 1:
        return kv + 2 * q
    # fixed-length points: every sequence has `parts` partitions; mixed lengths: an upper bound
    partials = r["num_seqs"] * r["num_heads"] * parts * (r["head_size"] + 2) * 4
    return kv + q + partials


def attention_flops(r) -> float:
    """QK^T and PV, 2 flops per multiply-add: 4 x heads x context tokens x head size."""
    return 4.0 * r["num_heads"] * r["num_seqs"] * r["mean_seq_len"] * r["head_size"]


# ---------------------------------------------------------------------------- joined tables
def with_sweep(counters, sweep):
    """Counter rows joined to the verified sweep rows of the same (point, variant), with:

    - ``sweep_attn_gbps``: attention-kernel bytes / the sweep's median ``attn_time_us``;
    - ``counter_dram_gbps``: the counters' (read + write) DRAM bytes / kernel duration;
    - ``bw_ratio``: counter / sweep bandwidth; ``time_ratio``: profiled duration / sweep time;
    - ``read_ratio``: counted DRAM read bytes / the bytes the kernel must read."""
    from .sweep import timed_rows

    s = timed_rows(sweep)
    # the point id as well where both tables carry it: mixed-length points can share every
    # other key (num_seqs, max_seq_len, ...) and must not be joined to each other's rows
    keys = [*KEYS, *(["point_id"] if "point_id" in counters.columns and "point_id" in s.columns else [])]
    keep = [*keys, "block_size", "mean_seq_len", "attn_time_us", "time_us", "frac_peak_bw", "read_gbps_ceiling",
            "num_partitions"]
    dup = s.duplicated(keys)
    if dup.any():
        raise ValueError(f"the sweep has {int(dup.sum())} timed rows that share the keys {keys} with another; "
                         "which one the counters belong to is not known")
    # the sweep's block_size is the KV cache's; the counters' is the kernel's threads per block
    s = s[[c for c in keep if c in s.columns]].rename(columns={"block_size": "kv_block_size",
                                                               "time_us": "sweep_time_us"})
    c = counters.drop(columns=[k for k in ("mean_seq_len",) if k in counters.columns and k in s.columns])
    d = c.merge(s, on=keys, how="inner")
    d["attention_bytes"] = d.apply(attention_bytes, axis=1)
    d["flops"] = d.apply(attention_flops, axis=1)
    d["sweep_attn_gbps"] = d.attention_bytes / (d.attn_time_us * 1e3)
    if "dram_bandwidth" in d:
        d["counter_dram_gbps"] = d.dram_bandwidth / 1e9
        d["bw_ratio"] = d.counter_dram_gbps / d.sweep_attn_gbps
    if "duration_ns" in d:
        d["time_ratio"] = d.duration_ns / (d.attn_time_us * 1e3)
        d["achieved_tflops"] = d.flops / (d.duration_ns * 1e-9) / 1e12
        d["arithmetic_intensity"] = d.flops / (d.dram_read_bytes + d.dram_write_bytes) \
            if "dram_read_bytes" in d else math.nan
    if "dram_read_bytes" in d:
        must_read = d.attention_bytes - d.apply(lambda r: _written_bytes(r), axis=1)
        d["read_ratio"] = d.dram_read_bytes / must_read
    d["kv_mib"] = d.apply(lambda r: 2 * r["num_seqs"] * r["mean_seq_len"] * r["num_kv_heads"] * r["head_size"] *
                          (_KV_ELEM[r["kv_cache_dtype"]] or _ELEM[r["dtype"]]) / 2**20, axis=1)
    d["shape"] = "b" + d.num_seqs.astype(int).astype(str) + " ctx " + d.max_seq_len.astype(int).astype(str)
    return d.sort_values(["num_seqs", "max_seq_len", "tiling", "partition_size"]).reset_index(drop=True)


def _written_bytes(r) -> float:
    parts = math.ceil(r["max_seq_len"] / r["partition_size"])
    if parts <= 1:
        return r["num_seqs"] * r["num_heads"] * r["head_size"] * _ELEM[r["dtype"]]
    return r["num_seqs"] * r["num_heads"] * parts * (r["head_size"] + 2) * 4


def bandwidth_agreement(joined, *, long_context: int = 8192):
    """Per shape, the median counter/sweep bandwidth ratio, and whether the shape is a long
    context (``max_seq_len >= long_context``), where the two should agree within 10%."""
    g = joined.groupby(["num_seqs", "max_seq_len"], as_index=False).agg(
        bw_ratio=("bw_ratio", "median"), bw_ratio_min=("bw_ratio", "min"), bw_ratio_max=("bw_ratio", "max"),
        time_ratio=("time_ratio", "median"), read_ratio=("read_ratio", "median"),
        attn_time_us=("attn_time_us", "median"), rows=("bw_ratio", "size"))
    g["long_context"] = g.max_seq_len >= long_context
    g["within_10pct"] = (g.bw_ratio_min >= 0.9) & (g.bw_ratio_max <= 1.1)
    return g


def theoretical_occupancy(joined, static=None, spec=None):
    """Adds, per row: ``theoretical_occupancy`` (resident warps the attention kernel's
    compiled resources allow per SM / the SM's warp slots; sm_90 table of ``cpa static``)
    and ``grid_limited_occupancy`` (the same, capped by the workgroups the grid has per SM
    that holds any: a launch with fewer workgroups than slots cannot fill them). Achieved
    occupancy from the counters (per active SM cycle) sits at or below both."""
    from . import hardware as hw
    from . import occupancy as O
    from . import variants as V

    spec = spec or hw.H200
    static = static if static is not None else O.load_static_table("sm_90")
    att = static[static.kernel == "attention"]
    out = joined.copy()
    theo, grid_lim, slots_l = [], [], []
    for _, r in out.iterrows():
        gqa = int(r.num_heads // r.num_kv_heads)
        v = V.variant_for(tiling=r.tiling, partition_size=int(r.partition_size), head_size=int(r.head_size),
                          block_size=int(r.kv_block_size), dtype=r["dtype"], kv_cache_dtype=r.kv_cache_dtype,
                          gqa_ratio=gqa, platform="cuda")
        row = att[att.variant == v.name]
        if len(row) != 1:
            theo.append(math.nan)
            grid_lim.append(math.nan)
            slots_l.append(math.nan)
            continue
        per_sm, _ = O.resident_workgroups("sm_90", row.iloc[0].to_dict(), spec)
        warps_per_block = int(row.iloc[0].threads_per_block) // 32
        t = per_sm * warps_per_block / spec.max_warps_per_sm
        wg = r.num_seqs * math.ceil(r.max_seq_len / r.partition_size) * r.num_kv_heads
        theo.append(t)
        # ncu's achieved occupancy is averaged over the cycles an SM is active, so an SM with no
        # workgroup does not count: a grid of wg workgroups puts wg / min(wg, SMs) on each busy SM
        busy = min(wg, spec.compute_units)
        grid_lim.append(min(t, wg / busy * warps_per_block / spec.max_warps_per_sm))
        slots_l.append(per_sm * spec.compute_units)
    out["theoretical_occupancy"] = theo
    out["grid_limited_occupancy"] = grid_lim
    out["slots"] = slots_l
    return out


# ---- ncu raw pages of `scripts/h200.sh stalls` (one target per file) ----------------------------

#: the raw-page metrics a stalls table keeps, by short name
STALL_METRICS = {
    "time_us": "gpu__time_duration.sum",  # ns (base units); converted below
    "dram_read_gb": "dram__bytes_read.sum",
    "l2_read_sectors_m": "lts__t_sectors_srcunit_tex_op_read.sum",
    "dram_throughput_pct": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "warps_active_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "issue_active_pct": "sm__issue_active.avg.pct_of_peak_sustained_elapsed",
    "l2_throughput_pct": "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "l2_hit_pct": "lts__t_sector_hit_rate.pct",
    "instructions_m": "smsp__inst_executed.sum",
    "registers": "launch__registers_per_thread",
    "grid": "launch__grid_size",
    "block": "launch__block_size",
}
_SCALE = {"time_us": 1e-3, "dram_read_gb": 1e-9, "l2_read_sectors_m": 1e-6, "instructions_m": 1e-6}


def read_ncu_raw(path) -> dict:
    """The longest kernel of one ``ncu --csv --page raw`` file (the attention kernel of a
    launch; cuDNN's flash kernel rather than its reduction) as {short name: number} over
    :data:`STALL_METRICS`, plus ``kernel`` and ``top_stalls`` (the six largest warp-stall
    reasons per issued instruction). Read by :func:`cpa.profile.parse_ncu_raw_csv` (ncu's notes,
    program output, the optional units row and "n/a" cells handled there, values in base
    units); a page with no kernel time raises ValueError naming the file."""
    from .profile import parse_ncu_raw_csv

    tidy = parse_ncu_raw_csv(Path(path).read_text())
    times = tidy[(tidy.metric == "gpu__time_duration.sum") & tidy.value.notna()]
    if times.empty:
        raise ValueError(f"{path}: not an ncu raw page with a gpu__time_duration.sum value for any kernel")
    longest = times.loc[times.value.idxmax()]
    launch = tidy[tidy.dispatch == longest.dispatch]
    row = dict(zip(launch.metric, launch.value))
    out = {"kernel": str(longest.get("kernel", "?"))}
    for short, metric in STALL_METRICS.items():
        out[short] = row.get(metric, float("nan")) * _SCALE.get(short, 1.0)
    stalls = {m.split("issue_stalled_")[1].split("_per_issue")[0]: v for m, v in row.items()
              if "issue_stalled_" in m and m.endswith("_per_issue_active.ratio")}
    top = sorted(((v, k) for k, v in stalls.items() if v == v), reverse=True)[:6]
    out["top_stalls"] = ", ".join(f"{k} {v:.2f}" for v, k in top)
    return out


def stall_table(paths):
    """One row per ncu raw page (:func:`read_ncu_raw`), ``target`` = the file's stem and ``label``
    the build and target it names: `scripts/h200.sh stalls` writes
    ``<gpu>-stalls-<build>_<target>_<P>_<batch>_<context>-<commit>.csv``, and the label drops the
    card, the shape and the commit (``default_mfma16``, ``DCPA_LOAD_ONLY_2_mfma16``,
    ``default_reader_paged_2x8``, ...)."""
    import pandas as pd

    t = pd.DataFrame([dict(target=Path(p).stem, **read_ncu_raw(p)) for p in paths])
    if len(t):
        t.insert(1, "label", t.target.str.replace(r"^h\d00-stalls-|_\d+_\d+_\d+-[0-9a-f]+$", "", regex=True))
    return t
