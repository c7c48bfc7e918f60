"""A straightforward kernel of the TEAL design, for comparison in bench_kernels_gpu.py only.

Split-K GEMV: program (n-block, k-block) loads its BLOCK_K inputs, masks the rows whose |v| is below
the threshold on the weight load, and atomically adds its fp32 partial sums into a zero-filled fp32
output, cast to the input dtype afterwards (zero-fill, kernel, cast: three launches). Written here
from the published description, not copied.
"""
from __future__ import annotations

import torch

_KERNEL = {}


def _kernel():
    if "k" not in _KERNEL:
        import triton
        import triton.language as tl

        from rana.kernels.triton_gemv import interpreting

        configs = ([triton.Config({"BLOCK_N": 32, "BLOCK_K": 16})] if interpreting() else
                   [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w)
                    for bn in (64, 128, 256) for bk in (16, 32, 64) for w in (4, 8)])

        @triton.autotune(configs=configs, key=["K", "N"], reset_to_zero=["y_ptr"])
        @triton.jit
        def splitk_gemv(w_ptr, v_ptr, y_ptr, t, K, N, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
            offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
            offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok, n_ok = offs_k < K, offs_n < N
            v = tl.load(v_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            active = k_ok & (tl.abs(v) >= t)
            w = tl.load(w_ptr + offs_k[:, None].to(tl.int64) * stride_w + offs_n[None, :],
                        mask=active[:, None] & n_ok[None, :], other=0.0)
            tl.atomic_add(y_ptr + offs_n, tl.sum(w.to(tl.float32) * v[:, None], axis=0), mask=n_ok, sem="relaxed")

        _KERNEL["k"] = (triton, splitk_gemv)
    return _KERNEL["k"]


def teal_reference_gemv(w_t: torch.Tensor, v: torch.Tensor, threshold: float) -> torch.Tensor:
    """sum over k with |v_k| >= threshold of v_k * w_t[k, :], in v's dtype (w_t: K x N row-major)."""
    triton, kernel = _kernel()
    K, N = w_t.shape
    y = torch.zeros(N, dtype=torch.float32, device=v.device)
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), triton.cdiv(K, meta["BLOCK_K"]))
    kernel[grid](w_t, v.reshape(K), y, float(threshold), K, N, w_t.stride(0))
    return y.to(v.dtype)
