"""scripts/h200.sh on a stand-in card (CPU): its sweep step names the files by the card it runs
on, so a run on an H100 neither resumes an H200 table nor appends to the H200 ceilings."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _run(tmp_path: Path, card: str, *extra_env: tuple[str, str]):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "calls.txt"
    _stub(bin_dir / "nvidia-smi", f'echo "{card}"')
    # python3 stands in for `cpa sweep`: it records its arguments and the CPA_COMMAND provenance
    _stub(bin_dir / "python3", f'echo "ARGS $*" >> {calls}; echo "COMMAND $CPA_COMMAND" >> {calls}')
    env = {k: v for k, v in os.environ.items() if not k.startswith("CPA_")}
    env.update({"PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"), "CPA_GIT_COMMIT": "0" * 40,
                **dict(extra_env)})
    r = subprocess.run(["bash", str(ROOT / "scripts" / "h200.sh"), "sweep:llama70b-decode"], env=env,
                       capture_output=True, text=True, timeout=60)
    return r, calls.read_text() if calls.exists() else ""


@pytest.mark.parametrize("card,tag", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200")])
def test_sweep_files_are_named_by_the_card(tmp_path, card, tag):
    r, calls = _run(tmp_path, card, ("CPA_ALLOW_OTHER_GPU", "1"), ("CPA_SWEEP_FRESH", "1"))
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out" / "sweeps"
    assert f"--out {out}/{tag}-llama70b-decode.parquet" in calls
    assert f"--ceilings-json {out}/{tag}-ceilings.json" in calls
    assert f"--out data/sweeps/{tag}-llama70b-decode.parquet" in calls  # the provenance names the same file
    other = "h200" if tag == "h100" else "h100"
    assert f"{other}-" not in calls
    if tag == "h100":  # the H200's ceilings are not copied in to be appended to
        assert not (out / "h200-ceilings.json").exists() and not (out / "h100-ceilings.json").exists()
    else:
        assert (out / "h200-ceilings.json").read_bytes() == (ROOT / "data/sweeps/h200-ceilings.json").read_bytes()


def test_sweep_on_another_card_needs_the_opt_in(tmp_path):
    r, calls = _run(tmp_path, "NVIDIA H100 80GB HBM3")
    assert r.returncode == 0 and calls == ""
    assert "skipped: 'NVIDIA H100 80GB HBM3' is not an H200" in r.stdout


@pytest.mark.parametrize("retry", ["", "1"])
def test_sweep_retries_failed_rows_on_request(tmp_path, retry):
    r, calls = _run(tmp_path, "NVIDIA H200", ("CPA_SWEEP_FRESH", "1"), ("CPA_SWEEP_RETRY", retry))
    assert r.returncode == 0, r.stderr
    args = [line for line in calls.splitlines() if line.startswith("ARGS ")]
    command = [line for line in calls.splitlines() if line.startswith("COMMAND ")]
    assert len(args) == len(command) == 1 and "--resume" in args[0]
    # the run and the provenance it records say the same
    assert ("--retry-errors" in args[0]) == ("--retry-errors" in command[0]) == bool(retry)


def test_a_commit_whose_code_is_not_the_tree_is_refused(tmp_path):
    """CPA_GIT_COMMIT naming a commit the copy's git knows, whose cpa/, scripts/ or tests/ differ
    from the tree (a stale `git rev-parse HEAD` on the device), stops the script before any step."""
    root = subprocess.run(["git", "rev-list", "--max-parents=0", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    first = root.stdout.split()[0] if root.returncode == 0 and root.stdout.strip() else ""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    if not first or first == head or subprocess.run(["git", "diff", "--quiet", first, "--", "cpa"], cwd=ROOT).returncode == 0:
        pytest.skip("no older commit with other code here (a shallow or exported tree)")
    r, calls = _run(tmp_path, "NVIDIA H200", ("CPA_GIT_COMMIT", first))
    assert r.returncode == 2 and "is not that of CPA_GIT_COMMIT" in r.stderr and calls == ""
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "cpa", "scripts", "tests"], cwd=ROOT).returncode
    if not dirty:  # the checkout's own commit passes
        r, calls = _run(tmp_path, "NVIDIA H200", ("CPA_GIT_COMMIT", head), ("CPA_SWEEP_FRESH", "1"))
        assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("sha", ["d6eadc3", "d6eadc36cfac9ef4f4ef9b31048249c73a66895", "D6EADC36CFAC9EF4F4EF9B31048249C73A668953",
                                 "g" + "0" * 39, "0" * 40 + "-dirty", "0" * 41])
def test_a_commit_that_is_not_a_full_sha_is_refused(tmp_path, sha):
    """A short, mistyped or decorated CPA_GIT_COMMIT stops the script before any step: it would be
    recorded as the measurements' commit as is (the copy's git does not know newer commits)."""
    r, calls = _run(tmp_path, "NVIDIA H200", ("CPA_GIT_COMMIT", sha))
    assert r.returncode == 2 and "not a full sha" in r.stderr and calls == ""
