"""A projection's weights as the decode kernels read them: one small type per weight format.

    FloatWeight   an nn.Linear weight (N, K) stored column-major (its ``w_t = weight.t()`` is (K, N) with unit
                  stride along N: a skipped input skips one contiguous row), or experts stacked (E, N, K) the
                  same way; the bias
    Int8Weight    int8 codes ``q_t`` (K, N), unit stride along N, fp32 per-output-channel scales (N,); the bias; its
                  activation format (``activations``: "float", or "int8": each token's kept inputs quantized per
                  ``block`` input positions, multiplied int8 × int8, torch_gemv.quantize_activations)

A module makes its operand once (rana.modules.common: on its first decode token after it was built, loaded or
moved) and hands it to the entry points of the decode route (route.py), whatever its format. The operand
carries what is decided once rather than per token:

- ``backend``: which implementations serve its tokens (route.py's table), chosen from where its tensors live
  and what this process can run: "triton" (CUDA with triton; CPU tensors under the interpreter with
  ``RANA_TRITON_ON_CPU=1``), "native" (CPU, the native library built, weights it takes), else "torch";
- its bound native call (cpu_gemv.NativeCall), bound on its first CPU token for the mask mode and scale its
  module uses, and rebound only if those (or the weights' storage) change.

Adding a weight format is one subclass here (its tensors as the kernels take them: ``op_tensors``) plus its
kernels. Self-contained (torch + its sibling kernel files) so it ships with exported models.
"""
from __future__ import annotations

import os

import torch

from .cpu_gemv import A8_BLOCK_UNRECORDED, NativeCall, check_a8_block, native_kernel, native_masked
from .triton_gemv import interpreting, kernels_available

__all__ = ["Weight", "FloatWeight", "Int8Weight", "backend_for", "eager_cpu", "BACKENDS", "TRITON_ON_CPU"]

BACKENDS = ("native", "triton", "torch")

# CPU tensors take the Triton kernels (under the interpreter) only when asked for with RANA_TRITON_ON_CPU=1 as
# well: TRITON_INTERPRET=1 alone is set for whole test sessions, and the interpreter is 30-70x slower than the
# native kernel for every decoded token. Read once, when this module is imported.
TRITON_ON_CPU = interpreting() and os.environ.get("RANA_TRITON_ON_CPU") == "1"


def eager_cpu(v: torch.Tensor) -> bool:
    """Whether one token on `v` runs eagerly on CPU, where no backend has a grouped launch (not traced, not the
    interpreter's Triton): there a grouped call is a loop of single calls, so callers may skip assembling one."""
    return v.is_cpu and not TRITON_ON_CPU and not torch.compiler.is_compiling()


TRITON_KERNELS = kernels_available()  # read once: the choice below runs inside traced steps too


def backend_for(device: torch.device, native_ok: bool) -> str:
    """The backend for weights on `device`; `native_ok`: the native kernel takes this format and dtype. Under
    torch.compile (an operand made for a trace) only "triton" matters (route.py's traced rows), so the native
    library, which may have to be built first, is not asked for."""
    if TRITON_KERNELS and (device.type == "cuda" or (device.type == "cpu" and TRITON_ON_CPU)):
        return "triton"
    if device.type == "cpu" and native_ok and not torch.compiler.is_compiling() and native_kernel() is not None:
        return "native"
    return "torch"


def _unpickled_none():
    return None


class Weight:
    """What every format gives the route: its tensors as the ops and kernels take them, its backend, its bias,
    and the native call bound for a mask mode and scale."""

    format: str = ""
    activations: str = "float"  # the tokens as the kernels multiply them (Int8Weight may take "int8")
    block: int = A8_BLOCK_UNRECORDED  # int8 activations: the inputs quantized per scale
    # stored: the tensor whose storage a bound call reads, checked per token (None: not checked); bound: the native
    # call bound last (see `native`)
    __slots__ = ("bias", "backend", "stored", "bound")

    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    def op_tensors(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(w_t (K, N) with unit stride along N, the int8 scales or None, the bias or None)."""
        raise NotImplementedError

    def native(self, mode: str, scale: torch.Tensor | None) -> NativeCall:
        """The native call for `mode` and `scale`, bound on first use and kept while it describes them and the
        weights' storage (`stored`: an in-place ``.data`` swap moves it)."""
        call = self.bound
        if call is None or call.mode != mode or call.tensors[2] is not scale or (
                self.stored is not None and call.ptr != self.stored.data_ptr()):
            w_t, qscale, bias = self.op_tensors()
            call = self.bound = NativeCall.bind(w_t, qscale, mode, scale, bias, activations=self.activations,
                                                block=self.block)
        return call

    def native_once(self, v: torch.Tensor, threshold: float, mode: str, scale: torch.Tensor | None):
        """The native kernel for a token the bound call declined, its operands converted for this one call; None
        (the default): the format has no such conversion and the token takes the torch path."""
        return None

    def __reduce__(self):  # holds a module's tensors and a call bound to their addresses: a copy remakes its own
        return _unpickled_none, ()


class FloatWeight(Weight):
    """Float weights: `weight` (N, K) as nn.Linear holds it (column-major for the masked kernels), or stacked
    experts (E, N, K) stored input-major; `bias` (N,) or None."""

    format = "float"
    __slots__ = ("weight",)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias, self.bound = weight, bias, None
        self.stored = weight
        self.backend = backend_for(weight.device, weight.dtype is torch.float32)

    @property
    def w_t(self) -> torch.Tensor:
        return self.weight.transpose(-2, -1)

    @property
    def requires_grad(self) -> bool:
        """The kernels have no backward: a token whose weights want gradients takes the torch path."""
        return self.weight.requires_grad or (self.bias is not None and self.bias.requires_grad)

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def op_tensors(self):
        return self.weight.transpose(-2, -1), None, self.bias


class Int8Weight(Weight):
    """int8 codes `q_t` (K, N) with unit stride along N and fp32 per-output-channel `qscale` (N,); `bias`;
    `activations` "float" (W8A16: fp32 tokens times the codes) or "int8" (W8A8, each token's kept inputs quantized
    per `block` input positions)."""

    format = "int8"
    __slots__ = ("q_t", "qscale", "activations", "block")

    def __init__(self, q_t: torch.Tensor, qscale: torch.Tensor, bias: torch.Tensor | None = None,
                 activations: str = "float", block: int = A8_BLOCK_UNRECORDED):
        self.q_t, self.qscale, self.bias, self.bound = q_t, qscale, bias, None
        self.activations, self.block = activations, check_a8_block(block)
        # int8 codes are buffers, replaced (not swapped in place) when they change: the identity checks of its
        # layer's operand see that, and a token does not read the storage's address (float weights are
        # Parameters, whose `.data` peft and rana's loaders swap)
        self.stored = None
        self.backend = backend_for(q_t.device, True)  # the native kernel takes int8 with any float token

    @property
    def requires_grad(self) -> bool:
        return self.bias is not None and self.bias.requires_grad  # the codes and scales are buffers

    @property
    def device(self) -> torch.device:
        return self.q_t.device

    def op_tensors(self):
        return self.q_t, self.qscale, self.bias

    def native_once(self, v, threshold, mode, scale):
        """A bf16 / fp16 token, bias or scale: the kernel still, with fp32 operands for this call (the int8 kernel
        takes any float token that way; its bound call declines them so that the fp32 case pays no checks)."""
        return native_masked(self.q_t, self.qscale, v, threshold, mode, scale, self.bias, activations=self.activations,
                             block=self.block)
