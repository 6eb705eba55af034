"""pytest plugin (``pytest -p cpa.testing``): with CPA_VERIFY_CSV=path, write one row per
test (outcome, duration) plus provenance to that CSV when the session ends."""

from __future__ import annotations

import csv
import os
from pathlib import Path

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
