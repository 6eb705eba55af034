"""plotly figures of sweep tables (notebooks and the report). Imports plotly when called, so
``import cpa`` and the CLI never need it.

Every figure states where its numbers come from in its title (``measured on <device>``);
an H200 figure never speaks for an MI300.
"""

from __future__ import annotations

import math

from . import analysis as A

_plotlyjs_sent = False


def show(fig) -> None:
    """Display a figure so that it is interactive both in a live Jupyter and in the static
    HTML report: the plotly mimetype for Jupyter, and an HTML rendering (plotly.js inlined
    once per kernel, so a page works offline) that nbconvert puts in the page."""
    global _plotlyjs_sent
    from IPython.display import display

    html = fig.to_html(full_html=False, include_plotlyjs=not _plotlyjs_sent, default_height=fig.layout.height
                       or 480)
    _plotlyjs_sent = True
    display({"application/vnd.plotly.v1+json": fig.to_plotly_json(), "text/html": html}, raw=True)


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


def explorer(load, grids: list[str]):
    """ipywidgets controls (grid, dtype, tiling) over :func:`latency_vs_partition`.

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
    tiling_w = W.Dropdown(description="tiling")
    out = W.Output()
    note = W.HTML()

    def refresh_options():
        c = A.choices(data(grid_w.value).df)
        dtype_w.options, tiling_w.options = c["dtype"], c["tiling"]

    def redraw(*_):
        s = data(grid_w.value)
        if not dtype_w.value or not tiling_w.value:
            return
        note.value = s.banner().replace("**", "")
        with out:
            out.clear_output(wait=True)
            show(latency_vs_partition(s.df, tiling=tiling_w.value, dtype=dtype_w.value))

    def on_grid(_):
        refresh_options()
        redraw()

    refresh_options()
    redraw()
    grid_w.observe(on_grid, names="value")
    dtype_w.observe(redraw, names="value")
    tiling_w.observe(redraw, names="value")
    return W.VBox([W.HBox([grid_w, dtype_w, tiling_w]), note, out])


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
    d["device"] = d.device + " (" + d.slots.astype(str) + " slots)"
    fig = px.line(d, x="partition_size", y="fill", color="device", facet_col="shape", facet_col_wrap=4, markers=True,
                  hover_data=["workgroups", "waves", "tail_workgroups", "partials_bytes"],
                  labels={"partition_size": "partition", "fill": "slots busy"})
    fig.update_xaxes(**_pow2_axis(d.partition_size))
    fig.update_yaxes(range=[0, 1.05])
    rows = math.ceil(d["shape"].nunique() / 4)
    fig.update_layout(height=240 * rows + 120, title="Grid-level fill of the workgroup slots (modeled from compiled "
                                                     "resources: 2 workgroups per CU/SM for mfma16 at GQA 8)")
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
