"""lm-eval through the stock path: `lm_eval --model hf --model_args pretrained=FOLDER` on a quantizer-format
export (`rana export`, the default format), no trust_remote_code, in a fresh process that never imports
rana itself (rana's start-up hook, rana-hf-quantizer.pth, registers quant_method "rana"), gives the
accuracies and per-sample log-likelihoods of `rana eval --tasks` (rana's harness on `rana.load`'s model)
on the rana folder the export came from.

Without rana (a process where `import rana` fails and the start-up hook is off), the same command cannot
say "pip install rana": lm-eval 0.4.13's HFLM.__init__ (lm_eval/models/huggingface.py, line 364) parses
config.json's quantization_config with `AutoQuantizationConfig.from_dict` before it loads any weight, and
transformers (quantizers/auto.py, line 173) raises `ValueError: Unknown quantization type, got rana -
supported types are: [...]` for a quant_method it does not know. Nothing in the folder runs before that
line without trust_remote_code (AutoConfig reads JSON only; the weights guard in `transformers_weights` is
read later, by from_pretrained), and the message is built from the quant_method, which must stay "rana"
(transformers', vLLM's and SGLang's registries select by it). What the test pins: the run ends with that
one line, naming rana, as the last line of its output. With trust_remote_code=True the shipped remote
code is the fallback: its config class reads the quantization_config itself (configuration_rana.py's
from_dict), so lm-eval's parse finds none and the run gives rana eval's metrics without rana.

The offline `*_local` tasks (rana/tasks/) read a few hand-written rows here: nothing from a hub.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import rana.io as rio
from helpers import byte_tokenizer, tiny_model
from rana.compress import CompressConfig, compress_model
from rana.evaluation import harness
from rana.evaluation.harness import LOCAL_TASKS, write_local_tasks
from rana.export import export
from test_export import SMALL, isolated_env

LIMIT = 4
HELLASWAG = [  # already what lm-eval's hellaswag process_docs builds: query, choices, label
    ("Cooking: A man cracks an egg into a bowl. He",
     ["whisks it with a fork.", "paints the wall blue.", "drives to the moon.", "sings to the bowl."], 0),
    ("Running: A woman laces her shoes. She",
     ["eats the shoes.", "starts jogging down the street.", "flies away.", "reads a map of Mars."], 1),
    ("Gardening: A boy digs a hole in the soil. He",
     ["swims in it.", "throws the spade at a cloud.", "plants a small tree in it.", "sells the hole."], 2),
    ("Music: A girl picks up a violin. She",
     ["eats the bow.", "hides it under water.", "paints it green.", "plays a short tune."], 3),
]
LAMBADA = ["The cat sat on the warm mat", "She opened the door and saw the garden",
           "He counted the coins one by one until there were ten", "The river ran quietly past the old mill"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A compressed tiny llama (byte tokenizer, every byte in its vocabulary) as a rana folder, its
    quantizer-format export, the offline task data and the rendered task YAMLs."""
    tmp = tmp_path_factory.mktemp("lm_eval_stock")
    model = tiny_model("llama", seed=3, **{**SMALL, "vocab_size": 257})
    ids = torch.randint(0, 257, (20, 32), generator=torch.Generator().manual_seed(0))
    cfg = CompressConfig(model="x", flops=0.7, method="rana-mixed", calib_tokens=512, seq_len=32, batch_size=4,
                         search_tokens=128, fit_sample_tokens=256)
    compress_model(model, None, cfg, SimpleNamespace(fit=ids[:16], heldout=ids[16:]))
    src, dst = tmp / "tiny_rana", tmp / "tiny_quant"
    rio.save(model, byte_tokenizer(), src)
    export(src, dst)  # the default format: quantizer
    data = tmp / "data"
    (data / "eval").mkdir(parents=True)
    (data / "eval" / "hellaswag_validation.jsonl").write_text(
        "".join(json.dumps({"query": q, "choices": c, "label": label}) + "\n" for q, c, label in HELLASWAG))
    (data / "eval" / "lambada_openai_test.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in LAMBADA))
    tasks = write_local_tasks(tmp / "tasks", data)
    return SimpleNamespace(tmp=tmp, src=src, dst=dst, data=data, tasks=tasks)


def per_sample(samples: list[dict]) -> dict[int, list[float]]:
    """doc_id -> the log-likelihood of each of its requests (each choice, or the target)."""
    return {s["doc_id"]: [float(r[0][0]) for r in s["resps"]] for s in samples}


# lm-eval's CLI in a process that cannot import rana (editable-install finders dropped, `rana` blocked)
WITHOUT_RANA = """
import importlib.abc, sys
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "rana":
            raise ModuleNotFoundError(f"No module named {name!r}")

sys.meta_path.insert(0, Block())
from lm_eval.__main__ import cli_evaluate
sys.argv = ["lm_eval", *sys.argv[1:]]
cli_evaluate()
"""


def lm_eval_without_rana(work, out: Path, model_args: str) -> subprocess.CompletedProcess:
    """`lm_eval --model hf` on the export, rana not importable and its start-up hook off."""
    script = work.tmp / "lm_eval_without_rana.py"
    script.write_text(WITHOUT_RANA)
    env = isolated_env(work.tmp)  # RANA_NO_HF_HOOK=1: the .pth hook imports nothing
    env["HF_DATASETS_OFFLINE"] = "1"
    env["HF_DATASETS_CACHE"] = str(work.tmp / "datasets_cache")
    cmd = [sys.executable, str(script), "--model", "hf", "--model_args", f"pretrained={work.dst},{model_args}",
           "--tasks", ",".join(LOCAL_TASKS), "--include_path", str(work.tasks), "--device", "cpu",
           "--batch_size", "1", "--limit", str(LIMIT), "--output_path", str(out)]
    return subprocess.run(cmd, cwd=work.tmp, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def stock(work):
    """`python -m lm_eval --model hf` on the export, in a fresh process (rana not imported by it)."""
    out = work.tmp / "lm_eval_out"
    env = isolated_env(work.tmp)
    env.pop("RANA_NO_HF_HOOK")  # rana installed: its start-up hook registers the quantizer
    env["HF_DATASETS_OFFLINE"] = "1"
    env["HF_DATASETS_CACHE"] = str(work.tmp / "datasets_cache")
    cmd = [sys.executable, "-m", "lm_eval", "--model", "hf",
           "--model_args", f"pretrained={work.dst},dtype=float32",
           "--tasks", ",".join(LOCAL_TASKS), "--include_path", str(work.tasks), "--device", "cpu",
           "--batch_size", "1", "--limit", str(LIMIT), "--output_path", str(out), "--log_samples"]
    proc = subprocess.run(cmd, cwd=work.tmp, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "trust_remote_code" not in " ".join(cmd)
    results = sorted(out.rglob("results_*.json"))
    assert len(results) == 1, sorted(out.rglob("*"))
    doc = json.loads(results[0].read_text())
    samples = {}
    for task in LOCAL_TASKS:
        files = sorted(out.rglob(f"samples_{task}_*.jsonl"))
        assert len(files) == 1, files
        samples[task] = [json.loads(line) for line in files[0].read_text().splitlines() if line.strip()]
    return doc, samples


@pytest.fixture(scope="module")
def reference(work, monkeypatch_module):
    """rana's harness (what `rana eval --tasks ... --task-data` runs) on `rana.load`'s model of the source
    folder; lm-eval's per-sample records kept (the harness itself asks for none)."""
    import lm_eval

    captured = {}
    original = lm_eval.simple_evaluate

    def keep_samples(*args, **kwargs):
        kwargs["log_samples"] = True
        captured.update(original(*args, **kwargs))
        return captured

    monkeypatch_module.setattr(lm_eval, "simple_evaluate", keep_samples)
    monkeypatch_module.setattr(harness, "TASK_MANAGERS", {})
    model, tokenizer = rio.load(work.src)
    metrics = harness.lm_eval_tasks(model, tokenizer, list(LOCAL_TASKS), data_dir=work.data, limit=LIMIT,
                                    bootstrap_iters=0)
    return metrics, captured["samples"]


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_export_is_the_quantizer_format(work):
    cfg = json.loads((work.dst / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "rana" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"  # the stock class (auto_map: the remote-code fallback, unused here)


def test_stock_lm_eval_matches_rana_eval(stock, reference):
    doc, samples = stock
    metrics, ref_samples = reference
    assert doc["config"]["model"] == "hf" and "trust_remote_code" not in str(doc["config"]["model_args"])
    for task in LOCAL_TASKS:
        got = {k.removesuffix(",none"): v for k, v in doc["results"][task].items()
               if isinstance(v, (int, float)) and not k.endswith("_stderr,none")}
        want = {k: v for k, v in metrics[task].items() if not k.endswith("_stderr")}
        assert got.keys() == want.keys(), (task, got, want)
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-4), (task, key, got[key], want[key])
        a, b = per_sample(samples[task]), per_sample(ref_samples[task])
        assert a.keys() == b.keys() and len(a) == LIMIT
        for doc_id in b:
            assert a[doc_id] == pytest.approx(b[doc_id], rel=1e-5, abs=1e-4), (task, doc_id)
    # the accuracy compared is a real one (the tiny model is not the same answer everywhere)
    assert len({tuple(v) for v in per_sample(ref_samples["hellaswag_local"]).values()}) == LIMIT


def test_without_rana_lm_eval_ends_with_one_line(work):
    """Not fixable from the folder (module docstring): pinned as one last line that names rana."""
    proc = lm_eval_without_rana(work, work.tmp / "out_without_rana", "dtype=float32")
    assert proc.returncode != 0
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert lines[-1].startswith("ValueError: Unknown quantization type, got rana - supported types are:"), lines[-5:]
    assert "rana" not in lines[-1].split(" - ", 1)[1], lines[-1]  # rana is no registered quant_method there


def test_without_rana_trust_remote_code_is_the_fallback(work, reference):
    """The shipped remote code answers lm-eval's trust_remote_code=True without rana: rana eval's metrics."""
    out = work.tmp / "out_remote_code"
    proc = lm_eval_without_rana(work, out, "dtype=float32,trust_remote_code=True")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    doc = json.loads(next(out.rglob("results_*.json")).read_text())
    metrics, _ = reference
    for task in LOCAL_TASKS:
        got = {k.removesuffix(",none"): v for k, v in doc["results"][task].items()
               if isinstance(v, (int, float)) and not k.endswith("_stderr,none")}
        want = {k: v for k, v in metrics[task].items() if not k.endswith("_stderr")}
        assert got.keys() == want.keys(), (task, got, want)
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-4), (task, key, got[key], want[key])
