"""int8 weights (issue 28, model half): the quantization math, Int8Linear, `quantize_model` with the
threshold refit, `rana quantize` / `rana compress --weights int8`, reload and both export formats."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from typer.testing import CliRunner

import rana
import rana.io as rio
from helpers import exported_logits, tiny_calibration, tiny_compress_config, tiny_model, tiny_model_dir
from rana.cli.app import app
from rana.compress import CompressConfig, compress_model
from rana.export import export
from rana.kernels.torch_gemv import masked_gemv_int8_dense, masked_gemv_int8_torch
from rana.math.quantize import dequantize_int8, quantize_int8, relative_output_error, row_errors
from rana.modules.int8 import Int8Linear
from rana.modules.neuron_linear import Int8InputSparseHead
from rana.quantize import QuantizeError, quantize_model

pytestmark = pytest.mark.usefixtures("one_thread")
runner = CliRunner()
PROMPT = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(4))


# ------------------------------------------------------------------------------------------ the math
def _activations(n=512, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * torch.logspace(-1, 1, d)  # channels of very different scales


def test_representable_weights_round_trip_exactly():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (24, 40), generator=g, dtype=torch.int16).to(torch.int8)
    q[:, 0] = 127  # every row reaches the grid's end: max-abs gives the exact scale
    scale = 2.0 ** torch.randint(-12, -2, (24,), generator=g).float()
    w = dequantize_int8(q, scale)
    x = _activations(d=40)
    for h in (None, x.t() @ x):
        q2, s2 = quantize_int8(w, h)
        assert q2.dtype == torch.int8 and s2.dtype == torch.float32
        assert torch.equal(q2, q) and torch.equal(s2, scale)
        assert torch.equal(dequantize_int8(q2, s2), w)


def test_hessian_scales_never_worse_than_max_abs_on_the_calibration_data():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 64, generator=g)
    w[torch.rand(w.shape, generator=g) < 0.01] *= 12  # outliers: clipping pays
    x = _activations()
    h = x.t() @ x
    q_h, s_h = quantize_int8(w, h)
    q_m, s_m = quantize_int8(w)
    out = lambda q, s: x.double() @ dequantize_int8(q, s).double().t()  # noqa: E731
    ref = x.double() @ w.double().t()
    err_h = ((out(q_h, s_h) - ref) ** 2).sum(0)  # per output channel, on the calibration inputs
    err_m = ((out(q_m, s_m) - ref) ** 2).sum(0)
    assert (err_h <= err_m * (1 + 1e-4) + 1e-9).all()
    assert err_h.sum() < 0.95 * err_m.sum()  # and clipping helps here
    assert (s_h <= s_m * (1 + 1e-6)).all()  # clip ratios ≤ 1
    # the per-row error the quantizer minimises is that output error
    torch.testing.assert_close(row_errors(w, q_h, s_h, h).double(), err_h, rtol=1e-3, atol=1e-3)
    rel = relative_output_error(w, q_h, s_h, h)
    assert 0 < rel < 1e-3 and rel == pytest.approx(float(err_h.sum() / (ref ** 2).sum()), rel=1e-3)


def test_max_abs_error_and_chunking():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(100, 33, generator=g)
    w[7] = 0  # an all-zero row stays exact
    q, s = quantize_int8(w)
    assert torch.equal(s, torch.where(w.abs().amax(1) > 0, w.abs().amax(1) / 127, torch.ones(100)))
    err = (dequantize_int8(q, s) - w).abs()
    assert (err <= s[:, None] / 2 + 1e-7).all() and err[7].max() == 0
    x = _activations(d=33)
    h = x.t() @ x
    for hess in (None, h):
        a, b = quantize_int8(w, hess), quantize_int8(w, hess, chunk_elements=33 * 7)  # 7 rows per chunk
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ------------------------------------------------------------------------------------------ Int8Linear
def _int8_linear(bias=True, out_f=24, in_f=40, seed=3):
    g = torch.Generator().manual_seed(seed)
    layer = nn.Linear(in_f, out_f, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_f, in_f, generator=g))
        if bias:
            layer.bias.copy_(torch.randn(out_f, generator=g))
    q, s = quantize_int8(layer.weight)
    return Int8Linear.from_quantized(q, s, layer.bias, torch.float32), q, s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_linear_matches_the_dequantized_linear(dtype):
    m, q, s = _int8_linear()
    m = m.to(dtype)
    assert m.qweight.dtype == torch.int8 and m.weight_scale.dtype == torch.float32  # kept through .to(dtype)
    assert m.qweight.shape == (40, 24) and m.qweight.is_contiguous()  # in × out row-major: the kernels' layout
    assert m.weight.shape == (24, 40) and m.weight.dtype == dtype and m.bias.dtype == dtype
    torch.testing.assert_close(m.weight.float(), dequantize_int8(q, s).to(dtype).float())
    x = torch.randn(3, 5, 40).to(dtype)
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}[dtype]
    with torch.no_grad():
        want = F.linear(x.float(), dequantize_int8(q, s), m.bias.float())
        torch.testing.assert_close(m(x).float(), want, rtol=tol, atol=tol * 4)
        one = x[:1, :1]  # one decode token: the int8 masked-GEMV entry point (mode "none")
        assert m(one).shape == (1, 1, 24) and m(one).dtype == dtype
        torch.testing.assert_close(m(one).float(), m(x)[:1, :1].float(), rtol=tol, atol=tol * 4)


@pytest.mark.parametrize("fn", [masked_gemv_int8_torch, masked_gemv_int8_dense])
@pytest.mark.parametrize("mode", ["none", "square", "abs_scaled", "abs"])
def test_masked_int8_gemv_matches_a_float64_reference(fn, mode):
    # one token through the CPU one-token path (native kernel, else the gathered rows) and through the
    # dense dequantized path; the reference is written out here, not taken from the kernels
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-127, 128, (40, 24), generator=g, dtype=torch.int16).to(torch.int8)
    qscale, bias, scale = torch.rand(24, generator=g), torch.randn(24, generator=g), torch.rand(40, generator=g)
    v = torch.randn(1, 40, generator=g)
    t = torch.tensor(0.5)
    score = {"none": None, "square": v * v, "abs_scaled": v.abs() * scale, "abs": v.abs()}[mode]
    keep = torch.ones_like(v) if score is None else (score >= t).float()
    assert 0 < keep.sum() < keep.numel() or mode == "none"  # a partial mask: the comparison is exercised
    want = ((v * keep).double() @ q.double()) * qscale.double() + bias.double()
    got = fn(q, qscale, v, t, mode=mode, scale=scale, bias=bias)
    assert got.shape == (1, 24) and got.dtype == v.dtype  # v's leading dims and dtype
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)  # fp32 accumulation
    for threshold in (torch.tensor(-float("inf")), torch.tensor(float("inf"))):  # full and empty masks
        if mode == "none":
            continue
        keep = torch.full_like(v, float(threshold < 0))
        want = ((v * keep).double() @ q.double()) * qscale.double() + bias.double()
        torch.testing.assert_close(fn(q, qscale, v, threshold, mode=mode, scale=scale, bias=bias).double(), want,
                                   rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------ models
def _compressed(method="rana", arch="llama", compress_kw=None, **model_kw):
    vocab = model_kw.get("vocab_size", 128)
    model = tiny_model(arch, **model_kw)
    config = tiny_compress_config(method=method, flops=0.7, **(compress_kw or {}))
    calibration = tiny_calibration(vocab=vocab)
    result = compress_model(model, None, config, calibration)
    return result, config, calibration


@pytest.mark.parametrize("method,kw,model_kw", [
    ("rana", {"lm_head": "sparse"}, {"vocab_size": 1024, "tie_word_embeddings": True}),
    ("rana-paper", {}, {}),  # rank adapters, a shared q/k/v code, neuron-thresholded down
    ("cats", {}, {}),
], ids=["rana-sparse-tied-head", "rana-paper", "cats"])
def test_quantize_model_refits_thresholds_and_reloads(tmp_path, method, kw, model_kw):
    result, config, calibration = _compressed(method, compress_kw=kw, **model_kw)
    model = result.model.eval()
    vocab = model_kw.get("vocab_size", 128)
    prompt = PROMPT % vocab
    with torch.no_grad():
        dense_logits = model(prompt).logits
    report = quantize_model(model, calibration.fit, batch_size=4)
    assert all(type(m) is not nn.Linear for n, m in model.named_modules() if n.startswith("model.layers."))
    assert type(model.lm_head) in (Int8Linear, Int8InputSparseHead)
    errors = [m["relative_error"] for m in report["modules"]]
    assert 0 < max(errors) < 1e-3
    refit = report["refit"]
    assert refit and all(abs(r["fraction_after"] - r["fraction_before"]) < 0.01 for r in refit.values()), refit
    assert report["untied_head"] == bool(model_kw.get("tie_word_embeddings"))
    if report["untied_head"]:
        assert model.get_input_embeddings().weight.dtype == torch.float32 and not model.config.tie_word_embeddings
    with torch.no_grad():
        logits = model(prompt).logits
        assert float((logits - dense_logits).norm() / dense_logits.norm()) < 0.2
        # one decode token (the int8 masked paths) vs the same token through the multi-token path
        one = model(prompt[:1, :1]).logits
        model.train()
        torch.testing.assert_close(one, model(prompt[:1, :1]).logits, rtol=1e-4, atol=1e-4)
        model.eval()
    folder = rio.save(model, None, tmp_path / "q", plan={**result.plan, "weights": "int8", "quantization": report})
    meta = rio.read_meta(folder)
    assert meta["weights"] == "int8" and len(meta["int8"]["modules"]) == len(errors)
    assert rio.read_plan(folder)["quantization"]["file_bytes"] > 0
    loaded, _ = rana.load(folder)
    with torch.no_grad():
        torch.testing.assert_close(loaded(prompt).logits, logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loaded(prompt[:1, :1]).logits, one, rtol=1e-5, atol=1e-5)


def test_compress_weights_int8_option(tmp_path):
    result, config, _ = _compressed("teal", compress_kw={"weights": "int8"})
    assert result.plan["weights"] == "int8" and result.plan["quantization"]["refit"]
    folder = rio.save(result.model, None, tmp_path / "c", plan=result.plan,
                      extra={"method": "teal", "compress_config": config.to_dict()})
    assert rio.read_meta(folder)["compress_config"]["weights"] == "int8"
    loaded, _ = rana.load(folder)
    with torch.no_grad():
        torch.testing.assert_close(loaded(PROMPT).logits, result.model.eval()(PROMPT).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="--weights"):
        CompressConfig(model="tiny", weights="int4").validate()


def test_mixture_of_experts_is_refused():
    model = tiny_model("mixtral")
    with pytest.raises(QuantizeError, match="mixtures of experts") as e:
        quantize_model(model)
    assert "\n" not in str(e.value)
    with pytest.raises(QuantizeError, match="mixtures of experts"):
        compress_model(model, None, tiny_compress_config(weights="int8"), tiny_calibration())


# ------------------------------------------------------------------------------------------ commands
@pytest.fixture(scope="module")
def int8_folders(tmp_path_factory, calib_file):
    """(compressed folder, `rana quantize` output) of a tiny llama with a byte tokenizer, vocab 257."""
    tmp = tmp_path_factory.mktemp("int8")
    src = tiny_model_dir(tmp / "dense")
    comp, quant = tmp / "comp", tmp / "quant"
    small = ["--calib-tokens", "1024", "--seq-len", "64", "--batch-size", "4"]
    res = runner.invoke(app, ["compress", str(src), "--out", str(comp), "--dataset", str(calib_file), "--lm-head",
                              "sparse", *small])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["quantize", str(comp), "--weights", "int8", "--out", str(quant), "--dataset",
                              str(calib_file), "--calib-tokens", "1024", "--seq-len", "64"])
    assert res.exit_code == 0, res.output
    assert "int8 modules" in res.output
    return comp, quant


def test_rana_quantize_writes_an_int8_folder(int8_folders):
    comp, quant = int8_folders
    meta, plan = rio.read_meta(quant), rio.read_plan(quant)
    assert meta["weights"] == "int8" and meta["int8"]["modules"]
    assert [a["path"] for a in meta["adapters"]] == [a["path"] for a in rio.read_meta(comp)["adapters"]]
    assert plan["weights"] == "int8" and plan["quantization"]["calibration_tokens"] == 1024
    refit = plan["quantization"]["refit"]
    assert refit and all(abs(r["fraction_after"] - r["fraction_before"]) < 0.01 for r in refit.values())
    size = lambda d: sum(f.stat().st_size for f in d.glob("*.safetensors"))  # noqa: E731
    assert plan["quantization"]["file_bytes"] == size(quant) < 0.5 * size(comp)
    from safetensors import safe_open
    with safe_open(str(quant / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert {v for k, v in dtypes.items() if k.endswith("qweight")} == {"I8"}
    assert {v for k, v in dtypes.items() if k.endswith("weight_scale")} == {"F32"}
    # fine-tuning an int8 folder: LoRA on the frozen int8 base is accepted (tests/test_finetune_int8.py), --full
    # (training the codes themselves) is refused in one line
    from rana.finetune import FinetuneConfig, FinetuneError
    from rana.finetune.source import inspect_source
    assert inspect_source(FinetuneConfig(source=str(quant))).meta["weights"] == "int8"
    with pytest.raises(FinetuneError, match="int8 weights: --full") as e:
        inspect_source(FinetuneConfig(source=str(quant), full=True))
    assert "\n" not in str(e.value)


def test_int8_folder_reloads_identically_in_a_fresh_process(int8_folders, tmp_path):
    _, quant = int8_folders
    ids = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(6))
    model, _ = rana.load(quant)
    with torch.no_grad():
        want = model(ids).logits
    script = ("import sys, json, torch, rana; m, _ = rana.load(sys.argv[1]); ids = torch.tensor(json.loads(sys.argv[2]))\n"
              "with torch.no_grad(): print(json.dumps(m(ids).logits.tolist()))")
    proc = subprocess.run([sys.executable, "-c", script, str(quant), json.dumps(ids.tolist())], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    torch.testing.assert_close(torch.tensor(json.loads(proc.stdout.strip().splitlines()[-1])), want, rtol=1e-5,
                               atol=1e-5)
    # both export formats: the quantizer (stock class) in process, the remote code in a bare process
    for fmt in ("quantizer", "remote-code"):
        out = tmp_path / f"exp_{fmt.replace('-', '_')}"
        export(quant, out, format=fmt)
        if fmt == "quantizer":
            from transformers import AutoModelForCausalLM
            m = AutoModelForCausalLM.from_pretrained(out)
            assert any(type(x).__name__ == "Int8Linear" for x in m.modules())
            with torch.no_grad():
                got = m(ids).logits
        else:
            got = exported_logits(out, ids, tmp_path, "assert any(type(x).__name__ == 'Int8Linear' for x in m.modules())")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the peak resident memory from /proc")
def test_an_int8_folder_loads_without_a_float_copy_of_its_weights(tmp_path):
    # rana.load builds the model on the meta device and assigns the folder's tensors: loading an int8 folder takes
    # about its size in memory. Built as a float model first, its linear weights alone would take 4 bytes each.
    folders = []
    for size in ({}, dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=8, num_key_value_heads=8)):
        model = tiny_model("llama", num_hidden_layers=2, **size)
        float_bytes = 4 * sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
        quantize_model(model, None, activations="int8")
        folders.append(str(rio.save(model, None, tmp_path / f"w8a8_{len(folders)}", plan={"weights": "int8"})))
    # a small folder loaded first (what a load imports is imported), then the big one; VmHWM: this process's peak
    # resident memory (ru_maxrss would carry over the forking pytest process's)
    script = ("import sys, rana\n"
              "def peak(): return int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1])\n"
              "rana.load(sys.argv[1])\n"
              "before = peak()\n"
              "m, _ = rana.load(sys.argv[2])\n"
              "print((peak() - before) * 1024)")
    proc = subprocess.run([sys.executable, "-c", script, *folders], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    grown = int(proc.stdout.strip().splitlines()[-1])
    assert grown < float_bytes / 2, (grown, float_bytes)  # the int8 rows are float_bytes / 4


@pytest.mark.parametrize("args,message", [
    (["quantize", "{src}", "--weights", "int4", "--out", "{out}"], "unknown --weights 'int4'"),
    (["quantize", "{missing}", "--weights", "int8", "--out", "{out}"], "does not exist"),
    (["quantize", "{quant}", "--weights", "int8", "--out", "{out}"], "holds int8 weights already"),
    (["quantize", "{src}", "--weights", "int8", "--out", "{src}"], "already exists"),
    (["quantize", "{src}", "--weights", "int8", "--activations", "int4", "--out", "{out}"], "--activations must be one of"),
])
def test_user_errors_are_one_line(int8_folders, tmp_path, args, message):
    comp, quant = int8_folders
    names = {"src": comp, "quant": quant, "missing": tmp_path / "nope", "out": tmp_path / "out"}
    res = runner.invoke(app, [a.format(**names) for a in args])
    assert res.exit_code != 0 and message in res.output, res.output
    assert "Traceback" not in res.output and len([x for x in res.output.splitlines() if x.strip()]) == 1, res.output
    assert not (tmp_path / "out").exists()
