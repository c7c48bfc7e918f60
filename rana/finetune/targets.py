"""What trains, and the model surgery around it: LoRA targets (the adapters' linear children, dense
projections by name), LAuReL residuals, trainable flags; after training, the merge back to plain
adapters (column-major weights, neuron norms that follow the trained weights).

What an adapter offers LoRA and needs after a merge is what its kind declares (rana.modules.registry):
`linear_children`, `bare_weights`, `norms_child`, `restore`; a kind registered there needs nothing here."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..archs import get_arch
from ..modules.int8 import Int8Linear
from ..modules.laurel import LaurelConfig, apply_laurel, get_laurel_config, laurel_parameters
from ..modules.rebuild import restore_adapters
from ..modules.registry import adapter_class, declared
from .config import FinetuneConfig, FinetuneError

LINEAR_TYPES = (nn.Linear, Int8Linear)  # what LoRA wraps: full-precision and int8 linears (rana.finetune.int8_lora)


def _is_linear(module: nn.Module) -> bool:
    """An nn.Linear or Int8Linear, or a peft LoRA wrapper around one."""
    return isinstance(module, LINEAR_TYPES) or isinstance(getattr(module, "base_layer", None), LINEAR_TYPES)


def _is_adapter(module: nn.Module) -> bool:
    return adapter_class(module) is not None


def _lora_children(adapter: nn.Module) -> list[str]:
    """Names of `adapter`'s linear children LoRA can wrap (its kind's `linear_children`). Empty ones are
    left out: a rank-0 SparseLowRankLinear (plain magnitude sparsity) keeps 0-row side linears, which LoRA
    cannot train. CatsActivation and RotatedInput hold none (the projections around them are plain linears)."""
    out = []
    for name in declared(adapter, "linear_children"):
        child = adapter._modules.get(name)
        base = getattr(child, "base_layer", child)
        if _is_linear(child) and base.in_features * base.out_features > 0:
            out.append(name)
    return out


def adapter_linear_names(model: nn.Module) -> list[str]:
    """Dotted names of the linear children of every RaNA adapter (their B / A / linear / side_in / side_out)."""
    names = []
    for name, m in model.named_modules():
        if _is_adapter(m):
            names += [f"{name}.{child}" if name else child for child in _lora_children(m)]
    return names


def has_int8(model: nn.Module) -> bool:
    """True when the model holds int8 linears (an int8 rana folder)."""
    return any(type(m) is Int8Linear for m in model.modules())


def _layer_roots(model: nn.Module) -> list[str]:
    """Names of the decoder-layer containers (LoRA 'all' stays inside them: no embeddings / lm_head)."""
    try:
        return [get_arch(model.config).layers]
    except Exception:  # noqa: BLE001 - unknown architecture: any ModuleList named like layers
        return [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and n.split(".")[-1] in ("layers", "h")]


def _dense_projection_names(model: nn.Module) -> list[str]:
    """nn.Linear modules inside the decoder layers that are not part of an adapter."""
    roots = _layer_roots(model)
    inside_adapter = set()
    for name, m in model.named_modules():
        if _is_adapter(m):
            inside_adapter.update(f"{name}.{c}" for c, _ in m.named_modules() if c)
    out = []
    for name, m in model.named_modules():
        if isinstance(m, LINEAR_TYPES) and name not in inside_adapter and any(name.startswith(r + ".") for r in roots):
            if ".laurel_" not in name:
                out.append(name)
    return out


def resolve_lora_targets(model: nn.Module, spec: str | None) -> list[str]:
    """Full module names for peft from ``adapters`` | ``all`` | ``none`` | ``name,name,...``.

    A name selects every module whose dotted path ends with it (``o_proj``, ``mlp.down_proj``); an
    adapter module contributes its linear children, a plain nn.Linear itself; ``adapters`` may appear in
    the list.
    """
    spec = (spec or "adapters").strip()
    adapters = adapter_linear_names(model)
    if spec == "none":
        return []
    if spec == "adapters":
        if not adapters:
            raise FinetuneError(f"--lora-targets adapters: {_no_adapter_linears(model)}; use --lora-targets all, "
                                "a list of module names (e.g. q_proj,v_proj) or --full")
        return adapters
    if spec == "all":
        return adapters + _dense_projection_names(model)
    chosen: list[str] = []
    for item in (s.strip() for s in spec.split(",")):
        if item:
            chosen += adapters if item == "adapters" else _named_targets(model, item, adapters)
    return list(dict.fromkeys(chosen))


def _no_adapter_linears(model: nn.Module) -> str:
    """Why a model gives `adapters` no targets: no adapters, or only kinds without linear children."""
    kinds = sorted({type(m).__name__ for m in model.modules() if _is_adapter(m)})
    if not kinds:
        return "this model has no RaNA adapters"
    return f"this model's adapters ({', '.join(kinds)}) hold no linear layers LoRA can wrap"


def _named_targets(model: nn.Module, item: str, adapters: list[str]) -> list[str]:
    """The LoRA targets one ``--lora-targets`` name selects (see `resolve_lora_targets`)."""
    found, bare = [], []
    for n, m in model.named_modules():
        if not (n == item or n.endswith("." + item)):
            continue
        if _is_adapter(m):
            found += [f"{n}.{c}" for c in _lora_children(m)]
            # weights that are parameters of its own (the head's, a tied one the embedding's; stacked experts'):
            # peft's target_modules wraps modules, never a bare parameter, so --full trains them
            if declared(m, "bare_weights"):
                bare.append(f"'{n}' ({type(m).__name__})")
        elif isinstance(m, LINEAR_TYPES):
            found.append(n)
    if found:
        return found
    if bare:
        raise FinetuneError(f"--lora-targets {item}: {', '.join(bare)} holds its weights as parameters of its own, "
                            "not linear layers, and LoRA wraps only linear layers; train it with --full")
    leaves = sorted({n.split(".")[-1] for n in _dense_projection_names(model)} | {n.split(".")[-2] for n in adapters})
    raise FinetuneError(f"--lora-targets: no linear or adapter module named {item!r}; available: "
                        f"{', '.join(leaves)} (or adapters / all)")


def unique_parameters(params):
    """Each parameter once (tied weights appear under several names)."""
    seen = set()
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            yield p


@dataclass(frozen=True)
class Trainables:
    """What a model made trainable by `make_trainable` trains (the counts go into finetune.json)."""

    peft: bool  # LoRA wraps some modules
    lora_targets: int  # modules LoRA wraps
    laurel: LaurelConfig | None  # the LAuReL residuals the model carries (trained, or kept frozen)
    trainable_params: int
    laurel_params: int
    lora_params: int
    total_params: int


def make_trainable(model: nn.Module, config: FinetuneConfig) -> tuple[nn.Module, Trainables]:
    """Add LAuReL / LoRA as `config` asks and set the trainable flags; returns the (maybe peft-wrapped) model."""
    existing = get_laurel_config(model)
    laurel_cfg = None
    if config.laurel != "none":
        laurel_cfg = LaurelConfig(variant=config.laurel, rank=config.laurel_rank, history=config.laurel_history)
        if existing is not None:
            if existing.components != laurel_cfg.components or existing.rank != laurel_cfg.rank:
                raise FinetuneError(f"the source already has LAuReL {existing.variant} (rank {existing.rank}); "
                                    f"--laurel {config.laurel} would add a second one: pass --laurel {existing.variant} "
                                    f"--laurel-rank {existing.rank} to keep training it, or --laurel none")
            laurel_cfg = existing
        else:
            apply_laurel(model, laurel_cfg, dtype=torch.float32 if config.dtype != "float32" else None)
    elif existing is not None:
        laurel_cfg = existing  # kept (frozen) and saved again
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    targets = [] if config.full else resolve_lora_targets(model, config.lora_targets)
    peft_on = bool(targets)
    if config.full:
        if has_int8(model):
            raise FinetuneError("--full cannot train int8 weights (codes have no gradient); fine-tune an int8 "
                                "folder with LoRA (--lora-targets), merged back by requantizing")
        for p in model.parameters():
            p.requires_grad_(True)
    elif peft_on:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                          target_modules=targets, bias="none")
        if has_int8(model):  # LoRA on the frozen int8 base, merged back by requantizing
            from .int8_lora import register_int8

            register_int8(lora)
        model = get_peft_model(model, lora)
    else:
        for p in model.parameters():
            p.requires_grad_(False)
    if config.laurel != "none":
        for p in laurel_parameters(model):
            p.requires_grad_(True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise FinetuneError("nothing to train: --lora-targets none without --laurel; pick LoRA targets, a LAuReL "
                            "variant or --full")
    if hasattr(model, "config"):
        model.config.use_cache = False
    return model, Trainables(
        peft=peft_on,
        lora_targets=len(targets),
        laurel=laurel_cfg,
        trainable_params=sum(p.numel() for p in unique_parameters(trainable)),
        laurel_params=sum(p.numel() for p in laurel_parameters(model)),
        lora_params=sum(p.numel() for n, p in model.named_parameters() if "lora_" in n),
        total_params=sum(p.numel() for p in unique_parameters(model.parameters())),
    )


def merge_trained(model: nn.Module, *, gradient_checkpointing: bool) -> nn.Module:
    """An unwrapped trained model as a plain frozen one in eval mode: LoRA merged (into an int8 base by
    requantizing, rana.finetune.int8_lora), every adapter's weights in its decode layouts again, neuron
    norms of the merged weights, the KV cache back on."""
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    if hasattr(model, "gradient_checkpointing_disable") and gradient_checkpointing:
        model.gradient_checkpointing_disable()
    for p in model.parameters():
        p.requires_grad_(False)
    # every adapter's weights back in the layouts its decode path reads (masked linears column-major, the rank
    # adapters' B row-major, stacked experts input-major, an untied head's own weight column-major) and its
    # column norms those of the merged weights: each kind's `restore`
    restore_adapters(model)
    if hasattr(model, "config"):
        model.config.use_cache = True
    return model.eval()


@torch.no_grad()
def sync_neuron_norms(model: nn.Module) -> None:
    """Point every mask criterion that reads column norms (``|h_i|·‖W[:, i]‖``, a kind's `norms_child`) at
    the weight it really applies: the trained weight, or with LoRA the effective ``W + ΔW``. Called after
    each optimizer step, so training sees the masks the merged model will use (merged == unmerged)."""
    for m in model.modules():
        child = declared(m, "norms_child")
        if child is None:
            continue
        lin = m._modules[child]
        base = getattr(lin, "base_layer", None)
        if isinstance(base, LINEAR_TYPES) and hasattr(lin, "get_delta_weight"):
            # an int8 base: its fp32 dequantized weight (the merge requantizes W + ΔW)
            w = base.dequantized(torch.float32) if type(base) is Int8Linear else base.weight
            for name in getattr(lin, "active_adapters", []):
                if name in getattr(lin, "lora_A", {}) and not lin.merged:
                    w = w + lin.get_delta_weight(name)
            m.refresh_norms(w)
        else:
            m.refresh_norms()  # of an int8 weight: the fp32 dequantized one, whatever the compute dtype
