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


@lru_cache(maxsize=None)
def _compiler_id(platform: str) -> str:
    exe = "hipcc" if platform == "hip" else "nvcc"
    if platform == "cuda":
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME:
            exe = str(Path(CUDA_HOME) / "bin" / "nvcc")
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"cannot run the {platform} compiler {exe!r}: {e}") from e
    return out.strip().splitlines()[-1] if out.strip() else exe


def sources_digest(csrc: Path = CSRC) -> str:
    """sha256 over the kernel headers (*.h) of `csrc`, names and bytes, in name order."""
    h = hashlib.sha256()
    for p in sorted(Path(csrc).glob("*.h")):
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


def cache_key(variant: Variant, arch: str) -> str:
    import torch

    parts = {
        "sources": sources_digest(),
        "variant": variant.name,
        "arch": arch,
        "compiler": _compiler_id(variant.platform),
        "torch": torch.__version__,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "extra_flags": extra_flags(),
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
        """Registers, shared memory, stack, and resident blocks per SM/CU of the three kernels."""
        res = {}
        for which, kname in ((0, "attention"), (1, "reduce"), (2, "reduce_few")):
            buf = (ctypes.c_int * 6)()
            self.check(self.lib.cpa_kernel_attributes(which, buf), f"attributes({kname})")
            res[kname] = dict(zip(("registers", "shared_bytes", "local_bytes", "max_threads_per_block",
                                   "threads_per_block", "blocks_per_sm"), list(buf)))
        return res


_loaded: dict[tuple[str, str], BuiltKernel] = {}


def _compile(variant: Variant, arch: str, workdir: Path, verbose: bool) -> Path:
    from torch.utils import cpp_extension

    src = workdir / f"{variant.name.replace('-', '_')}.cu"
    src.write_text(variant.source())
    name = "cpa_" + variant.name.replace("-", "_")
    flags = ["-O3", "-std=c++17", f"-I{CSRC}", *extra_flags()]
    env_key, env_val = ("TORCH_CUDA_ARCH_LIST", f"{arch[3]}.{arch[4:]}") if variant.platform == "cuda" \
        else ("PYTORCH_ROCM_ARCH", arch)
    if variant.platform == "cuda":
        flags += ["-lineinfo", "--expt-relaxed-constexpr"]
    old = os.environ.get(env_key)
    os.environ[env_key] = env_val
    try:
        path = cpp_extension.load(name=name, sources=[str(src)], extra_cuda_cflags=flags, extra_cflags=["-O3"],
                                  extra_include_paths=[str(CSRC)], build_directory=str(workdir),
                                  is_python_module=False, verbose=verbose)
    finally:
        if old is None:
            os.environ.pop(env_key, None)
        else:
            os.environ[env_key] = old
    if not path:
        path = workdir / f"{name}.so"
    return Path(path)


def compile_variant(variant: Variant, arch: str, *, verbose: bool = False) -> tuple[Path, bool, float]:
    """Compile one variant for `arch` into the disk cache (no GPU needed, no load).

    Returns (library path, from_cache, compile seconds)."""
    digest = cache_key(variant, arch)
    final_dir = cache_root() / f"{variant.name}-{arch}-{digest}"
    lib_path = final_dir / "kernel.so"
    meta_path = final_dir / "build.json"
    if meta_path.exists():
        return lib_path, True, 0.0
    with _file_lock(cache_root() / f"{variant.name}-{arch}-{digest}.lock"):
        if meta_path.exists():  # another process finished it while we waited
            return lib_path, True, 0.0
        work = cache_root() / f"{variant.name}-{arch}-{digest}.tmp{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        tb = time.perf_counter()
        built = _compile(variant, arch, work, verbose)
        seconds = time.perf_counter() - tb
        final_dir.mkdir(parents=True, exist_ok=True)
        tmp_lib = final_dir / f"kernel.so.tmp{os.getpid()}"
        shutil.copy2(built, tmp_lib)
        os.replace(tmp_lib, lib_path)
        tmp_meta = final_dir / f"build.json.tmp{os.getpid()}"
        tmp_meta.write_text(json.dumps({"variant": variant.as_dict(), "arch": arch, "key": digest,
                                        "build_seconds": seconds}, indent=1))
        os.replace(tmp_meta, meta_path)  # the marker last: a library without it is not trusted
        shutil.rmtree(work, ignore_errors=True)
    return lib_path, False, seconds


def build(variant: Variant, device=None, *, verbose: bool = False) -> BuiltKernel:
    """Compile (or load from the disk cache) one variant for `device` and load it in-process."""
    t0 = time.perf_counter()
    platform, arch = device_arch(device)
    if variant.platform != platform:
        raise ValueError(f"variant {variant.name} is for platform {variant.platform!r}, the device is {platform!r}")
    key = (variant.name, arch, os.environ.get("CPA_NVCC_FLAGS", ""))  # (the flags key the disk cache too)
    if key in _loaded:
        return _loaded[key]
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
    with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
        futs = [pool.submit(_compile_one, (v, arch)) for v in variants]
        for f in as_completed(futs):
            v, from_cache, seconds, err = f.result()
            rows.append({"variant": v.name, "from_cache": from_cache, "build_seconds": seconds, "error": err})
            if bar:
                bar.update(1)
    if bar:
        bar.close()
    return rows
