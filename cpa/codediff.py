"""Does a measurement still describe the kernel? Compile the same variants from two versions
of cpa/csrc and compare the generated code, kernel by kernel, with no GPU.

A table measured at an older commit (a bench, a sweep, GPU-test counts) stands for a newer
commit's kernels exactly where the compiler emits the same code for them: identical PTX for
sm_90 (ptxas and the driver are the same, so the SASS is too) or identical gfx942 assembly
(including the kernel descriptor's resources). Comments, source line records and the
compiler banner are not code and are ignored, so a change that only moves lines or edits
comments compares equal; anything else (an instruction, a register count, a launch bound)
does not.

Each variant is compiled from its whole JIT source (``Variant.source()``: launch.h and the
``CPA_DEFINE_VARIANT`` entry points), so every kernel the library can launch is compared:
the fixed-partition and shared-steps attention kernels and both reduce kernels. The flags
are the JIT build's (cpa.jit: -O3 -lineinfo and torch's common nvcc flags) on NVIDIA and
cpa.static's on AMD. On NVIDIA the comparison can be of the PTX (nvcc alone) or of the
machine code itself (``level="sass"``: cuobjdump's listing with every instruction's
encoding, scheduling control bits included).

    cpa same-code --base 1ddcbf6 --grid bench --arch sm_90
"""

from __future__ import annotations

import datetime as _dt
import io
import re
import shutil
import subprocess
import tarfile
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import variants as V
from .jit import CSRC, sources_digest
from .static import CompilerMissing, check_arch, check_knob_flags, find_clang, find_nvcc

ROOT = CSRC.parent.parent
# torch.utils.cpp_extension's COMMON_NVCC_FLAGS (what every JIT build gets), spelled out so
# that comparing code needs no torch; tests check that they still match torch's.
TORCH_NVCC_FLAGS = ("-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
                    "--expt-relaxed-constexpr")


# ---------------------------------------------------------------- source trees
def resolve(rev: str) -> str:
    """The full commit sha of a git revision (a clear error if it is not one)."""
    p = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=ROOT,
                       capture_output=True, text=True)
    if p.returncode:
        raise ValueError(f"{rev!r} is not a commit of {ROOT} (git rev-parse failed)")
    return p.stdout.strip()


def source_tree(rev: str | None, dest: Path) -> tuple[Path, str]:
    """The kernel headers of `rev` (None: the working tree) written into `dest`; returns the
    folder and its digest (the same digest as cpa.jit.sources_digest for that tree)."""
    dest.mkdir(parents=True, exist_ok=True)
    if rev is None:
        files = {p.name: p.read_bytes() for p in CSRC.glob("*.h")}
    else:
        p = subprocess.run(["git", "archive", "--format=tar", resolve(rev), "cpa/csrc"], cwd=ROOT,
                           capture_output=True)
        if p.returncode:
            raise ValueError(f"git archive {rev} cpa/csrc failed: {p.stderr.decode()[-500:]}")
        files = {}
        with tarfile.open(fileobj=io.BytesIO(p.stdout)) as tar:
            for m in tar.getmembers():
                if m.isfile() and m.name.startswith("cpa/csrc/") and m.name.endswith(".h") and m.name.count("/") == 2:
                    files[m.name.rsplit("/", 1)[1]] = tar.extractfile(m).read()
        if not files:
            raise ValueError(f"{rev} has no kernel headers in cpa/csrc")
    for name, data in files.items():
        (dest / name).write_bytes(data)
    return dest, sources_digest(dest)


# ---------------------------------------------------------------- normalized code
_PTX_FUNC = re.compile(r"^\.(?:visible\s+|weak\s+|extern\s+)*\.(?:entry|func)\s+(?:\([^)]*\)\s*)?([\w$]+)")
# block labels carry the function's index in the file (.LBB3_7, $L__BB3_7): numbered per
# function, so that adding or reordering kernels does not change every label
_BLOCK_LABEL = re.compile(r"(\.LBB|\$L__BB)\d+_")
_AMD_LABEL = re.compile(r"^(_Z\S+):")
_AMD_KD = re.compile(r"^\s*\.amdhsa_kernel\s+(\S+)")


def ptx_kernels(ptx: str) -> dict[str, list[str]]:
    """PTX text -> {entry or function: [code lines]}, plus "module": the lines outside them
    (the target, global and shared declarations); comments, .loc / .file records, the
    -lineinfo debug sections (their strings carry per-compile hashes) and blank lines removed,
    whitespace collapsed."""
    out: dict[str, list[str]] = {"module": []}
    cur, depth = out["module"], 0
    debug = False  # inside a .section .debug_* block (-lineinfo: names, not code)
    for line in ptx.splitlines():
        s = line.split("//", 1)[0].strip()
        if depth == 0 and s.startswith(".section") and ".debug" in s:
            debug = True
            continue
        if debug:
            if s == "}":
                debug = False
            continue
        if not s or s.startswith((".loc", ".file")):
            continue
        m = _PTX_FUNC.match(s) if depth == 0 else None
        if m:
            cur = out.setdefault(m.group(1), [])
        cur.append(_BLOCK_LABEL.sub(r"\1_", " ".join(s.split())))
        depth += s.count("{") - s.count("}")
        if depth == 0 and s.endswith(("}", ";")) and cur is not out["module"]:
            cur = out["module"]  # the end of a body, or of a prototype
    return out


def amd_kernels(asm: str) -> dict[str, list[str]]:
    """clang -S output -> {function: [code lines]}: the instructions from the function's label
    to its .Lfunc_end, then its kernel descriptor (.amdhsa_* resources), comments and debug
    records removed."""
    out: dict[str, list[str]] = {}
    cur = None
    for line in asm.splitlines():
        s = line.split(";", 1)[0].strip()
        m = _AMD_LABEL.match(s)
        if m:
            cur = out.setdefault(m.group(1), [])
            continue
        m = _AMD_KD.match(s)
        if m:
            cur = out.setdefault(m.group(1), [])
            cur.append(s)
            continue
        if cur is None or not s or s.startswith((".loc", ".file", ".cfi_")):
            continue
        if s.startswith(".Lfunc_end") or s.startswith(".end_amdhsa_kernel"):
            if s.startswith(".end"):
                cur.append(s)
            cur = None
            continue
        cur.append(_BLOCK_LABEL.sub(r"\1_", " ".join(s.split())))
    return out


_SASS_FUNC = re.compile(r"^\s*Function : (\S+)")
_SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;?\s*/\* (0x[0-9a-f]{16}) \*/\s*$")
_SASS_CTRL = re.compile(r"^\s*/\* (0x[0-9a-f]{16}) \*/\s*$")


def sass_kernels(dump: str) -> dict[str, list[str]]:
    """cuobjdump -sass output -> {function: [instruction text and its 128-bit encoding]}:
    equal lists are the same machine code, scheduling control bits included."""
    out: dict[str, list[str]] = {}
    cur = None
    for line in dump.splitlines():
        m = _SASS_FUNC.match(line)
        if m:
            cur = out.setdefault(m.group(1), [])
            continue
        if cur is None:
            continue
        m = _SASS_LINE.match(line)
        if m:
            cur.append(" ".join(m.group(1).split()) + " " + m.group(2))
            continue
        m = _SASS_CTRL.match(line)
        if m and cur:
            cur[-1] += " " + m.group(1)
    return out


def find_cuobjdump() -> str:
    """cuobjdump from CPA_CUOBJDUMP, PATH, CUDA_HOME, or the copy Triton ships (the CUDA
    toolkit of some machines has nvcc and ptxas only)."""
    import importlib.util
    import os

    exe = os.environ.get("CPA_CUOBJDUMP") or shutil.which("cuobjdump")
    if exe:
        return exe
    cands = [Path(os.environ[k]) / "bin" / "cuobjdump" for k in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(k)]
    spec = importlib.util.find_spec("triton")
    if spec and spec.origin:
        cands.append(Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    for c in cands:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    raise CompilerMissing("cuobjdump not found (CPA_CUOBJDUMP, PATH, CUDA_HOME/bin or Triton's bundled copy): "
                          "compare at level 'ptx' instead")


def kernel_role(symbol: str) -> str:
    """attention, attention_shared_steps, reduce or reduce_few, from a mangled kernel name."""
    if "paged_attention_reduce_few_kernel" in symbol:
        return "reduce_few"
    if "paged_attention_reduce_kernel" in symbol:
        return "reduce"
    if "paged_attention_kernel" in symbol:
        return "attention_shared_steps" if symbol.endswith("ELb1EEEvNS_10AttnParamsE") else "attention"
    return symbol


def _run(cmd, cwd) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=1800)
    if p.returncode:
        raise RuntimeError(f"compile failed ({' '.join(map(str, cmd[:3]))} ...):\n{p.stderr[-3000:]}")
    return p


LEVELS = {"sm_90": ("ptx", "sass"), "gfx942": ("asm",), "gfx90a": ("asm",)}


def compile_code(variant: V.Variant, arch: str, inc: Path, flags=(), level: str | None = None) -> dict[str, list[str]]:
    """{kernel role: normalized code lines} of one variant compiled from the headers in `inc`;
    `level`: 'ptx' or 'sass' (machine code, needs cuobjdump) on NVIDIA, 'asm' on AMD."""
    level = level or LEVELS[arch][0]
    work = Path(tempfile.mkdtemp(prefix="cpa-codediff-"))
    try:
        if arch.startswith("gfx"):
            (work / "v.hip").write_text(variant.source())
            _run([find_clang(), "-x", "hip", "-std=c++17", f"--offload-arch={arch}", "--cuda-device-only", "-O3",
                  "-nogpulib", "-S", f"-I{inc}", *flags, "v.hip", "-o", "v.s"], work)
            code = amd_kernels((work / "v.s").read_text())
        else:
            (work / "v.cu").write_text(variant.source())
            base = [find_nvcc(), "-std=c++17", f"-arch={arch}", "-O3", "-lineinfo", *TORCH_NVCC_FLAGS, f"-I{inc}",
                    *flags, "v.cu"]
            if level == "sass":
                _run(base + ["-cubin", "-o", "v.cubin"], work)
                code = sass_kernels(_run([find_cuobjdump(), "-sass", "v.cubin"], work).stdout)
            else:
                _run(base + ["-ptx", "-o", "v.ptx"], work)
                code = ptx_kernels((work / "v.ptx").read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    roles = {kernel_role(sym): lines for sym, lines in code.items()}
    if len(roles) != len(code):  # (one kernel per role in a variant's library)
        raise RuntimeError(f"{variant.name}: two kernels with one role among {sorted(code)}")
    return roles


def first_difference(a: list[str], b: list[str]) -> str:
    """Where two code listings first part, as 'line N: <a> | <b>' ('' when equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"line {i}: {x[:80]} | {y[:80]}"
    if len(a) != len(b):
        i = min(len(a), len(b))
        return f"line {i}: {(a[i] if i < len(a) else '<end>')[:80]} | {(b[i] if i < len(b) else '<end>')[:80]}"
    return ""


def compiler_version(arch: str) -> str:
    exe = find_clang() if arch.startswith("gfx") else find_nvcc()
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout.strip().splitlines()
    if not out:
        return exe
    return out[0] if arch.startswith("gfx") else out[-1]


def check_options(arch: str, level: str | None, *flag_sets) -> tuple[str, list[tuple]]:
    """(the level, each flag set as a tuple), refused before any compile: an unknown arch or
    level, a flag that is not a -D knob, or no cuobjdump for level 'sass'."""
    check_arch(arch)
    level = level or LEVELS[arch][0]
    if level not in LEVELS[arch]:
        raise ValueError(f"level={level!r}: {arch} compares at {' or '.join(LEVELS[arch])}")
    flag_sets = [check_knob_flags(f) for f in flag_sets]
    if level == "sass":
        find_cuobjdump()  # (missing: say so once, before any compile)
    return level, flag_sets


def compare_trees(variants, base_inc: Path, head_inc: Path, *, arch: str = "sm_90", flags=(),
                  base_flags=(), head_flags=(), level: str | None = None, jobs: int | None = None,
                  progress: bool = True):
    """One row per (variant, kernel): is the code compiled from the headers in `base_inc`
    identical to the code compiled from `head_inc`? `flags` (-D knobs) go to both builds,
    `base_flags` / `head_flags` to one (was a measured knob build the same code as today's
    default?). Columns variant, kernel, identical, lines_base, lines_head, first_difference,
    arch, level, compiler, base_flags, head_flags, date. A variant one of the trees cannot
    compile is one row (kernel '*') saying why."""
    import os

    import pandas as pd

    level, (flags, base_flags, head_flags) = check_options(arch, level, flags, base_flags, head_flags)
    side_flags = {"base": flags + base_flags, "head": flags + head_flags}
    platform = V.platform_of_arch(arch)
    variants = [v for v in dict.fromkeys(variants) if v.platform == platform]
    if not variants:
        raise ValueError(f"no {platform} variants to compare for {arch}")
    trees = {"base": Path(base_inc), "head": Path(head_inc)}
    tasks = [(v, side) for v in variants for side in ("base", "head")]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(tasks), desc=f"compile {arch}", unit="build")

    def one(task):
        v, side = task
        try:
            return task, compile_code(v, arch, trees[side], side_flags[side], level), None
        except RuntimeError as e:  # a tree whose headers do not build this variant: reported
            return task, None, str(e).strip().splitlines()[-1][:200] if str(e).strip() else "compile failed"

    code, errors = {}, {}
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        for task, c, err in pool.map(one, tasks):
            code[task], errors[task] = c, err
            if bar:
                bar.update()
    if bar:
        bar.close()
    rows = []
    for v in variants:
        a, b = code[(v, "base")], code[(v, "head")]
        if a is None or b is None:
            rows.append(dict(variant=v.name, kernel="*", identical=False, lines_base=0, lines_head=0,
                             first_difference="not compiled: " + (errors[(v, "base")] or errors[(v, "head")])))
            continue
        for k in sorted(set(a) | set(b)):
            la, lb = a.get(k, []), b.get(k, [])
            rows.append(dict(variant=v.name, kernel=k, identical=la == lb and k in a and k in b,
                             lines_base=len(la), lines_head=len(lb),
                             first_difference=first_difference(la, lb) if k in a and k in b
                             else f"only in {'base' if k in a else 'head'}"))
    df = pd.DataFrame(rows)
    df["arch"] = arch
    df["level"] = level
    df["compiler"] = compiler_version(arch)
    df["base_flags"] = " ".join(side_flags["base"])
    df["head_flags"] = " ".join(side_flags["head"])
    df["date"] = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return df


def compare(variants, base: str, head: str | None = None, *, arch: str = "sm_90", flags=(), base_flags=(),
            head_flags=(), level: str | None = None, jobs: int | None = None, progress: bool = True):
    """compare_trees for two git revisions of cpa/csrc (`head` None: the working tree), with
    the revisions and the digests of their kernel headers as columns base, head,
    base_digest, head_digest."""
    check_options(arch, level, flags, base_flags, head_flags)  # before any git work
    revs = {"base": resolve(base), "head": resolve(head) if head else None}
    tmp = Path(tempfile.mkdtemp(prefix="cpa-codediff-src-"))
    try:
        trees = {k: source_tree(r, tmp / k) for k, r in revs.items()}
        df = compare_trees(variants, trees["base"][0], trees["head"][0], arch=arch, flags=flags,
                           base_flags=base_flags, head_flags=head_flags, level=level, jobs=jobs, progress=progress)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    df["base"] = revs["base"]
    df["head"] = revs["head"] or "working tree"
    df["base_digest"] = trees["base"][1][:16]
    df["head_digest"] = trees["head"][1][:16]
    return df


def summary(df) -> dict:
    """{'variants': n, 'identical': n whose every kernel is identical, 'changed': [names]}."""
    by = df.groupby("variant").identical.all()
    return {"variants": int(len(by)), "identical": int(by.sum()), "changed": sorted(by.index[~by])}
