"""Theorem 1 of the RaNA paper: the output-optimal rank-r factorisation of a linear layer.

For inputs X (i × k) the best rank-r approximation of W X is U_r U_rᵀ W X, with U the left
singular vectors of W X. Only the second moment C = X Xᵀ is needed, so calibration never keeps
X: the left singular vectors of W X are the eigenvectors of W C Wᵀ (o × o), or — cheaper when
o > i — U = W L V Σ⁻¹ from Lᵀ Wᵀ W L = V Σ² Vᵀ with C = L Lᵀ.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Decomposition:
    """A = U[:, :r] (o × n, orthonormal columns), B = Uᵀ W (n × i), sorted by singular value."""

    U: torch.Tensor  # o × n, float64
    singular_values: torch.Tensor  # n, float64, descending (singular values of W X)

    def factors(self, weight: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) for the leading `rank` directions, in float64."""
        A = self.U[:, :rank]
        B = A.T @ weight.to(torch.float64)
        return A, B


def _lapack(fn, M: torch.Tensor):
    """Run a float64 factorisation. Small CPU problems run single-threaded: MKL's threaded
    eigh/qr were up to 20× *slower* than one thread on a busy 2-core machine (measured)."""
    if M.device.type != "cpu" or max(M.shape) > 2048:
        return fn(M)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(M)
    finally:
        torch.set_num_threads(threads)


def _eigh(M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _lapack(torch.linalg.eigh, M)


def _psd_sqrt(C: torch.Tensor) -> torch.Tensor:
    """L with C = L Lᵀ for a PSD matrix (eigen route: robust to rank deficiency)."""
    evals, evecs = _eigh(C)
    return evecs * evals.clamp_min(0).sqrt()


def decompose(weight: torch.Tensor, second_moment: torch.Tensor, *, damping: float = 1e-6) -> Decomposition:
    """Left singular vectors of W X from W and C = X Xᵀ, in float64.

    `damping` adds a tiny ridge (relative to the mean eigenvalue of C) so directions no token
    excited still get a well-defined basis instead of NaNs.
    """
    W = weight.detach().to(torch.float64)
    C = second_moment.detach().to(torch.float64)
    o, i = W.shape
    if C.shape != (i, i):
        raise ValueError(f"second moment has shape {tuple(C.shape)}, expected ({i}, {i})")
    C = C + damping * (C.diagonal().mean().clamp_min(1e-30)) * torch.eye(i, dtype=C.dtype, device=C.device)
    if o > i:
        L = _psd_sqrt(C)
        WL = W @ L
        evals, V = _eigh(WL.T @ WL)  # ascending
        evals, V = evals.flip(0), V.flip(1)
        sigma = evals.clamp_min(0).sqrt()
        keep = sigma > sigma[0] * 1e-12 if sigma[0] > 0 else torch.zeros_like(sigma, dtype=torch.bool)
        U = (WL @ V[:, keep]) / sigma[keep]
        # Re-orthonormalise against round-off (Σ⁻¹ amplifies it for small σ); keep column signs.
        Q, R = _lapack(torch.linalg.qr, U)
        U = Q * torch.sign(R.diagonal()).where(R.diagonal() != 0, torch.ones_like(R.diagonal()))
        return Decomposition(U=U, singular_values=sigma[keep])
    evals, U = _eigh(W @ C @ W.T)
    evals, U = evals.flip(0), U.flip(1)
    return Decomposition(U=U, singular_values=evals.clamp_min(0).sqrt())
