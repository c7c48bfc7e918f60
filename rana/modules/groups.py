"""Sibling projections that read one input (q/k/v, gate/up) decoded in one grouped masked-GEMV launch.

For one decode token the first sibling called with an input `x` runs every sibling's masked GEMV in
one `decode_masked_grouped` call (rana.kernels.route: one Triton launch on CUDA, per-projection inputs,
thresholds, scales and biases, one mask mode) and keeps the outputs, by the identity of `x`, until the last
sibling took its own (`rana.modules.common.ByInput`); a call with another tensor starts a new grouped call
(outputs are never mixed up, at worst computed twice). Several tokens, training, metering, gradients or a
peft-wrapped child (so LoRA is never skipped) send every member its own path.

Which siblings share an input comes from the architecture (`spec.qkv_paths()`, the gate and up of
`spec.mlp_paths()`; any object with those methods and `layers` serves, so exported models pass
their shipped spec). Only adapters whose kind declares `groupable` (rana.modules.registry) are grouped,
and only those of one mask mode (`decode_mode`): InputSparseLinear ("abs"), NeuronThresholdLinear
("abs_scaled"), RankAdapterLinear ("square": each member's own code `B x` is its input, the A matrices
share the launch). A set with two modes groups each mode's members (at least two) and leaves the rest
alone; fused projections (qkv, gate_up) need no group. A shared rank code (rana.modules.rank_linear) groups
its own consumers, q/k/v slices of one stacked A reading the one code `B x` it computes per input.
Members of one format decode in one call (float, or int8: one int8 Triton launch); int8 beside
full-precision members decode on their own.

Eagerly on CPU (the native kernels, no Triton) a grouped call would be a loop of single calls, so there the
group steps aside and each member decodes on its own (`GROUP_EAGER_CPU`); the grouping pays where
one launch replaces several: Triton (CUDA, the interpreter) and torch.compile (one op per group). A shared
code's group decodes on CPU too: it computes the code once without the mask its consumers' own path would.

The links are weak references (the group is no module: nothing changes in the module tree or the
state dict): ``copy.deepcopy`` keeps them pointing at the originals, so a copy falls back to the
per-projection path until :func:`relink` is called on it.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from ..kernels.route import decode_dense_grouped, decode_masked_grouped, eager_cpu, sparsity_bin
from .common import ByInput
from .registry import declared


def groupable(module: nn.Module) -> bool:
    """True for an adapter whose kind decodes in one launch with its siblings (`groupable`)."""
    return declared(module, "groupable") is True


MAX_GROUP = 3  # the grouped kernel's limit
# Eagerly on CPU (the native kernels, no Triton) a grouped call is a loop of single calls: the group then only
# adds work (gathering operands, caching outputs), ~7 µs per projection per token, so each member decodes on
# its own. True: group there too (tests of the grouping logic on CPU).
GROUP_EAGER_CPU = False


class DecodeGroup:
    """Up to three same-mode adapters that are called with one input tensor, in slot order. With `code` (a
    shared rank code), its consumers: every member's input is the code `B x`, computed once per input."""

    def __init__(self, members: list[nn.Module], code: nn.Module | None = None):
        if not 2 <= len(members) <= MAX_GROUP or len({m.decode_mode for m in members}) != 1:
            raise ValueError(f"a decode group holds 2 to {MAX_GROUP} adapters of one mask mode")
        self.mode = members[0].decode_mode
        self._members = [weakref.ref(m) for m in members]
        self._code = None if code is None else weakref.ref(code)
        self._outputs = ByInput()
        self._bin = group_bin(members) if code is None else None
        for slot, m in enumerate(members):
            m._decode_group, m._decode_slot = self, slot

    def members(self) -> list[nn.Module | None]:
        return [ref() for ref in self._members]

    @property
    def decode_bin(self) -> int:
        """The launch's sparsity bin (the Triton tuning key): a shared code's own, else the members' (group_bin)."""
        code = None if self._code is None else self._code()
        return self._bin if code is None else code.decode_bin

    def decode(self, x: torch.Tensor, slot: int) -> torch.Tensor | None:
        """Output of member `slot` for one decode token, or None (the member computes its own)."""
        if self._code is None and not GROUP_EAGER_CPU and eager_cpu(x):
            return None  # checked first: CPU decoding runs this every token
        outs = self._outputs.get(x)
        if outs is None:
            outs = self._decode(x)
            if outs is None:
                return None
            self._outputs.put(x, outs, len(outs))
        return outs[slot]

    def _decode(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every member's output for one decode token, in one grouped call; None where a member must compute
        its own (see the module docstring)."""
        if x.numel() != x.shape[-1]:
            return None
        code = None if self._code is None else self._code()
        members = self.members()
        if any(m is None or m._decode_group is not self or m.training for m in members):
            return None  # a member gone or relinked elsewhere, or training
        if code is None:
            if self._code is not None or any(m.meter_on for m in members):
                return None  # its shared code gone, or a member metering
        elif code.training or code.meter_on:
            return None
        codes = self._codes(x, members, code)
        operands = [m.decode_operands(x, z) for m, z in zip(members, codes)]
        if any(o is None for o in operands):
            return None  # a peft-wrapped child: LoRA must run
        vs, ws, ts, scales = (list(c) for c in zip(*operands))
        if len({(w.format, w.backend, w.activations, w.block) for w in ws}) != 1:
            return None  # int8 beside full-precision siblings (or another activation format): each on its own
        if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in ws)):
            return None  # the kernels have no backward
        flat = decode_masked_grouped(ws, vs, ts, self.mode, scales, self.decode_bin)
        lead = x.shape[:-1]
        return [y.view(*lead, y.shape[-1]) for y in flat]

    def _codes(self, x: torch.Tensor, members: list, code: nn.Module | None) -> list:
        """The members' inputs where the group computes them: a shared code's `B x` once for all; the rank
        adapters' own codes in one launch where the backend has one (Triton); Nones elsewhere (each member then
        applies its own B)."""
        if code is not None:
            z = code.B(x)
            return [z] * len(members)
        none = [None] * len(members)
        if self.mode != "square":
            return none
        weights = [m.code_weight() for m in members]
        if any(w is None for w in weights):
            return none
        if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
            return none
        codes = decode_dense_grouped(weights, [x] * len(members))
        return none if codes is None else [z.view(*x.shape[:-1], z.shape[-1]) for z in codes]


def group_bin(members) -> int:
    """The sparsity bin of a grouped launch: the members' expected active fractions weighted by their
    weight sizes (members without one count as half active, the default bin)."""
    total = active = 0.0
    for m in members:
        size = float(m.in_features * m.out_features)
        f = m.active_fraction
        total += size
        active += size * (0.5 if f is None else f)
    return sparsity_bin(active / total) if total else sparsity_bin(0.5)


def unlink(module: nn.Module) -> None:
    if groupable(module):
        module._decode_group, module._decode_slot = None, 0


def link_siblings(root: nn.Module, paths) -> int:
    """Group the adapters at `paths` (relative to `root`; they must read one input) by mask mode;
    returns the groups made. Paths that do not exist or hold no groupable adapter are skipped."""
    found = []
    for path in paths:
        try:
            m = root.get_submodule(path)
        except AttributeError:
            continue
        unlink(m)
        if groupable(m):
            found.append(m)
    by_mode: dict[str, list] = {}
    for m in found:
        by_mode.setdefault(m.decode_mode, []).append(m)
    made = 0
    for members in by_mode.values():
        if len(members) >= 2:
            DecodeGroup(members[:MAX_GROUP])
            made += 1
    return made


def shared_input_paths(spec) -> list[list[str]]:
    """Layer-relative paths of the projection sets that read one input: q/k/v, gate/up (unfused only)."""
    sets = []
    qkv = spec.qkv_paths()
    if len(qkv) > 1:
        sets.append(list(qkv.values()))
    mlp = spec.mlp_paths()
    if "gate" in mlp and "up" in mlp:
        sets.append([mlp["gate"], mlp["up"]])
    return sets


def link_layer(layer: nn.Module, spec) -> int:
    """(Re)link one decoder layer's sibling groups; returns the groups made."""
    return sum(link_siblings(layer, paths) for paths in shared_input_paths(spec))


def link_decode_groups(model: nn.Module, spec) -> int:
    """(Re)link the sibling groups of every decoder layer of a *ForCausalLM model; returns the groups made."""
    try:
        layers = model.get_submodule(spec.layers)
    except AttributeError:
        return 0
    return sum(link_layer(layer, spec) for layer in layers)


def relink(root: nn.Module) -> int:
    """After ``copy.deepcopy``: point every copied shared code at the consumers beside it (its q/k/v slices)
    and every copied decode group at the copied members (in their slots). Needs no architecture; returns the
    links made."""
    count = 0
    for parent in root.modules():
        for child in parent.children():
            relink_consumers = getattr(child, "relink_consumers", None)  # a shared rank code
            if relink_consumers is not None:
                count += relink_consumers(parent)
    groups: dict[int, list] = {}
    for m in root.modules():
        if groupable(m) and m._decode_group is not None:
            groups.setdefault(id(m._decode_group), []).append(m)
    for members in groups.values():
        members.sort(key=lambda m: m._decode_slot)
        for m in members:
            unlink(m)
        if len(members) >= 2 and len({m.decode_mode for m in members}) == 1:
            DecodeGroup(members[:MAX_GROUP])
            count += 1
    return count


__all__ = ["DecodeGroup", "groupable", "GROUP_EAGER_CPU", "group_bin", "link_siblings", "shared_input_paths",
           "link_layer", "link_decode_groups", "relink", "unlink"]
