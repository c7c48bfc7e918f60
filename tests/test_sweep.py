"""`rana sweep` on a tiny random Llama folder: outputs, resuming, figures."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from helpers import tiny_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest

SMALL = ["--calib-tokens", "1024", "--seq-len", "64", "--eval-tokens", "1024", "--batch-size", "4"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from rana.data import BUNDLED_CORPUS

    root = tmp_path_factory.mktemp("sweep")
    tiny_model_dir(root / "tiny")
    text = BUNDLED_CORPUS.read_text()
    (root / "calib.txt").write_text(text[:12000])
    (root / "held_a.txt").write_text(text[-4000:])
    (root / "held_b.txt").write_text(text[-9000:-4000])
    return root


def _args(root, out, methods, flops="0.85", *extra):
    return ["sweep", str(root / "tiny"), "--methods", methods, "--flops", flops, "--dataset", str(root / "calib.txt"),
            "--ppl-data", str(root / "held_a.txt"), "--ppl-data", str(root / "held_b.txt"), "--out", str(out), *SMALL, *extra]


def test_sweep_writes_results_and_resumes(setup, tmp_path, monkeypatch):
    import rana.sweep.run
    from rana.cli.app import app

    out = tmp_path / "sw"
    res = CliRunner().invoke(app, _args(setup, out, "teal,cats"))
    assert res.exit_code == 0, res.output
    results = json.loads((out / "results.json").read_text())
    assert results["texts"] == ["held_a", "held_b"]
    assert [(p["method"], p["target_flops"]) for p in results["points"]] == [("dense", 1.0), ("teal", 0.85), ("cats", 0.85)]
    dense, teal, cats = results["points"]
    assert dense["flops"]["fraction"] == 1.0
    for p in (teal, cats):
        assert p["status"] == "ok" and 0.7 < p["flops"]["fraction"] < 0.95
        assert p["heldout_flops"] == pytest.approx(0.85, abs=0.01)
        assert set(p["ppl"]) == {"held_a", "held_b"} and all(r["ppl"] > 1 and r["windows"] == 16 for r in p["ppl"].values())
        assert len(p["layers"]) == 2 and p["layers"][0]["mlp_error"] > 0
        assert (out / p["plan_file"]).is_file()
    assert teal["layers"][0]["attention_error"] > 0 and cats["layers"][0]["attention_error"] is None
    assert {f.name for f in (out / "points").iterdir()} == {
        "dense.json", "teal_0.85.json", "teal_0.85.plan.json", "cats_0.85.json", "cats_0.85.plan.json"}
    md = (out / "results.md").read_text()
    assert "| teal | 0.85 |" in md and "ppl held_a" in md and "ppl held_b" in md
    for name in ("ppl_vs_flops.png", "layer_errors.png"):
        assert (out / name).stat().st_size > 1000
    assert results["figures_skipped"]["rank_contributions"]

    # second run: every point (dense included) is read back, nothing is compressed or evaluated
    calls = []
    monkeypatch.setattr(rana.sweep.run, "compress_model", lambda *a, **k: calls.append("compress"))
    monkeypatch.setattr(rana.sweep.run, "evaluate_model", lambda *a, **k: calls.append("evaluate"))
    mtimes = {p.name: p.stat().st_mtime_ns for p in (out / "points").iterdir()}
    res = CliRunner().invoke(app, _args(setup, out, "teal,cats"))
    assert res.exit_code == 0, res.output
    assert calls == [] and "skipped" in res.output
    assert {p.name: p.stat().st_mtime_ns for p in (out / "points").iterdir()} == mtimes
    assert json.loads((out / "results.json").read_text())["points"] == results["points"]


def test_sweep_changed_eval_settings_redo_points(setup, tmp_path):
    from rana.cli.app import app

    out = tmp_path / "sw"
    assert CliRunner().invoke(app, _args(setup, out, "dense")).exit_code == 0
    first = json.loads((out / "points" / "dense.json").read_text())
    args = _args(setup, out, "dense")
    args[args.index("--eval-tokens") + 1] = "2048"
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0 and "other settings" in res.output
    again = json.loads((out / "points" / "dense.json").read_text())
    assert first["ppl"]["held_b"]["windows"] == 16 and again["ppl"]["held_b"]["windows"] == 32


def test_sweep_rank_method_figures_and_infeasible_budget(setup, tmp_path):
    from rana.sweep import SweepConfig, run_sweep

    out = tmp_path / "sw"
    seen = []
    config = SweepConfig(model=str(setup / "tiny"), out=out, ppl_data=[str(setup / "held_a.txt")],
                         methods=["rana-paper", "cats"], flops=[0.8, 0.55], dense=False, dataset=str(setup / "calib.txt"),
                         calib_tokens=1024, seq_len=64, eval_tokens=1024, batch_size=4, figure_flops=0.8)
    results = run_sweep(config, progress=lambda what, done, total: seen.append(what))
    by = {(p["method"], p["target_flops"]): p for p in results["points"]}
    assert by[("cats", 0.55)]["status"] == "infeasible" and "use --flops ≥" in by[("cats", 0.55)]["error"]
    assert by[("rana-paper", 0.55)]["status"] == "ok"
    hist = by[("rana-paper", 0.8)]["rank_contributions"]
    assert any(k.endswith("mlp.up_proj") for k in hist) and all(h["tokens"] > 0 for h in hist.values())
    assert by[("cats", 0.8)]["rank_contributions"] is None
    assert (out / "rank_contributions.png").stat().st_size > 1000
    assert (out / "layer_errors.png").stat().st_size > 1000
    assert "infeasible" in (out / "results.md").read_text()
    assert {"points", "compress layers", "ppl held_a"} <= set(seen)


def test_layer_budget_plot_only_when_plans_vary(tmp_path):
    from rana.sweep import plots

    def point(fracs):
        return {"method": "rana", "target_flops": 0.7, "status": "ok",
                "layers": [{"layer": i, "attention_fraction": f, "mlp_fraction": f, "attention_error": 0.1,
                            "mlp_error": 0.2} for i, f in enumerate(fracs)]}

    assert not plots.layer_budget_varies([point([0.6, 0.6, 0.605])], 0.7)
    varied = [point([0.4, 0.6, 0.8])]
    assert plots.layer_budget_varies(varied, 0.7)
    path = plots.plot_layer_budget(varied, 0.7, tmp_path / "b.png")
    assert path.stat().st_size > 1000


def test_sweep_user_errors(setup, tmp_path):
    from rana.cli.app import app

    res = CliRunner().invoke(app, _args(setup, tmp_path / "o", "teal,bogus"))
    assert res.exit_code == 2 and "unknown method" in res.output
    res = CliRunner().invoke(app, _args(setup, tmp_path / "o", "teal", "0.8,x"))
    assert res.exit_code == 2 and "--flops" in res.output


def test_sweep_with_a_sparse_lm_head(setup, tmp_path):
    """--lm-head sparse reaches every point's compression (the head's inputs are metered: 'other' < 1)
    and is part of the settings a stored point is reused under; a bad value is one line."""
    from rana.cli.app import app

    out = tmp_path / "sw"
    res = CliRunner().invoke(app, _args(setup, out, "teal", "0.7", "--lm-head", "sparse", "--no-dense"))
    assert res.exit_code == 0, res.output
    point = json.loads((out / "points" / "teal_0.7.json").read_text())
    assert point["compress_settings"]["lm_head"] == "sparse"
    assert point["flops"]["by_part"]["other"]["fraction_of_part"] < 1.0
    assert point["flops"]["fraction"] == pytest.approx(0.7, abs=0.03)
    bad = CliRunner().invoke(app, _args(setup, tmp_path / "bad", "teal", "0.7", "--lm-head", "int8"))
    assert bad.exit_code != 0 and "unknown --lm-head 'int8'" in bad.output and "Traceback" not in bad.output
