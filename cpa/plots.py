"""plotly figures of sweep tables (notebooks and the report). Imports plotly when called, so
``import cpa`` and the CLI never need it.

Every figure states where its numbers come from in its title (``measured on <device>``);
an H200 figure never speaks for an MI300.
"""

from __future__ import annotations

import math

from . import analysis as A

_plotlyjs_sent = False


def _bundle(fig) -> dict:
    """The mime bundle of a figure: the plotly mimetype for Jupyter and an HTML rendering
    (plotly.js inlined the first time in a kernel) for the static report."""
    global _plotlyjs_sent
    html = fig.to_html(full_html=False, include_plotlyjs=not _plotlyjs_sent, default_height=fig.layout.height
                       or 480)
    _plotlyjs_sent = True
    return {"application/vnd.plotly.v1+json": fig.to_plotly_json(), "text/html": html}


def show(fig, *, display_id=None):
    """Display a figure so that it is interactive both in a live Jupyter and in the static
    HTML report: the plotly mimetype for Jupyter, and an HTML rendering (plotly.js inlined
    once per kernel, so a page works offline) that nbconvert puts in the page. With
    ``display_id=True`` returns the display handle (``handle.update(_bundle(fig), raw=True)``)."""
    from IPython.display import display

    return display(_bundle(fig), raw=True, display_id=display_id)


def _label(df):
    """A short name per point, for grids that are not batch x context."""
    def one(r):
        lens = f"ctx {int(r.max_seq_len)}" if r.seq_lens_dist == "fixed" else \
            f"mean {r.mean_seq_len:.0f} / max {int(r.max_seq_len)}"
        return f"b{int(r.num_seqs)} {int(r.num_heads)}/{int(r.num_kv_heads)}h d{int(r.head_size)} {lens}"
    return df.apply(one, axis=1)


def _is_batch_by_context(df) -> bool:
    d = A.cpa_rows(df)
    return (d.seq_lens_dist == "fixed").all() and d[["num_heads", "num_kv_heads", "head_size"]].drop_duplicates() \
        .shape[0] == 1


def _source(df) -> str:
    names = sorted(set(df.device_name.dropna()))
    return f"measured on {', '.join(names) or '?'}"


def _pow2_axis(values):
    vals = sorted({int(v) for v in values})
    return dict(type="log", tickvals=vals, ticktext=[str(v) for v in vals])


def latency_vs_partition(df, *, tiling: str, dtype: str | None = None, kv_cache_dtype: str | None = None):
    """Median latency against partition size, one line per context (facets: batch), or one
    line per point for grids that are not batch x context."""
    import plotly.express as px

    d = A.cpa_rows(df)
    d = d[d.tiling == tiling]
    if dtype:
        d = d[d.dtype == dtype]
    if kv_cache_dtype:
        d = d[d.kv_cache_dtype == kv_cache_dtype]
    d = d.sort_values(["num_seqs", "max_seq_len", "partition_size"]).copy()
    hover = ["time_us_p25", "time_us_p75", "attn_time_us", "reduce_time_us", "frac_peak_bw", "num_partitions"]
    if _is_batch_by_context(d):
        d["context"] = d.max_seq_len.astype(str)
        fig = px.line(d, x="partition_size", y="time_us", color="context", facet_col="num_seqs", facet_col_wrap=4,
                      markers=True, log_y=True, hover_data=hover, facet_row_spacing=0.08,
                      labels={"partition_size": "partition size (tokens)", "time_us": "median µs",
                              "num_seqs": "batch", "context": "context"})
        fig.update_yaxes(matches=None, showticklabels=True)
        rows = math.ceil(d.num_seqs.nunique() / 4)
        height = 260 * rows + 120
    else:
        d["point"] = _label(d)
        fig = px.line(d, x="partition_size", y="time_us", color="point", markers=True, log_y=True, hover_data=hover,
                      labels={"partition_size": "partition size (tokens)", "time_us": "median µs"})
        height = 520
    fig.update_xaxes(**_pow2_axis(d.partition_size))
    fig.update_layout(height=height, title=f"Latency vs partition size, tiling {tiling} ({_source(df)})",
                      legend_title_text="context" if "context" in d else "point")
    return fig


def bandwidth_roof(df, ceilings: dict | None = None):
    """Achieved GB/s (K+V read once / median time) of the best CPA variant per point and of
    each peer, against the read and copy ceilings measured in the same run."""
    import plotly.graph_objects as go

    ceilings = ceilings or {}
    fig = go.Figure()
    best = A.best_by_point(df).sort_values("kv_bytes")
    text = best.apply(lambda r: f"b{int(r.num_seqs)} ctx {int(r.max_seq_len)}: {r.tiling}/{int(r.partition_size)}",
                      axis=1)
    fig.add_trace(go.Scatter(x=best.kv_bytes / 2**20, y=best.gbps, mode="markers", name="CPA (best variant)",
                             text=text, marker=dict(size=8, symbol="circle")))
    from .sweep import timed_rows

    ok = timed_rows(df)
    for sym, p in zip(("diamond", "x", "triangle-up", "square"), A.peer_names(df)):
        r = ok[ok.tiling == p].sort_values("kv_bytes")
        fig.add_trace(go.Scatter(x=r.kv_bytes / 2**20, y=r.gbps, mode="markers", name=p,
                                 text=r.apply(lambda q: f"b{int(q.num_seqs)} ctx {int(q.max_seq_len)}", axis=1),
                                 marker=dict(size=7, symbol=sym, opacity=0.8)))
    for key, name, dash in (("read_gbps", "read ceiling", "solid"), ("copy_gbps", "copy ceiling", "dot")):
        v = ceilings.get(key)
        if v and v == v:
            fig.add_hline(y=v, line_dash=dash, line_color="gray", annotation_text=f"{name} {v:.0f} GB/s",
                          annotation_position="bottom right")
    fig.update_xaxes(type="log", title="K+V bytes per call (MiB)")
    fig.update_yaxes(title="GB/s (K+V read once / median time)")
    fig.update_layout(height=520, title=f"Bandwidth against the roof ({_source(df)})")
    return fig


def best_partition_heatmap(df, *, tiling: str | None = None):
    """The fastest partition size over (batch, context), with the winning tiling in the cell."""
    import numpy as np
    import plotly.graph_objects as go

    best = A.best_by_point(df, tiling)
    p = best.pivot_table(index="num_seqs", columns="max_seq_len", values="partition_size", aggfunc="first")
    lab = best.assign(l=best.tiling + "/" + best.partition_size.astype(int).astype(str)) \
        .pivot_table(index="num_seqs", columns="max_seq_len", values="l", aggfunc="first")
    z = np.log2(p.values.astype(float))
    ticks = sorted({int(v) for v in best.partition_size})
    fig = go.Figure(go.Heatmap(z=z, x=[str(c) for c in p.columns], y=[str(i) for i in p.index], text=lab.values,
                               texttemplate="%{text}", colorscale="Viridis",
                               colorbar=dict(title="partition", tickvals=[math.log2(t) for t in ticks],
                                             ticktext=[str(t) for t in ticks]),
                               hovertemplate="batch %{y}, context %{x}: %{text}<extra></extra>"))
    fig.update_xaxes(title="context (tokens)", type="category")
    fig.update_yaxes(title="batch", type="category")
    what = f"tiling {tiling}" if tiling else "any tiling"
    fig.update_layout(height=460, title=f"Fastest partition size ({what}; {_source(df)})")
    return fig


def speedup_heatmap(table, column: str, *, title: str, source: str):
    """A (batch, context) heatmap of one speed-up column of :func:`cpa.analysis.speedups`."""
    import plotly.graph_objects as go

    p = table.pivot_table(index="num_seqs", columns="max_seq_len", values=column)
    lo, hi = float(p.min().min()), float(p.max().max())
    span = max(abs(math.log(lo)), abs(math.log(hi)), 0.05)
    fig = go.Figure(go.Heatmap(z=p.values, x=[str(c) for c in p.columns], y=[str(i) for i in p.index],
                               texttemplate="%{z:.2f}x", colorscale="RdBu", zmid=1.0,
                               zmin=math.exp(-span), zmax=math.exp(span),
                               hovertemplate="batch %{y}, context %{x}: %{z:.3f}x<extra></extra>"))
    fig.update_xaxes(title="context (tokens)", type="category")
    fig.update_yaxes(title="batch", type="category")
    fig.update_layout(height=440, title=f"{title} ({source})")
    return fig


def speedup_bars(table, columns: list[str], *, title: str, source: str):
    """Speed-ups per point as grouped bars (for grids that are not batch x context)."""
    import plotly.graph_objects as go

    t = table.copy()
    t["point"] = t.apply(lambda r: f"b{int(r.num_seqs)} {int(r.num_heads)}/{int(r.num_kv_heads)}h "
                                   f"d{int(r.head_size)} mean {r.mean_seq_len:.0f}", axis=1)
    fig = go.Figure([go.Bar(x=t.point, y=t[c], name=c) for c in columns])
    fig.add_hline(y=1.0, line_color="gray")
    fig.update_layout(barmode="group", height=460, title=f"{title} ({source})", yaxis_title="speed-up (x)")
    return fig


def sdpa_gap_bars(gap, *, source: str):
    """:func:`cpa.bench.sdpa_gap` as grouped bars per shape: SDPA's time over the kernel's
    (reduce launch included) and over its attention kernel alone; above 1 is faster than SDPA."""
    import plotly.graph_objects as go

    x = [f"{int(b)} x {int(c) // 1024}k" for b, c in zip(gap.num_seqs, gap.max_seq_len)]
    fig = go.Figure([go.Bar(x=x, y=gap.vs_sdpa, name="SDPA / CPA (attention + reduce)"),
                     go.Bar(x=x, y=gap.attn_vs_sdpa, name="SDPA / CPA attention alone")])
    fig.add_hline(y=1.0, line_color="gray")
    vals = [float(v) for v in (*gap.vs_sdpa, *gap.attn_vs_sdpa)] or [1.0]
    lo, hi = min(0.9, min(vals) * 0.97), max(1.1, max(vals) * 1.03)  # (every bar whole: 1.19 was cut at 1.1)
    fig.update_layout(barmode="group", height=460, yaxis=dict(title="speed-up (x)", range=[lo, hi]),
                      xaxis_title="batch x context",
                      title=f"Against cuDNN SDPA at batch <= 8, the best fixed partition per shape ({source})")
    return fig


def streaming_lines(df, fit, *, source: str):
    """K/V GB/s (bytes read once / time) of the fastest CPA launch and of SDPA per shape of a
    bench CSV, against the K/V bytes of the shape, with the curves of
    :func:`cpa.bench.streaming_fit` (bytes / (fixed + bytes / marginal rate)) and the run's read
    ceiling: the fixed cost sets the small shapes, the marginal rate the large ones."""
    import numpy as np
    import plotly.graph_objects as go

    from . import bench as B

    names = {"cpa_best": ("CPA, fastest launch per shape", "#d62728"), "sdpa_cudnn": ("cuDNN SDPA", "#1f77b4")}
    f = fit.set_index("arm")
    fig = go.Figure()
    lo, hi = float(df.kv_bytes.min()), float(df.kv_bytes.max())
    xs = np.geomspace(lo, hi, 60)
    for arm, (best, _) in B.streaming_points(df).items():
        name, color = names[arm]
        fig.add_trace(go.Scatter(
            x=best.b / 1e9, y=best.b / best.t / 1e3, mode="markers", name=name, marker=dict(color=color, size=8),
            text=[f"{int(n)} x {int(c) // 1024}k: {t:.1f} us"
                  for n, c, t in zip(best.num_seqs, best.max_seq_len, best.t)]))
        if arm in f.index:
            r = f.loc[arm]
            fig.add_trace(go.Scatter(
                x=xs / 1e9, y=xs / (r.fixed_us + xs / (r.marginal_gbps * 1e3)) / 1e3, mode="lines",
                line=dict(color=color, dash="dot"),
                name=f"fit: {r.fixed_us:.1f} us + bytes at {r.marginal_gbps:.0f} GB/s ({r.frac_read_ceiling:.1%})"))
    if "read_gbps_ceiling" in df and df.read_gbps_ceiling.notna().any():
        fig.add_hline(y=float(df.read_gbps_ceiling.median()), line=dict(color="gray", width=1),
                      annotation_text="read ceiling", annotation_position="bottom right")
    fig.update_layout(height=460, xaxis=dict(title="K/V bytes of the shape (GB)", type="log"),
                      yaxis_title="K/V GB/s (bytes read once / time)",
                      title=f"A fixed cost and a streaming rate per arm ({source})")
    return fig


def combine_costs_by_partitions(costs: dict, *, source: str, auto_partitions: tuple[int, int] | None = None):
    """What each combine adds to the attention kernel's own time (:func:`cpa.bench.combine_costs`
    tables, one per label, e.g. two builds of an A/B), median over shapes against the number of
    partitions: the fused reduce's column of each table, and the reduce launch of the first.
    `auto_partitions` (lo, hi) shades the range where the default takes the fused reduce."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for i, (label, c) in enumerate(costs.items()):
        med = c.groupby("num_partitions")[["reduce_us", "fused_us"]].median().sort_index()
        if i == 0:
            fig.add_trace(go.Scatter(x=med.index, y=med.reduce_us, mode="lines+markers", name="reduce launch",
                                     line=dict(dash="dash", color="gray")))
        fig.add_trace(go.Scatter(x=med.index, y=med.fused_us, mode="lines+markers", name=f"fused reduce, {label}"))
    if auto_partitions:
        lo, hi = auto_partitions
        # (shapes take data coordinates on a log axis; annotations would not)
        fig.add_vrect(x0=lo, x1=hi, fillcolor="green", opacity=0.08, line_width=0)
    parts = sorted({int(n) for c in costs.values() for n in c.num_partitions})
    fig.update_layout(height=420, xaxis=dict(title="partitions per sequence", **_pow2_axis(parts)),
                      yaxis=dict(title="added to the attention kernel (us, median over shapes)", rangemode="tozero"),
                      title=f"What combining the partitions costs ({source})"
                      + ("<br><sup>shaded: the partition counts where the default takes the fused reduce</sup>"
                         if auto_partitions else ""))
    return fig


def kv_dtype_bars(table, *, source: str):
    """:func:`cpa.analysis.kv_dtype_table` as grouped bars: the best time per shape with the
    16-bit and the fp8 KV cache, one group per (query dtype, batch x context); the label over
    each fp8 bar is fp8 time / 16-bit time (0.5 = the halved bytes fully turned into time)."""
    import plotly.graph_objects as go

    t = table.copy()
    t["shape"] = t.apply(lambda r: f"{r.dtype} b{int(r.num_seqs)} x {int(r.max_seq_len) // 1024}k", axis=1)
    fig = go.Figure([
        go.Bar(x=t.shape, y=t.auto_us, name="KV cache = query dtype", customdata=t.auto_variant,
               hovertemplate="%{x}: %{y:.1f} us (%{customdata})"),
        go.Bar(x=t.shape, y=t.fp8_us, name="KV cache fp8 e4m3", customdata=t.fp8_variant,
               text=[f"{r:.2f}x" for r in t.fp8_over_auto], textposition="outside",
               hovertemplate="%{x}: %{y:.1f} us (%{customdata})"),
    ])
    fig.update_layout(barmode="group", height=460, yaxis_type="log", yaxis_title="best CPA time (us)",
                      title=f"16-bit against fp8 KV cache, best variant per shape ({source})")
    return fig


def explorer(load, grids: list[str]):
    """ipywidgets controls (grid, dtype, KV cache dtype, tiling) over :func:`latency_vs_partition`.

    `load(grid)` returns a :class:`cpa.analysis.SweepData`. Returns the widget box; in a
    static page it shows the first selection."""
    import ipywidgets as W

    cache: dict = {}

    def data(g):
        if g not in cache:
            cache[g] = load(g)
        return cache[g]

    grid_w = W.Dropdown(options=grids, value=grids[0], description="grid")
    dtype_w = W.Dropdown(description="dtype")
    kv_w = W.Dropdown(description="KV cache")
    tiling_w = W.Dropdown(description="tiling")
    out = W.Output()
    note = W.HTML()

    def refresh_options():
        c = A.choices(data(grid_w.value).df)
        dtype_w.options, kv_w.options, tiling_w.options = c["dtype"], c["kv_cache_dtype"], c["tiling"]

    def redraw(*_):
        s = data(grid_w.value)
        if not dtype_w.value or not kv_w.value or not tiling_w.value:
            return
        note.value = s.banner().replace("**", "")
        with out:
            out.clear_output(wait=True)
            show(latency_vs_partition(s.df, tiling=tiling_w.value, dtype=dtype_w.value, kv_cache_dtype=kv_w.value))

    def on_grid(_):
        refresh_options()
        redraw()

    refresh_options()
    redraw()
    grid_w.observe(on_grid, names="value")
    for w in (dtype_w, kv_w, tiling_w):
        w.observe(redraw, names="value")
    return W.VBox([W.HBox([grid_w, dtype_w, kv_w, tiling_w]), note, out])


# ------------------------------------------------------------------------ compiled evidence
def register_budget(tables: dict):
    """Registers per lane/thread of the attention kernel by tiling, heads cap and head size:
    gfx942 VGPR+AGPR (unified 512-entry file) beside sm_90 registers (255 max). **compiled**."""
    import pandas as pd
    import plotly.express as px

    parts = []
    for arch, t in tables.items():
        col = "total_vgprs" if "total_vgprs" in t else "registers"
        d = t.assign(arch=arch, regs=t[col], variant=t.tiling + " cap " + t.heads_cap.astype(str))
        parts.append(d[["arch", "variant", "head_size", "regs", "limit", "workgroups_per_cu"]])
    d = pd.concat(parts).drop_duplicates()
    d["head_size"] = d.head_size.astype(str)
    fig = px.bar(d, x="variant", y="regs", color="head_size", barmode="group", facet_col="arch",
                 hover_data=["limit", "workgroups_per_cu"],
                 labels={"regs": "registers per lane (AMD: VGPR+AGPR) / per thread (NVIDIA)", "head_size": "head"})
    fig.update_xaxes(matches=None)
    fig.update_layout(height=460, title="Registers of the attention kernel (compiled: clang-19 gfx942, nvcc sm_90)")
    return fig


def grid_fill(grids):
    """Fraction of workgroup slots busy (workgroups / (waves x slots)) against partition size,
    per shape, one line per device. **modeled** from compiled resources."""
    import pandas as pd
    import plotly.express as px

    d = pd.concat(grids).copy()
    d["fill"] = d.workgroups / (d.waves * d.slots)
    d["shape"] = "b" + d.num_seqs.astype(str) + " ctx " + d.max_seq_len.astype(str)
    # the resident workgroups per CU/SM the slots come from, as the tables give them (not a constant:
    # a knob's build or another head size changes them)
    per_cu = ", ".join(f"{dev} {'/'.join(map(str, sorted(g.resident_per_cu.unique())))} per "
                       f"{'SM' if dev.startswith('NVIDIA') else 'CU'}"
                       for dev, g in d.groupby("device", sort=False))
    d["device"] = d.device + " (" + d.slots.astype(str) + " slots)"
    fig = px.line(d, x="partition_size", y="fill", color="device", facet_col="shape", facet_col_wrap=4, markers=True,
                  hover_data=["workgroups", "waves", "tail_workgroups", "partials_bytes"],
                  labels={"partition_size": "partition", "fill": "slots busy"})
    fig.update_xaxes(**_pow2_axis(d.partition_size))
    fig.update_yaxes(range=[0, 1.05])
    rows = math.ceil(d["shape"].nunique() / 4)
    fig.update_layout(height=240 * rows + 120, title="Grid-level fill of the workgroup slots (modeled from compiled "
                                                     f"resources: resident workgroups {per_cu})")
    return fig


def model_vs_measured(joined, model):
    """Modeled against measured time for the rows a wave model was fitted to."""
    import plotly.express as px

    d = joined.copy()
    d["shape"] = "b" + d.num_seqs.astype(str) + " ctx " + d.max_seq_len.astype(str)
    fig = px.scatter(d, x="time_us", y="model_us", color=d.partition_size.astype(str), log_x=True, log_y=True,
                     hover_data=["shape", "tiling", "waves", "partitions"],
                     labels={"time_us": "measured µs", "model_us": "modeled µs", "color": "partition"})
    lo, hi = float(d[["time_us", "model_us"]].min().min()), float(d[["time_us", "model_us"]].max().max())
    fig.add_shape(type="line", x0=lo, y0=lo, x1=hi, y1=hi, line=dict(color="gray", dash="dot"))
    fig.update_layout(height=480, legend_title_text="partition",
                      title=f"Wave model fitted to {model.source}: t_wave {model.t_wave_us:.2f} µs, "
                            f"t_reduce {model.t_reduce_us:.2f} µs, t_launch {model.t_launch_us:.2f} µs")
    return fig


def single_choice_bars(table, *, title: str):
    """Geometric-mean slowdown of each fixed partition size, one bar group per scenario."""
    import plotly.express as px

    d = table.copy()
    d["partition_size"] = d.partition_size.astype(str)
    fig = px.bar(d, x="partition_size", y="geomean_slowdown", color="scenario", barmode="group",
                 labels={"partition_size": "fixed partition size", "geomean_slowdown":
                         "geomean slowdown vs per-shape best"})
    fig.update_yaxes(range=[1.0, float(d.geomean_slowdown.max()) * 1.03])
    fig.update_layout(height=440, title=title)
    return fig


def default_vs_fixed(by_shape, fixed, *, title: str):
    """Per shape: the slowdown against the shape's best of the shape-chosen default
    (cpa.bench.by_shape_choice; its partition size on the bar) and of one fixed choice
    (cpa.bench.fixed_choice)."""
    import pandas as pd
    import plotly.express as px

    label = lambda d: d.num_seqs.astype(int).astype(str) + " x " + d.max_seq_len.astype(int).astype(str)  # noqa: E731
    a = by_shape.assign(shape=label(by_shape), choice="partition size by shape (the sm_90 default)",
                        text=by_shape.partition_size.astype(int).astype(str))
    f = fixed.iloc[0] if len(fixed) else None
    b = fixed.assign(shape=label(fixed), choice=f"fixed {f.tiling} / {int(f.partition_size)}" if f is not None else "",
                     text="")
    d = pd.concat([a, b], ignore_index=True)[["shape", "choice", "slowdown", "text"]]
    fig = px.bar(d, x="shape", y="slowdown", color="choice", barmode="group", text="text",
                 labels={"shape": "batch x context", "slowdown": "time / per-shape best"})
    fig.update_yaxes(range=[0.95, float(d.slowdown.max()) * 1.03])
    fig.update_layout(height=440, title=title, legend=dict(orientation="h", y=-0.25))
    return fig


# ------------------------------------------------------------------------ hardware counters
_METRIC_LABEL = {
    "duration_ns": "kernel duration (ns)", "achieved_occupancy": "achieved occupancy (of warp slots)",
    "dram_read_bytes": "DRAM read bytes", "dram_write_bytes": "DRAM write bytes",
    "dram_bandwidth": "DRAM bandwidth (B/s)", "l2_hit_rate": "L2 hit rate", "matrix_core_busy": "tensor pipe busy",
    "valu_busy": "FMA pipe busy", "lds_bank_conflict_rate": "shared-memory bank conflicts per wavefront",
    "registers_per_thread": "registers per thread", "occupancy_limit_registers": "blocks per SM (register limit)",
    "shared_memory_bytes": "shared memory per block (B)", "block_size": "threads per block",
    "grid_size": "blocks launched", "bw_ratio": "counter / sweep bandwidth", "time_ratio": "profiled / swept time",
    "read_ratio": "DRAM read / bytes the kernel must read"}


def _counter_source(d) -> str:
    names = sorted(set(d.device_name.dropna()))
    prof = sorted(set(d.profiler.dropna())) if "profiler" in d else []
    return f"measured with {', '.join(prof) or 'counters'} on {', '.join(names) or '?'}"


def counters_vs_partition(joined, metric: str, *, tilings=None, shapes=None):
    """One counter (or a derived ratio) against partition size, one line per tiling, one
    facet per shape. **measured** (attention kernel only)."""
    import plotly.express as px

    d = joined
    if tilings:
        d = d[d.tiling.isin(list(tilings))]
    if shapes:
        d = d[d["shape"].isin(list(shapes))]
    d = d.sort_values(["num_seqs", "max_seq_len", "tiling", "partition_size"])
    hover = [c for c in ("duration_ns", "attn_time_us", "dram_bandwidth", "achieved_occupancy", "grid_size")
             if c in d.columns and c != metric]
    fig = px.line(d, x="partition_size", y=metric, color="tiling", facet_col="shape", facet_col_wrap=3,
                  markers=True, hover_data=hover, facet_row_spacing=0.1,
                  labels={"partition_size": "partition size (tokens)", metric: _METRIC_LABEL.get(metric, metric)})
    fig.update_xaxes(**_pow2_axis(d.partition_size))
    fig.update_yaxes(matches=None, showticklabels=True)
    rows = max(1, math.ceil(d["shape"].nunique() / 3))
    fig.update_layout(height=270 * rows + 120,
                      title=f"{_METRIC_LABEL.get(metric, metric)}: attention kernel ({_counter_source(d)})")
    return fig


def bandwidth_agreement(joined):
    """DRAM bandwidth from the counters against the sweep's bytes / median attention time,
    with the y = x line and a ±10% band. **measured** (both axes)."""
    import plotly.graph_objects as go

    d = joined.dropna(subset=["counter_dram_gbps", "sweep_attn_gbps"])
    fig = go.Figure()
    lo, hi = 0.0, float(max(d.counter_dram_gbps.max(), d.sweep_attn_gbps.max()) * 1.08)
    for f, dash in ((1.0, "solid"), (0.9, "dot"), (1.1, "dot")):
        fig.add_trace(go.Scatter(x=[lo, hi], y=[lo * f, hi * f], mode="lines", showlegend=f == 1.0,
                                 name="y = x (±10% dotted)", line=dict(color="gray", dash=dash, width=1)))
    for ctx, g in d.groupby("max_seq_len"):
        fig.add_trace(go.Scatter(
            x=g.sweep_attn_gbps, y=g.counter_dram_gbps, mode="markers", name=f"ctx {int(ctx)}",
            text=g.apply(lambda r: f"{r['shape']} {r.tiling}/{int(r.partition_size)}: ratio {r.bw_ratio:.3f}", axis=1),
            marker=dict(size=8)))
    fig.update_xaxes(title="sweep: attention bytes / median attn_time_us (GB/s)", range=[lo, hi])
    fig.update_yaxes(title="ncu: (DRAM read + write bytes) / duration (GB/s)", range=[lo, hi])
    fig.update_layout(height=560, width=720, title=f"Counter bandwidth against the sweep's ({_counter_source(d)})")
    return fig


def counter_roofline(joined, spec, *, read_ceiling_gbps: float | None = None):
    """Achieved TFLOP/s (QK^T + PV flops / profiled duration) against arithmetic intensity
    (flops / counted DRAM bytes), under the device's bandwidth and matrix-core roofs.
    Points **measured**; roofs from the datasheet (`cpa.hardware`) and the measured read
    ceiling."""
    import numpy as np
    import plotly.graph_objects as go

    d = joined.dropna(subset=["arithmetic_intensity", "achieved_tflops"])
    fig = go.Figure()
    x = np.logspace(-1, 3.5, 200)
    peak = spec.matrix_fp16_tflops
    roofs = [(spec.hbm_bandwidth_bytes_per_s / 1e9, f"datasheet HBM {spec.hbm_bandwidth_bytes_per_s / 1e12:.2f} TB/s",
              "dash")]
    if read_ceiling_gbps:
        roofs.append((read_ceiling_gbps, f"measured read ceiling {read_ceiling_gbps / 1e3:.2f} TB/s", "solid"))
    for gbps, name, dash in roofs:
        fig.add_trace(go.Scatter(x=x, y=np.minimum(x * gbps / 1e3, peak), mode="lines", name=name,
                                 line=dict(color="gray", dash=dash, width=1)))
    for t, g in d.groupby("tiling"):
        fig.add_trace(go.Scatter(
            x=g.arithmetic_intensity, y=g.achieved_tflops, mode="markers", name=t,
            text=g.apply(lambda r: f"{r['shape']} P{int(r.partition_size)}", axis=1), marker=dict(size=8)))
    fig.update_xaxes(type="log", title="arithmetic intensity (flop / DRAM byte, counted)")
    fig.update_yaxes(type="log", title="achieved TFLOP/s")
    fig.update_layout(height=520, title=f"Roofline of the attention kernel: {spec.name} roofs, points "
                                        f"{_counter_source(d)} (dense fp16 matrix peak {peak:.0f} TFLOP/s)")
    return fig


def occupancy_achieved_vs_theoretical(table):
    """Achieved occupancy (counters) against partition size, with the theoretical occupancy
    of the compiled resources and the grid-limited one (fewer workgroups than slots), per
    shape; one colour per tiling. Achieved **measured**, the other two **modeled** from
    ``cpa static`` sm_90 resources."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    d = table.dropna(subset=["achieved_occupancy"]).sort_values(["num_seqs", "max_seq_len", "partition_size"])
    shapes = list(dict.fromkeys(d["shape"]))
    cols = 3
    rows = max(1, math.ceil(len(shapes) / cols))
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=shapes, shared_yaxes=True,
                        vertical_spacing=0.12, horizontal_spacing=0.05)
    colors = dict(zip(sorted(d.tiling.unique()), ("#636efa", "#ef553b", "#00cc96", "#ab63fa")))
    for i, s in enumerate(shapes):
        r, c = divmod(i, cols)
        g = d[d["shape"] == s]
        for t, h in g.groupby("tiling"):
            at = dict(row=r + 1, col=c + 1)
            one = dict(legendgroup=t, showlegend=i == 0)
            fig.add_trace(go.Scatter(x=h.partition_size, y=h.achieved_occupancy, mode="lines+markers",
                                     name=f"{t} achieved", line=dict(color=colors[t]), **one), **at)
            fig.add_trace(go.Scatter(x=h.partition_size, y=h.grid_limited_occupancy, mode="lines",
                                     name=f"{t} grid-limited (model)", line=dict(color=colors[t], dash="dot"),
                                     **one), **at)
            fig.add_trace(go.Scatter(x=h.partition_size, y=h.theoretical_occupancy, mode="lines",
                                     name=f"{t} theoretical (model)", line=dict(color=colors[t], dash="dash",
                                                                                width=1), **one), **at)
    fig.update_xaxes(**_pow2_axis(d.partition_size))
    fig.update_yaxes(range=[0, 1.05])
    fig.update_layout(height=280 * rows + 140, title=f"Achieved occupancy ({_counter_source(d)}) against the "
                                                     "theoretical and grid-limited occupancy (modeled, sm_90 "
                                                     "compiled resources)")
    return fig


class CounterExplorer:
    """ipywidgets controls (counter, tilings, shapes) over :func:`counters_vs_partition`.

    Displaying it shows the controls and the figure of the current selection; the figure is
    an ordinary output updated in place through its display id (not an ``ipywidgets.Output``:
    a figure that inlines plotly.js inside an Output widget stalls headless nbclient runs, and
    a static page would need the widget JavaScript to show it). In a static page it shows
    the first selection."""

    def __init__(self, joined, metrics: list[str]):
        import ipywidgets as W

        if not metrics:
            raise ValueError("counter_explorer: no metrics to choose from")
        self.joined = joined
        shapes = list(dict.fromkeys(joined["shape"]))
        tilings = sorted(joined.tiling.unique())
        self.metric = W.Dropdown(options=list(metrics), value=metrics[0], description="counter")
        self.tilings = W.SelectMultiple(options=tilings, value=tuple(tilings), description="tilings",
                                        rows=len(tilings))
        self.shapes = W.SelectMultiple(options=shapes, value=tuple(shapes), description="shapes",
                                       rows=min(6, len(shapes)))
        self.controls = W.HBox([self.metric, self.tilings, self.shapes])
        self.handle = None
        self.figure = self._figure()
        for w in (self.metric, self.tilings, self.shapes):
            w.observe(self.redraw, names="value")

    def _figure(self):
        if not (self.tilings.value and self.shapes.value):
            return None
        return counters_vs_partition(self.joined, self.metric.value, tilings=self.tilings.value,
                                     shapes=self.shapes.value)

    def redraw(self, *_):
        fig = self._figure()
        if fig is None:
            return
        self.figure = fig
        if self.handle is not None:
            self.handle.update(_bundle(fig), raw=True)

    def _ipython_display_(self):
        from IPython.display import display

        display(self.controls)
        self.handle = show(self.figure, display_id=True)


def counter_explorer(joined, metrics: list[str]) -> CounterExplorer:
    """A :class:`CounterExplorer` (display it: the last expression of a cell)."""
    return CounterExplorer(joined, metrics)


def read_patterns(df):
    """Read rate of a plain streaming reader of one decode step's K/V bytes (`cpa read-patterns`)
    against the KB one program has in flight per loop iteration: one panel per run, a line per
    (layout, partition size); the run's read ceiling and, where the run timed them, the CPA
    kernel and cuDNN SDPA on the same bytes as horizontal lines. **measured** (all of it)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from . import readpattern as RP

    pts = RP.in_flight_rows(df)
    runs = list(dict.fromkeys(df.run)) if "run" in df else [None]
    fig = make_subplots(rows=1, cols=len(runs), shared_yaxes=True, horizontal_spacing=0.04,
                        subplot_titles=[str(r).replace("h200-read-patterns", "run").strip("-") or "run" for r in runs])
    colors = {"contiguous": "#1f77b4", "paged": "#d62728", "paged_all_heads": "#2ca02c"}
    dashes = {4096: "solid", 8192: "dash"}
    seen = set()
    for col, run in enumerate(runs, start=1):
        d = pts if run is None else pts[pts.run == run]
        for (pattern, part), g in d.groupby(["pattern", "partition_size"]):
            name = f"{pattern}, P {int(part)}"
            fig.add_trace(go.Scatter(
                x=g.kb_in_flight, y=g.gbps, mode="lines+markers", name=name, legendgroup=name,
                showlegend=name not in seen, line=dict(color=colors.get(pattern), dash=dashes.get(int(part), "dot")),
                text=g.apply(lambda r: f"{int(r.programs)} programs, {int(r.blocks_per_iter)} blocks x "
                                       f"{int(r.num_warps)} warps, {r.kv_cache_dtype}", axis=1)), row=1, col=col)
            seen.add(name)
        whole = df if run is None else df[df.run == run]
        ceil = whole.read_gbps_ceiling.dropna()
        if len(ceil):
            fig.add_hline(y=float(ceil.median()), line=dict(color="gray", width=1), annotation_text="read ceiling",
                          annotation_position="bottom right", annotation_font_size=10, row=1, col=col)
        xs = [d.kb_in_flight.min(), d.kb_in_flight.max()] if len(d) else [1, 1]
        for r in whole[(whole.kind == "kernel") & whole.gbps.notna()].itertuples():
            sdpa = r.pattern == "sdpa_cudnn"
            name = "cuDNN SDPA (whole attention)" if sdpa else f"CPA {r.pattern}, P {int(r.partition_size)}"
            fig.add_trace(go.Scatter(
                x=xs, y=[r.gbps] * 2, mode="lines", name=name, legendgroup=name, showlegend=name not in seen,
                line=dict(color="black", width=1.5, dash="dot" if sdpa else dashes.get(int(r.partition_size), "dot")),
                hovertemplate=f"{name}: %{{y:.0f}} GB/s ({r.time_us:.1f} us)<extra></extra>"), row=1, col=col)
            seen.add(name)
        fig.update_xaxes(type="log", title="KB in flight per program and iteration",
                         tickvals=sorted(d.kb_in_flight.unique()), row=1, col=col)
    fig.update_yaxes(title="GB/s (bytes read once / median time)", row=1, col=1)
    shapes = ", ".join(f"{int(b)} x {int(c) // 1024}k" for b, c in
                       pts[["num_seqs", "max_seq_len"]].drop_duplicates().itertuples(index=False))
    fig.update_layout(height=480, title=f"Paged vs contiguous K/V, read apart from any kernel ({_source(df)}; "
                                        f"{shapes}, the kernel's programs)")
    return fig
