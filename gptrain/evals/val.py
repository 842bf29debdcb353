"""Evaluation: loss and bits per byte on the fixed validation token budget.

The budget is eval.tokens // seq_len windows spread evenly over the whole val split (every source
of a split written source by source in proportion; gptrain/data/loader.py's val_windows): the
same tokens on every run and world size. Sums (loss x tokens, tokens, bytes) are all-reduced once, so the result is the
exact token mean over all ranks. Bits per byte = total nats / ln 2 / total UTF-8 bytes of the
target tokens: comparable across tokenizers. Each batch goes through the model's loss path
(`model(x, y)`: chunked cross-entropy, the (B, T, V) logits never exist), never through logits.
"""

from __future__ import annotations

import math

import torch

from gptrain.data.loader import IGNORE_INDEX, Dataset, val_batches
from gptrain.distributed import runtime as dist
from gptrain.evals.task import Outcome


@torch.no_grad()
def evaluate(
    model,
    dataset: Dataset,
    *,
    seq_len: int,
    micro_batch_size: int,
    eval_tokens: int,
    info: dist.DistInfo,
    autocast,
    byte_lengths: torch.Tensor,
) -> tuple[float, float]:
    """(val loss in nats/token, val bits per byte). Collective: every rank calls it."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=info.device)  # loss*tokens, tokens, bytes
    batches = val_batches(
        dataset, seq_len, micro_batch_size, eval_tokens, info.rank, info.world_size, info.device
    )
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


class ValLoss:
    """The validation task (evals/task.py's shape): loss and bits per byte on `eval_tokens`
    tokens spread evenly over the val split, the same tokens on every run and world size."""

    name = "val"

    def __init__(
        self,
        dataset: Dataset,
        *,
        seq_len: int,
        micro_batch_size: int,
        eval_tokens: int,
        byte_lengths: torch.Tensor,
    ):
        self.dataset, self.seq_len, self.mb = dataset, seq_len, micro_batch_size
        self.eval_tokens, self.byte_lengths = eval_tokens, byte_lengths

    def run(self, model, info: dist.DistInfo, autocast) -> Outcome:
        loss, bpb = evaluate(
            model,
            self.dataset,
            seq_len=self.seq_len,
            micro_batch_size=self.mb,
            eval_tokens=self.eval_tokens,
            info=info,
            autocast=autocast,
            byte_lengths=self.byte_lengths,
        )
        return Outcome(
            {"val_loss": loss, "val_bpb": bpb}, f"val loss {loss:.4f}, val bpb {bpb:.4f}"
        )
