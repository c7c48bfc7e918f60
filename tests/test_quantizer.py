"""`rana export --format quantizer`: config.json keeps the stock model type and class and records the
adapters as quantization_config {"quant_method": "rana"}; `rana.quantizer` (registered in every process
where rana is installed: rana.hf_hook, rana-hf-quantizer.pth) loads it with plain
`AutoModelForCausalLM.from_pretrained(folder)` into the modules, thresholds and logits of `rana.load`.

Checked in fresh interpreters that never import rana themselves: the stock path in fp32 / bf16 / fp16
with `dtype`, `torch_dtype` and `device_map`; and, where rana cannot be imported (test_export's isolated
loader, the same reload-and-compare as the remote-code format), one line saying `pip install rana`
without trust_remote_code and the shipped remote code with it.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import rana.io as rio
from rana.export import export
from rana.quantizer import QUANT_METHOD, WEIGHTS_GUARD
from test_export import CASES, NEW_TOKENS, PROMPT, assert_close, build_case, isolated_env, run_isolated

# llama + a tokenizer; q/k/v biases, tied and sharded; LAuReL; GPT-NeoX (LM head renamed by the stock
# checkpoint conversion) with LAuReL's history; Gemma 3's multimodal wrapper
NAMES = ["llama_rana", "qwen2_rana_tied", "qwen2_laurel", "gpt_neox_laurel", "gemma3_multimodal"]
DTYPES = {"fp32": ("dtype", None), "bf16": ("dtype", "bfloat16"), "fp16": ("torch_dtype", "float16")}

# Runs in a fresh interpreter with rana installed but not imported by the script: the stock class loads
STOCK = textwrap.dedent(r'''
    import json, sys
    import torch
    from transformers import AutoModelForCausalLM

    jobs = json.loads(sys.argv[1])
    torch.set_num_threads(jobs["threads"])
    prompt, results = torch.tensor(jobs["prompt"]), {}
    for name, folder in jobs["folders"].items():
        for mode, (key, dtype) in jobs["dtypes"].items():
            kwargs = {key: getattr(torch, dtype)} if dtype else {}
            if mode == "fp32":
                kwargs["device_map"] = "cpu"
            model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
            with torch.no_grad():
                logits = model(prompt).logits.float()
                tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                        max_new_tokens=jobs["new_tokens"], min_new_tokens=jobs["new_tokens"],
                                        pad_token_id=0)
            results[name, mode] = {
                "class": type(model).__module__ + "." + type(model).__name__, "logits": logits, "tokens": tokens,
                "dtype": str(model.dtype),
                "thresholds": sorted({str(b.dtype) for n, b in model.named_buffers() if n.endswith("threshold")}),
                "adapters": sorted({type(m).__name__ for m in model.modules() if hasattr(m, "measured_macs")}),
                "grouped": sum(getattr(m, "_decode_group", None) is not None for m in model.modules()),
                "buffers": dict(model.named_buffers()),
            }
    torch.save(results, jobs["out"])
''')

# rana cannot be imported (test_export's blocker) and no trust_remote_code: what plain transformers says
WITHOUT_RANA = textwrap.dedent(r'''
    import importlib.abc, sys
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "rana":
                raise ModuleNotFoundError(f"No module named {name!r}")

    sys.meta_path.insert(0, Block())
    from transformers import AutoModelForCausalLM
    try:
        AutoModelForCausalLM.from_pretrained(sys.argv[1])
    except Exception as e:
        print(f"{type(e).__name__}: {e}")
    else:
        print("LOADED")
''')


def run_script(source: str, args: list[str], tmp: Path, env: dict) -> str:
    script = tmp / "script.py"
    script.write_text(source)
    proc = subprocess.run([sys.executable, str(script), *args], cwd=tmp, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{case: (rana folder, quantizer-format export)}."""
    tmp = tmp_path_factory.mktemp("quantizer")
    out = {}
    for name in NAMES:
        src, dst = tmp / f"{name}_rana", tmp / f"{name}_quant"
        build_case(name, src)
        export(src, dst, max_shard_size=CASES[name][4])  # the default format
        out[name] = (src, dst)
    return out


@pytest.fixture(scope="module")
def stock(folders, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stock")
    env = {**isolated_env(tmp)}
    env.pop("RANA_NO_HF_HOOK")  # rana installed: its start-up hook registers the quantizer
    jobs = {"folders": {k: str(v[1]) for k, v in folders.items()}, "prompt": PROMPT.tolist(), "dtypes": DTYPES,
            "new_tokens": NEW_TOKENS, "out": str(tmp / "stock.pt"), "threads": torch.get_num_threads()}
    run_script(STOCK, [json.dumps(jobs)], tmp, env)
    return torch.load(tmp / "stock.pt", weights_only=False)


@pytest.fixture(scope="module")
def reference(folders):
    refs = {}
    for name, (src, _) in folders.items():
        for mode, (_, dtype) in DTYPES.items():
            model, _ = rio.load(src, dtype=getattr(torch, dtype) if dtype else None)
            with torch.no_grad():
                refs[name, mode] = {
                    "logits": model(PROMPT).logits.float(),
                    "tokens": model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), do_sample=False,
                                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0),
                    "adapters": sorted({type(m).__name__ for m in model.modules() if hasattr(m, "measured_macs")}),
                    "grouped": sum(getattr(m, "_decode_group", None) is not None for m in model.modules()),
                    "buffers": dict(model.named_buffers())}
    return refs


@pytest.mark.parametrize("mode", list(DTYPES))
@pytest.mark.parametrize("name", NAMES)
def test_stock_class_matches_rana_load(stock, reference, name, mode):
    got, want = stock[name, mode], reference[name, mode]
    assert got["class"].startswith("transformers.models."), got["class"]  # the stock class, no remote code
    assert got["adapters"] == want["adapters"] and got["grouped"] == want["grouped"]
    assert got["thresholds"] == ["torch.float32"]
    assert got["dtype"] == f"torch.{DTYPES[mode][1] or 'float32'}"
    assert got["buffers"].keys() == want["buffers"].keys()
    for key, buf in want["buffers"].items():  # thresholds, column norms, RoPE frequencies: dtype and value
        assert got["buffers"][key].dtype == buf.dtype and torch.equal(got["buffers"][key], buf), key
    # the same modules either way (rana.load builds in the dtype asked for, as from_pretrained does: RoPE's
    # buffers float32, column norms of the half-precision weights), so the same masks and logits
    assert_close(got["logits"], want["logits"])
    if mode != "fp32":
        assert torch.equal(got["logits"], want["logits"])
    assert torch.equal(got["tokens"], want["tokens"])


def test_config_records_the_quantizer(folders):
    src, dst = folders["qwen2_rana_tied"]
    cfg = json.loads((dst / "config.json").read_text())
    meta = json.loads((src / rio.RANA_CONFIG).read_text())
    assert cfg["model_type"] == "qwen2" and cfg["architectures"] == ["Qwen2ForCausalLM"]
    q = cfg["quantization_config"]
    assert q["quant_method"] == QUANT_METHOD and q["adapters"] == meta["adapters"] and q["laurel"] is None
    assert q["format_version"] == meta["format_version"] and cfg["transformers_weights"] == WEIGHTS_GUARD
    assert "rana_adapters" not in cfg and (dst / "modeling_rana.py").is_file()  # remote code: the fallback
    laurel = json.loads((folders["qwen2_laurel"][1] / "config.json").read_text())["quantization_config"]["laurel"]
    assert laurel["variant"] == "rw+lr"


def test_without_rana_one_line_or_remote_code(folders, reference, tmp_path):
    """rana not installed: one line saying `pip install rana`; with trust_remote_code=True the shipped code
    loads it (test_export's isolated loader: rana and triton blocked), with rana.load's logits and tokens."""
    out = run_script(WITHOUT_RANA, [str(folders["llama_rana"][1])], tmp_path, isolated_env(tmp_path)).strip()
    assert "pip install rana" in out and "trust_remote_code=True" in out and len(out.splitlines()) == 1, out
    results = run_isolated({n: folders[n][1] for n in NAMES}, tmp_path, resave=False)
    for name in NAMES:
        r, want = results[name], reference[name, "fp32"]
        assert r["module"].startswith("transformers_modules.") and r["rana_modules"] == []
        assert r["missing"] == [] and r["unexpected"] == []
        assert_close(r["logits"], want["logits"])
        assert torch.equal(r["tokens"], want["tokens"])


def test_unknown_format_refused(folders, tmp_path):
    with pytest.raises(ValueError, match="unknown export format 'onnx'"):
        export(folders["llama_rana"][0], tmp_path / "x", format="onnx")
