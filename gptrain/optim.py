"""AdamW with GPT-2 weight-decay groups, and the warmup + cosine learning-rate schedule.

Weight decay applies to matrices (embeddings and Linear weights, dim >= 2) and not to biases or
LayerNorm parameters. Works unchanged with FSDP2 (DTensor parameters report their global shape).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from gptrain.config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: dim >= 2 parameters decayed, the rest not; a tied weight appears once."""
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() yields a shared (tied) Parameter only once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: OptimConfig, device_type: str) -> torch.optim.AdamW:
    """AdamW(betas=(beta1, beta2), eps) over param_groups: the fused kernel on CUDA, else foreach."""
    fused = device_type == "cuda"
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=fused,
        foreach=not fused,
    )


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """The learning rate of optimizer step `step` under cfg's schedule (see the two below)."""
    return cosine_lr(
        step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, max_steps=max_steps
    )


def cosine_lr(step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """Learning rate of optimizer step `step` (counted from 0).

        step < warmup_steps:              lr * (step + 1) / warmup_steps      (linear warmup)
        step >= max_steps - 1:            min_lr                              (end, held after)
        otherwise, with p = (step - warmup_steps) / (max_steps - 1 - warmup_steps) in [0, 1):
                                          min_lr + 0.5 * (1 + cos(pi * p)) * (lr - min_lr)

    So the last warmup step and the first cosine step both use the peak lr, and min_lr is
    reached exactly at step max_steps - 1. warmup_steps may be 0 (start at the peak).
    """
    if warmup_steps < 0 or max_steps < 1 or step < 0:
        raise ValueError(
            f"need step >= 0, warmup_steps >= 0, max_steps >= 1; got step={step}, "
            f"warmup_steps={warmup_steps}, max_steps={max_steps}"
        )
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= max_steps - 1:
        return min_lr
    progress = (step - warmup_steps) / (max_steps - 1 - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)
