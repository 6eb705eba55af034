"""Write data/kernel-sources.json: the git tree of cpa/csrc at every commit that measured a
shipped dataset (the git_commit of data/sweeps, data/counters and data/bench rows), so that
cpa.analysis can tell which measurements ran the same kernel. Needs the git history.

    python scripts/kernel_sources.py
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent


def dataset_commits() -> set[str]:
    commits = set()
    for p in [*ROOT.glob("data/sweeps/**/*.parquet"), *ROOT.glob("data/counters/**/*.parquet")]:
        commits |= set(pd.read_parquet(p, columns=["git_commit"]).git_commit.dropna())
    for p in ROOT.glob("data/bench/**/*.csv"):
        df = pd.read_csv(p)
        if "git_commit" in df:
            commits |= set(df.git_commit.dropna())
    return {c for c in commits if len(c) == 40}


def tree(commit: str) -> str | None:
    p = subprocess.run(["git", "rev-parse", f"{commit}:cpa/csrc"], cwd=ROOT, capture_output=True, text=True)
    return p.stdout.strip() if p.returncode == 0 else None


def main() -> None:
    trees = {c: t for c in sorted(dataset_commits()) if (t := tree(c))}
    out = ROOT / "data" / "kernel-sources.json"
    out.write_text(json.dumps({"cpa/csrc": trees}, indent=1, sort_keys=True) + "\n")
    print(f"{len(trees)} commits -> {len(set(trees.values()))} kernel source trees in {out}")


if __name__ == "__main__":
    main()
