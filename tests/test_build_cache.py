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
