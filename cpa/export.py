"""Tuned parameters for production builds: a JSON file and a C++ header with the same table.

A tuned result is, per kernel configuration (GQA ratio, head size, block size, query dtype, KV
cache dtype), one tiling and the partition size to launch for each measured (or modeled) grid
shape. Shapes are keyed by ``kv_seqs`` = num_seqs x num_kv_heads (the (sequence, KV head) pairs
the grid has per partition, so a table carries across tensor-parallel degrees) and
``max_seq_len``. Both files answer a lookup the same way (:func:`lookup` here,
``cpa_tuned::partition_size`` in the header):

1. the entries of the launch's exact configuration (none: the export's fallback size);
2. of their kv_seqs, the smallest >= the launch's (else the largest);
3. of that kv_seqs' max_seq_len, the smallest >= the launch's (else the largest).

The header is plain C++17 with no includes: a launcher of a kernel whose partition size is a
template parameter (CPA's; vLLM's ROCm launcher fixes 256 today) calls
``cpa_tuned::partition_size(...)`` and instantiates the sizes of ``CPA_TUNED_PARTITION_SIZES(X)``;
the Python side sizes its partition buffers (float32 ``tmp_out``, ``exp_sums``, ``max_logits``)
from the JSON through :func:`lookup`. Every export says how its numbers were obtained (``evidence``:
``measured`` on a named device, or ``modeled``) -- a modeled MI300X table is never a
measurement.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .fsio import write_text_atomic

SCHEMA = "cpa.tuned/1"
LOOKUP_RULE = ("the entries of the launch's exact configuration (gqa_ratio, head_size, block_size, dtype, "
               "kv_cache_dtype), else fallback_partition_size; of their kv_seqs (num_seqs x num_kv_heads) the "
               "smallest >= the launch's, else the largest; of that kv_seqs' max_seq_len the smallest >= the "
               "launch's, else the largest")
CONFIG_KEYS = ("gqa_ratio", "head_size", "block_size", "dtype", "kv_cache_dtype")
DTYPE_CODES = {"fp16": 0, "bf16": 1}  # the header's query dtype codes
KV_CODES = {"auto": 0, "fp8": 1}  # the header's KV cache dtype codes


# ------------------------------------------------------------------------------------ building
def _measured_rows(df, tilings=None, partition_sizes=None):
    """Verified, timed rows of the CPA kernel with the reduce launch (the structure a production
    launcher has): a sweep table or a `cpa bench` CSV."""
    from . import variants as V

    need = ["tiling", "partition_size", "num_seqs", "num_heads", "num_kv_heads", "head_size", "block_size", "dtype",
            "kv_cache_dtype", "max_seq_len", "time_us", "verified"]
    missing = [c for c in need if c not in df]
    if missing:
        raise ValueError(f"not a sweep table or bench CSV: no column {', '.join(missing)}")
    d = df[df.tiling.isin(V.TILINGS)].copy()
    if "error" in d:
        d = d[d.error.isna()]
    d = d[d.time_us.notna() & d.verified.fillna(False).astype(bool)]
    for col in ("fused_reduce", "cluster_reduce", "shared_steps", "default_path"):  # bench CSVs: the in-kernel
        # combines out, and the launcher's own picks (they repeat a named row)
        if col in d:
            d = d[~d[col].fillna(False).astype(bool)]
    if "seq_lens_dist" in d:  # a table keyed by max_seq_len: sequences all of that length
        d = d[d.seq_lens_dist == "fixed"]
    if tilings:
        d = d[d.tiling.isin(tilings)]
    if partition_sizes:
        d = d[d.partition_size.isin(partition_sizes)]
    if "gqa_ratio" not in d:
        d["gqa_ratio"] = d.num_heads // d.num_kv_heads
    d["kv_seqs"] = d.num_seqs * d.num_kv_heads
    return d


def _geomean(x) -> float:
    return math.exp(sum(math.log(v) for v in x) / len(x))


def _best_single(slow: dict) -> int:
    """Of {partition size: slowdowns against the per-shape best, one per shape it was measured
    or modeled at}, the size measured at the most shapes with the smallest geometric mean."""
    return min(slow, key=lambda p: (-len(slow[p]), _geomean(slow[p]), p))


def _fixed_fields(slow: dict) -> dict:
    p = _best_single(slow)
    return {"fixed_partition_size": int(p), "fixed_geomean_slowdown": round(_geomean(slow[p]), 4),
            "fixed_worst_slowdown": round(max(slow[p]), 4)}


def _provenance_of(df, source: str, evidence: str, detail: str) -> dict:
    from .provenance import command, git_commit, now

    def uniq(col):
        return sorted({str(v) for v in df[col].dropna()}) if col in df else []

    return {"evidence": evidence, "evidence_detail": detail, "source": source, "source_devices": uniq("device_name"),
            "source_drivers": uniq("driver_version"), "source_torch": uniq("torch_version"),
            "source_commits": uniq("git_commit"), "created": now(), "cpa_commit": git_commit(), "command": command()}


def read_tables(paths):
    """The rows of several measured tables (sweep parquets, `cpa bench` CSVs) as one frame;
    ValueError naming the file that is missing or not a table."""
    import pandas as pd

    frames = []
    for f in map(str, paths):
        if not Path(f).is_file():
            raise ValueError(f"--from {f}: no such file")
        try:
            d = pd.read_parquet(f) if f.endswith(".parquet") else pd.read_csv(f)
        except Exception as e:  # not a table at all
            raise ValueError(f"--from {f}: not a sweep parquet or bench CSV ({type(e).__name__}: {e})")
        # columns one kind of table has and the other not, filled per table before they are
        # joined (else the bench rows' NaN would drop them from the filters and groupings):
        # every bench sequence has max_seq_len tokens, and the GQA ratio follows from the heads
        if "seq_lens_dist" not in d:
            d["seq_lens_dist"] = "fixed"
        if "gqa_ratio" not in d and {"num_heads", "num_kv_heads"} <= set(d.columns):
            d["gqa_ratio"] = d.num_heads // d.num_kv_heads
        frames.append(d)
    return pd.concat(frames, ignore_index=True)


def from_table(df, *, source: str, tilings=None, partition_sizes=None) -> dict:
    """A tuned result measured: for each configuration of the table's verified CPA rows, the
    tiling whose per-shape bests are fastest (geometric mean over the configuration's shapes),
    and for each shape that tiling's fastest partition size; plus the best single partition
    size per configuration (`fixed_partition_size`, its geomean and worst slowdown against the
    per-shape best) and over everything (`fallback_partition_size`). `tilings` /
    `partition_sizes` restrict the candidates (e.g. the sizes a production build instantiates)."""
    d = _measured_rows(df, tilings, partition_sizes)
    if d.empty:
        raise ValueError(f"{source}: no verified CPA rows with the reduce launch"
                         + (f" among tilings {list(tilings)}" if tilings else "")
                         + (f" and partition sizes {list(partition_sizes)}" if partition_sizes else ""))
    archs = sorted({str(a) for a in d.arch.dropna()}) if "arch" in d else []
    if len(archs) != 1:
        raise ValueError(f"{source}: one arch per export (the rows have {archs or 'none'})")
    devices = sorted(set(d.device_name.dropna())) if "device_name" in d else []
    # one time per (config, shape, tiling, partition size): the fastest where tables overlap
    best = d.groupby(list(CONFIG_KEYS) + ["kv_seqs", "max_seq_len", "tiling", "partition_size"],
                     as_index=False).time_us.min()
    configs, all_slow = [], {}
    for cfg, g in best.groupby(list(CONFIG_KEYS)):
        shapes = g.groupby(["kv_seqs", "max_seq_len"])
        shape_best = shapes.time_us.min()
        # the tiling: of those measured at the most shapes, the fastest by geometric mean of its
        # per-shape bests against the shapes' bests
        per_tiling = {}
        for t, gt in g.groupby("tiling"):
            tb = gt.groupby(["kv_seqs", "max_seq_len"]).time_us.min()
            per_tiling[t] = (-len(tb), _geomean(tb / shape_best.loc[tb.index]))
        tiling = min(per_tiling, key=lambda t: (per_tiling[t], t))
        gt = g[g.tiling == tiling]
        entries = []
        for (kv_seqs, L), s in gt.groupby(["kv_seqs", "max_seq_len"]):
            row = s.loc[s.time_us.idxmin()]
            entries.append({"kv_seqs": int(kv_seqs), "max_seq_len": int(L), "partition_size": int(row.partition_size),
                            "time_us": round(float(row.time_us), 3)})
        tb = gt.groupby(["kv_seqs", "max_seq_len"]).time_us.min()
        # the best single size: of those measured at the most shapes (every shape, in a whole
        # table), the smallest geometric-mean slowdown against the per-shape best
        slow = {}
        for p, gp in gt.groupby("partition_size"):
            tp = gp.set_index(["kv_seqs", "max_seq_len"]).time_us
            slow[int(p)] = (tp / tb.loc[tp.index]).tolist()
            all_slow.setdefault(int(p), []).extend(slow[int(p)])
        configs.append({**dict(zip(CONFIG_KEYS, [int(cfg[0]), int(cfg[1]), int(cfg[2]), str(cfg[3]), str(cfg[4])])),
                        "tiling": tiling, **_fixed_fields(slow), "entries": entries})
    fallback = _best_single(all_slow)
    detail = f"measured on {', '.join(devices) or 'an unnamed device'} ({archs[0]}): {source}"
    return _finish(archs[0], configs, fallback, _provenance_of(d, source, "measured", detail))


def from_model(arch: str, *, grid: str = "llama70b-decode", partition_sizes=None,
               fixed_cost_scale: float = 1.0) -> dict:
    """A tuned result modeled: the wave model the sm_90 default uses (cpa.variants.SHAPE_MODELS,
    fitted to the H200 sweep) applied to `arch`'s compiled resources (data/static/<arch>.csv:
    workgroups per compute unit) and HBM bandwidth (cpa.hardware) at the fraction of peak the
    H200 reached, its fixed costs times `fixed_cost_scale` (they are not known off the H200),
    over the shapes of a sweep grid (points whose sequences all have max_seq_len tokens). The
    tiling is the arch's default (cpa.variants.DEFAULTS); the candidates those of the default
    (cpa.variants.partition_candidates), within `partition_sizes` when given. The best single
    size is the one with the smallest geometric-mean modeled slowdown against the per-shape
    best. Only the ratio of fixed costs to streaming time decides the choice: a bandwidth k times
    lower picks what fixed costs k times smaller pick, so `fixed_cost_scale` covers both
    unknowns. Nothing in it is a measurement of `arch`."""
    import dataclasses

    from . import hardware as hw
    from . import occupancy as O
    from . import sweep as S
    from . import variants as V
    from .provenance import command, git_commit, now

    h200 = O.shape_model("sm_90")
    spec = hw.spec_for(arch)
    frac = h200.bw_bytes_per_s / hw.H200.hbm_bandwidth_bytes_per_s
    model = dataclasses.replace(h200, bw_bytes_per_s=spec.hbm_bandwidth_bytes_per_s * frac,
                                t_wave_us=h200.t_wave_us * fixed_cost_scale,
                                t_reduce_us=h200.t_reduce_us * fixed_cost_scale,
                                t_launch_us=h200.t_launch_us * fixed_cost_scale)
    resident_per_cu = O.static_resident(arch, spec)
    platform = V.platform_of_arch(arch)
    g = S.load_grid(grid)
    by_cfg: dict[tuple, list] = {}
    for pt in g.points:
        if pt.seq_lens_dist != "fixed":
            continue
        cfg = (pt.num_heads // pt.num_kv_heads, pt.head_size, pt.block_size, pt.dtype, pt.kv_cache_dtype)
        by_cfg.setdefault(cfg, []).append(pt)
    if not by_cfg:
        raise ValueError(f"grid {g.name}: no point whose sequences are all max_seq_len long")
    configs, all_slow = [], {}
    for (gqa, head, block, dt, kv), pts in by_cfg.items():
        tiling, _, _ = V.default_choice(arch, gqa, dt, kv)
        axes = dict(tiling=tiling, head_size=head, block_size=block, dtype=dt, kv_cache_dtype=kv, gqa_ratio=gqa,
                    platform=platform)
        sizes = [p for p in V.partition_candidates(max_seq_len=1 << 30, **axes)
                 if not partition_sizes or p in partition_sizes]
        if not sizes:
            raise ValueError(f"{arch} {tiling}: none of partition_sizes={list(partition_sizes)} builds")
        per_cu = resident_per_cu(V.variant_for(partition_size=sizes[0], **axes))
        entries, slow = [], {p: [] for p in sizes}
        for pt in sorted(pts, key=lambda q: (q.num_seqs * q.num_kv_heads, q.max_seq_len)):
            shape = dict(num_seqs=pt.num_seqs, num_heads=pt.num_heads, num_kv_heads=pt.num_kv_heads, head_size=head,
                         max_seq_len=pt.max_seq_len, kv_elem_bytes=1 if kv == "fp8" else 2,
                         slots=per_cu * spec.compute_units, compute_units=spec.compute_units)
            # the default's candidates for the shape (at most one size covering it), then every size
            cands = [p for p in V.partition_candidates(max_seq_len=pt.max_seq_len, **axes) if p in sizes] or sizes[:1]
            p = O.partition_by_wave_model(model, cands, **shape)
            t = O.wave_model_times(model, sizes, **shape)
            entries.append({"kv_seqs": pt.num_seqs * pt.num_kv_heads, "max_seq_len": pt.max_seq_len,
                            "partition_size": int(p), "model_us": round(t[p], 3)})
            for q in sizes:
                slow[q].append(t[q] / t[p])
        for q, v in slow.items():
            all_slow.setdefault(q, []).extend(v)
        configs.append({"gqa_ratio": gqa, "head_size": head, "block_size": block, "dtype": dt, "kv_cache_dtype": kv,
                        "tiling": tiling, **_fixed_fields(slow), "entries": entries})
    fallback = _best_single(all_slow)
    detail = (f"modeled for {arch} ({spec.name}), not measured there: the H200-fitted wave model "
              f"(cpa.variants.SHAPE_MODELS) on {arch}'s compiled resources (data/static/{arch}.csv, {per_cu} "
              f"workgroups per CU) and {spec.hbm_bandwidth_bytes_per_s / 1e12:.1f} TB/s x {frac:.3f}, fixed costs "
              f"x {fixed_cost_scale:g}, over the shapes of grid {g.name}")
    prov = {"evidence": "modeled", "evidence_detail": detail, "source": f"cpa.export.from_model(grid={g.name!r})",
            "model": {"t_wave_us": model.t_wave_us, "t_reduce_us": model.t_reduce_us,
                      "t_launch_us": model.t_launch_us, "bw_gbps": round(model.bw_bytes_per_s / 1e9, 1),
                      "fitted": h200.source},
            "created": now(), "cpa_commit": git_commit(), "command": command()}
    return _finish(arch, configs, fallback, prov)


def _finish(arch: str, configs: list[dict], fallback: int, provenance: dict) -> dict:
    sizes = sorted({e["partition_size"] for c in configs for e in c["entries"]} | {fallback}
                   | {c["fixed_partition_size"] for c in configs})
    for c in configs:
        c["entries"].sort(key=lambda e: (e["kv_seqs"], e["max_seq_len"]))
    return {"schema": SCHEMA, "arch": arch, "evidence": provenance["evidence"], "provenance": provenance,
            "lookup": LOOKUP_RULE,
            "partition_sizes": sizes, "fallback_partition_size": int(fallback), "configs": configs}


# ------------------------------------------------------------------------------------ reading
def lookup(tuned: dict, *, num_seqs: int, num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
           dtype: str, kv_cache_dtype: str, max_seq_len: int) -> int:
    """The partition size a tuned result gives one launch (the rule of the module docstring;
    the header's ``cpa_tuned::partition_size`` answers the same)."""
    from .validation import normalize_kv_cache_dtype

    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if dtype not in DTYPE_CODES:  # (a misspelt key would otherwise get the fallback silently)
        raise ValueError(f"dtype: {dtype!r}, expected one of {', '.join(map(repr, DTYPE_CODES))}")
    kv_cache_dtype = normalize_kv_cache_dtype(kv_cache_dtype)  # 'fp8_e4m3' is 'fp8', as for the kernel
    key = (num_heads // num_kv_heads, head_size, block_size, dtype, kv_cache_dtype)
    cfg = next((c for c in tuned["configs"] if tuple(c[k] for k in CONFIG_KEYS) == key), None)
    if cfg is None:
        return int(tuned["fallback_partition_size"])
    kv_seqs = num_seqs * num_kv_heads
    have = sorted({e["kv_seqs"] for e in cfg["entries"]})
    ks = next((k for k in have if k >= kv_seqs), have[-1])
    rows = [e for e in cfg["entries"] if e["kv_seqs"] == ks]
    lens = sorted(e["max_seq_len"] for e in rows)
    L = next((x for x in lens if x >= max_seq_len), lens[-1])
    return int(next(e["partition_size"] for e in rows if e["max_seq_len"] == L))


def load(path) -> dict:
    tuned = json.loads(Path(path).read_text())
    if tuned.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema {tuned.get('schema')!r}, expected {SCHEMA!r}")
    return tuned


# ------------------------------------------------------------------------------------ writing
def to_json(tuned: dict) -> str:
    return json.dumps(tuned, indent=1) + "\n"


def to_header(tuned: dict, *, json_name: str | None = None) -> str:
    """The C++17 header of a tuned result (no includes; see the module docstring)."""
    prov = tuned["provenance"]
    p_list = " ".join(f"X({p})" for p in tuned["partition_sizes"])
    lines = [
        "// Tuned partition sizes for the CPA paged-attention decode kernel.",
        f"// {prov['evidence_detail']}",
        f"// Generated by `cpa export` (cpa {prov['cpa_commit'][:12]}, {prov['created']})"
        + (f"; the same table as {json_name}" if json_name else "") + ". Do not edit.",
        f"// Schema {tuned['schema']}. Lookup: {tuned['lookup']}",
        "#pragma once",
        "",
        f"#define CPA_TUNED_ARCH \"{tuned['arch']}\"",
        f"#define CPA_TUNED_EVIDENCE \"{tuned['evidence']}\"",
        f"#define CPA_TUNED_FALLBACK_PARTITION_SIZE {tuned['fallback_partition_size']}",
        "// every partition size the table returns: instantiate the kernel for each X(size) (a kernel",
        "// whose partition size is a template parameter, as CPA's: vLLM's ROCm launcher fixes 256)",
        f"#define CPA_TUNED_PARTITION_SIZES(X) {p_list}",
        "// partials of a launch with P = partition_size(...), partitions = ceil(max_seq_len / P):",
        "// exp_sums, max_logits float32 [num_seqs][num_heads][partitions] and tmp_out float32",
        "// [num_seqs][num_heads][partitions][head_size] (4 bytes per element, not the output's dtype)",
        "",
        "namespace cpa_tuned {",
        "",
        "enum Dtype { kFp16 = 0, kBf16 = 1 };     // query dtype",
        "enum KvCache { kAuto = 0, kFp8 = 1 };    // KV cache dtype (kAuto: the query's)",
        "",
        "struct Entry {",
        "  int gqa_ratio, head_size, block_size, dtype, kv_cache;",
        "  int kv_seqs;       // num_seqs * num_kv_heads",
        "  int max_seq_len;",
        "  int partition_size;",
        "};",
        "",
        "// tiling per configuration (informational: upstream picks its MFMA shape by GQA ratio)",
    ]
    for c in tuned["configs"]:
        lines.append(f"//   gqa {c['gqa_ratio']}, head {c['head_size']}, block {c['block_size']}, {c['dtype']} / "
                     f"{c['kv_cache_dtype']}: {c['tiling']}, best single size {c['fixed_partition_size']}")
    lines += ["inline constexpr Entry kEntries[] = {"]
    for c in tuned["configs"]:
        head = (f"{c['gqa_ratio']}, {c['head_size']}, {c['block_size']}, {DTYPE_CODES[c['dtype']]}, "
                f"{KV_CODES[c['kv_cache_dtype']]}")
        for e in c["entries"]:
            lines.append(f"    {{{head}, {e['kv_seqs']}, {e['max_seq_len']}, {e['partition_size']}}},")
    lines += [
        "};",
        "inline constexpr int kNumEntries = sizeof(kEntries) / sizeof(kEntries[0]);",
        "",
        "// The partition size for one launch: the entries of its exact configuration; of their",
        "// kv_seqs the smallest >= num_seqs * num_kv_heads (else the largest); of that kv_seqs'",
        "// max_seq_len the smallest >= max_seq_len (else the largest). No entry of the",
        "// configuration: CPA_TUNED_FALLBACK_PARTITION_SIZE.",
        "constexpr int partition_size(int num_seqs, int num_heads, int num_kv_heads, int head_size, int block_size,",
        "                             int dtype, int kv_cache, int max_seq_len) {",
        "  if (num_kv_heads < 1 || num_heads % num_kv_heads != 0) return CPA_TUNED_FALLBACK_PARTITION_SIZE;",
        "  const int gqa = num_heads / num_kv_heads, kv_seqs = num_seqs * num_kv_heads;",
        "  int ks = -1, ks_max = -1;  // the kv_seqs bucket",
        "  for (int i = 0; i < kNumEntries; ++i) {",
        "    const Entry& e = kEntries[i];",
        "    if (e.gqa_ratio != gqa || e.head_size != head_size || e.block_size != block_size || e.dtype != dtype ||",
        "        e.kv_cache != kv_cache) continue;",
        "    if (e.kv_seqs > ks_max) ks_max = e.kv_seqs;",
        "    if (e.kv_seqs >= kv_seqs && (ks < 0 || e.kv_seqs < ks)) ks = e.kv_seqs;",
        "  }",
        "  if (ks_max < 0) return CPA_TUNED_FALLBACK_PARTITION_SIZE;",
        "  if (ks < 0) ks = ks_max;",
        "  int len = -1, len_max = -1, p = -1, p_max = -1;  // the max_seq_len bucket within it",
        "  for (int i = 0; i < kNumEntries; ++i) {",
        "    const Entry& e = kEntries[i];",
        "    if (e.gqa_ratio != gqa || e.head_size != head_size || e.block_size != block_size || e.dtype != dtype ||",
        "        e.kv_cache != kv_cache || e.kv_seqs != ks) continue;",
        "    if (e.max_seq_len > len_max) { len_max = e.max_seq_len; p_max = e.partition_size; }",
        "    if (e.max_seq_len >= max_seq_len && (len < 0 || e.max_seq_len < len)) { len = e.max_seq_len; p = e.partition_size; }",
        "  }",
        "  return len >= 0 ? p : p_max;",
        "}",
        "",
        "}  // namespace cpa_tuned",
        "",
    ]
    return "\n".join(lines)


def write(tuned: dict, *, json_path=None, header_path=None) -> None:
    """Write the JSON and / or the header (each atomically: a crash leaves the old file or the new)."""
    if json_path:
        write_text_atomic(json_path, to_json(tuned))
    if header_path:
        write_text_atomic(header_path, to_header(tuned, json_name=Path(json_path).name if json_path else None))
