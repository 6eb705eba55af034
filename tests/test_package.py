"""``import cpa``: exports, version, and that it stays light."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import cpa

ROOT = Path(__file__).resolve().parents[1]


def test_exports():
    for name in ("reference", "inputs", "validation", "make_paged_inputs", "__version__"):
        assert hasattr(cpa, name), name
    assert cpa.make_paged_inputs is cpa.inputs.make_paged_inputs
    assert callable(cpa.reference.paged_attention)
    assert callable(cpa.validation.validate_paged_attention_args)


def test_version_matches_pyproject():
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M)
    assert m and cpa.__version__ == m.group(1)


def test_import_is_light():
    code = (
        "import sys, cpa\n"
        "heavy = [m for m in ('plotly', 'ipywidgets', 'nbformat', 'nbclient', 'IPython', 'pandas', "
        "'typer', 'cpa.cli', 'torch.utils.cpp_extension') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "", f"import cpa pulled in: {res.stdout.strip()}"
