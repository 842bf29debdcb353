"""Muon (momentum + Newton-Schulz orthogonalisation) for the 2-D matrices inside the blocks, with
the orthogonalisation in a dtype chosen for the device (`optim.muon_dtype`).

Why our own: torch.optim.Muon (torch >= 2.9) always orthogonalises in bf16 (`grad.bfloat16()`),
which is fast where bf16 is native (GPUs of compute capability >= 8.0, CPUs with AVX512-BF16 or
AMX) and ~20x slower than float32 where it is emulated (AVX2-only CPUs, older GPUs). The update
below is the same computation, op for op: in bfloat16 it equals torch.optim.Muon with
adjust_lr_fn="original" bit for bit (tests/test_optim.py); in float32 the orthogonalisation is
within 1e-5 of the same iteration in float64 (max abs error; measured ~7e-7 on entries of
~0.1-0.6, where bf16 is ~1e-2 off; same test file). It also runs on a torch without
torch.optim.Muon (< 2.9).

The optimizer keeps torch.optim.Muon's layout: the same param-group keys (lr, weight_decay,
momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn) and one state entry per matrix,
`momentum_buffer`, so checkpoints written with either resume with either. The dtype is not part
of that state: it is a property of the device a run is on, not of the run.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# Keller Jordan's quintic iteration (torch.optim._muon's DEFAULT_A, _B, _C and EPS)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
EPS = 1e-7


def orthogonalise(
    g: Tensor,
    steps: int,
    dtype: torch.dtype = torch.bfloat16,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = EPS,
) -> Tensor:
    """~U V^T of g = U S V^T by `steps` Newton-Schulz iterations in `dtype` (the singular values
    land in roughly [0.5, 1.5], which is all Muon needs). Returns a new tensor in `dtype`, never
    g itself. Works on the wide orientation (rows <= cols), where the Gram matrix is smaller."""
    a, b, c = coefficients
    tall = g.size(0) > g.size(1)
    x = g.to(dtype)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm = 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G^2
        x = torch.addmm(x, poly, x, beta=a)  # a X + (b G + c G^2) X
    return x.T if tall else x


def lr_scale(shape: torch.Size) -> float:
    """torch's adjust_lr_fn "original" (Keller Jordan's rule): sqrt(max(1, rows / cols))."""
    rows, cols = shape[:2]
    return math.sqrt(max(1, rows / cols))


class Muon(torch.optim.Optimizer):
    """Muon over 2-D parameters: per matrix, momentum (nesterov by default), its orthogonalisation
    in `dtype`, decoupled weight decay p *= 1 - lr * weight_decay (the group's lr, without
    lr_scale), then p -= lr * lr_scale(p.shape) * update. Groups and state as torch.optim.Muon's
    (module docstring)."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5, dtype: torch.dtype = torch.bfloat16):  # fmt: skip
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_coefficients=NS_COEFFICIENTS, eps=EPS, ns_steps=ns_steps, adjust_lr_fn="original")  # fmt: skip
        super().__init__(params, defaults)
        self.dtype = dtype
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"Muon takes 2-D parameters only, got shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("Muon.step takes no closure")
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = orthogonalise(update, group["ns_steps"], self.dtype, group["ns_coefficients"], group["eps"])  # fmt: skip
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-lr * lr_scale(p.shape))
