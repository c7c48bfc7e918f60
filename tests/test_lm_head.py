"""`rana compress --lm-head`: the budget each part keeps (said before compressing, warned when harsh),
and the LM head as input sparsity — on budget measured on held-out tokens, tied embeddings kept tied
and stored once, the same logits after save / load / export, dense logits when it keeps everything."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn
from safetensors import safe_open
from transformers import LlamaConfig
from typer.testing import CliRunner

import rana.io as rio
from helpers import tiny_calibration, tiny_compress_config, tiny_model
from rana.accounting import dense_macs, measured_macs, metering
from rana.cli.app import app
from rana.compress import BudgetError, budget_for, compress_model
from rana.compress.lm_head import HARSH_FRACTION, LARGE_HEAD_SHARE, harsh_budget_warning
from rana.methods import get_method
from rana.modules import InputSparseHead

pytestmark = pytest.mark.usefixtures("one_thread")

SEQ = 32
SMALL = ["--calib-tokens", "1024", "--seq-len", "64", "--batch-size", "4"]


def _config(vocab: int) -> LlamaConfig:
    return LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256)


def _held_out(vocab: int, n: int = 16) -> torch.Tensor:
    """Tokens neither the thresholds nor the held-aside slice saw."""
    return torch.randint(0, vocab, (n, SEQ), generator=torch.Generator().manual_seed(123))


def _measure(model: nn.Module, ids: torch.Tensor) -> dict:
    with metering(model), torch.no_grad():
        model(ids)
    return measured_macs(model, SEQ)


# ---------------------------------------------------------------------------- the budget report


@pytest.mark.parametrize("lm_head", ["dense", "sparse"])
def test_budget_report_is_the_compressor_accounting(lm_head):
    """The reported fractions are the ones the model-level accounting adds up to F."""
    cfg, method = _config(1024), get_method("rana")
    f, info = budget_for(cfg, method, 0.7, SEQ, lm_head)
    dense = dense_macs(cfg, SEQ)
    layers = dense["total"] - dense["lm_head"]
    head_kept = info["lm_head_fraction"] * dense["lm_head"]
    assert info["projections_fraction"] == f
    assert info["layers_fraction"] * layers + head_kept == pytest.approx(0.7 * dense["total"], rel=1e-12)
    assert info["lm_head_share"] == pytest.approx(dense["lm_head"] / dense["total"])
    assert info["lm_head_fraction"] == (f if lm_head == "sparse" else 1.0)
    assert info["harsh"] == (f < HARSH_FRACTION)


@pytest.mark.parametrize("lm_head", ["dense", "auto"])
def test_layers_fraction_matches_measured_layers(lm_head):
    """What the report says the layers keep is what their masks then take on held-out tokens
    (`auto`: the default method adapts the head, so the layers keep more)."""
    model = tiny_model("llama", vocab_size=1024)
    got = []
    compress_model(model, None, tiny_compress_config(flops=0.7, lm_head=lm_head), tiny_calibration(vocab=1024),
                   on_budget=got.append)
    parts = _measure(model, _held_out(1024))["by_part"]
    layers = (parts["attention"]["measured_macs"] + parts["mlp"]["measured_macs"]) / \
        (parts["attention"]["dense_macs"] + parts["mlp"]["dense_macs"])
    assert layers == pytest.approx(got[0]["layers_fraction"], abs=0.01)
    assert got[0]["lm_head"] == ("sparse" if lm_head == "auto" else "dense")
    head_kept = parts["other"]["fraction_of_part"]  # "other" is the head alone on this model
    assert head_kept == 1.0 if lm_head == "dense" else head_kept == pytest.approx(got[0]["lm_head_fraction"], abs=0.05)


@pytest.mark.parametrize("method, resolved", [("rana", "sparse"), ("rana-contrib", "sparse"), ("teal", "dense"),
                                              ("wina", "dense"), ("rana-paper", "dense"), ("rana-dense-head", "dense")])
def test_auto_is_the_method_choice_and_an_explicit_mode_wins(method, resolved):
    config = tiny_compress_config(method=method)
    assert config.lm_head == "auto" and config.resolved().lm_head == resolved
    for explicit in ("dense", "sparse"):
        assert tiny_compress_config(method=method, lm_head=explicit).resolved().lm_head == explicit


def test_harsh_warning_fires_when_the_head_dominates():
    method = get_method("rana")
    # vocab 2048 × hidden 64: the head is ~60 % of the MACs; at F = 0.7 the projections keep ~25 %
    _, big = budget_for(_config(2048), method, 0.7, SEQ)
    assert big["lm_head_share"] > 0.5 and big["projections_fraction"] < 0.3
    warning = harsh_budget_warning(big)
    assert warning is not None and "--lm-head sparse" in warning and "\n" not in warning
    # the same model with the head adapted: F applies to every adapted MAC, nothing harsh
    _, shared = budget_for(_config(2048), method, 0.7, SEQ, "sparse")
    assert shared["projections_fraction"] == pytest.approx(0.7, abs=0.02) and harsh_budget_warning(shared) is None
    # a small head: no warning at a moderate budget; at a harsh one a warning without the head hint
    _, small = budget_for(_config(128), method, 0.7, SEQ)
    assert small["lm_head_share"] < LARGE_HEAD_SHARE and harsh_budget_warning(small) is None
    _, tight = budget_for(_config(128), method, 0.4, SEQ)
    assert tight["harsh"] and "--lm-head" not in harsh_budget_warning(tight)


def test_infeasible_budget_still_fails_clearly():
    with pytest.raises(BudgetError, match="use --flops ≥"):
        budget_for(_config(4096), get_method("rana"), 0.5, SEQ)  # the dense head alone costs ~0.75
    f, _ = budget_for(_config(4096), get_method("rana"), 0.5, SEQ, "sparse")  # reachable with the head adapted
    assert 0 < f < 1


# ---------------------------------------------------------------------------- the sparse head


@pytest.fixture(scope="module")
def tied_sparse(tmp_path_factory):
    """A tiny tied-embeddings llama (head ~75 % of the MACs) compressed with --lm-head sparse, saved."""
    model = tiny_model("llama", vocab_size=4096, tie_word_embeddings=True)
    embedding = model.get_input_embeddings().weight.detach().clone()
    cfg = tiny_compress_config(flops=0.6, lm_head="sparse")
    result = compress_model(model, None, cfg, tiny_calibration(vocab=4096))
    folder = tmp_path_factory.mktemp("head") / "tied_sparse"
    rio.save(model, None, folder, plan=result.plan, extra={"compress_config": cfg.to_dict()})
    return model, result.plan, embedding, folder


def test_sparse_head_hits_the_budget_on_held_out_tokens(tied_sparse):
    model, plan, _, _ = tied_sparse
    assert isinstance(model.lm_head, InputSparseHead)
    measured = _measure(model, _held_out(4096))
    assert measured["fraction"] == pytest.approx(0.6, abs=0.01)
    head = measured["modules"]["lm_head"]  # the head's own masks are counted, not its dense cost
    assert head["measured_macs"] == pytest.approx(model.lm_head.out_features * head["mean_active"])
    assert measured["by_part"]["other"]["fraction_of_part"] == pytest.approx(plan["adapted_fraction"], abs=0.03)
    assert plan["lm_head"]["tied"] and plan["lm_head"]["measured_active"] > 0
    assert plan["budget"]["lm_head"] == "sparse" and plan["config"]["lm_head"] == "sparse"


def test_tied_embedding_stays_intact_and_is_stored_once(tied_sparse):
    model, _, embedding, folder = tied_sparse
    emb = model.get_input_embeddings()
    assert model.lm_head.weight is emb.weight  # one Parameter
    ids = _held_out(4096, 2)
    assert torch.equal(emb(ids), nn.functional.embedding(ids, embedding))  # the lookup is unchanged
    with safe_open(str(folder / rio.WEIGHTS), framework="pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    spec = next(a for a in json.loads((folder / rio.RANA_CONFIG).read_text())["adapters"] if a["path"] == "lm_head")
    assert spec["type"] == "input_sparse_head" and spec["tied"] is True


def test_save_load_and_export_give_the_same_logits(tied_sparse, tmp_path):
    from rana.export import export
    from test_export import assert_close, run_isolated

    model, _, _, folder = tied_sparse
    prompt = _held_out(4096, 1)[:, :12]
    with torch.no_grad():
        ref = model(prompt).logits
        ref_decode = model(prompt[:, :1]).logits  # one token: the masked-GEMV path
    loaded, _ = rio.load(folder)
    assert isinstance(loaded.lm_head, InputSparseHead) and loaded.lm_head.weight is loaded.get_input_embeddings().weight
    with torch.no_grad():
        assert torch.equal(loaded(prompt).logits, ref)
        assert_close(loaded(prompt[:, :1]).logits, ref_decode)
    out = tmp_path / "tied_sparse_export"
    export(folder, out)
    r = run_isolated({"head": out}, tmp_path, prompt=prompt, resave=True)["head"]
    assert r["missing"] == [] and r["unexpected"] == [] and r["tied"]
    assert "InputSparseHead" in r["adapters"]
    assert_close(r["logits"], ref)
    assert_close(r["logits_resaved"], ref)


def test_untied_head_roundtrips_with_its_own_weight(tmp_path):
    model = tiny_model("qwen2", vocab_size=1024, tie_word_embeddings=False)
    compress_model(model, None, tiny_compress_config(flops=0.7, lm_head="sparse"), tiny_calibration(vocab=1024))
    assert model.lm_head.weight is not model.get_input_embeddings().weight
    assert model.lm_head.weight.t().is_contiguous()  # its own weight in the masked GEMV's layout
    rio.save(model, None, tmp_path / "untied")
    with safe_open(str(tmp_path / "untied" / rio.WEIGHTS), framework="pt") as f:
        assert "lm_head.weight" in set(f.keys())
    loaded, _ = rio.load(tmp_path / "untied")
    assert loaded.lm_head.weight.t().is_contiguous()
    prompt = _held_out(1024, 1)[:, :10]
    with torch.no_grad():
        assert torch.equal(loaded(prompt).logits, model(prompt).logits)
        one, want = loaded(prompt[:, :1]).logits, model(prompt[:, :1]).logits  # the masked-GEMV path: its own order
    assert torch.allclose(one, want, rtol=0, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("threshold", [0.0, -math.inf])
def test_keeping_everything_gives_the_dense_logits(dtype, threshold):
    """Exactly the dense head's logits, prefill and one decode token (a tied head keeps the
    embedding's layout and takes the masked dense product)."""
    model = tiny_model("llama", vocab_size=512, tie_word_embeddings=True).to(dtype)
    prompt = _held_out(512, 2)[:, :9]
    with torch.no_grad():
        original, original_one = model(prompt).logits, model(prompt[:1, :1]).logits
        dense_head = model.lm_head
        sparse_head = InputSparseHead(dense_head.weight, dense_head.bias, threshold)
        assert dense_head.weight is sparse_head.weight is model.get_input_embeddings().weight
        dense = model(prompt).logits
        model.lm_head = sparse_head
        assert torch.equal(dense, original)
        assert torch.equal(model(prompt).logits, original)
        assert torch.equal(model(prompt[:1, :1]).logits, original_one)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_path_matches_the_masked_product(dtype):
    """One token goes through the masked-GEMV ops; it equals W (m ⊙ x) in every dtype."""
    torch.manual_seed(0)
    head = InputSparseHead(torch.randn(300, 48, dtype=dtype), None, 0.7).eval()
    x = torch.randn(1, 1, 48, dtype=dtype)
    with torch.no_grad():
        got = head(x)
        want = nn.functional.linear(x * (x.abs() >= 0.7), head.weight)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype and torch.allclose(got.float(), want.float(), atol=tol * want.abs().max().item())


# ---------------------------------------------------------------------------- the command line


def test_cli_says_the_budget_and_warns(model_dir, calib_file, tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["compress", str(model_dir), "--flops", "0.55", "--lm-head", "dense",
                              "--out", str(tmp_path / "harsh"), "--dataset", str(calib_file), *SMALL])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "the adapted projections keep" in text and "stays dense" in text
    assert text.count("warning:") == 1 and "--lm-head sparse" in text
    plan = json.loads((tmp_path / "harsh" / "plan.json").read_text())
    assert plan["budget"]["harsh"] and plan["budget"]["projections_fraction"] == plan["adapted_fraction"]
    # the default method under the default `--lm-head auto` adapts the head; the folder records "sparse"
    res = runner.invoke(app, ["compress", str(model_dir), "--flops", "0.55",
                              "--out", str(tmp_path / "shared"), "--dataset", str(calib_file), *SMALL])
    assert res.exit_code == 0, res.output
    assert "warning:" not in res.output and "keeps" in res.output and "LM head: input sparsity" in res.output
    plan = json.loads((tmp_path / "shared" / "plan.json").read_text())
    assert plan["lm_head"]["kind"] == "input_sparse" and abs(plan["measured_flops"] - 0.55) < 0.02
    assert plan["config"]["lm_head"] == "sparse"
    recipe = json.loads((tmp_path / "shared" / "recipe.json").read_text())
    assert recipe["config"]["lm_head"] == "sparse" and "--lm-head sparse" in recipe["equivalent_command"]
    stored = json.loads((tmp_path / "shared" / "rana_config.json").read_text())
    assert stored["compress_config"]["lm_head"] == "sparse"


def test_cli_rejects_an_unknown_head_mode(model_dir, tmp_path):
    res = CliRunner().invoke(app, ["compress", str(model_dir), "--lm-head", "quantized", "--out", str(tmp_path / "o")])
    assert res.exit_code not in (0, None)
    assert "Traceback" not in res.output and not (tmp_path / "o").exists()
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--lm-head" in res.output and "dense or sparse" in res.output
