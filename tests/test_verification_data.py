"""The shipped GPU test records (data/verification/): provenance on every row, one card type per
file, and the README's table of runs is what the files hold."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest

from cpa.selfcheck import SANITIZER_FIELDS
from cpa.testing import summary

VERIFY = Path(__file__).resolve().parents[1] / "data" / "verification"
CARDS = {"h200.csv": "H200", "h100.csv": "H100"}
PROVENANCE = ("device_name", "driver_version", "torch_version", "git_commit", "timestamp", "command")


@pytest.mark.parametrize("name", sorted(CARDS))
def test_rows_carry_provenance_and_one_card(name):
    d = pd.read_csv(VERIFY / name, dtype=str)
    assert list(d.columns) == ["test", "outcome", "seconds", *PROVENANCE]
    assert not d[list(PROVENANCE)].isna().any().any()
    assert d["outcome"].isin(["passed", "skipped", "failed", "error"]).all()
    assert d["git_commit"].str.fullmatch(r"[0-9a-f]{40}").all()
    assert d["device_name"].str.contains(CARDS[name]).all(), f"{name} holds another card's runs"


def readme_runs() -> pd.DataFrame:
    rows = []
    for line in (VERIFY / "README.md").read_text().splitlines():
        m = re.match(r"\| (h\d00\.csv) \| ([0-9a-f]{7}) \| (\S+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|", line)
        if m:
            rows.append(dict(file=m[1], commit=m[2], date=m[3], tests=int(m[4]), passed=int(m[5]),
                             skipped=int(m[6]), failed=int(m[7])))
    return pd.DataFrame(rows)


def test_readme_table_is_the_files_runs():
    table = readme_runs()
    got = []
    for name in sorted(CARDS):
        s = summary(VERIFY / name)
        got += [dict(file=name, commit=r.git_commit[:7], date=r.timestamp[:10], tests=r.tests, passed=r.passed,
                     skipped=r.skipped, failed=r.failed) for r in s.itertuples()]
    want = pd.DataFrame(got)
    key = ["file", "commit"]
    assert table.sort_values(key).reset_index(drop=True).equals(want.sort_values(key).reset_index(drop=True)), (
        "data/verification/README.md's table differs from cpa.testing.summary of the files:\n"
        f"{want.to_string()}")


def test_summary_counts_a_failure(tmp_path):
    """summary() must count what is not a pass or a skip as failed (the table's last column can
    say so), and keep two runs of one commit apart by command."""
    prov = dict(device_name="NVIDIA H200", driver_version="1", torch_version="2", git_commit="a" * 40,
                timestamp="2026-01-01T00:00:00+00:00")
    rows = [dict(test="t1", outcome="passed", seconds=1, **prov, command="pytest A"),
            dict(test="t2", outcome="failed", seconds=1, **prov, command="pytest A"),
            dict(test="t1", outcome="passed", seconds=1, **prov, command="pytest B")]
    p = tmp_path / "v.csv"
    pd.DataFrame(rows).to_csv(p, index=False)
    s = summary(p)
    assert s[["tests", "passed", "skipped", "failed"]].values.tolist() == [[2, 1, 0, 1], [1, 1, 0, 0]]


SANITIZER_FILES = sorted(p.name for p in VERIFY.glob("*-sanitizer.csv"))


def test_a_sanitizer_record_ships():
    assert SANITIZER_FILES, f"no *-sanitizer.csv in {VERIFY}"


@pytest.mark.parametrize("name", SANITIZER_FILES)
def test_sanitizer_records(name):
    """<card>-sanitizer.csv (cpa.selfcheck --record-sanitizer, from `scripts/h200.sh sanitize`):
    one card per file, provenance on every row, and a zero exit code exactly where no case failed
    and the sanitizer counted nothing."""
    card = name.removesuffix("-sanitizer.csv")
    assert re.fullmatch(r"[a-z]+\d+", card), f"{name}: expected <card>-sanitizer.csv, e.g. h100-sanitizer.csv"
    d = pd.read_csv(VERIFY / name)
    assert len(d), f"{name} has no rows"
    assert list(d.columns) == [*SANITIZER_FIELDS, *PROVENANCE]
    assert not d[list(PROVENANCE)].isna().any().any()
    assert d["device_name"].str.contains(card.upper()).all()
    assert d["tool"].isin(["memcheck", "racecheck", "initcheck", "synccheck"]).all()
    clean = (d["cases_failed"] == 0) & (d["sanitizer_errors"] == 0) & (d["cases_passed"] > 0)
    assert ((d["exit_code"] == 0) == clean).all()
