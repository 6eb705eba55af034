"""The record of a compute-sanitizer run of cpa.selfcheck (no GPU: the logs are the tools' own
lines, as the H100 run of 8f64c88 printed them)."""

from __future__ import annotations

import csv

import pytest

from cpa import provenance, selfcheck

CASES = "ok   mfma16  p256   fp16 kvauto  gqa8   shared     rel_err 2.69e-04\n22 passed, 0 failed\n"
MEMCHECK = "========= COMPUTE-SANITIZER\n" + CASES + "========= ERROR SUMMARY: 0 errors\n"
RACECHECK = CASES + "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"


def test_clean_runs():
    assert selfcheck.sanitizer_record("memcheck", 0, MEMCHECK) == dict(
        tool="memcheck", exit_code=0, cases_passed=22, cases_failed=0, sanitizer_errors=0,
        sanitizer_summary="ERROR SUMMARY: 0 errors")
    r = selfcheck.sanitizer_record("racecheck", 0, RACECHECK)
    assert (r["cases_passed"], r["sanitizer_errors"]) == (22, 0)
    assert r["sanitizer_summary"].startswith("RACECHECK SUMMARY: 0 hazards")


def test_errors_and_failed_cases_are_counted():
    log = CASES.replace("22 passed, 0 failed", "21 passed, 1 failed") + "========= ERROR SUMMARY: 3 errors\n"
    r = selfcheck.sanitizer_record("memcheck", 9, log)
    assert (r["exit_code"], r["cases_passed"], r["cases_failed"], r["sanitizer_errors"]) == (9, 21, 1, 3)


def test_a_crash_is_never_a_clean_run():
    r = selfcheck.sanitizer_record("memcheck", 124, "ok   mfma16 ...\nKilled\n")
    assert (r["cases_passed"], r["cases_failed"], r["sanitizer_errors"], r["sanitizer_summary"]) == (-1, -1, -1, "")


@pytest.fixture
def fresh_commit():
    """provenance.git_commit is cached per process: clear it around a test that sets CPA_GIT_COMMIT."""
    provenance.git_commit.cache_clear()
    yield
    provenance.git_commit.cache_clear()


def test_record_cli_appends_rows_with_provenance(tmp_path, monkeypatch, fresh_commit):
    monkeypatch.setenv("CPA_GIT_COMMIT", "a" * 40)
    monkeypatch.setenv("CPA_COMMAND", "compute-sanitizer --tool memcheck python3 -m cpa.selfcheck --small")
    (tmp_path / "m.log").write_text(MEMCHECK)
    (tmp_path / "r.log").write_text(RACECHECK)
    out = tmp_path / "sanitizer.csv"
    for tool, log in (("memcheck", "m.log"), ("racecheck", "r.log")):
        assert selfcheck.main(["--record-sanitizer", tool, "0", str(tmp_path / log), str(out)]) == 0
    rows = list(csv.DictReader(open(out)))
    assert [r["tool"] for r in rows] == ["memcheck", "racecheck"]
    assert all(r["git_commit"] == "a" * 40 and r["sanitizer_errors"] == "0" and r["device_name"] for r in rows)
    assert rows[0]["command"].startswith("compute-sanitizer --tool memcheck")
