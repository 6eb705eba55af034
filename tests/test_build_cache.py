"""The disk cache of cpa.build without a GPU: a fake compiler stands in for nvcc, so the
locking, the atomic publish and the cache hit are tested on any machine."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import cpa.jit as b
    from cpa.variants import Variant
    log = Path(os.environ["FAKE_LOG"])
    def fake_compile(variant, arch, work, verbose):
        with open(log, "a") as f:
            f.write(f"compile {variant.name} {os.getpid()}\\n")
        time.sleep(1.0)  # long enough for the other process to hit the lock
        out = work / "fake.so"
        out.write_bytes(b"not a real library")
        return out
    b._compile = fake_compile
    b._compiler_id = lambda platform: "fake-compiler 1.0"
    v = Variant("mfma16", 256, 128, 16, "fp16", "auto", 8, "cuda")
    path, from_cache, secs = b.compile_variant(v, "sm_90")
    print("RESULT", path, from_cache)
""")


def _run(env):
    return subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_two_processes_build_once_then_cache_hits(tmp_path):
    env = dict(os.environ, CPA_CACHE_DIR=str(tmp_path / "cache"), FAKE_LOG=str(tmp_path / "log"))
    procs = [_run(env), _run(env)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    results = [line.split() for out, _ in outs for line in out.splitlines() if line.startswith("RESULT")]
    assert len(results) == 2
    assert results[0][1] == results[1][1], "both processes must end on the same cached library"
    assert sorted(r[2] for r in results) == ["False", "True"], "exactly one process compiles"
    assert Path(results[0][1]).read_bytes() == b"not a real library"
    assert len((tmp_path / "log").read_text().splitlines()) == 1
    # a third process: a pure cache hit, no compile
    p = _run(env)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "RESULT" in out and out.split()[-1] == "True"
    assert len((tmp_path / "log").read_text().splitlines()) == 1
    # nothing half-written is left behind
    leftovers = [q.name for q in (tmp_path / "cache").rglob("*") if ".tmp" in q.name]
    assert not leftovers


def test_cache_key_changes_with_sources_and_variant(monkeypatch):
    import cpa.jit as b
    from cpa.variants import Variant

    monkeypatch.setattr(b, "_compiler_id", lambda platform: "fake")
    v1 = Variant("mfma16", 256, 128, 16, "fp16", "auto", 8, "cuda")
    v2 = Variant("mfma16", 512, 128, 16, "fp16", "auto", 8, "cuda")
    k1 = b.cache_key(v1, "sm_90")
    assert k1 == b.cache_key(v1, "sm_90")
    assert k1 != b.cache_key(v2, "sm_90")
    assert k1 != b.cache_key(v1, "sm_100")
    monkeypatch.setattr(b, "sources_digest", lambda: "other")
    assert k1 != b.cache_key(v1, "sm_90")


def test_loaded_kernels_are_kept_per_compiler_flags(monkeypatch):
    """A process that changes CPA_NVCC_FLAGS gets the other build, not the one it loaded first."""
    import cpa.jit as b
    from cpa.variants import Variant

    compiled = []
    monkeypatch.setattr(b, "device_arch", lambda device=None: ("cuda", "sm_90"))
    monkeypatch.setattr(b, "compile_variant", lambda v, arch, verbose=False:
                        compiled.append(os.environ.get("CPA_NVCC_FLAGS", "")) or (Path("/x.so"), True, 0.0))
    monkeypatch.setattr(b.ctypes, "CDLL", lambda path: None)
    monkeypatch.setattr(b, "BuiltKernel", lambda *a: object())
    monkeypatch.setattr(b, "_loaded", {})
    v = Variant("mfma16", 256, 128, 16, "fp16", "auto", 8, "cuda")
    monkeypatch.delenv("CPA_NVCC_FLAGS", raising=False)
    first = b.build(v)
    assert b.build(v) is first and compiled == [""]
    monkeypatch.setenv("CPA_NVCC_FLAGS", "-DCPA_MIN_BLOCKS=3")
    other = b.build(v)
    assert other is not first and compiled == ["", "-DCPA_MIN_BLOCKS=3"]
    monkeypatch.delenv("CPA_NVCC_FLAGS")
    assert b.build(v) is first


def test_device_arch_is_asked_once_per_device(monkeypatch):
    import types

    import torch

    import cpa.jit as b

    asked = []
    monkeypatch.setattr(b, "_info_by_index", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda dev: asked.append(dev) or types.SimpleNamespace(major=9, minor=0, gcnArchName="",
                                                                            multi_processor_count=132))
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert b.device_arch(torch.device("cuda", 1)) == ("cuda", "sm_90")
    assert b.device_arch(torch.device("cuda", 1)) == ("cuda", "sm_90")
    assert len(asked) == 1
    assert b.device_arch(torch.device("cuda", 0)) == ("cuda", "sm_90") and len(asked) == 2
    assert b.device_info(torch.device("cuda", 0)) == ("cuda", "sm_90", 132) and len(asked) == 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with __import__("pytest").raises(RuntimeError, match="no GPU"):
        b.device_arch(torch.device("cuda", 2))  # (an unknown device is still asked)


def test_flags_added_restores_the_environment(monkeypatch):
    import pytest

    from cpa.jit import extra_flags, flags_added

    monkeypatch.delenv("CPA_NVCC_FLAGS", raising=False)
    with pytest.raises(RuntimeError):
        with flags_added("-DCPA_LOAD_ONLY=1") as now:
            assert now == "-DCPA_LOAD_ONLY=1" and extra_flags() == ["-DCPA_LOAD_ONLY=1"]
            raise RuntimeError("a failed build")
    assert "CPA_NVCC_FLAGS" not in os.environ
    monkeypatch.setenv("CPA_NVCC_FLAGS", "-DCPA_MIN_BLOCKS=3")
    with flags_added("-DCPA_LOAD_ONLY=2"):
        assert extra_flags() == ["-DCPA_MIN_BLOCKS=3", "-DCPA_LOAD_ONLY=2"]
    assert os.environ["CPA_NVCC_FLAGS"] == "-DCPA_MIN_BLOCKS=3"


# ------------------------------------------------------------------ what the third audit found
def _fake_build(monkeypatch, tmp_path, log):
    """compile_variant with a fake compiler writing a known library; returns the variant."""
    import cpa.jit as b
    from cpa.variants import Variant

    def fake_compile(variant, arch, work, verbose):
        log.append(variant.name)
        out = work / "fake.so"
        out.write_bytes(b"library bytes " * 100)
        return out

    monkeypatch.setenv("CPA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(b, "_compile", fake_compile)
    monkeypatch.setattr(b, "_compiler_id", lambda platform: "fake")
    return Variant("mfma16", 256, 128, 16, "fp16", "auto", 8, "cuda")


def test_a_damaged_cache_entry_is_rebuilt_not_loaded(monkeypatch, tmp_path):
    """A truncated, emptied or missing library under a valid build.json (a crash between the
    writes, a full disk) is compiled again: loading a truncated ELF can kill the process."""
    import cpa.jit as b

    log = []
    v = _fake_build(monkeypatch, tmp_path, log)
    path, hit, _ = b.compile_variant(v, "sm_90")
    assert not hit and b.compile_variant(v, "sm_90")[1] and log == [v.name]
    for damage in (lambda p: p.write_bytes(p.read_bytes()[:50]), lambda p: p.write_bytes(b""), lambda p: p.unlink(),
                   lambda p: p.write_bytes(b"X" + p.read_bytes()[1:])):  # (same size, other bytes)
        damage(path)
        again, hit, _ = b.compile_variant(v, "sm_90")
        assert again == path and not hit and path.read_bytes() == b"library bytes " * 100
    assert len(log) == 5
    meta = __import__("json").loads((path.parent / "build.json").read_text())
    assert meta["lib_size"] == 1400 and len(meta["lib_sha256"]) == 64
    assert not [q for q in (tmp_path / "cache").iterdir() if ".bad" in q.name or ".tmp" in q.name]


def test_a_failed_compile_leaves_no_work_folder(monkeypatch, tmp_path):
    import pytest

    import cpa.jit as b

    v = _fake_build(monkeypatch, tmp_path, [])

    def broken(variant, arch, work, verbose):
        (work / "obj.o").write_bytes(b"half an object")
        raise RuntimeError("nvcc failed")

    monkeypatch.setattr(b, "_compile", broken)
    with pytest.raises(RuntimeError, match="nvcc failed"):
        b.compile_variant(v, "sm_90")
    assert [q.name for q in (tmp_path / "cache").iterdir() if not q.name.endswith(".lock")] == []


def test_build_flags_name_the_arch_so_no_environment_is_set(monkeypatch, tmp_path):
    """The arch goes to the compiler as a flag (torch then adds none): sm_100 / sm_120 build
    (TORCH_CUDA_ARCH_LIST=1.00 was refused by torch), and no thread sees another's arch through
    os.environ. The build reads a copy of the headers, so hipify's *_hip.h never land in
    cpa/csrc (they changed the sources' digest, hence the cache key, after every ROCm build)."""
    import cpa.jit as b
    from cpa.variants import Variant

    v = Variant("mfma16", 256, 128, 16, "fp16", "auto", 8, "cuda")
    assert b.build_flags(v, "sm_90")[0][-1] == "-gencode=arch=compute_90,code=sm_90"
    assert b.build_flags(v, "sm_100")[0][-1] == "-gencode=arch=compute_100,code=sm_100"
    assert b.build_flags(v, "sm_120")[0][-1] == "-gencode=arch=compute_120,code=sm_120"
    from torch.utils import cpp_extension

    assert cpp_extension._get_cuda_arch_flags(b.build_flags(v, "sm_100")[0]) == []  # torch adds no arch of its own
    h = Variant("mfma16", 256, 128, 16, "fp16", "auto", 16, "hip")
    assert "--offload-arch=gfx942" in b.build_flags(h, "gfx942")[0]
    assert cpp_extension._get_rocm_arch_flags(b.build_flags(h, "gfx942")[0]) == ["-fno-gpu-rdc"]

    seen = {}

    def fake_load(name, sources, extra_cuda_cflags, extra_cflags, extra_include_paths, build_directory,
                  is_python_module, verbose):
        inc = Path(extra_include_paths[0])
        seen.update(env={k: os.environ.get(k) for k in ("TORCH_CUDA_ARCH_LIST", "PYTORCH_ROCM_ARCH")},
                    inc=inc, flags=extra_cuda_cflags)
        (inc / "launch_hip.h").write_text("// what hipify writes")  # as torch's hipify does on ROCm
        out = Path(build_directory) / f"{name}.so"
        out.write_bytes(b"lib")
        return str(out)

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    before = b.sources_digest()
    work = tmp_path / "work"
    work.mkdir()
    b._compile(v, "sm_100", work, False)
    assert seen["env"] == {"TORCH_CUDA_ARCH_LIST": None, "PYTORCH_ROCM_ARCH": None}
    assert "-gencode=arch=compute_100,code=sm_100" in seen["flags"] and f"-I{seen['inc']}" in seen["flags"]
    assert seen["inc"] != b.CSRC and (seen["inc"] / "attention.h").read_bytes() == (b.CSRC / "attention.h").read_bytes()
    assert not list(b.CSRC.glob("*_hip.h")) and b.sources_digest() == before
    # a stray generated header is not a source either
    (seen["inc"] / "attention_hip.h").write_text("x")
    assert b.sources_digest(seen["inc"]) == b.sources_digest(b.CSRC)


def test_cache_key_covers_what_changes_the_library(monkeypatch):
    """The compilers' own environment variables, the generated source and the flags are in the key."""
    import cpa.jit as b
    from cpa.variants import Variant

    monkeypatch.setattr(b, "_compiler_id", lambda platform: "fake")
    for k in b.BUILD_ENV:
        monkeypatch.delenv(k, raising=False)
    v = Variant("mfma16", 256, 128, 16, "fp16", "auto", 8, "cuda")
    k0 = b.cache_key(v, "sm_90")
    for k, val in (("NVCC_APPEND_FLAGS", "-G -O0"), ("CC", "clang-19"), ("PYTORCH_NVCC", "ccache nvcc")):
        monkeypatch.setenv(k, val)
        assert b.cache_key(v, "sm_90") != k0, k
        monkeypatch.delenv(k)
    assert b.cache_key(v, "sm_90") == k0
    monkeypatch.setattr(Variant, "source", lambda self: "// another entry-point file")
    assert b.cache_key(v, "sm_90") != k0
    monkeypatch.undo()


def test_compiler_id_is_the_whole_version_text(monkeypatch):
    """ROCm's hipcc ends its --version with a config-file path: two versions must not share a key."""
    import subprocess as sp

    import cpa.jit as b

    outs = iter(["HIP version: 6.2.41133\nAMD clang version 18.0.0\nConfiguration file: /opt/rocm/lib/llvm/bin/clang++.cfg\n",
                 "HIP version: 6.3.42131\nAMD clang version 18.0.0\nConfiguration file: /opt/rocm/lib/llvm/bin/clang++.cfg\n"])
    monkeypatch.setattr(b, "_compiler_path", lambda platform: "hipcc")
    monkeypatch.setattr(b.subprocess, "run", lambda *a, **k: sp.CompletedProcess(a, 0, next(outs), ""))
    b._compiler_id.cache_clear()
    try:
        first = b._compiler_id("hip")
        b._compiler_id.cache_clear()
        assert b._compiler_id("hip") != first
    finally:
        b._compiler_id.cache_clear()


def test_an_edited_header_gets_a_new_build_in_the_same_process(monkeypatch, tmp_path):
    """build()'s in-process memo follows the headers (and the cache folder), not only the variant."""
    import shutil

    import cpa.jit as b
    from cpa.variants import Variant

    csrc = tmp_path / "csrc"
    shutil.copytree(b.CSRC, csrc)
    monkeypatch.setattr(b, "CSRC", csrc)
    monkeypatch.setattr(b, "SOURCES_RECHECK_S", 0.0)
    monkeypatch.setattr(b, "_sources_seen", [0.0, None, ""])
    monkeypatch.setattr(b, "device_arch", lambda device=None: ("cuda", "sm_90"))
    monkeypatch.setattr(b, "compile_variant", lambda v, arch, verbose=False: (Path("/x.so"), True, 0.0))
    monkeypatch.setattr(b.ctypes, "CDLL", lambda path: None)
    monkeypatch.setattr(b, "BuiltKernel", lambda *a: object())
    monkeypatch.setattr(b, "_loaded", {})
    monkeypatch.setenv("CPA_CACHE_DIR", str(tmp_path / "c1"))
    v = Variant("mfma16", 256, 128, 16, "fp16", "auto", 8, "cuda")
    first = b.build(v)
    assert b.build(v) is first
    with open(csrc / "attention.h", "a") as f:
        f.write("\n// an edit\n")
    edited = b.build(v)
    assert edited is not first and b.build(v) is edited
    monkeypatch.setenv("CPA_CACHE_DIR", str(tmp_path / "c2"))
    assert b.build(v) is not edited


def test_prebuild_keeps_finished_rows_when_a_worker_dies(monkeypatch):
    """A killed worker (out of memory, a signal) breaks the pool: the finished rows are kept and the
    lost variants are reported as errors (it used to raise and lose them all)."""
    import concurrent.futures as cf
    from concurrent.futures.process import BrokenProcessPool

    import cpa.jit as b
    from cpa.variants import Variant

    class Pool:
        def __init__(self, *a, **k):
            self.n = 0

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def submit(self, fn, args):
            f = cf.Future()
            self.n += 1
            if self.n == 1:
                f.set_result((args[0], False, 1.5, None))
            else:
                f.set_exception(BrokenProcessPool("a child process terminated abruptly"))
            return f

    monkeypatch.setattr(cf, "ProcessPoolExecutor", Pool)
    vs = [Variant("mfma16", p, 128, 16, "fp16", "auto", 8, "cuda") for p in (256, 512, 1024)]
    rows = b.prebuild(vs, "sm_90", jobs=2, progress=False)
    assert len(rows) == 3
    ok = [r for r in rows if not r["error"]]
    assert [r["variant"] for r in ok] == [vs[0].name] and ok[0]["build_seconds"] == 1.5
    assert all("BrokenProcessPool" in r["error"] for r in rows if r["error"])
