"""JIT build and in-process load of one kernel variant.

``build(variant)`` compiles exactly that instantiation with ``torch.utils.cpp_extension``
(nvcc for the device's sm arch on NVIDIA, hipcc through a ROCm build of torch on AMD),
caches the shared library on disk under a key made of the kernel sources, the variant, the
arch, the compiler and the torch version, and loads it with ctypes. Two processes building
the same variant at once serialize on a file lock; a later process loads the cached library
without compiling.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .variants import Variant

CSRC = Path(__file__).resolve().parent / "csrc"


def cache_root() -> Path:
    root = os.environ.get("CPA_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cpa" / "kernels"


_info_by_index: dict[int, tuple[str, str, int]] = {}


class NoGPUError(RuntimeError):
    """A GPU-only operation on a machine where torch sees no GPU (the CLI reports it as a usage
    error: nothing ran)."""


def require_gpu(what: str) -> None:
    """NoGPUError naming ``what`` unless torch sees a GPU: called before work a GPU must do."""
    import torch

    if not torch.cuda.is_available():
        raise NoGPUError(f"{what} needs a GPU; torch sees none (torch.cuda.is_available() is False)")


def device_info(device=None) -> tuple[str, str, int]:
    """(platform, arch, compute units) of a torch device: ('cuda', 'sm_90', 132) or
    ('hip', 'gfx942', 304)."""
    import torch

    # the eager launch path asks per call: kept per device index (the properties query and
    # is_available cost ~20 us of host time per call, cpa host-profile)
    if isinstance(device, torch.device) and device.type == "cuda" and device.index in _info_by_index:
        return _info_by_index[device.index]
    if not torch.cuda.is_available():
        raise NoGPUError("no GPU is visible to torch (torch.cuda.is_available() is False)")
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cuda":
        raise ValueError(f"device={dev} is not a GPU device")
    props = torch.cuda.get_device_properties(dev)
    if getattr(torch.version, "hip", None):
        found = "hip", props.gcnArchName.split(":")[0], props.multi_processor_count
    else:
        found = "cuda", f"sm_{props.major}{props.minor}", props.multi_processor_count
    _info_by_index[dev.index if dev.index is not None else torch.cuda.current_device()] = found
    return found


def device_arch(device=None) -> tuple[str, str]:
    """(platform, arch) of a torch device: ('cuda', 'sm_90') or ('hip', 'gfx942')."""
    return device_info(device)[:2]


def _compiler_path(platform: str) -> str:
    """The compiler torch.utils.cpp_extension runs for the build: PYTORCH_NVCC if set, else
    CUDA_HOME/bin/nvcc or ROCM_HOME/bin/hipcc (a bare name on PATH where torch found no home)."""
    if os.environ.get("PYTORCH_NVCC"):
        return os.environ["PYTORCH_NVCC"].split()[-1]  # (torch allows "ccache nvcc")
    from torch.utils import cpp_extension

    home = cpp_extension.ROCM_HOME if platform == "hip" else cpp_extension.CUDA_HOME
    exe = "hipcc" if platform == "hip" else "nvcc"
    return str(Path(home) / "bin" / exe) if home else exe


@lru_cache(maxsize=None)
def _compiler_id(platform: str) -> str:
    """The build compiler's whole ``--version`` output, hashed (its last line alone is a config
    file path on ROCm's hipcc, not a version)."""
    exe = _compiler_path(platform)
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"cannot run the {platform} compiler {exe!r}: {e}") from e
    text = out.strip() or exe
    return f"{text.splitlines()[-1][:80]} [{hashlib.sha256(text.encode()).hexdigest()[:16]}]"


def _kernel_headers(csrc: Path) -> list[Path]:
    # (hipify's *_hip.h copies are generated, not sources: a ROCm build once wrote them into csrc)
    return [p for p in sorted(Path(csrc).glob("*.h")) if not p.name.endswith("_hip.h")]


def sources_digest(csrc: Path = CSRC) -> str:
    """sha256 over the kernel headers (*.h) of `csrc`, names and bytes, in name order."""
    h = hashlib.sha256()
    for p in _kernel_headers(csrc):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def extra_flags() -> list[str]:
    """CPA_NVCC_FLAGS: extra compiler flags for experiments (e.g. -DCPA_MIN_BLOCKS=3); part of the key."""
    return os.environ.get("CPA_NVCC_FLAGS", "").split()


@contextmanager
def flags_added(flags: str):
    """CPA_NVCC_FLAGS with ``flags`` appended inside the block (builds, their cache keys and the
    provenance read it from the environment), then as it was; yields the flags in effect."""
    old = os.environ.get("CPA_NVCC_FLAGS")
    now = f"{old or ''} {flags}".strip()
    os.environ["CPA_NVCC_FLAGS"] = now
    try:
        yield now
    finally:
        if old is None:
            os.environ.pop("CPA_NVCC_FLAGS", None)
        else:
            os.environ["CPA_NVCC_FLAGS"] = old


def staged_loops_flagged() -> bool:
    """Whether CPA_NVCC_FLAGS builds a staged / ring main loop (-DCPA_KV_ASYNC=N, N != 0), which
    keeps fixed partitions (no shared steps)."""
    return any(f.startswith("-DCPA_KV_ASYNC=") and f != "-DCPA_KV_ASYNC=0" for f in extra_flags())


def build_flags(variant: Variant, arch: str) -> tuple[list[str], list[str]]:
    """(device-compiler flags, host flags) of a JIT build, include path aside: the arch is named
    here (nvcc -gencode, hipcc --offload-arch), so torch adds none of its own and no
    environment variable is set for the build; any sm_XY / sm_XYZ or gfx target works."""
    flags = ["-O3", "-std=c++17", *extra_flags()]
    if variant.platform == "cuda":
        n = arch.removeprefix("sm_")
        flags += ["-lineinfo", "--expt-relaxed-constexpr", f"-gencode=arch=compute_{n},code=sm_{n}"]
    else:
        flags += [f"--offload-arch={arch}"]
    return flags, ["-O3"]


# environment variables the compilers (or torch's build of the command line) read: a change
# in any of them can change the library
BUILD_ENV = ("CC", "CXX", "PYTORCH_NVCC", "NVCC_APPEND_FLAGS", "NVCC_PREPEND_FLAGS", "NVCC_CCBIN",
             "HIPCC_COMPILE_FLAGS_APPEND", "HIPCC_LINK_FLAGS_APPEND")


def cache_key(variant: Variant, arch: str) -> str:
    import torch

    cflags, hflags = build_flags(variant, arch)
    parts = {
        "sources": sources_digest(),
        "variant": variant.name,
        "source": hashlib.sha256(variant.source().encode()).hexdigest(),
        "arch": arch,
        "compiler": _compiler_id(variant.platform),
        "torch": torch.__version__,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "flags": [cflags, hflags],
        "env": {k: os.environ[k] for k in BUILD_ENV if k in os.environ},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


@contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class KernelError(RuntimeError):
    pass


@dataclass
class BuiltKernel:
    """A loaded variant: the C entry points of cpa/csrc/launch.h."""

    variant: Variant
    arch: str
    path: Path
    from_cache: bool
    build_seconds: float  # compile time (0 when loaded from the cache)
    load_seconds: float  # total time of build() for this variant
    lib: ctypes.CDLL

    def __post_init__(self) -> None:
        L = self.lib
        vp, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float
        L.cpa_variant.restype = ctypes.c_char_p
        L.cpa_tokens_per_step.restype = i32
        L.cpa_heads_cap.restype = i32
        L.cpa_attention.restype = i32
        L.cpa_attention.argtypes = [vp] * 10 + [i32] * 5 + [i64, i64, f32, f32, i32, vp, i32, vp, vp]
        L.cpa_reduce.restype = i32
        L.cpa_reduce.argtypes = [vp] * 5 + [i32] * 4 + [vp]
        L.cpa_kernel_attributes.restype = i32
        L.cpa_kernel_attributes.argtypes = [i32, ctypes.POINTER(ctypes.c_int)]
        L.cpa_max_active_clusters.restype = i32
        L.cpa_max_active_clusters.argtypes = [i32]
        got = L.cpa_variant().decode()
        if got != self.variant.name:
            raise KernelError(f"library {self.path} holds variant {got!r}, expected {self.variant.name!r}")
        self.attention = L.cpa_attention
        self.reduce = L.cpa_reduce

    def check(self, err: int, what: str) -> None:
        if err:
            import torch

            name = torch.cuda.get_device_name() if torch.cuda.is_available() else "?"
            raise KernelError(f"{what} launch of {self.variant.name} failed with runtime error {err} on {name}")

    def max_active_clusters(self, cluster: int) -> int:
        """Clusters of `cluster` attention workgroups the device holds at once (0: none fit)."""
        n = self.lib.cpa_max_active_clusters(int(cluster))
        if n < 0:
            self.check(-n, f"max_active_clusters({cluster})")
        return n

    def attributes(self) -> dict[str, dict[str, int]]:
        """Registers, shared memory, stack, and resident blocks per SM/CU of the four kernels:
        attention, reduce, reduce_few and attention_shared_steps (ops.prepare(shared_steps=True))."""
        res = {}
        for which, kname in ((0, "attention"), (1, "reduce"), (2, "reduce_few"), (3, "attention_shared_steps")):
            buf = (ctypes.c_int * 6)()
            self.check(self.lib.cpa_kernel_attributes(which, buf), f"attributes({kname})")
            res[kname] = dict(zip(("registers", "shared_bytes", "local_bytes", "max_threads_per_block",
                                   "threads_per_block", "blocks_per_sm"), list(buf)))
        return res


_loaded: dict[tuple, BuiltKernel] = {}


def _compile(variant: Variant, arch: str, workdir: Path, verbose: bool) -> Path:
    from torch.utils import cpp_extension

    # the build reads a copy of the headers in its own folder: on ROCm, torch's hipify writes
    # *_hip.h next to the headers it is given, and the package's folder must stay as it is
    # (parallel builds would rewrite the same files while others read them)
    inc = workdir / "csrc"
    shutil.copytree(CSRC, inc, ignore=shutil.ignore_patterns("*_hip.h", "__pycache__"))
    src = workdir / f"{variant.name.replace('-', '_')}.cu"
    src.write_text(variant.source())
    name = "cpa_" + variant.name.replace("-", "_")
    cflags, hflags = build_flags(variant, arch)
    path = cpp_extension.load(name=name, sources=[str(src)], extra_cuda_cflags=[f"-I{inc}", *cflags],
                              extra_cflags=hflags, extra_include_paths=[str(inc)], build_directory=str(workdir),
                              is_python_module=False, verbose=verbose)
    if not path:
        path = workdir / f"{name}.so"
    return Path(path)


def _entry_ok(final_dir: Path) -> bool:
    """A published cache entry whose library is whole: build.json (written last) records the
    library's size and sha256; a torn or truncated library (a crash between writes, a full disk)
    must be rebuilt, never loaded (a truncated ELF can kill the process on load)."""
    try:
        meta = json.loads((final_dir / "build.json").read_text())
        lib = final_dir / "kernel.so"
        if lib.stat().st_size != meta["lib_size"]:
            return False
        return hashlib.sha256(lib.read_bytes()).hexdigest() == meta["lib_sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _discard(final_dir: Path) -> None:
    """Move a damaged entry out of the way (renamed first, so no reader sees it half-removed)."""
    if final_dir.exists():
        aside = final_dir.with_name(f"{final_dir.name}.bad{os.getpid()}-{time.time_ns()}")
        os.replace(final_dir, aside)
        shutil.rmtree(aside, ignore_errors=True)


def compile_variant(variant: Variant, arch: str, *, verbose: bool = False) -> tuple[Path, bool, float]:
    """Compile one variant for `arch` into the disk cache (no GPU needed, no load).

    Returns (library path, from_cache, compile seconds)."""
    from .fsio import fsync_dir, write_bytes_atomic, write_text_atomic

    digest = cache_key(variant, arch)
    final_dir = cache_root() / f"{variant.name}-{arch}-{digest}"
    lib_path = final_dir / "kernel.so"
    meta_path = final_dir / "build.json"
    if _entry_ok(final_dir):
        return lib_path, True, 0.0
    with _file_lock(cache_root() / f"{variant.name}-{arch}-{digest}.lock"):
        if _entry_ok(final_dir):  # another process finished it while we waited
            return lib_path, True, 0.0
        _discard(final_dir)  # (a damaged entry, or a library a crash left without its build.json)
        work = cache_root() / f"{variant.name}-{arch}-{digest}.tmp{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        try:
            tb = time.perf_counter()
            built = _compile(variant, arch, work, verbose)
            seconds = time.perf_counter() - tb
            data = built.read_bytes()
            final_dir.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(lib_path, data)
            # the marker last: a library without it (or not matching it) is not trusted
            write_text_atomic(meta_path, json.dumps({
                "variant": variant.as_dict(), "arch": arch, "key": digest, "build_seconds": seconds,
                "lib_size": len(data), "lib_sha256": hashlib.sha256(data).hexdigest()}, indent=1))
            fsync_dir(cache_root())
        finally:  # a failed or interrupted compile leaves no work folder behind
            shutil.rmtree(work, ignore_errors=True)
    return lib_path, False, seconds


_sources_seen: list = [0.0, None, ""]  # (time of the last look, the headers' stamps, their digest)
SOURCES_RECHECK_S = 0.5


def _sources_now() -> str:
    """The kernel headers' digest, re-read when their sizes or times change, looked at no more
    than every SOURCES_RECHECK_S (the eager path calls build() per launch; an edit is found
    at the next build after it)."""
    now = time.monotonic()
    if now - _sources_seen[0] > SOURCES_RECHECK_S:
        stamps = tuple((p.name, st.st_mtime_ns, st.st_size) for p in _kernel_headers(CSRC) for st in [p.stat()])
        if stamps != _sources_seen[1]:
            _sources_seen[1:] = [stamps, sources_digest(CSRC)]
        _sources_seen[0] = now
    return _sources_seen[2]


def build(variant: Variant, device=None, *, verbose: bool = False) -> BuiltKernel:
    """Compile (or load from the disk cache) one variant for `device` and load it in-process."""
    t0 = time.perf_counter()
    platform, arch = device_arch(device)
    if variant.platform != platform:
        raise ValueError(f"variant {variant.name} is for platform {variant.platform!r}, the device is {platform!r}")
    # kept per build as the disk cache keys it, the cheap parts: the flags, the cache folder and
    # the headers (an edited header in a running notebook gets a new build, not the loaded one)
    key = (variant.name, arch, os.environ.get("CPA_NVCC_FLAGS", ""), str(cache_root()), _sources_now())
    if key in _loaded:
        return _loaded[key]
    lib_path, from_cache, seconds = compile_variant(variant, arch, verbose=verbose)
    try:
        lib = ctypes.CDLL(str(lib_path))
    except OSError:
        if not from_cache:
            raise
        # a cached library the loader refuses (whole by its checksum, so e.g. a file copied in
        # from another system): built again once, then trusted or reported
        _discard(lib_path.parent)
        lib_path, from_cache, seconds = compile_variant(variant, arch, verbose=verbose)
        lib = ctypes.CDLL(str(lib_path))
    k = BuiltKernel(variant, arch, lib_path, from_cache, seconds, time.perf_counter() - t0, lib)
    _loaded[key] = k
    return k


def _compile_one(args):
    variant, arch = args
    try:
        _, from_cache, seconds = compile_variant(variant, arch)
        return variant, from_cache, seconds, None
    except Exception as e:  # reported, not raised: one bad variant must not hide the others
        return variant, False, 0.0, f"{type(e).__name__}: {e}"


def prebuild(variants, arch: str, *, jobs: int | None = None, progress: bool = True) -> list[dict]:
    """Compile many variants in parallel processes (one per core by default)."""
    from concurrent.futures import ProcessPoolExecutor, as_completed
    import multiprocessing as mp

    variants = list(dict.fromkeys(variants))
    jobs = jobs or max(1, (os.cpu_count() or 2))
    rows = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(variants), desc=f"build {arch}", unit="variant")
    from concurrent.futures.process import BrokenProcessPool

    with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
        futs = {pool.submit(_compile_one, (v, arch)): v for v in variants}
        for f in as_completed(futs):
            try:
                v, from_cache, seconds, err = f.result()
            except BrokenProcessPool as e:  # a worker died (killed, out of memory): its variant and
                # those still queued are reported as not built, the finished rows are kept
                v, from_cache, seconds, err = futs[f], False, 0.0, f"BrokenProcessPool: {e}"
            rows.append({"variant": v.name, "from_cache": from_cache, "build_seconds": seconds, "error": err})
            if bar:
                bar.update(1)
    if bar:
        bar.close()
    return rows
