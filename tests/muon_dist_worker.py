"""Worker for tests/test_muon_dist.py, run as one process per rank (gloo, RANK/WORLD_SIZE set by
dist_helpers.spawn): `python tests/muon_dist_worker.py OUT DATA_DIR [OVERRIDE...]`.

Muon trains the same 5 float32 steps of the same global batches (wsd schedule) in one process
group: DDP with every rank orthogonalising every matrix (redundant), DDP with each matrix
orthogonalised on its owner and broadcast (split), FSDP2, and FSDP2 on a model whose matrices
split into row blocks of different sizes (fsdp_odd). Per variant rank 0 saves
the full weights (OUT.VARIANT.pt); every rank records which matrix shapes it orthogonalised and
a fingerprint of its parameters (OUT.RANK json)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DEBUG = str(REPO / "configs" / "debug.toml")
STEPS = 5
# the same 1024-token global batch every step: 1 x 4 micro-batches of 4, or 2 ranks x 2 of 4
MUON = [
    "optim.name=muon",
    "optim.muon_dtype=float32",
    "optim.lr_schedule=wsd",
    "optim.decay_fraction=0.4",
    "optim.warmup_steps=1",
    "optim.grad_clip=0.05",
    "train.micro_batch_size=4",
    "train.total_batch_size=1024",
    "train.dtype=float32",
]


def train(data_dir: str, *overrides: str, steps: int = STEPS) -> tuple:
    """(model, record): `steps` optimizer steps of Muon through gptrain's own build_training and
    train_step, the shapes this rank orthogonalised, and the loss of each step."""
    from gptrain.config.load import load_config
    from gptrain.data.loader import Dataset, TrainLoader
    from gptrain.distributed import runtime as dist
    from gptrain.training import muon
    from gptrain.training.batch import accumulation_steps
    from gptrain.training.build import build_training
    from gptrain.training.optim import lr_at, set_lr
    from gptrain.training.step import train_step

    cfg = load_config(DEBUG, [f"data.dir={data_dir}", *MUON, *overrides])
    info, t = dist.DistInfo.from_env("cpu"), cfg.train
    dataset = Dataset(cfg.data.dir)
    loader = TrainLoader(dataset, t.seq_len, t.micro_batch_size, info.rank, info.world_size, t.seed)
    model, wrapped, optimizer, _, autocast, scaler = build_training(
        cfg, info, dataset.vocab_size, t.dtype, False
    )
    accum = accumulation_steps(t.total_batch_size, t.micro_batch_size, t.seq_len, info.world_size)
    shapes, losses, original = [], [], muon.orthogonalise

    def counted(g, *args, **kwargs):  # a stack (B, m, n) is B matrices of shape (m, n)
        shapes.extend([list(g.shape[-2:])] * (g.shape[0] if g.dim() == 3 else 1))
        return original(g, *args, **kwargs)

    muon.orthogonalise = counted
    try:
        for step in range(steps):
            set_lr(optimizer, lr_at(step, cfg.optim, steps), cfg.optim)
            loss, _ = train_step(
                wrapped,
                model,
                optimizer,
                scaler,
                loader.next_batch,
                accum,
                autocast,
                cfg.optim.grad_clip,
            )
            losses.append(
                dist.all_reduce_mean(loss.float()).item() if info.world_size > 1 else loss.item()
            )
    finally:
        muon.orthogonalise = original
    return model, {"shapes": shapes, "losses": losses}


def full_weights(model) -> dict:
    """The whole model's state on every rank (gathered from the shards under FSDP2)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    return {k: v.detach().clone() for k, v in get_model_state_dict(model, options=options).items()}


def fingerprint(model) -> list:
    """Every rank's (sum, index-weighted sum) of its parameters, gathered."""
    vec = torch.cat(
        [
            p.detach().to_local().reshape(-1) if hasattr(p, "to_local") else p.detach().reshape(-1)
            for p in model.parameters()
        ]
    ).double()
    mine = torch.stack([vec.sum(), (vec * torch.arange(len(vec), dtype=torch.float64)).sum()])
    out = [torch.zeros_like(mine) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(out, mine)
    return [o.tolist() for o in out]


# width 33 (3 heads): c_attn has 99 rows and the projections 33, so the ranks' row blocks differ
ODD = ["model.n_embd=33", "model.n_head=3"]
VARIANTS = {
    "ddp_redundant": ["dist.mode=ddp", "optim.muon_split=redundant"],
    "ddp_split": ["dist.mode=ddp", "optim.muon_split=split"],
    "fsdp": ["dist.mode=fsdp"],
    "fsdp_odd": ["dist.mode=fsdp", *ODD],
}


def main(out: str, data_dir: str, *overrides: str) -> None:
    from gptrain.distributed import runtime as dist

    info = dist.DistInfo.from_env("cpu")
    dist.init(info, "gloo", 120)
    result = {}
    for name, extra in VARIANTS.items():
        model, record = train(data_dir, *extra, *overrides)
        weights = full_weights(model)
        record["fingerprints"] = fingerprint(model)
        if info.is_main:
            torch.save(weights, f"{out}.{name}.pt")
        result[name] = record
    dist.teardown()
    Path(f"{out}.{os.environ['RANK']}").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
    from gptrain.__main__ import exit_quickly

    exit_quickly(0)
