"""`cpa report`: execute every notebook headless and write a static HTML report.

Notebooks live in ``notebooks/`` as jupytext ``py:percent`` files (the ``.ipynb`` pair is
git-ignored). Each is executed in a fresh kernel with nbclient (working directory:
``notebooks/``), the executed notebook is kept beside its page, and nbconvert renders one
HTML page per notebook plus ``index.html``. Plotly figures are interactive in the pages
(plotly.js inlined once per page, so the report works offline). With no GPU the notebooks
read the shipped dataset (``data/``), and each page says so at its top.
"""

from __future__ import annotations

import html
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .analysis import ROOT, has_gpu
from .fsio import write_text_atomic

NOTEBOOKS = ROOT / "notebooks"
DEFAULT_OUT = ROOT / "build" / "report"


@dataclass
class Page:
    name: str
    title: str
    html: str  # file name inside the report folder
    seconds: float
    error: str | None


def notebook_sources(folder: Path = NOTEBOOKS) -> list[Path]:
    """The jupytext notebooks of a folder, in name order."""
    return sorted(p for p in folder.glob("*.py") if p.read_text().lstrip().startswith("# ---")
                  and "jupytext" in p.read_text()[:800])


def _title(nb, fallback: str) -> str:
    for c in nb.cells:
        if c.cell_type == "markdown":
            for line in c.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return fallback


def data_banner() -> str:
    from .provenance import git_commit

    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    where = os.environ.get("CPA_DATA", "auto")
    if where == "shipped" or (where == "auto" and not has_gpu()):
        src = ("**No GPU on this machine: every number on this page is from the dataset shipped in `data/`** "
               "(measured earlier, with the provenance shown in each table), and the compile-only analysis.")
    else:
        src = "**Measured live on this machine's GPU** (results under `build/sweeps/`)."
    return f"> Built by `cpa report` on {stamp} at commit {git_commit()[:12]}. {src}"


def run_notebook(src: Path, out_dir: Path, *, timeout: int = 1800, banner: str | None = None):
    """Execute one jupytext notebook; returns (executed notebook, error text or None)."""
    import jupytext
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    nb = jupytext.read(src)
    if banner:
        nb.cells.insert(0, nbformat.v4.new_markdown_cell(banner))
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(src.parent)}})
    error = None
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as e:  # keep what ran: the page shows
        # the failing cell and its traceback (a timeout or a dead kernel fails that page, not the report)
        lines = str(e).strip().splitlines()
        # a timeout's message ends with the cell's source between dashed rules (its last line was
        # the error text: "-------------------"); its first line says what happened
        # ("A cell timed out while it was being executed, after N seconds.")
        line = lines[0] if isinstance(e, CellTimeoutError) and lines else lines[-1] if lines else ""
        error = line[:500] or type(e).__name__
    nbformat.write(nb, str(out_dir / f"{src.stem}.ipynb"))
    return nb, error


def build_report(out: str | os.PathLike = DEFAULT_OUT, *, notebooks: list[Path] | None = None,
                 timeout: int = 1800, echo=print) -> list[Page]:
    """Execute the notebooks and write ``<out>/index.html`` and one page per notebook."""
    from nbconvert import HTMLExporter

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    srcs = notebooks if notebooks is not None else notebook_sources()
    if not srcs:
        raise FileNotFoundError(f"no jupytext notebooks in {NOTEBOOKS}")
    banner = data_banner()
    exporter = HTMLExporter(template_name="lab")
    pages = []
    for src in srcs:
        t0 = time.perf_counter()
        echo(f"report: running {src.name} ...")
        nb, error = run_notebook(Path(src), out, timeout=timeout, banner=banner)
        body, _ = exporter.from_notebook_node(nb)
        page = f"{Path(src).stem}.html"
        write_text_atomic(out / page, body)
        secs = time.perf_counter() - t0
        pages.append(Page(Path(src).stem, _title(nb, Path(src).stem), page, secs, error))
        echo(f"report: {src.name} -> {out / page} ({secs:.1f} s){' FAILED: ' + error if error else ''}")
    tuned = write_tuned(out / "tuned", echo=echo)
    write_text_atomic(out / "index.html", _index(pages, banner, tuned))
    echo(f"report: {out / 'index.html'}")
    return pages


def write_tuned(folder: Path, *, echo=print) -> list[dict]:
    """`cpa export` of what the report read: the sweep tables of this run (live on a GPU, else
    the shipped H200 ones) as a measured export, and MI300X (gfx942) modeled; one JSON and one
    header each under `folder`. Returns what was written (name, files, evidence)."""
    from . import analysis as A
    from . import export as E

    made = []
    source, tables = A.sweep_tables()
    jobs = []
    if tables:
        rel = ", ".join(str(t.relative_to(ROOT)) if t.is_relative_to(ROOT) else str(t) for t in tables)
        jobs.append((f"{source}-measured", lambda: E.from_table(E.read_tables(tables), source=rel)))
    jobs.append(("mi300x-modeled", lambda: E.from_model("gfx942")))
    for name, make in jobs:
        try:
            tuned = make()
        except (ValueError, KeyError) as e:  # e.g. live tables with no verified row yet
            echo(f"report: no {name} export ({e})")
            continue
        E.write(tuned, json_path=folder / f"{name}.json", header_path=folder / f"{name}.h")
        made.append(dict(name=name, json=f"tuned/{name}.json", header=f"tuned/{name}.h",
                         evidence=tuned["provenance"]["evidence_detail"]))
        echo(f"report: {folder / name}.json / .h ({tuned['evidence']})")
    return made


def _index(pages: list[Page], banner: str, tuned: list[dict] | None = None) -> str:
    items = "\n".join(
        f'<li><a href="{html.escape(p.html)}">{html.escape(p.title)}</a> '
        f'<span class="meta">({p.seconds:.0f} s{", <b>failed</b>: " + html.escape(p.error) if p.error else ""})'
        f"</span></li>" for p in pages)
    note = html.escape(banner.lstrip("> ").replace("**", "").replace("`", ""))
    tuned_items = "\n".join(
        f'<li><a href="{html.escape(t["json"])}">{html.escape(t["name"])}.json</a>, '
        f'<a href="{html.escape(t["header"])}">{html.escape(t["name"])}.h</a>: '
        f'<span class="meta">{html.escape(t["evidence"])}</span></li>' for t in (tuned or [])) or "<li>none</li>"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>cpa report</title>
<style>body{{font-family:system-ui,sans-serif;max-width:52em;margin:2em auto;line-height:1.5}}
.note{{background:#f4f4f4;padding:.6em 1em;border-left:4px solid #888}} .meta{{color:#666}}</style></head>
<body><h1>cpa report</h1>
<p class="note">{note}</p>
<p>Paged-attention decode kernels: partition size and matrix-core tiling. Every figure says how its numbers
were obtained: <b>measured</b> (on the GPU named in it), <b>compiled</b> (ISA and resources from the compiler),
or <b>modeled</b>. No MI300 number here is a measurement.</p>
<ul>
{items}
</ul>
<h2>Tuned parameters (<code>cpa export</code>)</h2>
<p>Partition sizes for a production build, as JSON (<code>cpa.export.lookup</code>) and a C++17 header
(<code>cpa_tuned::partition_size</code>); <code>data/export/README.md</code> says how to use them.</p>
<ul>
{tuned_items}
</ul></body></html>
"""
