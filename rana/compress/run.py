"""`rana compress`: the layer-by-layer loop (design.md): capture → statistics → search → swap
→ push the calibration activations through the compressed layer to feed the next."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from ..accounting import dense_macs, dense_macs_per_layer, measured_macs, metering
from ..archs import UnsupportedArchitectureError, decoder_layers, get_arch
from ..data import DataError, calibration_batches, load_texts, tokenize_stream
from ..io.folder import OffloadedLayers
from ..math.flops import adapted_fraction
from ..methods import LayerContext, Method, get_method, qkv_modules, relative_error
from ..quantize import check_quantizable, quantize_model
from ..units import DTYPES, Progress
from .calibrate import capture_first_layer_inputs, collect_inputs, run_layer
from .config import CompressConfig
from .distributed import global_roles
from .lm_head import budget_summary, compress_lm_head
from .job import CompressJob, preflight
from .placement import as_module_input
from .profile import profile_and_allocate
from .residency import Residency
from .resources import Resources
from .streaming import LazyWeights, load_for_compression
from ..errors import UserError


class BudgetError(UserError):
    """A FLOP target the method cannot reach on this model (user-facing)."""


@dataclass
class CompressResult:
    model: nn.Module
    tokenizer: object
    plan: dict
    # decoder layers a streamed run left on disk: pass to `rana.io.save(..., offloaded=...)`
    offloaded: OffloadedLayers | None = None


def budget_for(model_config, method: Method, target: float, seq_len: int, lm_head: str = "dense") -> tuple[float, dict]:
    """The fraction of the adapted parts' dense cost that makes the whole model spend `target`
    (`lm_head` "sparse": the LM head is one of the adapted parts, rana.compress.lm_head)."""
    if (problem := method.unsupported_reason(get_arch(model_config))) is not None:
        raise UnsupportedArchitectureError(problem)
    dense = dense_macs(model_config, seq_len)
    per_layer = dense_macs_per_layer(model_config, seq_len)
    in_layers = sum(d[p] for d in per_layer for p in method.adapted_parts)
    adapted = in_layers + (dense["lm_head"] if lm_head == "sparse" else 0.0)
    extra = float(method.runtime_macs(model_config)) if method.runtime_macs is not None else 0.0  # paid by the adapted parts
    f = adapted_fraction(target - extra / dense["total"], dense["total"], adapted)
    floor = (dense["total"] + extra - adapted * (1 - method.min_fraction)) / dense["total"]
    if f < method.min_fraction or f <= 0:
        added = f" plus the {extra / dense['total']:.3f} it adds" if extra else ""
        raise BudgetError(
            f"--flops {target} is below what method '{method.name}' can reach on this model: the parts it does not "
            f"adapt already cost {(dense['total'] - adapted) / dense['total']:.3f} of the dense FLOPs{added}; use --flops ≥ {math.ceil(floor * 1000) / 1000:.3f}")
    f = min(f, 1.0)
    return f, {"dense_macs": dense, "adapted_dense_macs": adapted, "unadapted_dense_macs": dense["total"] - adapted,
               **({"method_runtime_macs": extra} if extra else {}), **budget_summary(dense, in_layers, f, lm_head)}


def moment_sequences(fit: torch.Tensor, batch_size: int) -> torch.Tensor:
    """The fit sequences whose batches feed second moments (the rest feed thresholds only)."""
    roles = global_roles(math.ceil(len(fit) / batch_size))
    return fit[:batch_size * sum(r != "sample" for r in roles)]


def _module_outputs(modules: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    return torch.cat([m(x) for m in modules], dim=-1)


@torch.no_grad()
def _step_error(ctx: LayerContext, step_name: str, stats) -> Callable[[], float]:
    """Snapshot the dense outputs of the step's block on held-aside inputs; return a function
    that measures the compressed block's relative output error on the same inputs."""
    if step_name == "attention":
        mods = [m for _, m in qkv_modules(ctx)]
        x = as_module_input(stats["qkv_in"].eval[: ctx.search_tokens * 2], mods[0])
        ref = _module_outputs(mods, x)
        return lambda: relative_error(ref, _module_outputs([m for _, m in qkv_modules(ctx)], x))
    mlp = ctx.module(ctx.spec.mlp)
    x = as_module_input(stats["mlp_in"].eval[: ctx.search_tokens * 2], mlp)
    if ctx.spec.moe:  # an MoE block reads (batch, sequence, hidden)
        x = x.unsqueeze(0)
    ref = mlp(x)
    return lambda: relative_error(ref, mlp(x))


def compress_model(model: nn.Module, tokenizer, config: CompressConfig, calibration,
                   progress: Progress | None = None, *,
                   lazy_weights: LazyWeights | None = None,
                   on_budget: Callable[[dict], None] | None = None) -> CompressResult:
    """Compress `model` in place with calibration sequences (`calibration.fit`, `.heldout`).
    `lazy_weights`: the checkpoint a model from `load_lazy` streams its decoder layers from.
    `on_budget`: called with the budget (plan.json's `budget`) before any calibration work."""
    config.validate()
    config = config.resolved()
    method = get_method(config.method)
    fraction, budget_info = budget_for(model.config, method, config.flops, config.seq_len, config.lm_head)
    if config.weights == "int8":
        if lazy_weights is not None:
            raise UserError("--weights int8 does not work with layers streamed from disk; compress in memory, or "
                            "compress first and run `rana quantize` on the folder")
        check_quantizable(model)
    if on_budget:
        on_budget(budget_info)
    result = _compress_layers(model, tokenizer, config, calibration, method, fraction, budget_info, progress,
                              lazy_weights, Resources.of(config))
    _quantize_last(result, config, calibration, progress)
    # the adapters are new modules, built in training mode: put every module back in the model's own mode
    # (an eval-mode model decodes through the masked-GEMV kernels only when its adapters are in eval mode too)
    model.train(model.training)
    return result


@torch.no_grad()
def _compress_layers(model: nn.Module, tokenizer, config: CompressConfig, calibration, method: Method, fraction: float,
                     budget_info: dict, progress: Progress | None,
                     lazy_weights: LazyWeights | None, resources: Resources) -> CompressResult:
    """The loop, for a validated config, its budget and its resources."""
    spec = get_arch(model.config)
    device, offload = resources.device, resources.offload
    layers = decoder_layers(model, spec)
    # a method's model-level transform (larosa's folded rotations) runs on the dense model first
    transform = None
    if method.prepare is not None:
        transform = method.prepare(model, spec, moment_sequences(calibration.fit, config.batch_size),
                                   batch_size=config.batch_size,
                                   streamed=lazy_weights is not None or resources.work_dir is not None)
    # everything but the decoder stack on the device; the stack in host RAM or on disk (rana.compress.residency)
    residency = Residency.create(model, spec, config, resources, lazy_weights)
    dtype = DTYPES[config.dtype]
    t0 = time.perf_counter()
    fit = capture_first_layer_inputs(model, spec, calibration.fit, batch_size=config.batch_size, device=device, offload=offload)
    held = capture_first_layer_inputs(model, spec, calibration.heldout, batch_size=config.batch_size, device=device, offload=offload)
    fit, held = residency.adopt(fit), residency.adopt(held)
    allocation = None
    if config.allocation == "global" and fraction < 1.0:
        allocation = profile_and_allocate(model, spec, method, fit, held, fraction, dense_macs_per_layer(model.config, config.seq_len),
                                          fit_sample_tokens=config.fit_sample_tokens,
                                          search_tokens=config.search_tokens, device=device, offload=offload,
                                          residency=residency, progress=progress)
    t_profile = time.perf_counter() - t0
    layer_plans = []
    for idx, layer in enumerate(layers):
        residency.bring(idx, layer)
        ctx = LayerContext(index=idx, layer=layer, spec=spec, fraction=fraction, fit_sample_tokens=config.fit_sample_tokens,
                           search_tokens=config.search_tokens, grid_step=config.grid_step, dtype=dtype)
        fractions = allocation.fractions[idx] if allocation else None
        layer_plans.append(_compress_layer(ctx, method, fit, held, fractions, device))
        with metering(layer):  # measure masks on held-aside tokens as they flow
            held = run_layer(layer, held, device=device, offload=offload)
        fit = run_layer(layer, fit, device=device, offload=offload)
        residency.release(idx, layer)
        if progress:
            progress("layers", idx + 1, len(layers))
    head_plan = None
    if config.lm_head == "sparse" and fraction < 1.0:  # calibrated on the compressed layers' outputs
        head_plan = compress_lm_head(model, spec, fit, held, fraction, fit_sample_tokens=config.fit_sample_tokens,
                                     search_tokens=config.search_tokens, device=device, layer_index=len(layers))
    measured = measured_macs(model, config.seq_len)
    _attach_measurements(layer_plans, spec.layers, measured["modules"])
    plan = {
        "method": method.name,
        "method_description": method.description,
        "target_flops": config.flops,
        "adapted_fraction": fraction,
        "measured_flops": measured["fraction"],
        "measured_on": f"{held.tokens} held-aside calibration tokens (not used to fit thresholds)",
        "measured": {k: v for k, v in measured.items() if k != "modules"},
        "budget": budget_info,
        "config": config.to_dict(),
        "wall_time_s": time.perf_counter() - t0 + (transform or {}).get("seconds", 0.0),
        **({"model_transform": transform} if transform else {}),
        "allocation": allocation.to_dict() if allocation else {"kind": "uniform", "fraction": fraction},
        "allocation_profile_s": t_profile if allocation else 0.0,
        "layers": layer_plans,
        "lm_head": head_plan or {"kind": "dense"},
    }
    offloaded = residency.finish(model, plan)
    return CompressResult(model=model, tokenizer=tokenizer, plan=plan, offloaded=offloaded)


def _compress_layer(ctx: LayerContext, method: Method, fit, held, fractions: dict | None,
                    device: torch.device) -> dict:
    """One decoder layer: each step of the method fits and installs its adapters on statistics of
    the (already compressed) upstream; returns the layer's plan entry with held-aside errors."""
    layer, spec, fraction = ctx.layer, ctx.spec, ctx.fraction
    entry, measures = {"layer": ctx.index}, {}
    for step in method.layer_steps(spec) if fraction < 1.0 else []:
        ctx.fraction = fractions[step.block] if fractions else fraction
        if ctx.fraction >= 1.0:
            continue
        targets = {role: layer.get_submodule(spec.role_path(role)) for role in step.targets}
        stats = collect_inputs(layer, fit, held, targets, device=device, stop_at=targets[step.stop],
                               second_moment=step.moments, layer_index=ctx.index)
        if step.block not in measures:  # snapshot the dense block before its first step
            measures[step.block] = _step_error(ctx, step.block, stats)
        _merge(entry.setdefault(step.block, {"components": {}, "expected_macs": 0.0, "dense_macs": 0.0}),
               step.apply(ctx, stats))
        entry[step.block]["budget_fraction"] = ctx.fraction
        del stats
    for block, measure in measures.items():
        entry[block]["heldout_error"] = measure()
    return entry


def _merge(block: dict, result: dict) -> None:
    """Fold one step's result into its block's plan entry."""
    block["components"].update(result.pop("components", {}))
    block["expected_macs"] += result.pop("expected_macs", 0.0)
    block["dense_macs"] += result.pop("dense_macs", 0.0)
    block.update(result)


def _attach_measurements(layer_plans: list[dict], layers_path: str, modules: dict) -> None:
    """Copy measured active counts / MACs into the plan entries of the modules that took them."""
    by_path = {}
    for entry in layer_plans:
        for step in ("attention", "mlp"):
            for comp in entry.get(step, {}).get("components", {}).values():
                if "path" in comp:
                    by_path[f"{layers_path}.{entry['layer']}.{comp['path']}"] = comp
    for name, m in modules.items():
        if name in by_path:
            by_path[name]["measured_active"] = m["mean_active"]
            by_path[name]["measured_macs"] = m["measured_macs"]


def calibration_data(config: CompressConfig, tokenizer):
    """Calibration windows from `config.dataset`; reads only as much text as it needs first
    (~16 characters per wanted token), the whole source if that proves too short."""
    def attempt(max_chars):
        texts = load_texts(config.dataset, config=config.dataset_config, split=config.split,
                           text_column=config.text_column, max_chars=max_chars)
        return calibration_batches(tokenize_stream(texts, tokenizer), n_tokens=config.calib_tokens,
                                   seq_len=config.seq_len, heldout_fraction=config.heldout_fraction, seed=config.seed)

    try:
        return attempt(16 * config.calib_tokens)
    except DataError as e:
        if "too short" not in str(e):
            raise
        return attempt(None)


def compress(config: CompressConfig | CompressJob, progress: Progress | None = None,
             on_budget: Callable[[dict], None] | None = None) -> CompressResult:
    """Load the model and calibration data named by a config that passed `preflight` (a bare
    `CompressConfig` runs the pre-flight here first), then compress (`on_budget`: see compress_model)."""
    job = config if isinstance(config, CompressJob) else preflight(config)
    config, resources = job.run_config, job.resources
    model, tokenizer, lazy_weights = load_for_compression(config, resources)  # host RAM, or streamed from disk
    method = get_method(config.method)
    if config.weights == "int8":  # refused before any calibration work
        if lazy_weights is not None:
            raise UserError("--weights int8 does not work with layers streamed from disk (the model is bigger than "
                            "--max-memory); compress without it, or compress first and run `rana quantize`")
        check_quantizable(model)
    # an unsupported architecture or an unreachable target fails before any calibration text is read
    fraction, budget_info = budget_for(model.config, method, config.flops, config.seq_len, config.lm_head)
    if on_budget:
        on_budget(budget_info)
    calibration = calibration_data(config, tokenizer)
    result = _compress_layers(model, tokenizer, config, calibration, method, fraction, budget_info, progress,
                              lazy_weights, resources)
    _quantize_last(result, config, calibration, progress)
    result.plan["model"] = config.model
    return result


def _quantize_last(result: CompressResult, config: CompressConfig, calibration, progress) -> None:
    """`--weights int8`: quantize the compressed model (every linear of the decoder and the LM head), its
    thresholds refit on the quantized model's activations of the fit tokens (rana.quantize); plan.json
    records the per-module errors and the refit as `quantization` (the file size is added on saving)."""
    if config.weights != "int8":
        return
    if result.offloaded is not None:
        raise ValueError("--weights int8 does not work with layers streamed from disk")
    report = quantize_model(result.model, calibration.fit, batch_size=config.batch_size,
                            progress=(lambda what, done, total: progress(f"int8 {what}", done, total)) if progress else None)
    result.plan["weights"] = "int8"
    result.plan["quantization"] = report


__all__ = ["BudgetError", "CompressResult", "budget_for", "compress_model", "calibration_data", "compress"]
