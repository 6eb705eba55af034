"""pytest plugin (``pytest -p cpa.testing``): with CPA_VERIFY_CSV=path, write one row per
test (outcome, duration) plus provenance to that CSV when the session ends."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas

_rows: list[dict] = []


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _rows.append({"test": report.nodeid, "outcome": report.outcome, "seconds": round(report.duration, 3)})


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("CPA_VERIFY_CSV")
    if not path or not _rows:
        return
    from .provenance import provenance

    prov = provenance()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["test", "outcome", "seconds", *prov])
        w.writeheader()
        for r in _rows:
            w.writerow({**r, **prov})
    os.replace(tmp, path)


def summary(path) -> "pandas.DataFrame":
    """One row per recorded run of a verification CSV (a run = one git commit and command, in
    file order): device, first timestamp, tests recorded and their outcomes. What
    data/verification/README.md tabulates. (A module-level skip is not a test report, so it
    is not counted here; pytest's own summary line counts it.)"""
    import pandas as pd

    d = pd.read_csv(path)
    d["run"] = d["git_commit"].str[:7] + " " + d["command"]
    g = d.groupby("run", sort=False)
    out = g.agg(git_commit=("git_commit", "first"), device_name=("device_name", "first"),
                timestamp=("timestamp", "min"), tests=("test", "size"),
                passed=("outcome", lambda s: int((s == "passed").sum())),
                skipped=("outcome", lambda s: int((s == "skipped").sum())),
                failed=("outcome", lambda s: int((~s.isin(["passed", "skipped"])).sum())),
                command=("command", "first"))
    return out.reset_index(drop=True)
