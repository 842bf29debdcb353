"""Worker for tests/test_masked_targets.py: one optimizer step of configs/debug.toml's model,
through gptrain's own build_training and train_step, on a fixed global batch whose micro-batches
leave out different numbers of targets (IGNORE_INDEX), one of them all.

Run as one process per rank (gloo, RANK/WORLD_SIZE set by dist_helpers.spawn):
`python tests/masked_worker.py OUT MODE` with MODE ddp or fsdp; rank 0 saves the full gradients
and the logged loss (OUT.MODE.pt). Imported by the test for the one-process run (`step`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DEBUG = str(REPO / "configs" / "debug.toml")
VOCAB, MICRO, SEQ = 257, 2, 64
COUNTED = [SEQ, SEQ // 4, 0, SEQ - 3]  # targets counted per row, micro-batch by micro-batch


def global_batch() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Four (x, y) micro-batches of (MICRO, SEQ) tokens; micro-batch i counts COUNTED[i] targets
    of each row (the rest IGNORE_INDEX, as a document's padding or a prompt would be)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for counted in COUNTED:
        x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        y = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        y[:, counted:] = -1
        out.append((x, y))
    return out


def step(info, *overrides: str) -> tuple[dict, float]:
    """({name: full gradient}, logged loss) of one train_step on this rank's share of the global
    batch (world size w: w consecutive groups of 4 / w micro-batches)."""
    from torch.distributed.tensor import DTensor

    from gptrain.config.load import load_config
    from gptrain.distributed import runtime as dist
    from gptrain.training.build import build_training
    from gptrain.training.step import train_step

    cfg = load_config(DEBUG, ["train.dtype=float32", f"train.micro_batch_size={MICRO}", *overrides])
    model, wrapped, optimizer, _, autocast, scaler = build_training(
        cfg, info, VOCAB, "float32", False
    )
    accum = len(COUNTED) // info.world_size
    mine = iter(global_batch()[info.rank * accum : (info.rank + 1) * accum])
    grads = {}

    def record(opt, args, kwargs):  # before the update: the reduced gradients
        for name, p in model.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grads[name] = g.detach().clone()

    optimizer.register_step_pre_hook(record)
    loss, _ = train_step(
        wrapped, model, optimizer, scaler, lambda: next(mine), accum, autocast, 0.0
    )
    return grads, dist.all_reduce_mean(loss.float()).item()


def main(out: str, mode: str) -> None:
    from gptrain.distributed import runtime as dist

    info = dist.DistInfo.from_env("cpu")
    dist.init(info, "gloo", 120)
    grads, loss = step(info, f"dist.mode={mode}")
    if info.is_main:
        torch.save({"grads": grads, "loss": loss}, f"{out}.{mode}.pt")
    dist.teardown()


if __name__ == "__main__":
    main(*sys.argv[1:])
    from gptrain.__main__ import exit_quickly

    exit_quickly(0)
