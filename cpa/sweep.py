"""Sweeps: grids of decode shapes x kernel variants, each row verified and timed, in one table.

A **grid** is a list of points (decode shapes) and a list of variants (tiling x partition
size). A **row** is one (point, variant): the variant is built (``cpa.ops.prepare``, disk
cached), verified against ``cpa.reference.paged_attention`` on fresh random inputs
(``cpa.make_paged_inputs``: shuffled block tables with garbage tails, NaN-poisoned unused
cache slots) into a NaN-filled output buffer, then timed. Peers (``cpa.peers``: torch SDPA,
FlexAttention, FlashInfer) are rows of the same table with their own ``tiling`` name and
``partition_size`` 0.

Grid YAML (schema 1)
--------------------
Named grids ship in ``cpa/grids/<name>.yaml`` (``cpa sweep --grid llama70b-decode``); a user
grid is any YAML file with the same keys (``cpa sweep --grid my.yaml``)::

    schema: 1                    # optional; 1 is the only version
    name: my-grid                # required; recorded in every row (column `grid`)
    description: free text       # optional
    seed: 0                      # optional (default 0): seeds the random inputs of every point
    defaults:                    # optional: point fields shared by every point
      num_heads: 64
      num_kv_heads: 8
      head_size: 128
      block_size: 16
      dtype: fp16                # fp16 | bf16 (query, output and, with kv_cache_dtype auto, K/V)
      kv_cache_dtype: auto       # auto | fp8
    axes:                        # optional: the points are the cartesian product of the axes,
      num_seqs: [1, 8]           #   first axis outermost. An axis named after a point field
      max_seq_len: [512, 4096]   #   lists values of that field; an axis with any other name
      heads:                     #   lists mappings that set several fields together
        - {num_heads: 32, num_kv_heads: 4}
    points:                      # optional: explicit points (mappings), after the axes' points
      - {num_seqs: 3, seq_lens: [17, 900, 4000]}
    variants:                    # optional (default: all / all)
      tilings: all               # 'all' (cpa.variants.TILINGS) or a list
      partition_sizes: all       # 'all' (cpa.variants.PARTITION_SIZES) or a list

Point fields: ``num_seqs``, ``num_heads``, ``num_kv_heads``, ``head_size``, ``block_size``,
``dtype``, ``kv_cache_dtype`` and exactly one of

* ``max_seq_len: N`` -- every sequence has N tokens;
* ``seq_lens: [n0, n1, ...]`` -- one length per sequence (``num_seqs`` of them);
* ``seq_lens: {distribution: lognormal, median: M (or mu: ln M), sigma: S, min: A, max: B,
  seed: K}`` -- ``num_seqs`` draws ``round(exp(N(mu, S))))`` clipped to ``[A, B]`` from
  ``random.Random(K)`` (the first n draws of one stream: stable across platforms and Python
  versions), or ``{distribution: uniform, min: A, max: B, seed: K}``.

A point's (or an axis's) own ``max_seq_len`` / ``seq_lens`` replaces the other one from
``defaults``. The point id (column ``point_id``) spells every field (a length list by a digest); a row's
key is ``(point_id, tiling, partition_size)``.

Results
-------
One parquet file (pyarrow), one row per (point, variant); key-value metadata
``cpa.sweep.schema_version`` (:data:`SCHEMA_VERSION`) and ``cpa.sweep`` (JSON: every run
that wrote rows, with its provenance and the read/copy ceilings measured once at its
start). Columns: :data:`REQUIRED_COLUMNS` and more (:data:`COLUMN_TYPES`). Bytes:
``kv_bytes`` = K and V read once (``sum(seq_lens) * num_kv_heads * head_size * 2 *
element``); ``bytes`` = ``kv_bytes`` + q and out + the partials (max logit, exp sum and
``head_size`` floats per partition of each sequence, written by the attention kernel and
read back by the reduce) when a point needs more than one partition. ``gbps`` is
``kv_bytes`` over the median time -- the bytes any decode kernel must read, so kernels that
move more do not get credit for it (as in ``cpa bench``) -- and ``frac_peak_bw`` is that over
the read ceiling of the same run; ``total_gbps`` is ``bytes`` over the time.

Crash safety: each finished row is one small JSON file in ``<out>.journal/`` written to a
temporary name, fsynced and renamed (``os.replace``); after each point and at the end the
journal is compacted into the parquet (temporary file + ``os.replace``). A killed sweep loses
at most the row in flight; ``--resume`` compacts what is there (ignoring, and renaming to
``*.corrupt``, any unreadable journal file) and skips the rows already present.

Runners
-------
What is timed is pluggable (:class:`Runner`): :class:`CudaRunner` (the CPA kernel and the
peers, CUDA-graph replay over rotating input sets with ``cpa.timing.time_graph``; a point
too large for a second set is timed on its verification inputs, ``times_on_inputs``; column
``timing_inputs`` says which, "sets" or "inputs", in rows written since the twenty-sixth session) and
:class:`ReferenceRunner` (the torch reference on the CPU as the timed op, host timer; for
tests and CI). ``cpa sweep --runner module:attr`` loads any other.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

from .fsio import fsync_dir, write_bytes_atomic
from .timing import Settling

SCHEMA_VERSION = 1
GRID_SCHEMA = 1
META_VERSION_KEY = b"cpa.sweep.schema_version"
META_KEY = b"cpa.sweep"

KEY = ("point_id", "tiling", "partition_size")

#: the columns every results file has (peers too)
REQUIRED_COLUMNS = (
    "tiling", "partition_size", "num_seqs", "num_heads", "num_kv_heads", "head_size", "block_size",
    "max_seq_len", "mean_seq_len", "dtype", "kv_cache_dtype", "time_us", "time_us_p25", "time_us_p75",
    "attn_time_us", "reduce_time_us", "bytes", "gbps", "frac_peak_bw", "verified", "max_rel_err",
    "device_name", "driver_version", "torch_version", "git_commit", "timestamp",
)

#: every column the sweep writes, with its type (int: int64; Int64: nullable int)
COLUMN_TYPES: dict[str, str] = {
    "grid": "str", "point_id": "str", "tiling": "str", "partition_size": "int",
    "num_seqs": "int", "num_heads": "int", "num_kv_heads": "int", "head_size": "int", "block_size": "int",
    "gqa_ratio": "int", "max_seq_len": "int", "mean_seq_len": "float", "seq_lens_dist": "str",
    "dtype": "str", "kv_cache_dtype": "str", "seed": "int",
    "time_us": "float", "time_us_p25": "float", "time_us_p75": "float",
    "attn_time_us": "float", "reduce_time_us": "float", "num_partitions": "int",
    "kv_bytes": "int", "bytes": "int", "gbps": "float", "total_gbps": "float", "frac_peak_bw": "float",
    "verified": "bool", "max_rel_err": "float", "error": "str", "backend": "str", "note": "str",
    "n_sets": "Int64", "timing_inputs": "str", "replays": "Int64", "build_from_cache": "boolean", "build_seconds": "float",
    "read_gbps_ceiling": "float", "copy_gbps_ceiling": "float", "read_method": "str",
    "runner": "str", "arch": "str", "run_id": "str",
    "device_name": "str", "driver_version": "str", "torch_version": "str", "git_commit": "str",
    "timestamp": "str", "command": "str",
}
assert set(REQUIRED_COLUMNS) <= set(COLUMN_TYPES)

POINT_FIELDS = ("num_seqs", "num_heads", "num_kv_heads", "head_size", "block_size", "max_seq_len", "seq_lens",
                "dtype", "kv_cache_dtype")
_GRID_KEYS = ("schema", "name", "description", "seed", "defaults", "axes", "points", "variants")
_DTYPES = ("fp16", "bf16")
_ELEM = {"fp16": 2, "bf16": 2}
UNSUPPORTED = "unsupported"


# ==================================================================================== points
@dataclass(frozen=True)
class Point:
    """One decode shape."""

    num_seqs: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    seq_lens: tuple[int, ...]
    seq_lens_dist: str  # "fixed", "list:<digest>" or the distribution, e.g. "lognormal(median=1024,...)"
    dtype: str = "fp16"
    kv_cache_dtype: str = "auto"

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens)

    @property
    def mean_seq_len(self) -> float:
        return sum(self.seq_lens) / len(self.seq_lens)

    @property
    def fixed_length(self) -> bool:
        return len(set(self.seq_lens)) == 1

    @property
    def gqa_ratio(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def kv_elem(self) -> int:
        return 1 if self.kv_cache_dtype == "fp8" else _ELEM[self.dtype]

    @property
    def kv_bytes(self) -> int:
        """K and V read once."""
        return 2 * sum(self.seq_lens) * self.num_kv_heads * self.head_size * self.kv_elem

    @property
    def point_id(self) -> str:
        lens = f"L{self.seq_lens[0]}" if self.seq_lens_dist == "fixed" else self.seq_lens_dist
        return (f"s{self.num_seqs}-h{self.num_heads}-kv{self.num_kv_heads}-d{self.head_size}-b{self.block_size}-"
                f"{self.dtype}-kv{self.kv_cache_dtype}-{lens}")

    def torch_dtype(self):
        import torch

        return {"fp16": torch.float16, "bf16": torch.bfloat16}[self.dtype]

    def columns(self) -> dict:
        return dict(point_id=self.point_id, num_seqs=self.num_seqs, num_heads=self.num_heads,
                    num_kv_heads=self.num_kv_heads, head_size=self.head_size, block_size=self.block_size,
                    gqa_ratio=self.gqa_ratio, max_seq_len=self.max_seq_len, mean_seq_len=self.mean_seq_len,
                    seq_lens_dist=self.seq_lens_dist, dtype=self.dtype, kv_cache_dtype=self.kv_cache_dtype)


def _num(v: float) -> str:
    return f"{v:g}"


def sample_seq_lens(spec: Mapping, n: int, where: str = "seq_lens") -> tuple[tuple[int, ...], str]:
    """(lengths, description) for a distribution mapping (see the module docstring)."""
    spec = dict(spec)
    dist = spec.pop("distribution", None)
    if dist not in ("lognormal", "uniform"):
        raise ValueError(f"{where}.distribution: expected 'lognormal' or 'uniform', got {dist!r}")
    if "seed" not in spec:
        raise ValueError(f"{where}.seed: a distribution needs a seed (it is recorded in the point id)")
    seed = spec.pop("seed")
    lo = spec.pop("min", 1)
    hi = spec.pop("max", None)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (seed, lo, hi)):
        raise ValueError(f"{where}: seed, min and max must be integers (max is required)")

    def real(key: str, v) -> float:  # a finite number (YAML's .inf / .nan and booleans refused)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{where}.{key}: expected a finite number, got {v!r}")
        return float(v)

    if not 1 <= lo <= hi:
        raise ValueError(f"{where}: need 1 <= min <= max, got min={lo}, max={hi}")
    rng = random.Random(seed)
    if dist == "lognormal":
        if "median" in spec and "mu" in spec:
            raise ValueError(f"{where}: give median or mu, not both")
        if "median" in spec:
            median = real("median", spec.pop("median"))
            if median <= 0:
                raise ValueError(f"{where}.median: must be > 0")
            mu, label = math.log(median), f"median={_num(median)}"
        elif "mu" in spec:
            mu = real("mu", spec.pop("mu"))
            label = f"mu={_num(mu)}"
        else:
            raise ValueError(f"{where}: lognormal needs median (or mu)")
        sigma = real("sigma", spec.pop("sigma", 1.0))
        if sigma <= 0:
            raise ValueError(f"{where}.sigma: must be > 0")

        def draw() -> float:  # a huge mu or sigma overflows exp(): the draw is clamped to max anyway
            try:
                return rng.lognormvariate(mu, sigma)
            except OverflowError:
                return math.inf

        draws = [draw() for _ in range(n)]
        desc = f"lognormal({label},sigma={_num(sigma)},min={lo},max={hi},seed={seed})"
    else:
        draws = [rng.uniform(lo, hi) for _ in range(n)]
        desc = f"uniform(min={lo},max={hi},seed={seed})"
    if spec:
        raise ValueError(f"{where}: unknown key(s) {sorted(spec)} for distribution {dist!r}")
    lens = tuple(min(hi, max(lo, int(round(x)) if math.isfinite(x) else hi)) for x in draws)
    return lens, desc


def _as_int(where: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{where}: expected an integer, got {v!r}")
    if v < 1:
        raise ValueError(f"{where}: must be >= 1, got {v}")
    return v


def make_point(fields: Mapping, where: str = "point") -> Point:
    unknown = set(fields) - set(POINT_FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: {', '.join(POINT_FIELDS)}")
    f = {"dtype": "fp16", "kv_cache_dtype": "auto", **fields}
    for k in ("num_seqs", "num_heads", "num_kv_heads", "head_size", "block_size"):
        if k not in f:
            raise ValueError(f"{where}.{k}: missing")
        f[k] = _as_int(f"{where}.{k}", f[k])
    if f["dtype"] not in _DTYPES:
        raise ValueError(f"{where}.dtype: expected one of {_DTYPES}, got {f['dtype']!r}")
    kv = str(f["kv_cache_dtype"]).lower()
    kv = "fp8" if kv in ("fp8", "fp8_e4m3") else kv
    if kv not in ("auto", "fp8"):
        raise ValueError(f"{where}.kv_cache_dtype: expected auto or fp8, got {f['kv_cache_dtype']!r}")
    if f["num_heads"] % f["num_kv_heads"]:
        raise ValueError(f"{where}.num_heads: {f['num_heads']} is not a multiple of num_kv_heads {f['num_kv_heads']}")
    from .validation import SUPPORTED_BLOCK_SIZES, SUPPORTED_HEAD_SIZES

    # the op's contract (the reference and the peers run these; a size the CPA kernel lacks makes
    # its rows "unsupported"): anything else is refused here, not as a failed row of every variant
    for k, allowed in (("head_size", SUPPORTED_HEAD_SIZES), ("block_size", SUPPORTED_BLOCK_SIZES)):
        if f[k] not in allowed:
            raise ValueError(f"{where}.{k}: {f[k]} is not a paged_attention {k.replace('_', ' ')}; "
                             f"allowed: {tuple(allowed)}")
    x = 16 // (1 if kv == "fp8" else _ELEM[f["dtype"]])
    if f["head_size"] % x:
        raise ValueError(f"{where}.head_size: {f['head_size']} is not a multiple of {x}")
    S = f["num_seqs"]
    has_max, has_lens = "max_seq_len" in f, "seq_lens" in f
    if has_max == has_lens:
        raise ValueError(f"{where}: give exactly one of max_seq_len and seq_lens")
    if has_max:
        lens, dist = (_as_int(f"{where}.max_seq_len", f["max_seq_len"]),) * S, "fixed"
    elif isinstance(f["seq_lens"], Mapping):
        lens, dist = sample_seq_lens(f["seq_lens"], S, f"{where}.seq_lens")
    elif isinstance(f["seq_lens"], (list, tuple)):
        lens = tuple(_as_int(f"{where}.seq_lens[{i}]", v) for i, v in enumerate(f["seq_lens"]))
        if len(lens) != S:
            raise ValueError(f"{where}.seq_lens: {len(lens)} lengths for num_seqs={S}")
        digest = hashlib.blake2b(",".join(map(str, lens)).encode(), digest_size=6).hexdigest()
        dist = f"list:{digest}"
    else:
        raise ValueError(f"{where}.seq_lens: expected a list of lengths or a distribution mapping")
    return Point(S, f["num_heads"], f["num_kv_heads"], f["head_size"], f["block_size"], tuple(lens), dist,
                 f["dtype"], kv)


# ================================================================================== variants
@dataclass(frozen=True)
class RowVariant:
    """What a row runs: a CPA variant (tiling, partition size) or a peer (tiling = its name)."""

    tiling: str
    partition_size: int = 0
    peer: bool = False

    @property
    def label(self) -> str:
        return self.tiling if self.peer else f"{self.tiling}/{self.partition_size}"


def row_key(point_id: str, tiling: str, partition_size: int) -> tuple[str, str, int]:
    return (str(point_id), str(tiling), int(partition_size))


def num_partitions(point: Point, variant: RowVariant) -> int:
    if variant.peer or variant.partition_size <= 0:
        return 1
    return -(-point.max_seq_len // variant.partition_size)


def bytes_moved(point: Point, variant: RowVariant) -> int:
    """K and V read once, q read and out written, and the partials written and read back."""
    qo = 2 * point.num_seqs * point.num_heads * point.head_size * _ELEM[point.dtype]
    partials = 0
    if num_partitions(point, variant) > 1:
        parts = sum(-(-L // variant.partition_size) for L in point.seq_lens)
        partials = 2 * point.num_heads * parts * (point.head_size + 2) * 4
    return point.kv_bytes + qo + partials


# ===================================================================================== grids
@dataclass
class Grid:
    name: str
    points: list[Point]
    tilings: tuple[str, ...]
    partition_sizes: tuple[int, ...]
    seed: int = 0
    description: str = ""
    source: str = ""

    def variants(self) -> list[RowVariant]:
        return [RowVariant(t, int(p)) for t in self.tilings for p in self.partition_sizes]

    def rows(self) -> list[tuple[Point, RowVariant]]:
        vs = self.variants()
        return [(pt, v) for pt in self.points for v in vs]

    def point_seed(self, point: Point) -> int:
        h = hashlib.blake2b(f"cpa.sweep:{self.seed}:{point.point_id}".encode(), digest_size=4).digest()
        return int.from_bytes(h, "little") & 0x7FFFFFFF

    def with_variants(self, tilings=None, partition_sizes=None) -> "Grid":
        return dataclasses.replace(self, tilings=_tilings(tilings, "tilings") if tilings else self.tilings,
                                   partition_sizes=_partitions(partition_sizes, "partition_sizes")
                                   if partition_sizes else self.partition_sizes)


def _tilings(v, where) -> tuple[str, ...]:
    from . import variants as V

    if v in (None, "all"):
        return V.TILINGS
    if isinstance(v, str):
        v = [v]
    bad = [t for t in v if t not in V.TILINGS]
    if bad or not v:
        raise ValueError(f"{where}: unknown tiling(s) {bad}; allowed: {', '.join(V.TILINGS)} or 'all'")
    return tuple(dict.fromkeys(v))


def _partitions(v, where) -> tuple[int, ...]:
    from . import variants as V

    if v in (None, "all"):
        return V.PARTITION_SIZES
    if isinstance(v, int):
        v = [v]
    bad = [p for p in v if p not in V.PARTITION_SIZES]
    if bad or not v:
        raise ValueError(f"{where}: unsupported partition size(s) {bad}; allowed: "
                         f"{', '.join(map(str, V.PARTITION_SIZES))} or 'all'")
    return tuple(dict.fromkeys(int(p) for p in v))


def _expand_axes(axes: Mapping) -> list[dict]:
    combos: list[dict] = [{}]
    for name, values in axes.items():
        if not isinstance(values, list) or not values:
            raise ValueError(f"axes.{name}: expected a non-empty list")
        out = []
        for c in combos:
            for i, v in enumerate(values):
                if name in POINT_FIELDS:
                    upd = {name: v}
                elif isinstance(v, Mapping):
                    upd = dict(v)
                else:
                    raise ValueError(f"axes.{name}[{i}]: {name!r} is not a point field, so its values must be "
                                     f"mappings of point fields (point fields: {', '.join(POINT_FIELDS)})")
                out.append({**c, **upd})
        combos = out
    return combos


def parse_grid(spec: Mapping, source: str = "") -> Grid:
    """A :class:`Grid` from a mapping with the YAML schema of the module docstring."""
    if not isinstance(spec, Mapping):
        raise ValueError(f"grid {source}: expected a mapping at the top level")
    unknown = set(spec) - set(_GRID_KEYS)
    if unknown:
        raise ValueError(f"grid {source}: unknown key(s) {sorted(unknown)}; allowed: {', '.join(_GRID_KEYS)}")
    if spec.get("schema", GRID_SCHEMA) != GRID_SCHEMA:
        raise ValueError(f"grid {source}: schema {spec.get('schema')!r} is not supported (only {GRID_SCHEMA})")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"grid {source}: name: a non-empty string is required")
    seed = spec.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"grid {name}: seed: expected an integer")
    defaults = spec.get("defaults") or {}
    if not isinstance(defaults, Mapping):
        raise ValueError(f"grid {name}: defaults: expected a mapping")
    axes = spec.get("axes") or {}
    if not isinstance(axes, Mapping):
        raise ValueError(f"grid {name}: axes: expected a mapping of axis name -> list")
    explicit = spec.get("points") or []
    if not isinstance(explicit, list):
        raise ValueError(f"grid {name}: points: expected a list of mappings")
    fields = (_expand_axes(axes) if axes else []) + [dict(p) if isinstance(p, Mapping) else p for p in explicit]
    points = []
    for i, f in enumerate(fields):
        if not isinstance(f, Mapping):
            raise ValueError(f"grid {name}: points[{i}]: expected a mapping")
        merged = {**defaults, **f}
        for mine, other in (("seq_lens", "max_seq_len"), ("max_seq_len", "seq_lens")):
            if mine in f and other not in f:  # a point's own lengths replace the defaults' other spelling
                merged.pop(other, None)
        points.append(make_point(merged, where=f"grid {name}: point {i}"))
    if not points:
        raise ValueError(f"grid {name}: no points (give axes and/or points)")
    ids = [p.point_id for p in points]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ValueError(f"grid {name}: duplicate points {dup[:3]}")
    var = spec.get("variants") or {}
    if not isinstance(var, Mapping) or set(var) - {"tilings", "partition_sizes"}:
        raise ValueError(f"grid {name}: variants: expected a mapping with tilings and/or partition_sizes")
    return Grid(name=name, points=points, tilings=_tilings(var.get("tilings", "all"), f"grid {name}: variants.tilings"),
                partition_sizes=_partitions(var.get("partition_sizes", "all"), f"grid {name}: variants.partition_sizes"),
                seed=seed, description=str(spec.get("description", "")).strip(), source=source)


def builtin_grids() -> list[str]:
    from importlib.resources import files

    return sorted(p.name[:-5] for p in files("cpa").joinpath("grids").iterdir() if p.name.endswith(".yaml"))


def load_grid(name_or_path: str | os.PathLike) -> Grid:
    """A shipped grid by name (``cpa/grids/<name>.yaml``) or a user grid from a YAML file."""
    import yaml

    s = os.fspath(name_or_path)
    if os.path.exists(s) or s.endswith((".yaml", ".yml")) or os.sep in s:
        with open(s) as fh:
            text, source = fh.read(), s
    else:
        from importlib.resources import files

        res = files("cpa").joinpath("grids", f"{s}.yaml")
        if not res.is_file():
            raise ValueError(f"grid {s!r}: no such shipped grid (have: {', '.join(builtin_grids())}) "
                             f"and no such file")
        text, source = res.read_text(), f"builtin:{s}"
    try:
        spec = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"grid {source}: not valid YAML: {e}") from None
    return parse_grid(spec, source)


# =================================================================================== runners
class Unsupported(ValueError):
    """The variant does not exist for this point on this runner's platform."""


@dataclass
class Built:
    """A runner's handle for one (point, variant), plus columns it wants in the row."""

    handle: Any
    info: dict = field(default_factory=dict)


class Runner(Protocol):
    """What a sweep runs. The engine calls, in order::

        meta = runner.begin()                       # once: {'read_gbps', ...} (ceilings, arch, ...)
        peers, skipped = runner.peer_variants()     # peers to add as rows; {name: reason} skipped
        for point:  state = runner.open_point(point, seed)
            for variant:  built = runner.build(state, variant)   # raises Unsupported / any error
                          row |= runner.verify(state, built)     # {'verified', 'max_rel_err', ...}
                          row |= runner.time(state, built)       # {'time_us', 'time_us_p25', 'time_us_p75',
                                                                 #  'attn_time_us', 'reduce_time_us', ...}
                          runner.release(built)
            runner.close_point(state)

    ``healthy()`` is asked after a row raised: False stops the sweep without recording the
    row (e.g. a sticky device error), so that ``--resume`` retries it on a fresh process.
    """

    name: str
    replays: int

    def begin(self) -> dict: ...
    def peer_variants(self) -> tuple[list[RowVariant], dict[str, str]]: ...
    def open_point(self, point: Point, seed: int) -> Any: ...
    def close_point(self, state: Any) -> None: ...
    def build(self, state: Any, variant: RowVariant) -> Built: ...
    def verify(self, state: Any, built: Built) -> dict: ...
    def time(self, state: Any, built: Built) -> dict: ...
    def release(self, built: Built) -> None: ...
    def healthy(self) -> bool: ...


def host_timing(fn: Callable[[], Any], replays: int, warmup: int = 1):
    """Median / quartiles of a host-timed call (a cpa.timing.Timing)."""
    from .timing import Timing

    for _ in range(warmup):
        fn()
    xs = []
    for _ in range(max(1, replays)):
        t0 = time.perf_counter()
        fn()
        xs.append((time.perf_counter() - t0) * 1e6)
    xs.sort()
    if len(xs) == 1:
        return Timing(xs[0], xs[0], xs[0], 1)
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return Timing(statistics.median(xs), q[0], q[2], len(xs))


@dataclass
class _RefState:
    point: Point
    kwargs: dict
    ref: Any
    tol: float


class ReferenceRunner:
    """The torch reference on the CPU as the timed op (host timer): the sweep machinery without a GPU.

    ``build`` checks the variant against ``cpa.variants`` for ``platform`` (so the same rows
    are unsupported as on that GPU), ``verify`` runs the partitioned reference into a NaN-filled
    buffer and compares it with the single-pass reference, ``time`` times the partitioned call
    (together), the call with intermediates (attention) and ``reduce_partitions`` (reduce).
    """

    name = "cpu-reference"

    def __init__(self, replays: int = 5, platform: str = "cuda", device: str = "cpu"):
        self.replays = int(replays)
        self.platform = platform
        self.device = device

    def begin(self) -> dict:
        import torch

        x = torch.randn(1 << 23, dtype=torch.float32)  # 32 MiB
        t = host_timing(lambda: x.sum(), 5)
        y = torch.empty_like(x)
        c = host_timing(lambda: y.copy_(x), 5)
        nbytes = x.numel() * 4
        return {"read_gbps": nbytes / (t.median_us * 1e-6) / 1e9, "copy_gbps": 2 * nbytes / (c.median_us * 1e-6) / 1e9,
                "read_method": "torch.sum on the host (CPU reference runner)", "arch": "cpu", "platform": "cpu"}

    def peer_variants(self):
        from .peers import PEER_NAMES

        return [], {p: "no peers on the CPU reference runner" for p in PEER_NAMES}

    def open_point(self, point: Point, seed: int) -> _RefState:
        from . import reference
        from .inputs import make_paged_inputs

        inp = make_paged_inputs(point.num_seqs, point.num_heads, point.num_kv_heads, point.head_size,
                                point.block_size, list(point.seq_lens), dtype=point.torch_dtype(),
                                kv_cache_dtype=point.kv_cache_dtype, seed=seed, device=self.device)
        kw = inp.as_kwargs()
        ref = reference.paged_attention(**kw)
        return _RefState(point, kw, ref, reference.REL_ERR_TOL[point.torch_dtype()])

    def close_point(self, state) -> None:
        pass

    def build(self, state: _RefState, variant: RowVariant) -> Built:
        from . import variants as V

        if variant.peer:
            raise Unsupported(f"{UNSUPPORTED}: no peer {variant.tiling!r} on the CPU reference runner")
        pt = state.point
        try:
            v = V.variant_for(tiling=variant.tiling, partition_size=variant.partition_size, head_size=pt.head_size,
                              block_size=pt.block_size, dtype=pt.dtype, kv_cache_dtype=pt.kv_cache_dtype,
                              gqa_ratio=pt.gqa_ratio, platform=self.platform)
        except (ValueError, TypeError) as e:
            raise Unsupported(f"{UNSUPPORTED}: {e}") from None
        return Built(variant.partition_size, {"note": f"reference stands in for {v.name}"})

    def compute(self, kwargs: dict, partition_size: int, out) -> None:
        """The op under test, writing into `out` (here: the partitioned reference)."""
        from . import reference

        out.copy_(reference.paged_attention(**kwargs, partition_size=partition_size))

    def verify(self, state: _RefState, built: Built) -> dict:
        import torch

        from . import reference

        out = torch.full_like(state.kwargs["query"], float("nan"))  # poisoned: unwritten outputs show
        self.compute(state.kwargs, built.handle, out)
        err = reference.relative_error(out, state.ref, per_seq=True)
        return {"verified": bool(err <= state.tol), "max_rel_err": err}

    def time(self, state: _RefState, built: Built) -> dict:
        from . import reference

        P, kw = built.handle, state.kwargs
        t_all = host_timing(lambda: reference.paged_attention(**kw, partition_size=P), self.replays)
        t_attn = host_timing(lambda: reference.paged_attention(**kw, partition_size=P, return_intermediates=True),
                             self.replays)
        _, es, ml, to = reference.paged_attention(**kw, partition_size=P, return_intermediates=True)
        t_red = host_timing(lambda: reference.reduce_partitions(es, ml, to), self.replays)
        return {**t_all.as_dict(), "attn_time_us": t_attn.median_us, "reduce_time_us": t_red.median_us,
                "n_sets": 1, "timing_inputs": "inputs", "replays": self.replays}

    def release(self, built: Built) -> None:
        pass

    def healthy(self) -> bool:
        return True


@dataclass
class CudaPointState:
    """One point's device data, shared by its rows (the peers read it too).

    inputs: fresh verification inputs (``make_paged_inputs``: garbage block-table tails, NaN
    in unused cache slots); ref: the reference output for them; sets: the timing sets
    (``cpa.bench.make_sets``: one KV pool >= 1 GiB, disjoint block tables per set; or, where
    that pool would hold one set, the inputs themselves: ``times_on_inputs``).
    """

    point: Point
    inputs: Any
    ref: Any
    tol: float
    sets: Any
    replays: int
    # (the point's first timing warms up for cpa.timing.SETTLE_US)
    settling: Settling = field(default_factory=Settling)
    # what the rows are timed on (column `timing_inputs`): make_sets' "sets" or the verification "inputs"
    timing_inputs: str = "sets"


class CudaRunner:
    """The CPA kernel (and the peers) on the GPU, timed by CUDA-graph replay over rotating sets."""

    name = "cuda"

    def __init__(self, replays: int = 30, peers: Sequence[str] | None = None):
        self.replays = int(replays)
        self.peer_names = peers
        self._peers: dict[str, Any] = {}
        self.meta: dict = {}

    def begin(self) -> dict:
        from . import ceilings
        from .jit import device_arch

        platform, arch = device_arch()
        ceil = ceilings.measure()
        self.meta = {"read_gbps": ceil["read_gbps"], "copy_gbps": ceil["copy_gbps"],
                     "read_method": ceil["read_method"], "arch": arch, "platform": platform}
        return self.meta

    def prebuild(self, rows: Sequence[tuple[Point, RowVariant]]) -> dict:
        """Compile every CPA variant the rows need, in parallel processes, before the first point.

        The sweep would otherwise build them one at a time as it reaches them; the result is
        the same (the disk cache), only sooner. Variants that do not exist are left to the row."""
        from . import variants as V
        from .jit import prebuild

        platform, arch = self.meta.get("platform"), self.meta.get("arch")
        vs = []
        for pt, v in rows:
            if v.peer:
                continue
            try:
                vs.append(V.variant_for(tiling=v.tiling, partition_size=v.partition_size, head_size=pt.head_size,
                                        block_size=pt.block_size, dtype=pt.dtype, kv_cache_dtype=pt.kv_cache_dtype,
                                        gqa_ratio=pt.gqa_ratio, platform=platform))
            except ValueError:
                continue
        vs = list(dict.fromkeys(vs))
        t0 = time.perf_counter()
        res = prebuild(vs, arch, progress=False) if vs else []
        return {"variants": len(vs), "compiled": sum(not r["from_cache"] and not r["error"] for r in res),
                "errors": sum(bool(r["error"]) for r in res), "seconds": time.perf_counter() - t0}

    def peer_variants(self):
        from . import peers as P

        found, skipped = P.available_peers(self.peer_names)
        self._peers = {p.name: p for p in found}
        return [RowVariant(p.name, 0, peer=True) for p in found], skipped

    def open_point(self, point: Point, seed: int) -> CudaPointState:
        import torch

        from . import reference
        from .bench import make_sets
        from .inputs import make_paged_inputs

        dt = point.torch_dtype()
        inp = make_paged_inputs(point.num_seqs, point.num_heads, point.num_kv_heads, point.head_size,
                                point.block_size, list(point.seq_lens), dtype=dt, kv_cache_dtype=point.kv_cache_dtype,
                                seed=seed, device="cuda")
        ref = reference.paged_attention(**inp.as_kwargs())
        timing_inputs = "inputs" if times_on_inputs(point, inp) else "sets"
        if timing_inputs == "inputs":
            sets = sets_of_inputs(point, inp)
        else:
            # make_sets gives every sequence max_seq_len tokens of blocks; shorter sequences of a
            # mixed point just use a prefix of their row (and the pool stays >= 1 GiB)
            sets = make_sets(point.num_seqs, point.max_seq_len, num_heads=point.num_heads,
                             num_kv_heads=point.num_kv_heads, head_size=point.head_size, block_size=point.block_size,
                             dtype=dt, seed=seed + 1)
            if not point.fixed_length:
                sets = dataclasses.replace(sets, seq_lens=torch.tensor(point.seq_lens, dtype=torch.int32,
                                                                       device="cuda"),
                                           kv_bytes_per_set=point.kv_bytes)
            if point.kv_cache_dtype == "fp8":
                sets = _fp8_sets(sets)
        torch.cuda.synchronize()
        return CudaPointState(point, inp, ref, reference.REL_ERR_TOL[dt], sets, self.replays,
                              timing_inputs=timing_inputs)

    def close_point(self, state) -> None:
        import torch

        state.inputs = state.ref = state.sets = None  # drop the point's tensors before the next allocates
        torch.cuda.empty_cache()

    def build(self, state: CudaPointState, variant: RowVariant) -> Built:
        import torch

        from .ops import prepare

        if variant.peer:
            peer = self._peers[variant.tiling]
            return Built(("peer", peer, peer.build(state)), {})
        pt, sets = state.point, state.sets
        try:
            out = torch.full_like(state.inputs.query, float("nan"))  # poisoned: unwritten outputs show
            ver = prepare(**state.inputs.as_kwargs(), partition_size=variant.partition_size, tiling=variant.tiling,
                          out=out, **TWO_KERNELS)
            launches = [prepare(query=q, key_cache=sets.key_cache, value_cache=sets.value_cache, block_tables=bt,
                                seq_lens=sets.seq_lens, scale=sets.scale, partition_size=variant.partition_size,
                                tiling=variant.tiling, max_seq_len=pt.max_seq_len, check_values=(i == 0),
                                **launch_kwargs(pt, sets))
                        for i, (q, bt) in enumerate(zip(sets.queries, sets.block_tables))]
        except ValueError as e:  # not a variant of this platform / shape
            raise Unsupported(f"{UNSUPPORTED}: {e}") from None
        k = ver.kernel
        return Built(("cpa", ver, launches), {"build_from_cache": bool(k.from_cache),
                                             "build_seconds": float(k.build_seconds), "note": k.variant.name})

    def verify(self, state: CudaPointState, built: Built) -> dict:
        import torch

        from . import reference

        kind, a, b = built.handle
        if kind == "peer":
            return a.verify(state, b)
        a()
        torch.cuda.synchronize()
        err = reference.relative_error(a.out, state.ref, per_seq=True)
        return {"verified": bool(err <= state.tol), "max_rel_err": err}

    def time(self, state: CudaPointState, built: Built) -> dict:
        from .timing import time_graph

        kind, a, b = built.handle
        settle = state.settling.warmup_us()  # (as cpa.bench: a run's first timing reads slow)
        if kind == "peer":
            return {**a.time(state, b), "timing_inputs": state.timing_inputs}
        launches = b
        t_all = time_graph([l.__call__ for l in launches], replays=self.replays, warmup_us=settle)
        t_attn = time_graph([l.attention for l in launches], replays=self.replays)
        t_red = (time_graph([l.reduce for l in launches], replays=self.replays)
                 if launches[0].reduce_args is not None else None)
        return {**t_all.as_dict(), "attn_time_us": t_attn.median_us,
                "reduce_time_us": t_red.median_us if t_red else 0.0, "n_sets": len(launches),
                "timing_inputs": state.timing_inputs, "replays": self.replays}

    def release(self, built: Built) -> None:
        kind, a, b = built.handle
        if kind == "peer":
            a.release(b)
        built.handle = None

    def healthy(self) -> bool:
        import torch

        try:
            torch.cuda.synchronize()
            torch.zeros(1, device="cuda").add_(1).item()
            torch.cuda.empty_cache()  # after an out-of-memory row, give the next one the whole pool
            return True
        except Exception:
            return False


# the two-kernel design (attention, then the reduce launch) at every point, so that rows compare
# partition sizes on one structure; the in-kernel combines are bench modes
TWO_KERNELS = dict(fused_reduce=False, cluster_reduce=False)


def launch_kwargs(point, sets=None) -> dict:
    """prepare()'s options for a point's timing sets (and profiling/harness.py's launches): the
    reduce as its own launch, and with an fp8 cache its dtype and the sets' scales (1 for
    `_fp8_sets`' caches, the default without ``sets``)."""
    kw = dict(TWO_KERNELS)
    if point.kv_cache_dtype == "fp8":
        kw.update(kv_cache_dtype="fp8", k_scale=float(getattr(sets, "k_scale", 1.0)),
                  v_scale=float(getattr(sets, "v_scale", 1.0)))
    return kw


def times_on_inputs(point, inputs) -> bool:
    """Whether a point is timed on its verification inputs instead of its own timing sets.

    Where make_sets would draw a single set (the point's K/V is at least half the 1 GiB pool),
    that set is a second copy of the point's K/V for nothing: the verification inputs are as
    random, as shuffled and as far past the L2, and timing on them halves the point's memory
    (256 x 32k at head 128 then fits an 80 GB card beside SDPA's contiguous copy). Only where
    the inputs' own caches cover the pool (POOL_BYTES), so that no point is timed from the L2."""
    from .bench import POOL_BYTES, sets_layout

    # (an fp8 point's sets are drawn in the query's dtype, then converted: open_point)
    *_, n_sets = sets_layout(point.num_seqs, point.max_seq_len, num_kv_heads=point.num_kv_heads,
                             head_size=point.head_size, block_size=point.block_size, dtype=point.torch_dtype())
    cache_bytes = inputs.key_cache.nbytes + inputs.value_cache.nbytes
    return n_sets == 1 and cache_bytes >= POOL_BYTES


def sets_of_inputs(point, inputs):
    """The verification inputs as the point's one timing set (see ``times_on_inputs``)."""
    from .bench import DeviceSets

    return DeviceSets(inputs.key_cache, inputs.value_cache, [inputs.query], [inputs.block_tables],
                      inputs.seq_lens, inputs.scale, point.kv_bytes, k_scale=inputs.k_scale,
                      v_scale=inputs.v_scale)


def _fp8_sets(sets):
    """The timing sets with e4m3fn byte caches (values as drawn; k_scale = v_scale = 1)."""
    import torch

    kc, vc = sets.key_cache, sets.value_cache
    n, kvh, dx, bs, x = kc.shape
    D = dx * x
    # logical K [n, kvh, bs, D] -> fp8 layout [n, kvh, D/16, bs, 16]
    k = kc.permute(0, 1, 3, 2, 4).reshape(n, kvh, bs, D // 16, 16).permute(0, 1, 3, 2, 4)
    k8 = k.to(torch.float8_e4m3fn).view(torch.uint8).contiguous()
    v8 = vc.to(torch.float8_e4m3fn).view(torch.uint8).contiguous()
    return dataclasses.replace(sets, key_cache=k8, value_cache=v8, kv_bytes_per_set=sets.kv_bytes_per_set // 2)


def make_runner(kind: str = "auto", *, replays: int | None = None, peers: Sequence[str] | None = None) -> Runner:
    """'auto' (cuda when a GPU is visible, else cpu), 'cuda', 'cpu', or 'module:attr' (a factory or class)."""
    if replays is not None and (isinstance(replays, bool) or not isinstance(replays, int) or replays < 1):
        raise ValueError(f"replays={replays!r}: at least 1 replay per timing (None: the runner's default)")
    if kind == "auto":
        import torch

        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        from .jit import require_gpu

        require_gpu("runner 'cuda'")
        return CudaRunner(replays=replays or 30, peers=peers)
    if kind == "cpu":
        return ReferenceRunner(replays=replays or 5)
    if ":" in kind:
        mod, _, attr = kind.partition(":")
        factory = getattr(importlib.import_module(mod), attr)
        return factory(replays=replays) if replays else factory()
    raise ValueError(f"runner={kind!r}: expected auto, cuda, cpu or module:attr")


# ===================================================================================== store
def _jsonable(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if type(v).__name__ in ("NAType", "NaTType"):  # pandas missing values
        return None
    if hasattr(v, "item"):
        return v.item()
    return str(v)


def _normalize(df):
    """Columns in a stable order with stable types (see COLUMN_TYPES)."""
    import pandas as pd

    df = df.copy()
    n = len(df)
    for col, kind in COLUMN_TYPES.items():
        if col not in df:
            df[col] = pd.Series([None] * n, dtype=object, index=df.index)
        s = df[col]
        if kind == "int":
            df[col] = pd.to_numeric(s).astype("int64")
        elif kind == "Int64":
            df[col] = pd.to_numeric(s, errors="coerce").astype("Int64")
        elif kind == "float":
            df[col] = pd.to_numeric(s, errors="coerce").astype("float64")
        elif kind == "bool":
            df[col] = s.fillna(False).astype(bool)
        elif kind == "boolean":
            df[col] = s.astype("boolean")
        else:
            df[col] = pd.Series([None if (v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA)
                                 else str(v) for v in s], dtype=object, index=df.index)
    order = list(COLUMN_TYPES) + [c for c in df.columns if c not in COLUMN_TYPES]
    return df[order].reset_index(drop=True)


_ARROW = {"int": "int64", "Int64": "int64", "float": "float64", "bool": "bool_", "boolean": "bool_", "str": "string"}


def _typed_table(df):
    """A pyarrow table whose known columns have fixed types (all-null columns included)."""
    import pyarrow as pa

    table = pa.Table.from_pandas(df, preserve_index=False)
    for i, name in enumerate(table.column_names):
        kind = COLUMN_TYPES.get(name)
        if kind is None:
            continue
        want = getattr(pa, _ARROW[kind])()
        if table.schema.field(i).type != want:
            table = table.set_column(i, pa.field(name, want), table.column(i).cast(want))
    return table


class ResultStore:
    """A results parquet plus its journal directory (``<out>.journal/``)."""

    def __init__(self, path: str | os.PathLike, echo: Callable[[str], None] | None = None):
        self.path = Path(path)
        self.journal = self.path.with_name(self.path.name + ".journal")
        self.echo = echo or (lambda s: print(s, file=sys.stderr))
        self._lock_fd: int | None = None
        self._seq = 0

    # ---------------------------------------------------------------- locking
    def lock(self) -> None:
        self.journal.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.journal / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise RuntimeError(f"{self.path}: another sweep is writing it (lock {self.journal / 'lock'} is held)")
        self._lock_fd = fd
        for stale in self.journal.glob(".tmp-*"):  # temporary files of a killed writer
            stale.unlink(missing_ok=True)
        # (and of a compaction killed before its rename: cpa.fsio's .tmp-<pid>-<name> beside the table)
        for stale in self.path.parent.glob(f".tmp-*-{self.path.name}"):
            stale.unlink(missing_ok=True)

    def unlock(self) -> None:
        if self._lock_fd is None:
            return
        leftover = [p for p in self.journal.iterdir() if p.name != "lock"] if self.journal.exists() else []
        if not leftover:
            (self.journal / "lock").unlink(missing_ok=True)
        os.close(self._lock_fd)
        self._lock_fd = None
        if not leftover:
            try:
                self.journal.rmdir()
            except OSError:
                pass

    # ---------------------------------------------------------------- state
    def _journal_files(self, prefix: str) -> list[Path]:
        if not self.journal.exists():
            return []
        return sorted(self.journal.glob(f"{prefix}-*.json"))

    def has_data(self) -> bool:
        return self.path.exists() or bool(self._journal_files("row"))

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)
        for p in self._journal_files("row") + self._journal_files("run"):
            p.unlink(missing_ok=True)

    # ---------------------------------------------------------------- journal
    def append(self, row: Mapping) -> None:
        key = row_key(row["point_id"], row["tiling"], row["partition_size"])
        digest = hashlib.blake2b(json.dumps(key).encode(), digest_size=10).hexdigest()
        self._seq += 1
        rec = {"schema_version": SCHEMA_VERSION, "seq": [time.time_ns(), self._seq],
               "row": {k: _jsonable(v) for k, v in row.items()}}
        self.journal.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(self.journal / f"row-{digest}.json", json.dumps(rec).encode())

    def add_run(self, run: Mapping) -> None:
        self.journal.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(self.journal / f"run-{run['run_id']}.json",
                            json.dumps({k: _jsonable(v) if not isinstance(v, (dict, list)) else v
                                        for k, v in run.items()}).encode())

    def _quarantine(self, p: Path, why: str) -> None:
        self.echo(f"sweep: ignoring unreadable journal file {p.name} ({why}); its row will be run again")
        try:
            os.replace(p, p.with_name(p.name + ".corrupt"))
        except OSError:
            pass

    def _read_journal(self) -> tuple[list[dict], list[dict], list[Path]]:
        rows, runs, files = [], [], []
        recs = []
        for p in self._journal_files("row"):
            try:
                rec = json.loads(p.read_bytes())
                row = rec["row"]
                if not isinstance(row, dict) or rec.get("schema_version") != SCHEMA_VERSION:
                    raise ValueError("not a row record of this schema")
                row_key(row["point_id"], row["tiling"], row["partition_size"])
                recs.append((tuple(rec.get("seq", (0, 0))), row))
                files.append(p)
            except (OSError, ValueError, KeyError, TypeError) as e:
                self._quarantine(p, f"{type(e).__name__}: {e}"[:120])
        rows = [r for _, r in sorted(recs, key=lambda t: t[0])]
        for p in self._journal_files("run"):
            try:
                run = json.loads(p.read_bytes())
                if not isinstance(run, dict) or "run_id" not in run:
                    raise ValueError("not a run record")
                runs.append(run)
                files.append(p)
            except (OSError, ValueError) as e:
                self._quarantine(p, f"{type(e).__name__}: {e}"[:120])
        return rows, runs, files

    # ---------------------------------------------------------------- parquet
    def _read_parquet(self):
        import pandas as pd
        import pyarrow.parquet as pq

        if not self.path.exists():
            return None, []
        try:
            table = pq.read_table(self.path)
        except Exception as e:  # truncated / not parquet: keep it aside, never overwrite it silently
            bad = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
            os.replace(self.path, bad)
            self.echo(f"sweep: {self.path} is unreadable ({type(e).__name__}); moved it to {bad.name}")
            return None, []
        meta = table.schema.metadata or {}
        if META_VERSION_KEY not in meta:
            raise ValueError(f"{self.path}: not a cpa sweep results file (no {META_VERSION_KEY.decode()} metadata); "
                             "refusing to touch it")
        version = int(meta[META_VERSION_KEY])
        if version > SCHEMA_VERSION:
            raise ValueError(f"{self.path}: schema version {version} is newer than this cpa ({SCHEMA_VERSION})")
        info = json.loads(meta.get(META_KEY, b"{}"))
        df = table.to_pandas()
        return (df if len(df.columns) else pd.DataFrame()), info.get("runs", [])

    def read(self):
        """(DataFrame, metadata) of the parquet alone (what a finished sweep left)."""
        df, runs = self._read_parquet()
        return df, {"schema_version": SCHEMA_VERSION, "runs": runs}

    def compact(self):
        """Fold the journal into the parquet (atomic replace); returns the table."""
        import pandas as pd
        import pyarrow.parquet as pq

        old, old_runs = self._read_parquet()
        rows, runs, files = self._read_journal()
        parts = [d for d in (old, pd.DataFrame(rows) if rows else None) if d is not None and len(d)]
        df = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=list(COLUMN_TYPES))
        df = _normalize(df)
        df = df.drop_duplicates(subset=list(KEY), keep="last").reset_index(drop=True)
        if not files:
            return df
        by_id = {r["run_id"]: r for r in old_runs}
        by_id.update({r["run_id"]: r for r in runs})
        info = {"schema_version": SCHEMA_VERSION, "runs": list(by_id.values())}
        table = _typed_table(df)
        meta = dict(table.schema.metadata or {})
        meta[META_VERSION_KEY] = str(SCHEMA_VERSION).encode()
        meta[META_KEY] = json.dumps(info).encode()
        table = table.replace_schema_metadata(meta)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".tmp-{os.getpid()}-{self.path.name}")
        pq.write_table(table, tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)
        for p in files:  # a crash before this leaves duplicates, which the next compaction drops
            p.unlink(missing_ok=True)
        return df

    def keys(self, df=None, *, retry_errors: bool = False) -> set:
        if df is None or not len(df):
            return set()
        sel = df
        if retry_errors:
            err = df["error"]
            sel = df[err.isna() | err.astype(str).str.startswith(UNSUPPORTED)]
        return {row_key(a, b, c) for a, b, c in zip(sel.point_id, sel.tiling, sel.partition_size)}


def read_results(path: str | os.PathLike):
    """(DataFrame, metadata dict) of a sweep results parquet."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    meta = table.schema.metadata or {}
    if META_VERSION_KEY not in meta:
        raise ValueError(f"{path}: not a cpa sweep results file")
    info = json.loads(meta.get(META_KEY, b"{}"))
    info["schema_version"] = int(meta[META_VERSION_KEY])
    return table.to_pandas(), info


def merge_results(into: str | os.PathLike, source: str | os.PathLike, *, tilings: Sequence[str]) -> int:
    """Copy the rows of `tilings` from one results file into another where `into` has no row
    of that (point, tiling, partition size), with the runs metadata of both (each row keeps
    its own provenance columns). For a peer that one run could not import: its rows from an
    earlier run on the same GPU. Atomic replace; returns the number of rows added."""
    import pandas as pd
    import pyarrow.parquet as pq

    into = Path(into)
    dst, dmeta = read_results(into)
    src, smeta = read_results(source)
    have = {row_key(a, b, c) for a, b, c in zip(dst.point_id, dst.tiling, dst.partition_size)}
    add = src[src.tiling.isin(list(tilings))]
    add = add[[row_key(a, b, c) not in have for a, b, c in zip(add.point_id, add.tiling, add.partition_size)]]
    if not len(add):
        return 0
    used = set(add.run_id) if "run_id" in add else set()
    runs = {r["run_id"]: r for r in dmeta.get("runs", [])}
    runs.update({r["run_id"]: r for r in smeta.get("runs", []) if not used or r["run_id"] in used})
    df = _normalize(pd.concat([dst, add], ignore_index=True))
    table = _typed_table(df)
    meta = dict(table.schema.metadata or {})
    meta[META_VERSION_KEY] = str(SCHEMA_VERSION).encode()
    meta[META_KEY] = json.dumps({"schema_version": SCHEMA_VERSION, "runs": list(runs.values())}).encode()
    table = table.replace_schema_metadata(meta)
    tmp = into.with_name(f".tmp-{os.getpid()}-{into.name}")
    pq.write_table(table, tmp)
    os.replace(tmp, into)
    return len(add)


# ==================================================================================== engine
def _new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f"-{os.getpid()}-{random.getrandbits(24):06x}"


def write_ceilings(path: str | os.PathLike, run: Mapping) -> dict:
    """Add one run's measured ceilings (and its provenance) to a JSON file; atomic replace.

    The file holds ``{"schema_version", "runs": [...]}``, one entry per sweep run (keyed by
    ``run_id``: a resumed run adds its own entry, as it measured again)."""
    path = Path(path)
    doc = {"schema_version": SCHEMA_VERSION, "runs": []}
    if path.exists():
        doc = json.loads(path.read_text())
    entry = {"run_id": run["run_id"], "grid": run.get("grid"), "started": run.get("started"),
             **{k: run.get("ceilings", {}).get(k) for k in ("read_gbps", "copy_gbps", "read_method")},
             **{k: run.get("provenance", {}).get(k) for k in (
                 "device_name", "driver_version", "torch_version", "git_commit", "command")}}
    doc["runs"] = [r for r in doc.get("runs", []) if r.get("run_id") != entry["run_id"]] + [entry]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, (json.dumps(doc, indent=1) + "\n").encode())
    return doc


def run_sweep(grid: Grid | str, out: str | os.PathLike, *, runner: Runner | None = None, resume: bool = False,
              overwrite: bool = False, retry_errors: bool = False, tilings: Sequence[str] | None = None,
              partition_sizes: Sequence[int] | None = None, peers: bool = True, progress: bool = True,
              echo: Callable[[str], None] = print, ceilings_json: str | os.PathLike | None = None,
              allow_mixed: bool = False):
    """Run (or resume) a sweep into ``out`` (parquet); returns the whole table as a DataFrame.

    Without ``resume`` an existing ``out`` (or journal) is an error unless ``overwrite``.
    With ``resume`` the rows already there are skipped (``retry_errors``: except rows that
    failed for a reason other than the variant being unsupported). A resume is refused
    (ValueError, before any measurement) where the table's rows are of another runner, GPU
    model or arch, or of other input seeds for the same point, unless ``allow_mixed``: one
    table compares rows of one machine. Rows of other commits or torch versions are resumed
    and named (each row records its own). ``ceilings_json``: also record this run's
    measured read/copy ceilings there (:func:`write_ceilings`).
    """
    from .provenance import device_name, now, provenance

    if not isinstance(grid, Grid):
        grid = load_grid(grid)
    grid = grid.with_variants(tilings, partition_sizes)
    runner = runner or make_runner("auto")
    store = ResultStore(out, echo=lambda s: echo(s))
    store.lock()
    try:
        if store.has_data() and not (resume or overwrite):
            raise FileExistsError(f"{out} (or its journal) already exists: pass resume=True (--resume) to continue "
                                  f"it or overwrite=True (--overwrite) to start over")
        if overwrite and not resume:
            store.clear()
        existing = store.compact()
        done = store.keys(existing, retry_errors=retry_errors) if resume else set()
        seeds = {pt.point_id: grid.point_seed(pt) for pt in grid.points}

        def refuse_mixed(**this) -> None:
            why = resume_conflicts(existing, **this) if resume and not allow_mixed else ""
            if why:
                raise ValueError(f"{out}: cannot resume: {why} (pass allow_mixed=True / --allow-mixed to add "
                                 "rows of this run anyway)")

        refuse_mixed(runner=runner.name, device_name=device_name(), seeds=seeds)  # (before any measurement)
        meta = runner.begin()
        refuse_mixed(arch=meta.get("arch"))
        peer_rows, skipped = runner.peer_variants() if peers else ([], {})
        for name, why in skipped.items():
            echo(f"sweep: peer {name} skipped: {why}")
        variants = grid.variants() + list(peer_rows)
        prov = provenance()
        run_id = _new_run_id()
        read_gbps = float(meta.get("read_gbps") or float("nan"))
        run = {"run_id": run_id, "runner": runner.name, "grid": grid.name, "grid_source": grid.source,
               "started": prov["timestamp"], "provenance": prov, "ceilings": {k: meta.get(k) for k in (
                   "read_gbps", "copy_gbps", "read_method")}, "arch": meta.get("arch"),
               "replays": getattr(runner, "replays", None), "peers": [v.tiling for v in peer_rows],
               "peers_skipped": skipped}
        store.add_run(run)
        if ceilings_json:
            write_ceilings(ceilings_json, run)
        echo(f"sweep {grid.name}: {len(grid.points)} points x {len(variants)} variants on {runner.name} "
             f"({prov['device_name']}, {meta.get('arch')}); read ceiling {read_gbps:.0f} GB/s "
             f"({meta.get('read_method')}); run {run_id}")
        common = {"grid": grid.name, "runner": runner.name, "run_id": run_id, "arch": meta.get("arch"),
                  "read_gbps_ceiling": read_gbps, "copy_gbps_ceiling": meta.get("copy_gbps"),
                  "read_method": meta.get("read_method"),
                  **{k: prov[k] for k in ("device_name", "driver_version", "torch_version", "git_commit", "command")}}

        todo = [(pt, [v for v in variants if row_key(pt.point_id, v.tiling, v.partition_size) not in done])
                for pt in grid.points]
        todo = [(pt, vs) for pt, vs in todo if vs]
        total = sum(len(vs) for _, vs in todo)
        if resume:
            echo(f"sweep: resuming: {len(grid.points) * len(variants) - total} rows already done, {total} to run")
            for col in ("git_commit", "torch_version"):
                other = sorted({str(c) for c in existing[col].dropna()} - {str(prov[col])}) \
                    if existing is not None and col in existing.columns else []
                if other:
                    echo(f"sweep: the table also holds rows of {col} {', '.join(o[:12] for o in other)} "
                         f"(this run: {str(prov[col])[:12]}); each row records its own")
        if total and hasattr(runner, "prebuild"):  # parallel cold builds up front (cached ones cost nothing)
            pb = runner.prebuild([(pt, v) for pt, vs in todo for v in vs])
            echo(f"sweep: prebuilt {pb['variants']} variants in {pb['seconds']:.1f} s "
                 f"({pb['compiled']} compiled, {pb['errors']} errors)")
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc=f"sweep {grid.name}", unit="row", disable=not progress, dynamic_ncols=True)
        try:
            for pt, vs in todo:
                seed = seeds[pt.point_id]
                bar.set_postfix_str(pt.point_id, refresh=False)
                base = {**common, **pt.columns(), "seed": seed}
                try:
                    state = runner.open_point(pt, seed)
                except Exception as e:
                    if not runner.healthy():
                        raise RuntimeError(f"device unusable after setting up {pt.point_id}: {e}; "
                                           f"rerun with --resume") from e
                    msg = f"point setup failed: {type(e).__name__}: {e}"[:500]
                    bar.write(f"sweep: {pt.point_id}: {msg}")
                    for v in vs:
                        store.append(_row(base, pt, v, {"verified": False, "error": msg}, read_gbps, now()))
                        bar.update(1)
                    continue
                try:
                    for v in vs:
                        bar.set_postfix_str(f"{pt.point_id} {v.label}", refresh=False)
                        res = _run_row(runner, state, v)
                        if res.get("error") and not str(res["error"]).startswith(UNSUPPORTED) \
                                and not runner.healthy():
                            raise RuntimeError(f"device unusable after {pt.point_id} {v.label}: {res['error']}; "
                                               f"rerun with --resume")
                        if res.get("error") and not str(res["error"]).startswith(UNSUPPORTED):
                            bar.write(f"sweep: {pt.point_id} {v.label}: {res['error'][:200]}")
                        store.append(_row(base, pt, v, res, read_gbps, now()))
                        bar.update(1)
                finally:
                    runner.close_point(state)
                    del state
                store.compact()
        finally:
            bar.close()
            try:
                store.compact()
            except Exception as e:  # never hide the original exception; the journal is still there
                echo(f"sweep: could not compact the journal ({type(e).__name__}: {e}); --resume will")
        df = store.compact()
    finally:
        store.unlock()
    return df


def resume_conflicts(existing, *, runner: str | None = None, device_name: str | None = None,
                     arch: str | None = None, seeds: Mapping[str, int] | None = None) -> str:
    """Why the rows already in a table cannot be resumed by this run ("" if they can): rows of
    another runner, GPU model or arch, or a point whose rows were drawn with another seed."""
    if existing is None or not len(existing):
        return ""
    problems = []
    for col, want in (("runner", runner), ("device_name", device_name), ("arch", arch)):
        if want is None or col not in existing.columns:
            continue
        other = sorted({str(v) for v in existing[col].dropna()} - {str(want)})
        if other:
            problems.append(f"its rows are of {col} {', '.join(map(repr, other))}, this run's is {want!r}")
    if seeds and "seed" in existing.columns and "point_id" in existing.columns:
        moved = sorted({str(p) for p, sd in zip(existing["point_id"], existing["seed"])
                        if p in seeds and sd == sd and int(sd) != int(seeds[p])})
        if moved:
            problems.append(f"points {moved[:5]} were measured with other input seeds (the grid's seed changed)")
    return "; ".join(problems)


def _run_row(runner: Runner, state, v: RowVariant) -> dict:
    res: dict = {"verified": False}
    built = None
    try:
        built = runner.build(state, v)
        res.update(built.info)
        res.update(runner.verify(state, built))
        res.update(runner.time(state, built))
    except Unsupported as e:
        res["error"] = str(e)[:500]
    except Exception as e:  # recorded in the table; the sweep goes on
        res["error"] = f"{type(e).__name__}: {e}"[:500]
        release_frames(e)
    finally:
        if built is not None:
            try:
                runner.release(built)
            except Exception:
                pass
    return res


def release_frames(exc: BaseException) -> None:
    """Clear the locals of every finished frame a failed row's exception reaches: the frames of
    its traceback, its causes', contexts' and those of exceptions it keeps as attributes, and
    each such frame's finished callers (``f_back``).

    A failed row must not keep its point's tensors. A FlexAttention row whose Inductor compile
    failed in a subprocess (K/V of >= 2^31 elements) left them allocated after the point closed
    and after gc, until the next such failure: 33.6 GiB at 256 x 16k on an H100 (af48162). The
    holder, found with ``scripts/sweep_memory.py holders`` (H100, twenty-sixth session): the
    padded K / V were locals of Dynamo's and Inductor's compile frames (``trace_frame``,
    ``aot_module_simplified``, ...), kept alive through the ``f_back`` links of the frames of
    the original ``SubprocException``, which torch 2.11 keeps in the failed kernel's cached
    future. The exception a caller sees (``InductorError``) has a shortened traceback and holds
    the inner one as an attribute (``inner_exception``), so clearing only the caller's
    traceback and its causes freed the point's inputs but not the 16 GiB of K/V at 256 x 16k.
    Clearing a frame only drops its locals; frames still executing (this caller's) are skipped.
    A frame also holds its function, and the function its closure cells: on an H100 (twenty-
    seventh session) the 16 GiB were still held that way, cells of Dynamo's ``_compile_inner``
    whose frame the kept failure's traceback held. So every exception reached also loses its
    traceback (the library's kept one included: it keeps its message, not its frames), which
    frees the frames themselves. The flex peer now refuses such points anyway
    (cpa.peers.flex_fails_to_compile)."""
    import inspect
    import types

    todo, seen, frames = [exc], set(), []
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        tb, e.__traceback__ = e.__traceback__, None  # (its frames are held in `frames` until cleared)
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        todo += [e.__cause__, e.__context__]
        for v in getattr(e, "__dict__", {}).values():  # InductorError.inner_exception, .first_useful_frame
            if isinstance(v, BaseException):
                todo.append(v)
            elif isinstance(v, types.FrameType):
                frames.append(v)
    # a suspended generator's frame is left alone: clearing it would close the generator
    resumable = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
    cleared = set()
    for f in frames:
        while f is not None and id(f) not in cleared:
            cleared.add(id(f))
            if not f.f_code.co_flags & resumable:
                try:
                    f.clear()
                except RuntimeError:  # still executing: a caller of this row
                    pass
            f = f.f_back


def _row(base: dict, pt: Point, v: RowVariant, res: dict, read_gbps: float, timestamp: str) -> dict:
    row = {**base, "tiling": v.tiling, "partition_size": v.partition_size, "num_partitions": num_partitions(pt, v),
           "kv_bytes": pt.kv_bytes, "bytes": bytes_moved(pt, v), **res, "timestamp": timestamp}
    t = row.get("time_us")
    if t is not None and t == t and t > 0:
        row["gbps"] = pt.kv_bytes / (t * 1e-6) / 1e9
        row["total_gbps"] = row["bytes"] / (t * 1e-6) / 1e9
        row["frac_peak_bw"] = row["gbps"] / read_gbps if read_gbps == read_gbps and read_gbps > 0 else float("nan")
    row["verified"] = bool(row.get("verified", False))
    return row


# =================================================================================== summary
def summary_table(df):
    """One line per point: the fastest verified CPA variant, its bandwidth, each peer beside it."""
    import pandas as pd

    if df is None or not len(df):
        return pd.DataFrame()
    lines = []
    peer_names = [t for t in dict.fromkeys(df.tiling) if t not in _cpa_tilings()]
    for pid, g in df.groupby("point_id", sort=False):
        ok = timed_rows(g)
        cpa_ok = ok[ok.tiling.isin(_cpa_tilings())]
        first = g.iloc[0]
        line = {"num_seqs": int(first.num_seqs), "max_seq_len": int(first.max_seq_len),
                "mean_seq_len": round(float(first.mean_seq_len), 1), "heads": f"{first.num_heads}/{first.num_kv_heads}",
                "head_size": int(first.head_size)}
        if len(cpa_ok):
            best = cpa_ok.loc[cpa_ok.time_us.idxmin()]
            line.update(best=f"{best.tiling}/{int(best.partition_size)}", best_us=round(float(best.time_us), 2),
                        best_bw=f"{best.frac_peak_bw:.0%}" if best.frac_peak_bw == best.frac_peak_bw else "")
        else:
            line.update(best=None, best_us=None, best_bw=None)
        for p in peer_names:
            pr = ok[ok.tiling == p]
            if len(pr):
                us = float(pr.time_us.iloc[0])
                line[f"{p}_us"] = round(us, 2)
                if line["best_us"]:
                    line[f"vs_{p}"] = round(us / line["best_us"], 2)
            else:
                line[f"{p}_us"] = None
        cpa_rows = g[g.tiling.isin(_cpa_tilings())]
        ran = cpa_rows[~cpa_rows.error.fillna("").astype(str).str.startswith(UNSUPPORTED)]
        line["verified"] = f"{int(ran.verified.sum())}/{len(ran)}"
        lines.append(line)
    return pd.DataFrame(lines)


def timed_rows(df):
    """Rows that were verified and timed (no error): the ones a comparison may use."""
    return df[df.verified.astype(bool) & df.error.isna() & df.time_us.notna()]


def repeat_spread(a, b):
    """Rows timed in both tables (same key, both verified): the two medians and their spread.

    ``spread`` = |a - b| / min(a, b). For the 'same point twice' check of a sweep."""
    import pandas as pd

    cols = list(KEY) + ["time_us", "num_seqs", "max_seq_len"]
    m = timed_rows(a)[cols].merge(timed_rows(b)[list(KEY) + ["time_us"]], on=list(KEY), suffixes=("_a", "_b"))
    if not len(m):
        return pd.DataFrame(columns=cols + ["time_us_a", "time_us_b", "spread"])
    m["spread"] = (m.time_us_a - m.time_us_b).abs() / m[["time_us_a", "time_us_b"]].min(axis=1)
    return m.sort_values("spread", ascending=False).reset_index(drop=True)


def _cpa_tilings():
    from . import variants as V

    return V.TILINGS
