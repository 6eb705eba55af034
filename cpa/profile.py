"""Hardware counters through vendor profilers run as subprocesses: Nsight Compute (``ncu``) on
NVIDIA, ``rocprofv3`` (rocprofiler-sdk) on AMD.

Flow::

    cs = load_counter_set("ncu", "basic")                      # profiling/ncu.yaml
    tidy = profile_ncu(cs, "paged_attention", [sys.executable, "bench.py"], timeout=600)
    derived = derive(tidy, cs)                                 # one row per (dispatch, portable metric)
    table = join_to_sweep(wide(derived), sweep_df, mapping)    # mapping: dispatch -> variant/shape

* Counter sets live in ``<repo>/profiling/<profiler>.yaml`` (schema documented at the top of each
  file): a *portable* metric name (``dram_bandwidth``, ``achieved_occupancy``, ...) maps to the vendor
  counters it reads, a formula over them, a unit and a description.
* Formulas are parsed by :class:`Formula`, a recursive-descent parser over ``+ - * / ( )``, numbers and
  the names a metric declares; nothing is handed to Python's ``eval``.
* Command builders return argument lists; :func:`run_profiler` runs them without a shell and turns the
  profilers' failure modes into the exception classes below.
* Parsers return a *tidy* frame: one row per (dispatch, raw metric) with columns ``dispatch``,
  ``kernel``, ``metric`` (vendor name), ``value`` (float), ``unit``, plus the launch fields the
  profiler reports.

Only running a profiler needs a GPU. pandas and pyyaml are imported inside the functions that use
them, so importing this module costs nothing but the standard library.
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
import shutil
import signal
import subprocess
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROFILING_DIR = REPO_ROOT / "profiling"

# Variant and shape columns of a sweep row (cpa.sweep.COLUMNS) that identify a profiled launch.
SWEEP_KEYS = ("tiling", "partition_size", "num_seqs", "max_seq_len", "num_heads", "num_kv_heads", "head_size")

# Lines of the profiled program's stderr quoted in ProfiledProgramFailedError.
STDERR_TAIL_LINES = 20


# ================================================================== errors
class ProfilerError(RuntimeError):
    """A profiler run that produced no usable counters. Carries the run's argv and output."""

    def __init__(self, message: str, *, argv: Sequence[str] = (), returncode: int | None = None,
                 stdout: str = "", stderr: str = ""):
        super().__init__(message)
        self.argv = list(argv)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr


class ProfilerNotFoundError(ProfilerError):
    """The profiler executable is not on PATH."""


class ProfilerTimeoutError(ProfilerError):
    """The run exceeded its timeout; the profiler and everything it started were killed."""


class CounterPermissionError(ProfilerError):
    """The user may not read the GPU's performance counters."""


class UnknownCounterError(ProfilerError):
    """The profiler does not know a requested counter / metric. ``missing`` lists the names."""

    def __init__(self, message: str, *, missing: Sequence[str] = (), **kw):
        super().__init__(message, **kw)
        self.missing = list(missing)


class NoKernelsProfiledError(ProfilerError):
    """The run finished but no kernel matched the kernel-name filter."""


class ProfiledProgramFailedError(ProfilerError):
    """The profiler (usually: the program it ran) exited with a non-zero status."""


class CounterAccuracyWarning(UserWarning):
    """rocprofv3 collected counters but says they may be inaccurate (no exclusive device lock)."""


class CounterSetError(ValueError):
    """A counter-set YAML file does not follow the schema, or asks for an unknown set / metric."""


class MissingCounterError(ValueError):
    """A portable metric needs raw metrics (or constants) that the profile / caller did not supply."""


class FormulaError(ValueError):
    """A formula is not arithmetic over + - * / ( ), numbers and the names it may use."""


# ================================================================== formulas
_TOKEN_RE = re.compile(r"""
    \s*(?:
      (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)
    | (?P<name>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)   # ncu names have dots
    | (?P<op>[-+*/()])
    )""", re.VERBOSE)


def _tokenize(text: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN_RE.match(text, pos)
        if m is None or m.end() == pos:
            raise FormulaError(f"formula {text!r}: unexpected {text[pos:].lstrip()[:20]!r} at offset {pos}")
        kind = m.lastgroup
        tokens.append((kind, m.group(kind)))
        pos = m.end()
    return tokens


def _divide(a: float, b: float) -> float:
    # counter ratios with an empty denominator (no LDS traffic, no L2 requests) are undefined, not inf
    return a / b if b != 0 else math.nan


_BINARY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": _divide}


class Formula:
    """Arithmetic over ``+ - * / ( )``, unary minus, numbers and names from ``allowed``.

    Parsed once (recursive descent into a tuple tree); :meth:`evaluate` walks the tree with floats.
    Anything else -- calls, attributes of expressions, ``**``, comparisons, strings, names not in
    ``allowed`` -- is a :class:`FormulaError` at construction.
    """

    def __init__(self, text: str, allowed: Iterable[str]):
        self.text = text
        allowed = set(allowed)
        self._tokens = _tokenize(text)
        if not self._tokens:
            raise FormulaError("empty formula")
        self._pos = 0
        self._tree = self._expr()
        if self._pos != len(self._tokens):
            raise FormulaError(f"formula {text!r}: unexpected {self._tokens[self._pos][1]!r} after a complete expression")
        unknown = sorted(self.names - allowed)
        if unknown:
            raise FormulaError(f"formula {text!r} uses {unknown}, which it does not declare (allowed: {sorted(allowed)})")
        del self._tokens, self._pos

    # grammar: expr := term (('+'|'-') term)* ; term := unary (('*'|'/') unary)* ;
    #          unary := '-' unary | '+' unary | atom ; atom := number | name | '(' expr ')'
    def _peek(self):
        return self._tokens[self._pos] if self._pos < len(self._tokens) else (None, None)

    def _expr(self):
        node = self._term()
        while self._peek()[1] in ("+", "-"):
            op = self._tokens[self._pos][1]
            self._pos += 1
            node = ("bin", op, node, self._term())
        return node

    def _term(self):
        node = self._unary()
        while self._peek()[1] in ("*", "/"):
            op = self._tokens[self._pos][1]
            self._pos += 1
            node = ("bin", op, node, self._unary())
        return node

    def _unary(self):
        kind, tok = self._peek()
        if tok in ("-", "+"):
            self._pos += 1
            operand = self._unary()
            return ("neg", operand) if tok == "-" else operand
        return self._atom()

    def _atom(self):
        kind, tok = self._peek()
        if kind is None:
            raise FormulaError(f"formula {self.text!r} ends early")
        self._pos += 1
        if kind == "number":
            return ("num", float(tok))
        if kind == "name":
            return ("name", tok)
        if tok == "(":
            node = self._expr()
            if self._peek()[1] != ")":
                raise FormulaError(f"formula {self.text!r}: missing ')'")
            self._pos += 1
            return node
        raise FormulaError(f"formula {self.text!r}: unexpected {tok!r}")

    @property
    def names(self) -> set[str]:
        out, stack = set(), [self._tree]
        while stack:
            node = stack.pop()
            if node[0] == "name":
                out.add(node[1])
            elif node[0] == "neg":
                stack.append(node[1])
            elif node[0] == "bin":
                stack += [node[2], node[3]]
        return out

    def evaluate(self, values: Mapping[str, float]) -> float:
        def walk(node):
            kind = node[0]
            if kind == "num":
                return node[1]
            if kind == "name":
                return float(values[node[1]])
            if kind == "neg":
                return -walk(node[1])
            return _BINARY[node[1]](walk(node[2]), walk(node[3]))
        return walk(self._tree)

    def __repr__(self) -> str:
        return f"Formula({self.text!r})"


# ================================================================== counter sets
@dataclass(frozen=True)
class MetricDef:
    """One portable metric of a counter set."""

    name: str
    reads: tuple[str, ...]
    formula: Formula
    unit: str
    description: str
    constants: tuple[str, ...] = ()


@dataclass(frozen=True)
class CounterSet:
    """The portable metrics selected from one profiler's YAML file, and what collecting them takes."""

    profiler: str
    metrics: dict[str, MetricDef]
    constants: dict[str, str]  # name -> description, for every constant the file declares
    dispatch_fields: tuple[str, ...]
    block_limits: dict[str, int] = field(default_factory=dict)
    hardware_counters: dict[str, tuple[str, ...]] = field(default_factory=dict)
    source: Path | None = None

    @property
    def raw_names(self) -> list[str]:
        """Every vendor name the selected metrics read, in first-use order."""
        out: dict[str, None] = {}
        for m in self.metrics.values():
            out.update(dict.fromkeys(m.reads))
        return list(out)

    @property
    def counters(self) -> list[str]:
        """The names to request from the profiler (``raw_names`` without the dispatch fields)."""
        return [n for n in self.raw_names if n not in self.dispatch_fields]

    @property
    def constants_needed(self) -> list[str]:
        out: dict[str, None] = {}
        for m in self.metrics.values():
            out.update(dict.fromkeys(m.constants))
        return list(out)


_TOP_KEYS = {"schema", "profiler", "target", "sources", "constants", "dispatch_fields", "metrics", "sets",
             "block_limits", "hardware_counters"}
_METRIC_KEYS = {"reads", "constants", "formula", "unit", "description"}


def counter_set_path(profiler: str) -> Path:
    return PROFILING_DIR / f"{profiler}.yaml"


def _load_counter_file(path: Path) -> dict:
    """Read and validate one counter-set file; returns its metrics as MetricDefs (all of them)."""
    import yaml

    where = str(path)
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise CounterSetError(f"no counter-set file {where}") from None
    if not isinstance(doc, dict):
        raise CounterSetError(f"{where}: top level must be a mapping")
    if doc.get("schema") != 1:
        raise CounterSetError(f"{where}: schema must be 1, got {doc.get('schema')!r}")
    extra = set(doc) - _TOP_KEYS
    if extra:
        raise CounterSetError(f"{where}: unknown top-level keys {sorted(extra)} (known: {sorted(_TOP_KEYS)})")
    for key in ("profiler", "metrics", "sets"):
        if not doc.get(key):
            raise CounterSetError(f"{where}: '{key}' is missing or empty")
    constants = {str(k): str(v) for k, v in (doc.get("constants") or {}).items()}
    dispatch_fields = tuple(doc.get("dispatch_fields") or ())

    metrics: dict[str, MetricDef] = {}
    for name, spec in doc["metrics"].items():
        at = f"{where}: metrics.{name}"
        if not isinstance(spec, dict):
            raise CounterSetError(f"{at} must be a mapping")
        extra = set(spec) - _METRIC_KEYS
        if extra:
            raise CounterSetError(f"{at}: unknown keys {sorted(extra)} (known: {sorted(_METRIC_KEYS)})")
        for key in ("reads", "formula", "unit", "description"):
            if key not in spec:
                raise CounterSetError(f"{at}: '{key}' is missing")
        reads = tuple(spec["reads"])
        if not reads:
            raise CounterSetError(f"{at}: 'reads' is empty")
        used_constants = tuple(spec.get("constants") or ())
        undeclared = [c for c in used_constants if c not in constants]
        if undeclared:
            raise CounterSetError(f"{at}: constants {undeclared} are not declared under 'constants:'")
        try:
            formula = Formula(str(spec["formula"]), set(reads) | set(used_constants))
        except FormulaError as e:
            raise CounterSetError(f"{at}: {e}") from None
        unused = [r for r in reads if r not in formula.names]
        if unused:
            raise CounterSetError(f"{at}: reads {unused} but the formula does not use them")
        metrics[name] = MetricDef(name, reads, formula, str(spec["unit"]), str(spec["description"]), used_constants)

    sets = {}
    for set_name, members in doc["sets"].items():
        unknown = [m for m in members if m not in metrics]
        if unknown:
            raise CounterSetError(f"{where}: sets.{set_name} names unknown metrics {unknown}")
        sets[set_name] = list(members)
    limits = {str(k): int(v) for k, v in (doc.get("block_limits") or {}).items()}
    hw = {str(k): tuple(v) for k, v in (doc.get("hardware_counters") or {}).items()}
    return dict(profiler=str(doc["profiler"]), metrics=metrics, sets=sets, constants=constants,
                dispatch_fields=dispatch_fields, block_limits=limits, hardware_counters=hw, source=Path(path))


def load_counter_set(profiler: str, set_name_or_list: str | Sequence[str] = "basic", *,
                     path: Path | None = None) -> CounterSet:
    """The portable metrics of a named set (``"basic"``, ``"memory"``, ...) or of an explicit list of
    portable metric names, from ``profiling/<profiler>.yaml`` (or ``path``)."""
    info = _load_counter_file(Path(path) if path is not None else counter_set_path(profiler))
    if isinstance(set_name_or_list, str):
        if set_name_or_list not in info["sets"]:
            raise CounterSetError(f"{info['source']}: no set {set_name_or_list!r} (sets: {sorted(info['sets'])})")
        names = info["sets"][set_name_or_list]
    else:
        names = list(set_name_or_list)
        unknown = [n for n in names if n not in info["metrics"]]
        if unknown:
            raise CounterSetError(f"{info['source']}: unknown metrics {unknown} (known: {sorted(info['metrics'])})")
    return CounterSet(profiler=info["profiler"], metrics={n: info["metrics"][n] for n in names},
                      constants=info["constants"], dispatch_fields=info["dispatch_fields"],
                      block_limits=info["block_limits"], hardware_counters=info["hardware_counters"],
                      source=info["source"])


def device_constants(spec) -> dict[str, float]:
    """The formula constants a ``cpa.hardware`` device spec supplies (see each YAML's ``constants:``)."""
    from . import hardware

    if isinstance(spec, hardware.CdnaSpec):
        return {"MAX_WAVES_PER_CU": spec.max_waves_per_cu}
    if isinstance(spec, hardware.HopperSpec):
        return {}  # ncu reports its fractions against its own peaks; profiling/ncu.yaml needs no constants
    raise TypeError(f"no formula constants known for {type(spec).__name__}")


# ================================================================== command builders
def ncu_command(metrics: Sequence[str], kernel_regex: str, program_argv: Sequence[str], *,
                clock_control: str = "none", extra: Sequence[str] = ()) -> list[str]:
    """``ncu --csv --page raw --print-units base --metrics a,b,c --kernel-name regex:<re> --clock-control <cc>
    [extra] <program>``.

    ncu replays each kernel until it has every metric, so one run collects any number of them.
    ``clock_control="none"`` profiles at the clocks the benchmarks run at (ncu's default, ``base``,
    locks them lower)."""
    if not metrics:
        raise ValueError("ncu_command: no metrics")
    if not program_argv:
        raise ValueError("ncu_command: no program to profile")
    return ["ncu", "--csv", "--page", "raw", "--print-units", "base", "--metrics", ",".join(metrics),
            "--kernel-name", f"regex:{kernel_regex}", "--clock-control", clock_control,
            *extra, *program_argv]


def rocprofv3_command(pmc_pass: Sequence[str], kernel_regex: str, out_dir: str | os.PathLike, name: str,
                      program_argv: Sequence[str]) -> list[str]:
    """``rocprofv3 --pmc A B C --kernel-include-regex <re> --output-format csv -d <dir> -o <name> -- <program>``.

    One pass: rocprofv3 fails when the counters do not fit the hardware in one pass (its --pmc help),
    so split them first with :func:`split_passes`. Output: ``<dir>/<name>_counter_collection.csv``
    (see :func:`find_rocprofv3_counter_files`)."""
    if not pmc_pass:
        raise ValueError("rocprofv3_command: empty counter pass")
    if not program_argv:
        raise ValueError("rocprofv3_command: no program to profile")
    return ["rocprofv3", "--pmc", *pmc_pass, "--kernel-include-regex", kernel_regex,
            "--output-format", "csv", "-d", str(out_dir), "-o", name, "--", *program_argv]


def _counter_block(hw_counter: str) -> str:
    block = hw_counter.split("_", 1)[0]
    return "SQ" if block == "SQC" else block  # counter_defs.yaml: SQC_* counters have block: SQ


def split_passes(counters: Sequence[str], max_per_pass: int | Mapping[str, int] | None = None, *,
                 hardware_counters: Mapping[str, Sequence[str]] | None = None) -> list[list[str]]:
    """Split rocprofv3 counters into passes that each fit the hardware's per-block counter limits.

    ``max_per_pass``: counters per hardware block per pass -- a mapping ``{block: n, "default": n}``
    (default: ``block_limits`` of profiling/rocprofv3.yaml, gfx942) or one int for every block.
    ``hardware_counters``: what each derived counter programs (default: the YAML's table); any other
    name is a hardware counter whose block is its prefix. A hardware counter shared by two derived
    counters in one pass is programmed once. Greedy first fit, in the given order."""
    if max_per_pass is None or hardware_counters is None:
        info = _load_counter_file(counter_set_path("rocprofv3"))
        if max_per_pass is None:
            max_per_pass = info["block_limits"]
        if hardware_counters is None:
            hardware_counters = info["hardware_counters"]
    if isinstance(max_per_pass, int):
        limits, default = {}, max_per_pass
    else:
        limits = {k: v for k, v in max_per_pass.items() if k != "default"}
        default = max_per_pass.get("default", min(limits.values()) if limits else 1)

    def limit(block):
        return limits.get(block, default)

    def fits(hw: set[str]) -> bool:
        per_block: dict[str, int] = {}
        for c in hw:
            per_block[_counter_block(c)] = per_block.get(_counter_block(c), 0) + 1
        return all(n <= limit(b) for b, n in per_block.items())

    passes: list[tuple[list[str], set[str]]] = []
    for counter in dict.fromkeys(counters):  # drop repeats, keep order
        hw = set(hardware_counters.get(counter, (counter,)))
        if not fits(hw):
            raise ValueError(f"{counter} programs {sorted(hw)}, more than one pass allows per block "
                             f"(limits {dict(limits, default=default)})")
        for names, used in passes:
            if fits(used | hw):
                names.append(counter)
                used |= hw
                break
        else:
            passes.append(([counter], set(hw)))
    return [names for names, _ in passes]


# ================================================================== running a profiler
@dataclass(frozen=True)
class ProfilerRun:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str


_INSTALL_HINT = {
    "ncu": "install Nsight Compute",
    "rocprofv3": "install ROCm's rocprofiler-sdk (rocprofv3 is in /opt/rocm/bin)",
}

# ncu: https://developer.nvidia.com/ERR_NVGPUCTRPERM ("ERR_NVGPUCTRPERM: The user running <tool> does
# not have permission to access NVIDIA GPU Performance Counters ...").
_NCU_PERMISSION = re.compile(r"ERR_NVGPUCTRPERM")
# The two ncu messages below are matched as ncu prints them ("==ERROR== Failed to find metric <name>",
# "==WARNING== No kernels were profiled."); neither wording is in NVIDIA's published docs.
_NCU_UNKNOWN_METRIC = re.compile(r"Failed to find metrics?:?\s+(?:regex:)?([^\s,]+)")
_NCU_NO_KERNELS = re.compile(r"No kernels were profiled")
# rocprofiler-sdk source/lib/rocprofiler-sdk/counters/ioctl.cpp (EPERM on the profiler device lock):
# "Device {} could not be locked for profiling due to lack of permissions (capability SYS_PERFMON).
# PMC Counters may be inaccurate and System Counter Collection will be degraded." -- and the status
# string of ROCPROFILER_STATUS_ERROR_PERMISSION_DENIED in rocprofiler.cpp:
# "Required permission (CAP_PERFMON) is not set, permission denied".
_ROCPROF_PERMISSION = re.compile(r"could not be locked for profiling due to lack of permissions"
                                 r"|Required permission \(CAP_PERFMON\) is not set")
# rocprofiler-sdk source/lib/rocprofiler-sdk-tool/tool.cpp, construct_counter_collection_profile():
# "Unable to find all counters for agent N (gpu-I, NAME) in [...]. Found: [...]. Missing: [...]"
# (a warning; rocprofv3 then collects only the counters it found).
_ROCPROF_UNKNOWN_COUNTER = re.compile(r"Unable to find all counters for agent[^\n]*?Missing: \[([^\]]*)\]")


def _tail(text: str, n: int = STDERR_TAIL_LINES) -> str:
    return "\n".join(text.rstrip("\n").splitlines()[-n:])


def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_profiler(argv: Sequence[str], timeout: float, *, env: Mapping[str, str] | None = None,
                 cwd: str | os.PathLike | None = None) -> ProfilerRun:
    """Run a profiler command (an argument list, no shell) and classify its failures.

    Raises, in this order of precedence: :class:`ProfilerNotFoundError`, :class:`ProfilerTimeoutError`,
    :class:`CounterPermissionError`, :class:`UnknownCounterError`, :class:`ProfiledProgramFailedError`
    (non-zero exit; the message quotes the last lines of stderr), :class:`NoKernelsProfiledError`
    (ncu; for rocprofv3 that shows as an empty counter CSV, see :func:`profile_rocprofv3`).
    rocprofv3's device-lock permission warning on a run that succeeded becomes a
    :class:`CounterAccuracyWarning` (the SDK still collects, "PMC Counters may be inaccurate")."""
    argv = [str(a) for a in argv]
    if not argv:
        raise ValueError("run_profiler: empty argv")
    tool = Path(argv[0]).name
    hint = _INSTALL_HINT.get(tool, "install it or put it on PATH")
    path = os.environ.get("PATH") if env is None else env.get("PATH", os.environ.get("PATH"))
    if shutil.which(argv[0], path=path) is None:
        raise ProfilerNotFoundError(f"{tool} not found on PATH; {hint}", argv=argv)
    try:
        # own session: on a timeout the whole group dies -- the profiled program is the profiler's
        # child and would otherwise keep the output pipes open
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=None if env is None else dict(env), cwd=cwd, start_new_session=True)
    except FileNotFoundError:
        raise ProfilerNotFoundError(f"{tool} not found on PATH; {hint}", argv=argv) from None
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        stdout, stderr = proc.communicate()
        raise ProfilerTimeoutError(f"{tool} did not finish within {timeout:g} s; killed it and the program it ran "
                                   f"({' '.join(argv)})\n{_tail(stderr)}", argv=argv, returncode=proc.returncode,
                                   stdout=stdout, stderr=stderr) from None
    except BaseException:  # Ctrl-C (the group is in its own session, so the terminal's SIGINT
        # never reaches it) or any other way out: the profiler and its program go with us
        _kill_group(proc)
        proc.wait()
        raise

    rc, both = proc.returncode, stdout + "\n" + stderr
    kw = dict(argv=argv, returncode=rc, stdout=stdout, stderr=stderr)
    if tool == "ncu":
        if _NCU_PERMISSION.search(both):
            raise CounterPermissionError(
                "ncu: ERR_NVGPUCTRPERM, this user may not read the GPU performance counters; run as root or "
                "allow profiling for all users (see https://developer.nvidia.com/ERR_NVGPUCTRPERM)", **kw)
        m = _NCU_UNKNOWN_METRIC.search(both)
        if m:
            raise UnknownCounterError(f"ncu does not know metric {m.group(1)!r} on this GPU "
                                      f"(`ncu --query-metrics` lists them): {m.group(0)}", missing=[m.group(1)], **kw)
    elif tool == "rocprofv3":
        lock = next((ln.strip() for ln in both.splitlines() if _ROCPROF_PERMISSION.search(ln)), None)
        if lock and rc != 0:
            raise CounterPermissionError(f"rocprofv3 could not lock the GPU for counter collection "
                                         f"(needs CAP_PERFMON, e.g. run as root) and exited with status {rc}: "
                                         f"{lock}\n--- last {STDERR_TAIL_LINES} lines of its output ---\n"
                                         f"{_tail(stderr) or _tail(stdout)}", **kw)
        m = _ROCPROF_UNKNOWN_COUNTER.search(both)
        if m:
            missing = [s.strip() for s in m.group(1).split(",") if s.strip()]
            raise UnknownCounterError(f"rocprofv3 does not know counters {missing} on this GPU "
                                      f"(`rocprofv3 --list-avail` lists them): {m.group(0)}", missing=missing, **kw)
        if lock:
            warnings.warn(f"rocprofv3 collected counters without the exclusive device lock (no CAP_PERFMON); "
                          f"values may be inaccurate if another process profiles the GPU: {lock}",
                          CounterAccuracyWarning, stacklevel=2)
    if rc != 0:
        tail = _tail(stderr) or _tail(stdout)
        raise ProfiledProgramFailedError(
            f"{tool} exited with status {rc}: the profiled program failed or {tool} could not run it\n"
            f"command: {' '.join(argv)}\n--- last {STDERR_TAIL_LINES} lines of its output ---\n{tail}", **kw)
    if tool == "ncu" and _NCU_NO_KERNELS.search(both):
        raise NoKernelsProfiledError(f"ncu profiled no kernels: nothing matched the --kernel-name filter "
                                     f"({' '.join(argv)})", **kw)
    return ProfilerRun(argv=argv, returncode=rc, stdout=stdout, stderr=stderr)


# ================================================================== parsers
TIDY_COLUMNS = ("dispatch", "kernel", "metric", "value", "unit")

# Columns of `ncu --csv --page raw` that describe the launch rather than being metrics
# (tests/data/ncu_raw_sample.csv); older ncu versions also print "Kernel Time".
NCU_LAUNCH_COLUMNS = {"ID": "dispatch", "Process ID": "pid", "Process Name": None, "Host Name": None,
                      "Kernel Name": "kernel", "Kernel Time": None, "Context": "context", "Stream": "stream",
                      "Block Size": "block", "Grid Size": "grid", "Device": "device", "CC": "cc"}
_NCU_EMPTY = {"", "n/a", "N/A", "no data"}


def _ncu_number(cell: str) -> float | None:
    """ncu cells: "1,234,567" (thousands separators), "62.50", "n/a" / "no data" / "" (not collected:
    NaN), or text such as "PolicySpread" (an attribute, not a measurement: None, row dropped)."""
    cell = cell.strip()
    if cell in _NCU_EMPTY:
        return math.nan
    try:
        return float(cell.replace(",", ""))
    except ValueError:
        return None


# ncu's unit prefixes (SI: its Kbyte is 1000 bytes). --print-units base asks for base units (ns,
# byte, byte/s, hz, cycle); a page printed with ncu's default scaling (usecond, Mbyte, Gbyte/s, ...)
# is converted to them, so a formula over the values never depends on how the page was printed.
_SI_PREFIX = {"": 1.0, "n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_TIME = re.compile(r"^(n|u|m|)(s|sec|second)$")  # a time: to ns in a numerator, to s in a denominator
_COUNT = re.compile(r"^(k|K|M|G|T|)(byte|cycle|inst|sector|request|warp|thread|block|sample|hz|Hz)$")


def _unit_scale(unit: str) -> tuple[float, str]:
    """(factor, base unit) that turn a value printed in ``unit`` into ncu's base unit; units
    without a known prefix (%, register/thread, SM, ...) are kept as they are (factor 1)."""
    num, _, den = unit.partition("/")
    t = _TIME.match(num)
    if t:
        factor, base = _SI_PREFIX[t.group(1)] * 1e9, "ns"
    else:
        c = _COUNT.match(num)
        if not c:
            return 1.0, unit
        factor, base = _SI_PREFIX[c.group(1)], c.group(2).lower() if c.group(2) in ("hz", "Hz") else c.group(2)
    if den:
        t = _TIME.match(den)
        if t:  # per second
            factor, base = factor / _SI_PREFIX[t.group(1)], f"{base}/s"
        else:
            c = _COUNT.match(den)
            if not c:
                return 1.0, unit
            factor, base = factor / _SI_PREFIX[c.group(1)], f"{base}/{c.group(2)}"
    return factor, base


def parse_ncu_raw_csv(text: str):
    """Tidy frame from ``ncu --csv --page raw`` output.

    The output mixes ``==PROF==`` / ``==WARNING==`` lines (and whatever the program prints) into the
    CSV; the header is the first CSV row starting with ``ID``, an optional units row follows (its ID
    cell is empty), then one row per profiled launch. Columns: dispatch (ncu's ID), kernel, metric,
    value, unit, pid, context, stream, device, cc, block, grid. Values are in ncu's base units
    (ns, byte, byte/s, ...) however the page was printed (:func:`_unit_scale`)."""
    import pandas as pd

    empty = pd.DataFrame(columns=[*TIDY_COLUMNS, "pid", "context", "stream", "device", "cc", "block", "grid"])
    rows = [r for r in csv.reader(io.StringIO("\n".join(ln for ln in text.splitlines() if ln.startswith('"'))))]
    header_at = next((i for i, r in enumerate(rows) if r and r[0] == "ID"), None)
    if header_at is None:
        return empty
    header = rows[header_at]
    body = [r for r in rows[header_at + 1:] if len(r) == len(header)]  # program output that looks like CSV: skipped
    units = [""] * len(header)
    if body and body[0][0] == "":
        units, body = body[0], body[1:]
    launch_idx = {i: NCU_LAUNCH_COLUMNS[h] for i, h in enumerate(header) if h in NCU_LAUNCH_COLUMNS}
    metric_idx = [i for i, h in enumerate(header) if h not in NCU_LAUNCH_COLUMNS]
    scales = {i: _unit_scale(units[i]) for i in metric_idx}

    records = []
    for r in body:
        launch = {name: r[i] for i, name in launch_idx.items() if name}
        for key in ("dispatch", "pid", "context", "stream", "device"):
            if key in launch:
                launch[key] = int(launch[key].replace(",", "")) if launch[key].strip() else -1
        for i in metric_idx:
            value = _ncu_number(r[i])
            if value is None:
                continue
            factor, unit = scales[i]
            records.append({**launch, "metric": header[i], "value": value * factor, "unit": unit})
    if not records:
        return empty
    df = pd.DataFrame.from_records(records)
    front = [c for c in TIDY_COLUMNS if c in df.columns]
    return df[front + [c for c in df.columns if c not in front]]


# counter_collection.csv columns, exactly as rocprofiler-sdk writes them
# (source/lib/output/generateCSV.cpp; source/docs/how-to/using-rocprofv3.rst "Kernel counter collection output").
ROCPROFV3_COUNTER_COLUMNS = ("Correlation_Id", "Dispatch_Id", "Agent_Id", "Queue_Id", "Process_Id", "Thread_Id",
                             "Grid_Size", "Kernel_Id", "Kernel_Name", "Workgroup_Size", "LDS_Block_Size",
                             "Scratch_Size", "VGPR_Count", "Accum_VGPR_Count", "SGPR_Count", "Counter_Name",
                             "Counter_Value", "Start_Timestamp", "End_Timestamp")
# the per-dispatch columns, also emitted as metric rows so formulas can read them
ROCPROFV3_DISPATCH_FIELD_UNITS = {"Grid_Size": "work-item", "Workgroup_Size": "work-item",
                                  "LDS_Block_Size": "byte", "Scratch_Size": "byte/work-item",
                                  "VGPR_Count": "register", "Accum_VGPR_Count": "register",
                                  "SGPR_Count": "register", "Start_Timestamp": "ns", "End_Timestamp": "ns"}
_ROCPROFV3_LAUNCH = {"Correlation_Id": "correlation_id", "Agent_Id": "agent", "Queue_Id": "queue",
                     "Process_Id": "pid", "Thread_Id": "tid", "Kernel_Id": "kernel_id",
                     "Start_Timestamp": "start_ns", "End_Timestamp": "end_ns", "Grid_Size": "grid_size",
                     "Workgroup_Size": "workgroup_size", "LDS_Block_Size": "lds_block_size",
                     "Scratch_Size": "scratch_size", "VGPR_Count": "vgpr_count",
                     "Accum_VGPR_Count": "accum_vgpr_count", "SGPR_Count": "sgpr_count"}


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return int(float(text))


def parse_rocprofv3_counter_csv(path_or_text: str | os.PathLike):
    """Tidy frame from one rocprofv3 ``<name>_counter_collection.csv`` (a path, or the CSV text).

    The file has one row per (dispatch, counter). Each counter row becomes a tidy row (unit "": the
    CSV carries none); each dispatch also gets one row per dispatch field (Grid_Size, VGPR_Count,
    Start_Timestamp, ...; see ROCPROFV3_DISPATCH_FIELD_UNITS). Launch columns: agent, queue, pid, tid,
    correlation_id, kernel_id, start_ns, end_ns, grid_size, workgroup_size, lds_block_size,
    scratch_size, vgpr_count, accum_vgpr_count, sgpr_count."""
    import pandas as pd

    if isinstance(path_or_text, os.PathLike) or (isinstance(path_or_text, str) and "\n" not in path_or_text):
        text = Path(path_or_text).read_text()
    else:
        text = path_or_text
    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in ("Dispatch_Id", "Kernel_Name", "Counter_Name", "Counter_Value") if c not in (reader.fieldnames or [])]
    if missing:
        raise ValueError(f"not a rocprofv3 counter_collection.csv: columns {missing} missing "
                         f"(header: {reader.fieldnames})")
    records, seen = [], set()
    for row in reader:
        dispatch = int(row["Dispatch_Id"])
        launch = {"dispatch": dispatch, "kernel": row["Kernel_Name"]}
        for col, name in _ROCPROFV3_LAUNCH.items():
            if col in row:
                launch[name] = row[col] if col == "Agent_Id" else _int(row[col])  # "Agent 1" in newer versions
        records.append({**launch, "metric": row["Counter_Name"], "value": float(row["Counter_Value"]), "unit": ""})
        if dispatch not in seen:
            seen.add(dispatch)
            for col, unit in ROCPROFV3_DISPATCH_FIELD_UNITS.items():
                if col in row:
                    records.append({**launch, "metric": col, "value": float(row[col]), "unit": unit})
    columns = [*TIDY_COLUMNS, *_ROCPROFV3_LAUNCH.values()]
    df = pd.DataFrame.from_records(records, columns=columns)
    return df


def find_rocprofv3_counter_files(out_dir: str | os.PathLike, name: str | None = None) -> list[Path]:
    """Every counter_collection CSV rocprofv3 wrote under ``out_dir``, sorted.

    rocprofv3 writes ``<-d>/<-o>_counter_collection.csv``; without ``-o`` the prefix defaults to
    ``%hostname%/%pid%``, i.e. ``<-d>/<host>/<pid>_counter_collection.csv``; input-file runs with
    several passes add ``pmc_N/`` or ``pass_N/`` folders (rocprofv3.py, source/lib/output/output_stream.cpp,
    using-rocprofv3.rst). So: a recursive glob."""
    pattern = f"{name}_counter_collection.csv" if name else "*counter_collection.csv"
    return sorted(Path(out_dir).rglob(pattern))


def launch_order(tidy):
    """A tidy frame with ``dispatch`` renumbered 0, 1, 2, ... in the order of its dispatch ids.

    rocprofiler-sdk numbers every kernel dispatch of the process, from 1, before any kernel filter
    (its queue interceptor's sequence counter), so a filtered file's ``Dispatch_Id`` values skip
    the other kernels (torch's fills, the input set-up). The k-th kernel that passed the filter is
    the k-th launch of the profiled program, which is how the harness numbers its mapping (as
    ncu's ``ID`` does)."""
    ranks = {d: i for i, d in enumerate(sorted(tidy["dispatch"].unique()))}
    return tidy.assign(dispatch=tidy["dispatch"].map(ranks).astype("int64"))


def read_rocprofv3_counters(out_dir: str | os.PathLike, name: str | None = None, *, renumber: bool = False):
    """All counter_collection CSVs under ``out_dir`` as one tidy frame. Passes are separate runs of
    the same program, so a (dispatch, metric) seen in several files (the dispatch fields) is kept once.
    ``renumber``: each file's dispatches in launch order (:func:`launch_order`), so that passes
    agree even where the program's other dispatches differ between runs."""
    import pandas as pd

    files = find_rocprofv3_counter_files(out_dir, name)
    if not files:
        return parse_rocprofv3_counter_csv(",".join(ROCPROFV3_COUNTER_COLUMNS) + "\n")
    frames = [parse_rocprofv3_counter_csv(f) for f in files]
    if renumber:
        frames = [launch_order(f) for f in frames]
    return pd.concat(frames, ignore_index=True).drop_duplicates(["dispatch", "metric"], keep="first")


# ================================================================== end to end
def profile_ncu(counter_set: CounterSet, kernel_regex: str, program_argv: Sequence[str], *, timeout: float,
                clock_control: str = "none", extra: Sequence[str] = (), env: Mapping[str, str] | None = None):
    """Run ``program_argv`` under ncu for ``counter_set`` and return the tidy frame."""
    run = run_profiler(ncu_command(counter_set.counters, kernel_regex, program_argv,
                                   clock_control=clock_control, extra=extra), timeout, env=env)
    tidy = parse_ncu_raw_csv(run.stdout)
    if tidy.empty:
        raise NoKernelsProfiledError(f"ncu printed no result rows for --kernel-name regex:{kernel_regex}",
                                     argv=run.argv, returncode=run.returncode, stdout=run.stdout, stderr=run.stderr)
    return tidy


def profile_rocprofv3(counter_set: CounterSet, kernel_regex: str, out_dir: str | os.PathLike, name: str,
                      program_argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None):
    """Run ``program_argv`` under rocprofv3 once per counter pass (``out_dir/pass_N``) and return the
    merged tidy frame, its dispatches numbered in launch order among the kernels that matched
    (:func:`launch_order`). Each pass must produce counter rows: none means the kernel filter
    matched nothing (rocprofv3 itself does not complain)."""
    counters = counter_set.counters
    if not counters:
        raise ValueError("this counter set reads only dispatch fields; rocprofv3 reports those only on counter "
                         "rows, so add a counter metric (e.g. 'waves')")
    passes = split_passes(counters, counter_set.block_limits or None,
                          hardware_counters=counter_set.hardware_counters)
    out_dir = Path(out_dir)
    for i, pmc in enumerate(passes, 1):
        pass_dir = out_dir / f"pass_{i}"
        run = run_profiler(rocprofv3_command(pmc, kernel_regex, pass_dir, name, program_argv), timeout, env=env)
        files = find_rocprofv3_counter_files(pass_dir, name)
        if not files or all(parse_rocprofv3_counter_csv(f).empty for f in files):
            raise NoKernelsProfiledError(
                f"rocprofv3 pass {i} ({' '.join(pmc)}) wrote no counter_collection rows under {pass_dir}: no kernel "
                f"matched --kernel-include-regex {kernel_regex!r}", argv=run.argv, returncode=run.returncode,
                stdout=run.stdout, stderr=run.stderr)
    return read_rocprofv3_counters(out_dir, name, renumber=True)


# ================================================================== derived metrics
def derive(tidy, counter_set: CounterSet, constants: Mapping[str, float] | None = None):
    """Portable metrics per dispatch: one row per (dispatch, portable metric) with columns dispatch,
    kernel, metric, value, unit (in the counter set's metric order).

    A raw metric the profile does not contain at all, or a constant the caller did not pass, is a
    :class:`MissingCounterError`; a raw value that is NaN for one dispatch gives NaN there."""
    import pandas as pd

    constants = dict(constants or {})
    present = set(tidy["metric"].unique()) if len(tidy) else set()
    problems = []
    for m in counter_set.metrics.values():
        absent = [r for r in m.reads if r not in present]
        if absent:
            problems.append(f"{m.name} reads {absent}, which the profile does not contain")
        no_const = [c for c in m.constants if c not in constants]
        if no_const:
            problems.append(f"{m.name} needs constants {no_const} ({'; '.join(counter_set.constants[c] for c in no_const)})")
    if problems:
        raise MissingCounterError("cannot derive: " + "; ".join(problems))

    raw = tidy.drop_duplicates(["dispatch", "metric"]).pivot(index="dispatch", columns="metric", values="value")
    kernels = tidy.drop_duplicates("dispatch").set_index("dispatch")["kernel"]
    records = []
    for dispatch, row in raw.iterrows():
        values = {**row.to_dict(), **constants}
        for m in counter_set.metrics.values():
            records.append({"dispatch": dispatch, "kernel": kernels[dispatch], "metric": m.name,
                            "value": m.formula.evaluate(values), "unit": m.unit})
    return pd.DataFrame.from_records(records, columns=list(TIDY_COLUMNS))


def wide(tidy):
    """One row per dispatch (index), a ``kernel`` column and one column per metric; works on raw tidy
    frames and on :func:`derive` output. Units go to ``attrs["units"]``."""
    table = tidy.drop_duplicates(["dispatch", "metric"]).pivot(index="dispatch", columns="metric", values="value")
    order = list(dict.fromkeys(tidy["metric"]))
    table = table[order]
    table.columns.name = None
    table.insert(0, "kernel", tidy.drop_duplicates("dispatch").set_index("dispatch")["kernel"])
    table.attrs["units"] = dict(zip(tidy["metric"], tidy["unit"]))
    return table


def join_to_sweep(derived_wide, sweep_df, mapping, keys: Sequence[str] = SWEEP_KEYS, *,
                  reduce: str | None = "median"):
    """Attach profiled metrics to sweep rows.

    ``derived_wide``: :func:`wide` output (index ``dispatch``). ``mapping``: one row per profiled
    dispatch with a ``dispatch`` column and the ``keys`` columns -- the harness writes it while it
    launches each (variant, point), by kernel name and launch order or from NVTX/ROCTx ranges.
    Every profiled dispatch must be mapped and every mapped dispatch profiled. Several dispatches of
    one key (repeat launches) are combined with ``reduce`` (``"median"``, ``"mean"``, ``"min"``, ...;
    ``None`` keeps one row per dispatch); ``profiled_dispatches`` counts them. The result has the
    sweep columns first, then the metrics; keys must identify sweep rows uniquely."""
    keys = list(keys)
    for what, df in (("mapping", mapping), ("sweep_df", sweep_df)):
        absent = [k for k in keys if k not in df.columns]
        if absent:
            raise ValueError(f"{what} lacks key columns {absent}")
    if "dispatch" not in mapping.columns:
        raise ValueError("mapping needs a 'dispatch' column")
    if mapping["dispatch"].duplicated().any():
        raise ValueError(f"mapping lists dispatches twice: {sorted(mapping.loc[mapping['dispatch'].duplicated(), 'dispatch'])}")
    metrics = derived_wide.reset_index()
    if "dispatch" not in metrics.columns:
        raise ValueError("derived_wide needs a 'dispatch' index or column (use wide())")
    profiled, mapped = set(metrics["dispatch"]), set(mapping["dispatch"])
    if profiled - mapped:
        raise ValueError(f"profiled dispatches without a mapping row: {sorted(profiled - mapped)[:20]}")
    if mapped - profiled:
        raise ValueError(f"mapped dispatches missing from the profile: {sorted(mapped - profiled)[:20]}")
    metric_cols = [c for c in metrics.columns if c not in ("dispatch", "kernel")]
    clash = [c for c in metric_cols if c in sweep_df.columns]
    if clash:
        raise ValueError(f"metric columns {clash} also exist in sweep_df")
    tagged = mapping[["dispatch", *keys]].merge(metrics, on="dispatch", how="inner")
    if reduce is not None:
        grouped = tagged.groupby(keys, sort=False, dropna=False)
        tagged = grouped[metric_cols].agg(reduce)
        tagged["profiled_dispatches"] = grouped.size()
        tagged["kernel"] = grouped["kernel"].first()
        tagged = tagged.reset_index()
    dup = sweep_df.duplicated(keys)
    if dup.any():
        raise ValueError(f"keys {keys} do not identify sweep rows uniquely ({int(dup.sum())} duplicates); "
                         "add a column such as point_id or dtype to keys")
    joined = sweep_df.merge(tagged, on=keys, how="inner", validate="one_to_many")
    lost = len(tagged) - len(joined)
    if lost:
        raise ValueError(f"{lost} profiled key combinations have no sweep row")
    return joined


# ================================================================== one command: cpa profile
HARNESS = PROFILING_DIR / "harness.py"


def harness_argv(grid: str, mapping: str | os.PathLike, *, points: str | None = None,
                 tilings: Sequence[str] | None = None, partition_sizes: Sequence[int] | None = None,
                 repeats: int = 1, python: str | None = None) -> list[str]:
    """The program line of profiling/harness.py (what the profiler launches)."""
    import sys

    argv = [python or sys.executable, str(HARNESS), "--grid", str(grid), "--mapping", str(mapping),
            "--repeats", str(int(repeats))]
    if points:
        argv += ["--points", str(points)]
    if tilings:
        argv += ["--tilings", ",".join(tilings)]
    if partition_sizes:
        argv += ["--partition-sizes", ",".join(str(int(p)) for p in partition_sizes)]
    return argv


def profile_grid(profiler: str, counters: str | Sequence[str], grid: str, out: str | os.PathLike, *,
                 points: str | None = None, tilings: Sequence[str] | None = None,
                 partition_sizes: Sequence[int] | None = None, repeats: int = 1, timeout: float = 1800,
                 kernel_regex: str = "paged_attention_kernel", work_dir: str | os.PathLike | None = None,
                 device_spec=None):
    """Profile the attention kernel of grid points x variants and write one parquet row per
    (point, variant): the sweep keys, the portable metrics (median over repeats), provenance.

    The harness (profiling/harness.py) writes which dispatch is which; with ``rocprofv3`` the
    counters are split into passes, each a separate run of the harness."""
    import tempfile

    import pandas as pd

    from .provenance import provenance

    if profiler not in ("ncu", "rocprofv3"):
        raise ValueError(f"profiler={profiler!r}: expected ncu or rocprofv3")
    cset = load_counter_set(profiler, counters)
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="cpa-profile-"))
    work.mkdir(parents=True, exist_ok=True)
    scratch = work_dir is None  # removed after a run that succeeded (kept to look into after a failure)
    mapping_path = work / "mapping.csv"
    argv = harness_argv(grid, mapping_path, points=points, tilings=tilings, partition_sizes=partition_sizes,
                        repeats=repeats)
    if profiler == "ncu":
        tidy = profile_ncu(cset, kernel_regex, argv, timeout=timeout)
    else:
        tidy = profile_rocprofv3(cset, kernel_regex, work / "rocprofv3", "cpa", argv, timeout=timeout)
    mapping = pd.read_csv(mapping_path)
    if device_spec is None:
        from . import hardware

        device_spec = hardware.H200 if profiler == "ncu" else hardware.MI300X
    table = wide(derive(tidy, cset, device_constants(device_spec)))
    keys = [c for c in mapping.columns if c not in ("dispatch", "repeat")]
    joined = join_to_sweep(table, mapping.drop_duplicates(keys).drop(columns=["dispatch", "repeat"]),
                           mapping, keys=keys)
    prov = provenance()
    joined = joined.assign(profiler=profiler, counter_set=counters if isinstance(counters, str) else
                           ",".join(counters), **{k: prov[k] for k in ("device_name", "driver_version",
                                                                        "torch_version", "git_commit", "timestamp",
                                                                        "command")})
    from .fsio import write_parquet_atomic

    write_parquet_atomic(joined, out)
    if scratch:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return joined
