"""scripts/sysdeps.sh (run by `make test`, `make report` and CI) on stand-in system tools: it
installs the missing compiler packages where it can, says what to install where it cannot, and
fails only when an install it tried fails."""

from __future__ import annotations

import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKGS = ("clang-19", "lld-19", "libamdhip64-dev")


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _run(tmp_path: Path, *, installed=PKGS, uid=0, sudo=None, apt=True, apt_rc=0):
    """The script with PATH = stand-ins only (plus grep): dpkg-query knows `installed`, id -u
    says `uid`, sudo (None: absent) lets `-n true` pass or not, apt-get logs its calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.txt"
    (bin_dir / "grep").symlink_to(shutil.which("grep"))
    ok = " ".join(installed)
    _stub(bin_dir / "dpkg-query", f'for p in {ok}; do [ "$3" = "$p" ] && echo "install ok installed" && exit 0; done; exit 1')
    _stub(bin_dir / "id", f"echo {uid}")
    if sudo is not None:
        _stub(bin_dir / "sudo", f'[ "$2" = true ] && exit {0 if sudo else 1}; echo "sudo $*" >> {log}; shift; exec "$@"')
    if apt:
        _stub(bin_dir / "apt-get", f'echo "apt-get $*" >> {log}; exit {apt_rc}')
    r = subprocess.run(["/bin/bash", str(ROOT / "scripts" / "sysdeps.sh")], env={"PATH": str(bin_dir)},
                       capture_output=True, text=True, timeout=60)
    return r, log.read_text().splitlines() if log.exists() else []


def test_nothing_to_do_when_installed(tmp_path):
    r, calls = _run(tmp_path)
    assert r.returncode == 0 and "already installed" in r.stdout and calls == []


def test_root_installs_only_the_missing_packages(tmp_path):
    r, calls = _run(tmp_path, installed=("lld-19",))
    assert r.returncode == 0, r.stderr
    assert calls == ["apt-get update -qq",
                     "apt-get install -y -qq --no-install-recommends clang-19 libamdhip64-dev"]


def test_password_less_sudo_installs(tmp_path):
    r, calls = _run(tmp_path, installed=(), uid=1000, sudo=True)
    assert r.returncode == 0, r.stderr
    install = "apt-get install -y -qq --no-install-recommends " + " ".join(PKGS)
    # each apt-get through sudo -n (the stand-in sudo logs, then runs it)
    assert calls == ["sudo -n apt-get update -qq", "apt-get update -qq", f"sudo -n {install}", install]


@pytest.mark.parametrize("case", ["no-sudo", "sudo-asks-a-password", "no-apt"])
def test_says_what_to_install_where_it_cannot(tmp_path, case):
    kw = {"no-sudo": dict(uid=1000), "sudo-asks-a-password": dict(uid=1000, sudo=False),
          "no-apt": dict(apt=False)}[case]
    r, calls = _run(tmp_path, installed=("lld-19",), **kw)
    assert r.returncode == 0 and calls == []
    assert "not installed: clang-19 libamdhip64-dev" in r.stderr


def test_a_failed_install_is_an_error(tmp_path):
    r, _ = _run(tmp_path, installed=(), apt_rc=100)
    assert r.returncode != 0


def test_make_test_and_report_run_it():
    dry = {t: subprocess.run(["make", "-n", t], cwd=ROOT, capture_output=True, text=True).stdout for t in ("test", "report")}
    assert all("scripts/sysdeps.sh" in out for out in dry.values()), dry
    assert (ROOT / ".ci" / "run").read_text().strip().endswith("make test")
