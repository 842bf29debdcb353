"""Evaluation: loss and bits per byte on the fixed validation token budget.

The budget is the first eval.tokens // seq_len windows of the val split: the same tokens on every
run and world size. Sums (loss x tokens, tokens, bytes) are all-reduced once, so the result is the
exact token mean over all ranks. Bits per byte = total nats / ln 2 / total UTF-8 bytes of the
target tokens: comparable across tokenizers. Each batch goes through the model's loss path
(`model(x, y)`: chunked cross-entropy, the (B, T, V) logits never exist), never through logits.
"""

from __future__ import annotations

import math

import torch

from gptrain.data.loader import IGNORE_INDEX, Dataset, val_batches
from gptrain.distributed import runtime as dist


@torch.no_grad()
def evaluate(model, dataset: Dataset, *, seq_len: int, micro_batch_size: int, eval_tokens: int,
             info: dist.DistInfo, autocast, byte_lengths: torch.Tensor) -> tuple[float, float]:  # fmt: skip
    """(val loss in nats/token, val bits per byte). Collective: every rank calls it."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=info.device)  # loss*tokens, tokens, bytes
    batches = val_batches(dataset, seq_len, micro_batch_size, eval_tokens, info.rank, info.world_size, info.device)  # fmt: skip
    for x, y in batches:
        with autocast:
            _, loss = model(x, y)
        mask = y != IGNORE_INDEX
        n = mask.sum()
        # a rank's padding batch (all targets ignored) has a NaN mean loss: count it as 0
        sums[0] += torch.where(n > 0, loss.double() * n, 0.0)
        sums[1] += n
        sums[2] += byte_lengths[y[mask]].sum()
    dist.all_reduce_sum(sums)
    model.train()
    loss_sum, tokens, nbytes = sums.tolist()
    return loss_sum / tokens, loss_sum / math.log(2) / max(nbytes, 1)
