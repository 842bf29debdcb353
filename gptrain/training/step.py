"""One optimizer step: gradient accumulation over micro-batches, communication on the last one
(FSDP2 by default: on each), clipping, and the update (through the non-finite guard when the loop gives one). Used by
`gptrain train`, `gptrain bench` and the benchmarks."""

from __future__ import annotations

import math

import torch

from gptrain.distributed import parallelize
from gptrain.training.guards import NonFinite


def train_step(
    wrapped,
    model,
    optimizer,
    scaler,
    next_batch,
    accum: int,
    autocast,
    grad_clip: float,
    sync: bool = True,
    guard: NonFinite | None = None,
    step: int = 0,
):
    """One optimizer step over `accum` micro-batches; returns (mean loss, grad norm) as tensors.

    Each micro-loss is divided by `accum`, so the summed gradients equal the gradient of the big
    batch's mean loss. Gradients are communicated on the last micro-step only (`no_sync()` /
    `set_requires_gradient_sync` otherwise), overlapping that backward; under FSDP2 with
    dist.fsdp_reduce = every, on each micro-step. `sync=False` skips all
    communication (the benchmark uses it to measure the communication share). With `guard`, a
    step (number `step`) whose gradient norm is NaN/inf leaves weights and optimizer untouched."""
    loss_sum = None
    every = parallelize.syncs_every_micro_step(wrapped)
    for micro in range(accum):
        x, y = next_batch()
        with parallelize.grad_sync(wrapped, sync=sync and (every or micro == accum - 1)):
            with autocast:
                _, loss = wrapped(x, y)
            loss = loss / accum  # this micro-batch's share of the big batch's mean
            scaler.scale(loss).backward()
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(
        model.parameters(), grad_clip if grad_clip > 0 else math.inf
    )
    if guard is None:
        scaler.step(optimizer)
        scaler.update()
    else:
        guard.step(optimizer, scaler, grad_norm, step)
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm
