"""The masked GEMV called the way the kernel tests call it: raw tensors (``w_t`` (K, N) or int8 ``q_t`` with
``qscale``, a token of any leading dims, a threshold that may be None, a float or a tensor), through the product's
paths. Test code only: rana's modules decode through rana.kernels.route with the operands they keep.

    masked_gemv / masked_gemv_int8                the decode route with an operand made for the call (the
                                                  native kernel or the torch gather for one CPU token, Triton
                                                  on CUDA, the dense product for several tokens)
    masked_gemv_triton / masked_gemv_int8_triton  the Triton kernel for one token (CUDA, or CPU tensors under
                                                  TRITON_INTERPRET=1); everything active launches mode "none"
"""
from __future__ import annotations

import math

import torch

from rana.kernels import route
from rana.kernels import torch_gemv as tgm
from rana.kernels.triton_gemv import grouped_masked_gemv_triton, interpreting, triton_available
from rana.kernels.weights import FloatWeight, Int8Weight


def _all_active(threshold) -> bool:
    return threshold is None or (not isinstance(threshold, torch.Tensor) and float(threshold) == -math.inf)


def _threshold_tensor(threshold, v: torch.Tensor) -> torch.Tensor | None:
    if threshold is None:
        return None
    if isinstance(threshold, torch.Tensor):
        return threshold.reshape(()).to(device=v.device, dtype=torch.float32)
    return torch.tensor(float(threshold), dtype=torch.float32, device=v.device)


def masked_gemv(w_t, v, threshold, *, mode: str, scale=None, bias=None) -> torch.Tensor:
    """``(m ⊙ v) @ w_t (+ bias)`` through the decode route (float weights)."""
    tgm.check_args(w_t, v, mode, threshold, scale)
    return route.decode_masked(FloatWeight(w_t.t(), bias), v, _threshold_tensor(threshold, v), mode, scale)


def masked_gemv_int8(q_t, qscale, v, threshold, *, mode: str, scale=None, bias=None) -> torch.Tensor:
    """``qscale ⊙ ((m ⊙ v) @ q_t) (+ bias)`` through the decode route (int8 weights)."""
    tgm.check_int8_args(q_t, qscale, v, mode, threshold, scale)
    return route.decode_masked(Int8Weight(q_t, qscale.reshape(-1), bias), v, _threshold_tensor(threshold, v), mode,
                               scale)


def _one_token_launch(w_t, v, threshold, mode: str, scale, name: str):
    """(K, N, kernel mode, device threshold, fp32 scale) of a one-token Triton launch."""
    if not triton_available():
        raise RuntimeError("triton is not installed")
    K, N = w_t.shape
    if v.numel() != K:
        raise ValueError(f"{name} handles one token, got v of shape {tuple(v.shape)}")
    if not interpreting() and not (v.is_cuda and w_t.is_cuda):
        raise ValueError(f"{name} needs CUDA tensors (or TRITON_INTERPRET=1)")
    if mode == "none" or _all_active(threshold):
        kernel_mode, t = "none", torch.zeros((), dtype=torch.float32, device=v.device)
    else:
        kernel_mode = mode
        if isinstance(threshold, torch.Tensor) and threshold.device != v.device and threshold.device.type == "cpu":
            threshold = float(threshold)  # a host threshold next to accelerator inputs is read on the host
        t = _threshold_tensor(threshold, v)
    s = scale.reshape(K).to(device=v.device, dtype=torch.float32) if kernel_mode == "abs_scaled" else None
    return K, N, kernel_mode, t, s


def masked_gemv_triton(w_t, v, threshold, *, mode: str, scale=None, bias=None) -> torch.Tensor:
    """The Triton kernel for one token (v of shape (K,), (1, K) or (1, 1, K))."""
    tgm.check_args(w_t, v, mode, threshold, scale)
    K, N, kernel_mode, t, s = _one_token_launch(w_t, v, threshold, mode, scale, "masked_gemv_triton")
    y = grouped_masked_gemv_triton([v.reshape(K)], [w_t], [t], kernel_mode, [s],
                                   [None if bias is None else bias.reshape(N)])
    return y.reshape(*v.shape[:-1], N)


def masked_gemv_int8_triton(q_t, qscale, v, threshold, *, mode: str, scale=None, bias=None) -> torch.Tensor:
    """The Triton kernel's int8 path for one token."""
    tgm.check_int8_args(q_t, qscale, v, mode, threshold, scale)
    K, N, kernel_mode, t, s = _one_token_launch(q_t, v, None if mode == "none" else threshold, mode, scale,
                                                "masked_gemv_int8_triton")
    qs = qscale.reshape(N).to(device=v.device, dtype=torch.float32)
    y = grouped_masked_gemv_triton([v.reshape(K)], [q_t], [t], kernel_mode, [s],
                                   [None if bias is None else bias.reshape(N)], qscales=[qs])
    return y.reshape(*v.shape[:-1], N)
