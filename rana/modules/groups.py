"""Sibling projections that read one input (q/k/v, gate/up) decoded in one grouped masked-GEMV launch.

For one decode token the first sibling called with an input `x` runs every sibling's masked GEMV in
one `decode_masked_grouped` call (one Triton launch on CUDA: per-projection inputs, thresholds,
scales and biases, one mask mode) and keeps the outputs, by the identity of `x`, until the last
sibling took its own; a call with another tensor starts a new grouped call (outputs are never mixed
up, at worst computed twice). Several tokens, training, metering, gradients or a peft-wrapped
child (so LoRA is never skipped) send every member its own path.

Which siblings share an input comes from the architecture (`spec.qkv_paths()`, the gate and up of
`spec.mlp_paths()`; any object with those methods and `layers` serves, so exported models pass
their shipped spec). Only adapters whose kind declares `groupable` (rana.modules.registry) are grouped,
and only those of one mask mode (`decode_mode`): InputSparseLinear ("abs"), NeuronThresholdLinear
("abs_scaled"), RankAdapterLinear ("square": each member's own code `B x` is its input, the A matrices
share the launch). A set with two modes groups each mode's members (at least two) and leaves the rest
alone; fused projections (qkv, gate_up) need no group.
Members whose children hold int8 weights (Int8Linear) decode in one `decode_masked_int8_grouped` call
(one int8 Triton launch); int8 beside full-precision members decode on their own.

Eagerly on CPU (the native kernels) a grouped call would be a loop of single calls, so there the
group steps aside and each member decodes on its own (`GROUP_EAGER_CPU`); the grouping pays where
one launch replaces several: Triton (CUDA, the interpreter) and torch.compile (one op per group).

The links are weak references (the group is no module: nothing changes in the module tree or the
state dict), as for SharedRankCode: ``copy.deepcopy`` keeps them pointing at the originals, so a
copy falls back to the per-projection path until :func:`relink` is called on it.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from ..kernels.ops import decode_dense_grouped, decode_masked_grouped, eager_cpu, sparsity_bin, uses_triton
from .int8 import decode_int8_grouped
from .rank_linear import relink_shared_codes
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
    """Up to three same-mode adapters that are called with one input tensor, in slot order."""

    def __init__(self, members: list[nn.Module]):
        if not 2 <= len(members) <= MAX_GROUP or len({m.decode_mode for m in members}) != 1:
            raise ValueError(f"a decode group holds 2 to {MAX_GROUP} adapters of one mask mode")
        self.mode = members[0].decode_mode
        self._members = [weakref.ref(m) for m in members]
        self._decoded: tuple | None = None
        self.decode_bin = group_bin(members)
        for slot, m in enumerate(members):
            m._decode_group, m._decode_slot = self, slot

    def members(self) -> list[nn.Module | None]:
        return [ref() for ref in self._members]

    def decode(self, x: torch.Tensor, slot: int) -> torch.Tensor | None:
        """Output of member `slot` for one decode token, or None (the member computes its own)."""
        cached = self._decoded
        if cached is not None and cached[0] is x:
            outs, left = cached[1], cached[2]
        else:
            if x.numel() != x.shape[-1] or (not GROUP_EAGER_CPU and eager_cpu(x)):
                return None
            members = self.members()
            if any(m is None or m._decode_group is not self or m.training or m.meter_on for m in members):
                return None  # a member gone, relinked elsewhere, training or metering
            codes = self._codes(x, members)
            operands = [m.decode_operands(x) if z is None else m.decode_operands(x, z) for m, z in zip(members, codes)]
            if any(o is None for o in operands):
                return None  # a peft-wrapped child: LoRA must run
            vs, w_ts, ts, scales, biases = (list(c) for c in zip(*operands))
            int8 = [type(w) is tuple for w in w_ts]  # an Int8Linear child: (q_t, qscale)
            if any(int8):
                if not all(int8):
                    return None  # int8 beside full-precision siblings: each decodes on its own
                if torch.is_grad_enabled() and (x.requires_grad or any(b is not None and b.requires_grad
                                                                       for b in biases)):
                    return None
                flat = decode_int8_grouped(vs, [w[0] for w in w_ts], [w[1] for w in w_ts], ts, self.mode, scales,
                                           biases, self.decode_bin)
            else:
                if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in w_ts)):
                    return None  # the ops have no backward
                flat = decode_masked_grouped(vs, w_ts, ts, self.mode, scales, biases, self.decode_bin)
            lead = x.shape[:-1]
            outs = [y.view(*lead, y.shape[-1]) for y in flat]
            left = len(members)
        left -= 1
        self._decoded = (x, outs, left) if left > 0 else None
        return outs[slot]


    def _codes(self, x: torch.Tensor, members: list) -> list:
        """The rank adapters' codes `B x` of every member in one launch where the Triton kernels run;
        Nones elsewhere (each member then applies its own B)."""
        none = [None] * len(members)
        if self.mode != "square" or not uses_triton(x):  # checked first: CPU decoding runs this every token
            return none
        weights = [m.code_weight() for m in members]
        if any(w is None for w in weights):
            return none
        if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
            return none
        codes = decode_dense_grouped([x] * len(members), weights)
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
    """After ``copy.deepcopy``: point every copied q/k/v slice at its own SharedRankCode and every copied
    decode group at the copied members (in their slots). Needs no architecture; returns the links made."""
    count = relink_shared_codes(root)
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
