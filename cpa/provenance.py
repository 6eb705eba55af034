"""Where a measurement came from: GPU, driver, torch, git commit, date, command."""

from __future__ import annotations

import datetime as _dt
import os
import shlex
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@lru_cache(maxsize=None)
def git_commit(ignore: tuple[str, ...] = ()) -> str:
    """The commit the code came from, ``-dirty`` when tracked files differ from it. CPA_GIT_COMMIT
    wins (the device copy has no .git). ``ignore``: files whose changes do not count -- a
    measurement's own output file when it is tracked (a resumed bench writes the shipped table,
    and its second part must not call the first part's code dirty)."""
    env = os.environ.get("CPA_GIT_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        commit = out.stdout.strip()
        if not commit:
            return "unknown"
        inside = [os.path.relpath(os.path.abspath(p), REPO) for p in ignore]
        spec = [f":(exclude){p}" for p in inside if not p.startswith("..")]
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no",
                                *(["--", ".", *spec] if spec else [])],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


@lru_cache(maxsize=None)
def driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        out = subprocess.run(["rocm-smi", "--showdriverversion"], capture_output=True, text=True, timeout=20)
        for line in out.stdout.splitlines():
            if "version" in line.lower():
                return line.split(":")[-1].strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return "unknown"


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def command() -> str:
    """CPA_COMMAND if set, else this process's argv -- prefixed with CPA_NVCC_FLAGS when knob flags
    are set, so that a row measured or tested with a knob build says so."""
    flags = os.environ.get("CPA_NVCC_FLAGS", "").strip()
    cmd = os.environ.get("CPA_COMMAND") or " ".join(shlex.quote(a) for a in sys.argv)
    if flags and "CPA_NVCC_FLAGS=" not in cmd:  # (a knob build is labelled, however the command is given)
        return f"CPA_NVCC_FLAGS={shlex.quote(flags)} {cmd}"
    return cmd


def provenance() -> dict[str, str]:
    import torch

    return {
        "device_name": device_name(),
        "driver_version": driver_version(),
        "torch_version": torch.__version__,
        "git_commit": git_commit(),
        "timestamp": now(),
        "command": command(),
    }
