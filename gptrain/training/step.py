"""One optimizer step: gradient accumulation over micro-batches, communication on the last one
(FSDP2 by default: on each), clipping, and the update (through the non-finite guard when the loop gives one). Used by
`gptrain train`, `gptrain bench` and the benchmarks."""

from __future__ import annotations

import math

import torch

from gptrain.data.loader import IGNORE_INDEX
from gptrain.distributed import parallelize, runtime
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

    Each micro-batch's mean loss is weighted by its share of the targets counted over every
    micro-batch and rank (`target_weights`), so the summed gradients equal the gradient of the
    big batch's mean loss per target, also when some targets are IGNORE_INDEX. Gradients are
    communicated on the last micro-step only (`no_sync()` / `set_requires_gradient_sync`
    otherwise), overlapping that backward; under FSDP2 with dist.fsdp_reduce = every, on each
    micro-step. `sync=False` skips all communication (the benchmark uses it to measure the
    communication share). With `guard`, a step (number `step`) whose gradient norm is NaN/inf
    leaves weights and optimizer untouched."""
    loss_sum = None
    every = parallelize.syncs_every_micro_step(wrapped)
    batches = [next_batch() for _ in range(accum)]
    weights = target_weights([y for _, y in batches], count_globally=sync)
    for micro, (x, y) in enumerate(batches):
        with parallelize.grad_sync(wrapped, sync=sync and (every or micro == accum - 1)):
            with autocast:
                _, loss = wrapped(x, y)
            loss = loss * weights[micro] / accum  # this micro-batch's share of the big batch's mean
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


def target_weights(targets: list[torch.Tensor], count_globally: bool = True) -> torch.Tensor:
    """Per micro-batch, (its counted targets) x accum x world size / (all ranks' counted targets):
    multiplied into a micro-batch's mean loss over its own targets, then divided by accum, it
    makes DDP's mean over ranks the mean per target of the whole batch. Exactly 1.0 when every
    micro-batch counts the same targets (full windows), so the usual step's numbers are unchanged;
    0 for a micro-batch with none. One all-reduce of one number, on the device (no host sync);
    `count_globally=False` (a step that skips communication) counts this rank's targets only."""
    counts = torch.stack([(y != IGNORE_INDEX).sum() for y in targets])  # int64, on the device
    world = runtime.world_size() if count_globally else 1
    total = counts.sum()
    if world > 1:
        runtime.all_reduce_sum(total)
    scaled = counts * (len(targets) * world)
    return (scaled.double() / total.clamp_min(1).double()).float()
