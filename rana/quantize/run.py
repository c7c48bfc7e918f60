"""int8 weights for a rana model: `quantize_model` (in place) and `rana quantize DIR --weights int8 --out DIR2`.

What is quantized: every nn.Linear inside the decoder layers (the adapters' children — `linear`, `A`,
`B`, side paths — and the projections left dense, o_proj included) and the LM head (a dense nn.Linear
becomes an Int8Linear, an input-sparse head its int8 form), symmetric per output channel, scales fp32
(`rana.math.quantize`). The input embedding stays full precision for lookups: a tied head is untied
(its own int8 copy; config.json's `tie_word_embeddings` becomes false, the report says `untied_head`).
Mixtures of experts (3-D stacked experts) are refused.

With calibration tokens the run is sequential, as compression is (each layer sees the quantized upstream):

1. the full-precision model runs the calibration tokens once with its MAC meters on: every thresholded
   adapter's active fraction (its mean kept count over its mask width) is the target of step 3;
2. layer by layer: the layer's inputs (from the quantized layers before it) run through it with forward
   pre-hooks summing `H = Σ xᵀx` of every linear's input (linears reading one tensor, q/k/v or gate/up,
   share one H); each linear's scale per row is the clip ratio minimising `(w − s q)ᵀ H (w − s q)`;
3. **thresholds are refit on the quantized model's own activations**: in the order the layer calls its
   thresholded adapters (q/k/v, then o, then gate/up, then down: adapters reading one tensor form one
   stage), each stage's scores (|x|, |x|·‖W[:, i]‖ with column norms of the int8 weights, (B x)² with the
   int8 B, |act(gate)| for CATS) are collected on every calibration token with the earlier stages already
   refit, and its threshold is set to the quantile that keeps the target fraction
   (`rana.math.masks.threshold_for_keep_fraction`); the layer's outputs then feed the next layer;
4. the head: the final normed hidden states give its threshold (input-sparse head) and its H;
5. the meters run the quantized model on the calibration tokens again: the report holds, per adapter,
   the fraction before and after and both thresholds.

Without calibration tokens: max-abs scales, thresholds kept (column norms recomputed from the int8 weights).
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch
import torch.nn as nn

from ..accounting import metering
from ..archs import decoder_layers, get_arch, set_submodule, stubbed_decoder_layers, text_config
from ..checks import check_writable_dir
from ..data import DataError, calibration_batches, load_texts, tokenize_stream
from ..io.folder import check_folder, is_rana_dir, load, read_meta, read_plan, save
from ..io.format import WEIGHT_FORMATS
from ..io.paths import OutputExistsError, check_output
from ..math.masks import subsample_rows, threshold_for_keep_fraction
from ..math.quantize import CLIP_RATIOS, quantize_int8, relative_output_error
from ..kernels.cpu_gemv import check_a8_block
from ..modules.int8 import ACTIVATIONS, holds_int8
from ..modules.experts import InputSparseExperts
from ..modules.rebuild import int8_form, int8_paths
from ..modules.registry import declared
from ..units import Progress
# config.py sits below this module and holds what both need; DEFAULT_CALIB_TOKENS and QuantizeError stay
# importable from here too (__all__)
from .config import DEFAULT_ACTIVATION_BLOCK, DEFAULT_ACTIVATIONS, DEFAULT_CALIB_TOKENS, QuantizeConfig, QuantizeError

SCORE_ELEMENTS = 1 << 24  # scores kept per adapter while refitting its threshold (rows × mask width)


class _Stop(Exception):
    pass


# ---------------------------------------------------------------------------------------------- checks
def check_weights(weights: str, *, allow_none: bool = False) -> None:
    choices = WEIGHT_FORMATS if allow_none else tuple(w for w in WEIGHT_FORMATS if w != "none")
    if weights not in choices:
        raise QuantizeError(f"unknown --weights '{weights}' (choose {' or '.join(choices)})")


def check_quantizable(model: nn.Module) -> None:
    """QuantizeError unless every weight `quantize_model` would touch has an int8 form."""
    spec = get_arch(model.config)
    if spec.moe or any(isinstance(m, InputSparseExperts) for m in model.modules()):
        raise QuantizeError("--weights int8 does not support mixtures of experts (their stacked 3-D experts have no "
                            "int8 form); keep --weights none for this model")
    if int8_paths(model):
        raise QuantizeError("the model's weights are int8 already")


def quantize_targets(model: nn.Module, spec) -> list[str]:
    """Every nn.Linear under the decoder layers, then the LM head (a linear or an input-sparse head)."""
    prefix = spec.layers + "."
    paths = [n for n, m in model.named_modules() if type(m) is nn.Linear and n.startswith(prefix)]
    head = model.get_submodule(spec.lm_head)
    # a dense head, or an adapted one whose kind has an int8 form of its own
    if type(head) is nn.Linear or (declared(head, "int8_form") is not None and not holds_int8(head)):
        paths.append(spec.lm_head)
    return paths


def untie_head(model: nn.Module, spec) -> bool:
    """Record that the head no longer shares the input embedding's matrix (it gets its own int8 copy)."""
    head = model.get_submodule(spec.lm_head)
    emb = model.get_input_embeddings()
    tied = getattr(head, "weight", None) is getattr(emb, "weight", None)
    configs = {id(c): c for c in (model.config, text_config(model.config))}  # the wrapper and its text config
    for cfg in configs.values():
        if getattr(cfg, "tie_word_embeddings", False):
            cfg.tie_word_embeddings = False
    if isinstance(getattr(model, "all_tied_weights_keys", None), dict):
        model.all_tied_weights_keys = {}
    return bool(tied)


# ---------------------------------------------------------------------------------------------- thresholds
# What each adapter kind declares about its threshold (`refit`, rana.modules.registry): "own" / "shared" kinds
# own one and say how wide one token's mask is and what the threshold is compared with; an "owner" kind (a
# q/k/v slice) is scored for another's.
def mask_width(m: nn.Module) -> int:
    """Entries of one token's mask of a thresholded adapter."""
    return m.mask_width()


def refittable(m: nn.Module) -> bool:
    """A thresholded adapter whose threshold is finite (a static one, -inf or +inf, stays as it is)."""
    t = m._buffers.get("threshold") if declared(m, "refit") in ("own", "shared") else None
    return t is not None and math.isfinite(float(t))


def scores(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The values adapter `m` compares with its threshold for input x (rows × mask width, fp32)."""
    return m.refit_scores(x.reshape(-1, x.shape[-1]))


@torch.no_grad()
def active_fractions(model: nn.Module, ids: torch.Tensor, batch_size: int) -> dict[str, dict]:
    """{path: {"fraction", "threshold"}} of every refittable adapter, metered on the calibration tokens."""
    device = model.get_input_embeddings().weight.device
    with metering(model) as meters:
        for b in range(0, ids.shape[0], batch_size):
            model(input_ids=ids[b:b + batch_size].to(device), use_cache=False)
    return {name: {"fraction": m.mean_active() / mask_width(m), "threshold": float(m.threshold)}
            for name, m in meters.items() if refittable(m) and m._tokens}


def _score_sites(layer: nn.Module) -> dict[nn.Module, nn.Module]:
    """{module whose forward input gives the scores: the adapter owning the threshold} in one layer."""
    sites = {}
    for m in layer.modules():
        refit = declared(m, "refit")
        owner = m if refit == "own" else m.threshold_owner() if refit == "owner" else None
        if owner is not None and refittable(owner):
            sites[m] = owner
    return sites


# ---------------------------------------------------------------------------------------------- layer inputs
@torch.no_grad()
def capture_layer_inputs(model: nn.Module, spec, ids: torch.Tensor, batch_size: int) -> list[tuple]:
    """[(hidden entering layer 0, [kwargs of layer i])] per batch: the model runs with its decoder layers
    stubbed out (each records its keyword arguments and passes the hidden states on)."""
    device = model.get_input_embeddings().weight.device
    with stubbed_decoder_layers(model, spec) as run:
        return [run(ids[b:b + batch_size].to(device)) for b in range(0, ids.shape[0], batch_size)]


def _call(layer: nn.Module, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def _second_moments(layer: nn.Module, batches: list[tuple[torch.Tensor, dict]], names: list[str]) -> dict[str, tuple]:
    """{linear's path in the layer: (H, key)}: H = Σ xᵀx (fp32) of its inputs over the batches; linears called
    with one tensor share the H of the first (key: whose H it is)."""
    acc: dict[str, torch.Tensor] = {}
    alias: dict[str, str] = {}
    seen: list[tuple[torch.Tensor, str]] = []

    def hook(name: str):
        def pre(_m, args):
            x = args[0]
            for t, key in seen:
                if t is x:
                    alias.setdefault(name, key)
                    return
            x2 = x.reshape(-1, x.shape[-1]).float()
            h = x2.t() @ x2
            acc[name] = h if name not in acc else acc[name] + h
            seen.append((x, name))
        return pre

    handles = [layer.get_submodule(n).register_forward_pre_hook(hook(n)) for n in names]
    try:
        for hidden, kwargs in batches:
            seen.clear()
            _call(layer, hidden, kwargs)
            seen.clear()
    finally:
        for h in handles:
            h.remove()
    out = {}
    for n in names:
        key = alias.get(n, n)
        if key in acc:
            out[n] = (acc[key], key)
    return out


@torch.no_grad()
def _refit_layer(layer: nn.Module, batches: list[tuple[torch.Tensor, dict]], targets: dict[str, dict],
                 prefix: str) -> dict[str, float]:
    """Refit the layer's thresholds stage by stage (see the module docstring); returns {path: new threshold}."""
    sites = _score_sites(layer)
    names = {m: f"{prefix}.{n}" if n else prefix for n, m in layer.named_modules()}
    sites = {s: a for s, a in sites.items() if names[a] in targets}
    if not sites or not batches:
        return {}
    # the call order and which sites read one tensor (one stage), from the first batch
    order: list[tuple[nn.Module, torch.Tensor]] = []

    def record(site):
        def pre(_m, args):
            order.append((site, args[0]))
        return pre

    handles = [s.register_forward_pre_hook(record(s)) for s in sites]
    try:
        _call(layer, *batches[0])
    finally:
        for h in handles:
            h.remove()
    stages: list[list[nn.Module]] = []
    last = None
    for site, x in order:
        if last is not None and x is last and stages:
            if site not in stages[-1]:
                stages[-1].append(site)
        elif not any(site in st for st in stages):
            stages.append([site])
        last = x
    order.clear()
    fitted = {}
    per_batch = lambda width: max(1, SCORE_ELEMENTS // max(width, 1) // len(batches))  # noqa: E731
    for stage in stages:
        owners = {}
        for s in stage:
            owners.setdefault(sites[s], s)  # a shared code's first slice gives its scores
        collected: dict[nn.Module, list[torch.Tensor]] = {a: [] for a in owners}
        remaining = set(owners.values())

        def collect(site):
            def pre(_m, args):
                adapter = sites[site]
                if owners.get(adapter) is site and site in remaining:
                    sc = scores(adapter, args[0])
                    collected[adapter].append(subsample_rows(sc, per_batch(sc.shape[-1]), seed=len(collected[adapter])))
                    remaining.discard(site)
                if not remaining:
                    raise _Stop
            return pre

        handles = [s.register_forward_pre_hook(collect(s)) for s in owners.values()]
        try:
            for hidden, kwargs in batches:
                remaining = set(owners.values())
                try:
                    _call(layer, hidden, kwargs)
                except _Stop:
                    pass
        finally:
            for h in handles:
                h.remove()
        for adapter, rows in collected.items():
            if not rows:
                continue
            path = names[adapter]
            t = threshold_for_keep_fraction(torch.cat(rows), targets[path]["fraction"])
            adapter._buffers["threshold"].fill_(t)
            fitted[path] = t
    return fitted


# ---------------------------------------------------------------------------------------------- the model
def _quantize_module(model: nn.Module, path: str, hessian: torch.Tensor | None, clip_ratios,
                     activations: str, block: int) -> float:
    """Replace the module at `path` by its int8 form, multiplying its tokens as `activations` (int8: per `block`
    inputs); returns its relative output error."""
    m = model.get_submodule(path)
    w = m.weight.detach()
    q, s = quantize_int8(w, hessian, clip_ratios=clip_ratios)
    err = relative_output_error(w, q, s, hessian)
    new = int8_form(m, q, s)
    new.activations, new.activation_block = activations, block
    set_submodule(model, path, new)
    return err


def _refresh_norms(root: nn.Module) -> None:
    """Column norms of the int8 weights, for every adapter whose mask reads them (`norms_child`)."""
    for m in root.modules():
        if declared(m, "norms_child") is not None:
            m.refresh_norms()


@torch.no_grad()
def quantize_model(model: nn.Module, calibration=None, *, batch_size: int = 8, clip_ratios=CLIP_RATIOS,
                   progress: Progress | None = None, activations: str = DEFAULT_ACTIVATIONS,
                   activation_block: int = DEFAULT_ACTIVATION_BLOCK) -> dict:
    """Quantize `model` (a rana model, or a dense one) to int8 weights in place; returns the report that
    plan.json keeps as `quantization`. `calibration`: token ids (sequences × length) or an object with
    `.fit` (rana.data.CalibrationData); None: max-abs scales, thresholds kept. `activations`: how the int8
    modules multiply their tokens ("int8": W8A8, each token's inputs quantized per `activation_block`; "float":
    W8A16); the refit sees the model decoding that way.
    See the module docstring."""
    if activations not in ACTIVATIONS:
        raise QuantizeError(f"--activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
    try:
        check_a8_block(activation_block)
    except ValueError as e:
        raise QuantizeError(f"--activation-block: {e}") from None
    check_quantizable(model)
    spec = get_arch(model.config)
    ids = getattr(calibration, "fit", calibration)
    training = model.training
    model.eval()
    t0 = time.perf_counter()
    targets = quantize_targets(model, spec)
    untied = untie_head(model, spec)
    report = {"weights": "int8", "activations": activations, "scales": "float32, per output channel",
              **({"activation_block": activation_block} if activations == "int8" else {}),
              "clip_ratios": list(clip_ratios),
              "calibration_tokens": 0 if ids is None else int(ids.numel()), "untied_head": untied, "modules": []}
    if ids is None:
        for i, path in enumerate(targets):
            report["modules"].append({"path": path, "relative_error": _quantize_module(model, path, None, clip_ratios,
                                                                                      activations, activation_block)})
        _refresh_norms(model)
        report["refit"] = None
        report["wall_time_s"] = time.perf_counter() - t0
        model.train(training)
        return report
    before = active_fractions(model, ids, batch_size)
    batches = capture_layer_inputs(model, spec, ids, batch_size)
    layers = decoder_layers(model, spec)
    fitted: dict[str, float] = {}
    for idx, layer in enumerate(layers):
        prefix = f"{spec.layers}.{idx}"
        local = [p[len(prefix) + 1:] for p in targets if p.startswith(prefix + ".")]
        layer_batches = [(h, kw[idx]) for h, kw in batches]
        moments = _second_moments(layer, layer_batches, local)
        for name in local:
            h = moments.get(name, (None, None))[0]
            err = _quantize_module(layer, name, h, clip_ratios, activations, activation_block)
            report["modules"].append({"path": f"{prefix}.{name}", "relative_error": err})
        _refresh_norms(layer)
        fitted.update(_refit_layer(layer, layer_batches, before, prefix))
        batches = [(_call(layer, h, kw[idx]), kw) for h, kw in batches]
        if progress:
            progress("layers", idx + 1, len(layers))
    if spec.lm_head in targets:
        norm = model.get_submodule(spec.final_norm)
        xs = [norm(h).reshape(-1, h.shape[-1]) for h, _ in batches]
        head = model.get_submodule(spec.lm_head)
        if declared(head, "refit") == "own" and spec.lm_head in before:  # an input-sparse head
            t = threshold_for_keep_fraction(subsample_rows(scores(head, torch.cat(xs)),
                                                           max(1, SCORE_ELEMENTS // mask_width(head))),
                                            before[spec.lm_head]["fraction"])
            head._buffers["threshold"].fill_(t)
            fitted[spec.lm_head] = t
            xs = [x * (x.abs() >= head.threshold) for x in xs]  # the inputs the head multiplies
        hessian = sum(x.float().t() @ x.float() for x in xs)
        err = _quantize_module(model, spec.lm_head, hessian, clip_ratios, activations, activation_block)
        report["modules"].append({"path": spec.lm_head, "relative_error": err})
    after = active_fractions(model, ids, batch_size)
    report["refit"] = {path: {"fraction_before": b["fraction"], "fraction_after": after.get(path, {}).get("fraction"),
                              "threshold_before": b["threshold"], "threshold_after": fitted.get(path, b["threshold"])}
                       for path, b in before.items()}
    report["wall_time_s"] = time.perf_counter() - t0
    model.train(training)
    return report


# ---------------------------------------------------------------------------------------------- the command
def calibration_ids(tokenizer, dataset: str | None, calib_tokens: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """`calib_tokens // seq_len` random windows of the calibration text (the bundled corpus by default)."""
    def attempt(max_chars):
        texts = load_texts(dataset, max_chars=max_chars)
        return calibration_batches(tokenize_stream(texts, tokenizer), n_tokens=calib_tokens, seq_len=seq_len,
                                   heldout_fraction=0.0, seed=seed).fit

    try:
        return attempt(16 * calib_tokens)
    except DataError as e:
        if "too short" not in str(e):
            raise
        return attempt(None)


def quantize_folder(config: QuantizeConfig,
                    progress: Progress | None = None) -> tuple[Path, dict]:
    """`rana quantize SRC --weights int8 --out OUT`: the rana folder `config.src` with int8 weights, written
    atomically to `config.out`; returns (out, the quantization report). `calib_tokens` 0: no calibration.
    Everything is checked before the folder is loaded (--weights, the folders, the calibration sizes)."""
    check_weights(config.weights)
    check_writable_dir(config.out, "--out")
    # the settings under the names the steps below use
    weights, dataset, calib_tokens, seq_len = config.weights, config.dataset, config.calib_tokens, config.seq_len
    batch_size, seed, overwrite = config.batch_size, config.seed, config.overwrite
    src, out = Path(os.path.expanduser(str(config.src))), Path(os.path.expanduser(str(config.out)))
    if not src.exists():
        raise FileNotFoundError(f"'{src}' does not exist; pass a rana folder written by `rana compress`")
    if not is_rana_dir(src):
        raise QuantizeError(f"'{src}' is not a rana folder (no rana_config.json); produce one with `rana compress`")
    if out.exists() and not overwrite:
        raise OutputExistsError(f"output folder '{out}' already exists; choose another --out or pass --overwrite")
    check_output(out, [src], overwrite=overwrite)
    config.validate()
    check_folder(src)
    meta = read_meta(src)
    if meta.get("weights", "none") == "int8":
        raise QuantizeError(f"'{src}' holds int8 weights already")
    if any(a.get("type") == InputSparseExperts.spec_type for a in meta["adapters"]):
        raise QuantizeError("--weights int8 does not support mixtures of experts (their stacked 3-D experts have no "
                            "int8 form); keep --weights none for this model")
    settings = meta.get("compress_config") or {}
    seq_len = int(seq_len or settings.get("seq_len") or 512)
    if calib_tokens and calib_tokens < seq_len:
        seq_len = calib_tokens
    model, tokenizer = load(src)
    check_quantizable(model)
    ids = None
    if calib_tokens:
        if tokenizer is None:
            raise QuantizeError(f"'{src}' has no tokenizer to read calibration text with; pass --calib-tokens 0 "
                                "(max-abs scales, thresholds kept)")
        ids = calibration_ids(tokenizer, dataset, calib_tokens, seq_len, seed)
    report = quantize_model(model, ids, batch_size=batch_size, progress=progress, activations=config.activations,
                            activation_block=config.activation_block)
    plan = read_plan(src) or {}
    plan["weights"] = "int8"
    plan["quantization"] = report
    extra = {k: v for k, v in meta.items() if k not in ("format_version", "dtype", "adapters", "weights", "int8")}
    extra["quantize_config"] = {"weights": weights, "activations": config.activations,
                                "activation_block": config.activation_block, "dataset": dataset, "calib_tokens": calib_tokens,
                                "seq_len": seq_len, "batch_size": batch_size, "seed": seed}
    save(model, tokenizer, out, plan=plan, extra=extra, overwrite=overwrite)
    return out, report


__all__ = ["QuantizeError", "DEFAULT_CALIB_TOKENS", "check_weights", "check_quantizable", "quantize_targets",
           "quantize_model", "quantize_folder", "calibration_ids", "active_fractions", "mask_width", "untie_head"]
