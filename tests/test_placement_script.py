"""scripts/placement.py (which buffer's placement moves a short shape's time) on a stand-in
device: the rows it writes per trial and arm, what each arm re-allocates, the settle of the
first timing. The GPU run is the script itself (notes, "Open")."""

import importlib.util
import types
from pathlib import Path

import pandas as pd
import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "placement.py"


def _load():
    spec = importlib.util.spec_from_file_location("placement_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_placement_script_on_a_stand_in_device(monkeypatch, tmp_path):
    import cpa.bench as B
    import cpa.jit
    import cpa.ops
    import cpa.provenance
    import cpa.reference
    import cpa.timing

    mod = _load()
    made, spacers, warmups = [], [], []
    monkeypatch.setattr(cpa.jit, "require_gpu", lambda what: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: None)
    monkeypatch.setattr(cpa.provenance, "provenance", lambda: dict(device_name="stand-in", git_commit="0" * 40))
    monkeypatch.setattr(mod, "_spacer", lambda n: spacers.append(n) or (torch.empty(1) if n else None))

    def sets(b, ctx, **kw):
        made.append((b, ctx))
        q = torch.randn(b, 64, 128, generator=torch.Generator().manual_seed(kw["seed"]))  # (same seed, same values)
        return B.DeviceSets(torch.zeros(4), None, [q, q], [None, None], None, 0.1, 1)

    monkeypatch.setattr(B, "make_sets", sets)
    monkeypatch.setattr(cpa.reference, "paged_attention", lambda **kw: kw["query"])

    def prepare(query, **kw):
        assert kw["partition_size"] == 1024 and kw["fused_reduce"] is False and kw["cluster_reduce"] is False
        return types.SimpleNamespace(__call__=None, attention=lambda: None, tmp_out=torch.zeros(2),
                                     out=query)

    class Launch(types.SimpleNamespace):
        def __call__(self):
            return self.out

    monkeypatch.setattr(cpa.ops, "prepare", lambda **kw: Launch(**{k: v for k, v in vars(prepare(**kw)).items()
                                                                 if k != "__call__"}))

    def time_graph(calls, replays=30, warmup_us=None):
        warmups.append(warmup_us)
        return cpa.timing.Timing(20.0, 19.0, 21.0, replays)

    monkeypatch.setattr(cpa.timing, "time_graph", time_graph)
    out = tmp_path / "p.csv"
    assert mod.main(["--out", str(out), "--trials", "3", "--spacer-max", "4"]) == 0
    df = pd.read_csv(out)
    assert list(df.arm) == ["none", "partials", "pool"] * 3 and list(df.trial) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert (df[df.arm == "none"].spacer_mib == 0).all() and df.spacer_mib.between(0, 8).all()
    assert df.verified.all() and (df.time_us == 20.0).all() and (df.device_name == "stand-in").all()
    assert len(made) == 1 + 3  # the first sets, then new ones for each pool trial
    assert len(spacers) == 9 and spacers[0] == 0  # (the none arm's spacer is empty)
    assert warmups[0] == cpa.timing.SETTLE_US and warmups[1:] == [None] * 17


def test_placement_script_refuses_bad_options():
    mod = _load()
    with pytest.raises(SystemExit):
        mod.main(["--out", "x.csv", "--arms", "none,elsewhere"])
    with pytest.raises(SystemExit):
        mod.main(["--out", "x.csv", "--trials", "0"])
