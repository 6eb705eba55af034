"""Compile-only evidence: resource usage and instruction mix of every variant, from the real
compilers, with no GPU.

AMD (gfx942, gfx90a): clang-19 HIP device-only (``--cuda-device-only -nogpulib``) with
``-Rpass-analysis=kernel-resource-usage`` (VGPRs, AGPRs, SGPRs, scratch, LDS, spills,
waves/SIMD) and the ISA (``-S``) for the instruction mix. NVIDIA (sm_90): nvcc ``-ptx``
for the instruction mix, then ``ptxas -v`` on that PTX (registers, shared memory, stack, spills).
Variants are compiled in batches (one translation unit per tiling x dtype x cache dtype x
heads cap) on all cores.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import variants as V
from .jit import CSRC, sources_digest

AMD_ARCHS = ("gfx942", "gfx90a")
NV_ARCHS = ("sm_90",)
ARCHS = AMD_ARCHS + NV_ARCHS
CLANG_CANDIDATES = ("clang++-19", "clang++")


class CompilerMissing(RuntimeError):
    pass


def find_clang() -> str:
    for c in CLANG_CANDIDATES:
        if shutil.which(c):
            return c
    raise CompilerMissing("clang++-19 not found: on Debian, apt-get install clang-19 lld-19 libamdhip64-dev")


def find_nvcc() -> str:
    exe = shutil.which("nvcc")
    if not exe:
        raise CompilerMissing("nvcc not found on PATH (install the CUDA toolkit)")
    return exe


def find_ptxas(nvcc: str) -> str:
    """The ptxas beside `nvcc` (the one nvcc itself runs), else the first on PATH."""
    exe = Path(nvcc).resolve().parent / "ptxas"
    if exe.is_file():
        return str(exe)
    exe = shutil.which("ptxas")
    if not exe:
        raise CompilerMissing(f"ptxas not found beside {nvcc} or on PATH")
    return exe


# ---------------------------------------------------------------- mangled names
def _tag(variant: V.Variant) -> str:
    return {"mfma16": "TilingMfma16", "mfma4": "TilingMfma4", "scalar": "TilingScalar"}[variant.tiling]


def _dt(variant: V.Variant) -> str:
    return {"fp16": "F16", "bf16": "BF16"}[variant.dtype]


def attention_symbol_key(v: V.Variant) -> str:
    """A substring unique to the variant's mangled attention-kernel name (Itanium ABI)."""
    t, d = _tag(v), _dt(v)
    fp8 = int(v.kv_cache_dtype == "fp8")
    return (f"{len(t)}{t}ENS_{len(d)}{d}ELi{v.head_size}ELi{v.block_size}ELb{fp8}"
            f"ELi{v.partition_size}ELi{v.heads_cap}E")


def reduce_symbol_key(v: V.Variant, kernel: str = "reduce") -> str:
    d = _dt(v)
    name = {"reduce": "paged_attention_reduce_kernel", "reduce_few": "paged_attention_reduce_few_kernel"}[kernel]
    return f"{len(name)}{name}INS_{len(d)}{d}ELi{v.head_size}E"


# ---------------------------------------------------------------- parsing
def parse_amd_remarks(stderr: str) -> dict[str, dict]:
    """clang -Rpass-analysis=kernel-resource-usage output -> {function: {field: value}}."""
    res: dict[str, dict] = {}
    cur = None
    for line in stderr.splitlines():
        m = re.search(r"remark: Function Name: (\S+)", line)
        if m:
            cur = res.setdefault(m.group(1), {})
            continue
        m = re.search(r"remark:\s+([A-Za-z][A-Za-z /\[\]]*?):\s+(\S+)\s*\[-Rpass", line)
        if m and cur is not None:
            key, val = m.group(1).strip(), m.group(2)
            cur[key] = val
    return res


def _split_functions(text: str, start: str, is_end, is_code) -> dict[str, list[str]]:
    """{function: [first token of each code line]} for the lines between a `start` match
    (group 1 names the function) and the line for which `is_end` holds."""
    funcs: dict[str, list[str]] = {}
    cur = None
    for line in text.splitlines():
        m = re.match(start, line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        if cur is None:
            continue
        if is_end(line):
            cur = None
            continue
        s = line.strip()
        if s and is_code(s):
            cur.append(s)
    return funcs


def split_amd_functions(asm: str) -> dict[str, list[str]]:
    """-S output -> {function: [instruction mnemonics]} (code between the label and .Lfunc_end)."""
    funcs = _split_functions(asm, r"^(_Z\S+):", lambda ln: ln.startswith(".Lfunc_end"),
                             lambda s: s[0] not in ".;" and not s.endswith(":"))
    return {f: [s.split()[0] for s in lines] for f, lines in funcs.items()}


def amd_mix(mnemonics: list[str]) -> dict[str, int]:
    c = Counter(mnemonics)
    mix: dict[str, int] = {}
    for mn, n in sorted(c.items()):
        if mn.startswith("v_mfma"):
            mix[f"mma:{mn}"] = n
    mix["global_loads"] = sum(n for mn, n in c.items() if mn.startswith(("global_load", "buffer_load", "flat_load")))
    mix["global_stores"] = sum(n for mn, n in c.items() if mn.startswith(("global_store", "buffer_store", "flat_store")))
    mix["lds_loads"] = sum(n for mn, n in c.items() if mn.startswith(("ds_read", "ds_load")))
    mix["lds_stores"] = sum(n for mn, n in c.items() if mn.startswith(("ds_write", "ds_store")))
    mix["cross_lane"] = sum(n for mn, n in c.items() if mn.startswith(("ds_bpermute", "ds_permute", "ds_swizzle"))
                            or "_dpp" in mn)
    mix["exp"] = c.get("v_exp_f32", 0) + c.get("v_exp_f32_e32", 0)
    mix["instructions"] = sum(c.values())
    return mix


def parse_ptxas(stderr: str) -> dict[str, dict]:
    res: dict[str, dict] = {}
    cur = None
    for line in stderr.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line) or re.search(r"Function properties for (\S+)", line)
        if m:
            cur = res.setdefault(m.group(1), {})
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cur.update(stack_bytes=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["registers"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            cur["shared_bytes"] = int(s.group(1)) if s else 0
    return res


def split_ptx_entries(ptx: str) -> dict[str, list[str]]:
    """PTX -> {entry: [opcodes]} (guard predicates @p dropped)."""
    funcs = _split_functions(ptx, r"^\.(?:visible\s+)?\.entry\s+(\S+)\(", lambda ln: ln.startswith("}"),
                             lambda s: not s.startswith(("//", ".", "{", "}", "$")) and not s.endswith(":"))
    out = {}
    for f, lines in funcs.items():
        ops = []
        for s in lines:
            if s.startswith("@"):
                s = s.split(None, 1)[1] if " " in s else s
            ops.append(s.split()[0].rstrip(";"))
        out[f] = ops
    return out


def ptx_mix(ops: list[str]) -> dict[str, int]:
    c = Counter(ops)
    mix: dict[str, int] = {}
    for op, n in sorted(c.items()):
        if op.startswith("mma.sync"):
            shape = re.search(r"m\d+n\d+k\d+", op)
            key = f"mma:mma.sync.{shape.group(0)}" if shape else f"mma:{op}"
            mix[key] = mix.get(key, 0) + n
    mix["global_loads"] = sum(n for op, n in c.items() if op.startswith("ld.global"))
    mix["global_stores"] = sum(n for op, n in c.items() if op.startswith("st.global"))
    mix["lds_loads"] = sum(n for op, n in c.items() if op.startswith("ld.shared"))
    mix["lds_stores"] = sum(n for op, n in c.items() if op.startswith("st.shared"))
    mix["cross_lane"] = sum(n for op, n in c.items() if op.startswith(("shfl", "movmatrix")))
    mix["exp"] = sum(n for op, n in c.items() if op.startswith("ex2"))
    mix["instructions"] = sum(c.values())
    return mix


# ---------------------------------------------------------------- compiling
def _group_key(v: V.Variant):
    return (v.tiling, v.dtype, v.kv_cache_dtype, v.heads_cap)


def _tu_source(group: list[V.Variant], shared_steps: bool = False) -> str:
    """One translation unit: the group's attention kernels (the shared-steps instantiation,
    STEAL=true, instead of the fixed partitions' where `shared_steps`) and their reduces."""
    lines = ['#include "attention.h"']
    reduces = set()
    steal = ", true" if shared_steps else ""
    for v in group:
        lines.append(f"template __global__ void cpa::paged_attention_kernel<cpa::AttnConfig<{v.cpp_config()}>{steal}>"
                     "(cpa::AttnParams);")
        reduces.add((_dt(v), v.head_size))
    for d, h in sorted(reduces):
        lines.append(f"template __global__ void cpa::paged_attention_reduce_kernel<cpa::{d}, {h}>(cpa::ReduceParams);")
        lines.append(f"template __global__ void cpa::paged_attention_reduce_few_kernel<cpa::{d}, {h}>"
                     "(cpa::ReduceParams);")
    return "\n".join(lines) + "\n"


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=1800)
    if p.returncode:
        raise RuntimeError(f"compile failed ({' '.join(cmd[:3])} ...):\n{p.stderr[-4000:]}")
    return p


def snapshot_sources(dest: Path) -> str:
    """Copy the kernel headers to `dest` (one consistent version for a whole table, even while
    cpa/csrc is being edited) and return their digest (cpa.jit.sources_digest of the copy)."""
    for p in sorted(CSRC.glob("*.h")):
        (dest / p.name).write_bytes(p.read_bytes())
    return sources_digest(dest)


def _compile_amd(group, arch, work: Path, inc: Path = CSRC, flags=(), shared_steps=False) -> tuple[dict, dict]:
    """clang resource remarks and ISA mix per function; the assembly stays in work/tu.s."""
    src = work / "tu.hip"
    src.write_text(_tu_source(group, shared_steps))
    p = _run([find_clang(), "-x", "hip", "-std=c++17", f"--offload-arch={arch}", "--cuda-device-only", "-O3",
              "-nogpulib", "-Rpass-analysis=kernel-resource-usage", "-S", f"-I{inc}", *flags, str(src), "-o", "tu.s"],
             work)
    remarks = parse_amd_remarks(p.stderr)
    funcs = split_amd_functions((work / "tu.s").read_text())
    return remarks, {f: amd_mix(m) for f, m in funcs.items()}


def _compile_nv(group, arch, work: Path, inc: Path = CSRC, flags=(), shared_steps=False) -> tuple[dict, dict]:
    """ptxas resources and PTX mix per function; the PTX stays in work/tu.ptx. `flags`: extra
    nvcc options (the kernels' -D knobs)."""
    src = work / "tu.cu"
    src.write_text(_tu_source(group, shared_steps))
    nvcc = find_nvcc()
    _run([nvcc, "-std=c++17", f"-arch={arch}", "-O3", f"-I{inc}", *flags, str(src), "-ptx", "-o", "tu.ptx"], work)
    # ptxas on that PTX as `nvcc -cubin` runs it (its --dryrun: `ptxas -arch=sm_90 -m64`), so the
    # front end and cicc run once, not once per output (a third of the sm_90 table's time)
    p = _run([find_ptxas(nvcc), f"-arch={arch}", "-m64", "-v", "tu.ptx", "-o", "tu.cubin"], work)
    res = parse_ptxas(p.stderr)
    funcs = split_ptx_entries((work / "tu.ptx").read_text())
    return res, {f: ptx_mix(m) for f, m in funcs.items()}


def _rows_for_group(group, arch, inc: Path = CSRC, flags=(), shared_steps=False) -> list[dict]:
    work = Path(tempfile.mkdtemp(prefix="cpa-static-"))
    try:
        amd = arch.startswith("gfx")
        res, mixes = (_compile_amd if amd else _compile_nv)(group, arch, work, inc, flags=flags,
                                                            shared_steps=shared_steps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for v in group:
        for kernel, key in (("attention", attention_symbol_key(v)), ("reduce", reduce_symbol_key(v)),
                            ("reduce_few", reduce_symbol_key(v, "reduce_few"))):
            fn = [f for f in res if key in f]
            if len(fn) != 1:
                raise RuntimeError(f"{arch}: expected one {kernel} kernel for {v.name}, found {fn}")
            fn = fn[0]
            r = res[fn]
            row = dict(arch=arch, tiling=v.tiling, partition_size=v.partition_size, head_size=v.head_size,
                       block_size=v.block_size, dtype=v.dtype, kv_cache_dtype=v.kv_cache_dtype,
                       heads_cap=v.heads_cap, variant=v.name, kernel=kernel, symbol=fn)
            if shared_steps:  # the default tables keep their columns
                row["shared_steps"] = True
            if amd:
                row.update(vgprs=int(r["VGPRs"]), agprs=int(r["AGPRs"]), sgprs=int(r["SGPRs"]),
                           lds_bytes=int(r["LDS Size [bytes/block]"]),
                           scratch_bytes=int(r["ScratchSize [bytes/lane]"]),
                           spills=int(r["VGPRs Spill"]) + int(r["SGPRs Spill"]),
                           waves_per_simd_compiler=int(r["Occupancy [waves/SIMD]"]),
                           dynamic_stack=r.get("Dynamic Stack", "False") == "True")
            else:
                row.update(registers=r["registers"], shared_bytes=r["shared_bytes"], stack_bytes=r["stack_bytes"],
                           spills=r["spill_stores"] + r["spill_loads"])
            cfg_threads = {"attention": 4 * V.WAVE_SIZE[v.platform], "reduce": V.REDUCE_THREADS,
                           "reduce_few": V.REDUCE_FEW_THREADS}[kernel]
            row["threads_per_block"] = cfg_threads
            row.update(mixes.get(fn, {}))
            rows.append(row)
    return rows


def compile_variants(variants, arch: str, *, jobs: int | None = None, progress: bool = True, flags=(),
                     shared_steps: bool = False):
    """One row per (variant, kernel) as a pandas DataFrame.

    The kernel headers are copied once at the start, so every row comes from the same
    sources; their digest is the ``sources_digest`` column. ``flags``: extra compiler flags
    (a knob's build, e.g. ``-DCPA_MIN_BLOCKS=1``), recorded in the ``build_flags`` column ("" for
    the default build). ``shared_steps``: the attention kernels are the shared-steps
    instantiation (``ops.prepare(shared_steps=True)``; column ``shared_steps``), and only the
    variants that can share their steps are compiled (ValueError if none of them can)."""
    import pandas as pd

    check_arch(arch)
    flags = check_knob_flags(flags)
    platform = V.platform_of_arch(arch)
    variants = [v for v in variants if v.platform == platform]
    if shared_steps:
        variants = [v for v in variants if V.shared_steps_unsupported(v) is None]
        if not variants:
            raise ValueError("shared steps: none of the selected variants can share its steps "
                             f"(each wave needs >= {V.SHARED_STEPS_MIN_STEPS_PER_WAVE} steps of its partition)")
    groups: dict = defaultdict(list)
    for v in variants:
        groups[_group_key(v)].append(v)
    jobs = jobs or os.cpu_count() or 1
    rows: list[dict] = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(variants), desc=f"compile {arch}", unit="variant")
    inc = Path(tempfile.mkdtemp(prefix="cpa-static-src-"))
    try:
        digest = snapshot_sources(inc)
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futs = {pool.submit(_rows_for_group, g, arch, inc, flags, shared_steps): g for g in groups.values()}
            for f in futs:
                rows.extend(f.result())
                if bar:
                    bar.update(len(futs[f]))
    finally:
        shutil.rmtree(inc, ignore_errors=True)
    if bar:
        bar.close()
    df = pd.DataFrame(rows)
    df["sources_digest"] = digest[:16]
    if flags:  # the default tables keep their columns; a knob's table says which build it is
        df["build_flags"] = " ".join(flags)
    mma_cols = sorted(c for c in df.columns if c.startswith("mma:"))
    df[mma_cols] = df[mma_cols].fillna(0).astype(int)
    return df.sort_values(["kernel", "tiling", "dtype", "kv_cache_dtype", "heads_cap", "head_size", "block_size",
                           "partition_size"]).reset_index(drop=True)


def check_arch(arch: str) -> None:
    """Only the targets whose compile flags and resource parsing this module knows (a typo
    such as gfx924 would otherwise start hundreds of failing compiler runs)."""
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r}: cpa static compiles for {', '.join(ARCHS)}")


def check_knob_flags(flags) -> tuple:
    """The extra compiler flags of a knob's build, as a tuple: -DNAME[=VALUE] definitions only
    (compiled tables and code comparisons are of builds of one source, not of other options)."""
    flags = tuple(flags)
    bad = [f for f in flags if not f.startswith("-D")]
    if bad:
        raise ValueError(f"flags {bad}: only -DNAME[=VALUE] knob definitions (the tables compare builds of one source)")
    return flags


def variants_for_arch(arch: str, **filters):
    """Every valid variant of the arch's platform, narrowed by ``filters`` (all_variants' keyword
    arguments); ValueError for an unknown tiling or a selection with no variant."""
    check_arch(arch)
    unknown = set(filters.get("tilings") or ()) - set(V.TILINGS)
    if unknown:
        raise ValueError(f"tilings {sorted(unknown)}: not one of {', '.join(V.TILINGS)}")
    vs = list(V.all_variants(V.platform_of_arch(arch), **filters))
    if not vs:
        raise ValueError(f"no {arch} variant has {filters}")
    return vs
