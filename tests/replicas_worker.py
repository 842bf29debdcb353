"""Workers of the replica tests (run as `python tests/replicas_worker.py WORKER OUT ARGS...` on each
of 2 gloo ranks, started by dist_helpers.spawn; each writes its result to OUT.RANK as JSON):

- `probe OVERRIDES...`: the real `train()` of configs/debug.toml, recording on this rank, before
  each optimizer step, the learning rate it sets and an exact fingerprint of every parameter
  (what the step starts from), and after the run its training time.
- `check MODE`: `replicas.check` on a small model and an AdamW state after two steps: `same`
  (every rank equal), `perturbed` (rank 1's second parameter one ulp off), `swapped` (rank 1's
  first optimizer moment with two elements swapped), `counts` (rank 1 lacks a tensor); the
  ReplicaMismatch line each rank raised, or None.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DEBUG = str(REPO / "configs" / "debug.toml")


def fingerprint(params) -> list[int]:
    """Each parameter's bytes as integers, summed with their positions: equal iff (almost
    surely) the bits are equal; independent of the code under test."""
    out = []
    for p in params:
        ints = p.detach().reshape(-1).view(torch.int32).to(torch.int64)
        out.append(int((ints * torch.arange(1, ints.numel() + 1)).sum()))
    return out


def probe(overrides: list[str]) -> dict:
    import gptrain.training.run as phases
    from gptrain.commands.train import train
    from gptrain.config.load import load_config
    from gptrain.distributed import faults
    from gptrain.distributed import runtime as dist

    steps = []
    original = phases.set_lr

    def recording(optimizer, lr, cfg):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        steps.append({"lr": lr, "params": fingerprint(params)})
        return original(optimizer, lr, cfg)

    phases.set_lr = recording
    faults.install(int(os.environ["RANK"]))
    cfg = load_config(DEBUG, [o.removeprefix("--") for o in overrides])
    info = dist.DistInfo.from_env("cpu")
    dist.init(info, cfg.dist.backend, cfg.dist.timeout_s)
    summary = train(cfg, info)
    dist.teardown()
    return {"steps": steps, "train_s": summary["train_s"], "done": summary["steps"]}


def check(mode: str) -> dict:
    from gptrain.distributed import failures, replicas
    from gptrain.distributed import runtime as dist

    info = dist.DistInfo.from_env("cpu")
    dist.init(info, "gloo", 60)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):  # the same data on every rank: replicas
        model(torch.ones(3, 8)).square().sum().backward()
        optimizer.step()
    names = {p: n for n, p in model.named_parameters()}
    if info.rank == 1 and mode == "perturbed":
        w = model[0].bias.detach()
        w[3] = torch.nextafter(w[3], torch.tensor(float("inf")))
    if info.rank == 1 and mode == "swapped":
        m = optimizer.state[model[0].weight]["exp_avg"].view(-1)
        m[[0, 1]] = m[[1, 0]]
    tensors = replicas.replicated(model, optimizer, {"step": 2.0})
    if info.rank == 1 and mode == "counts":
        tensors = tensors[:-1]
    line = None
    try:
        replicas.check(tensors, info, step=2)
    except failures.ReplicaMismatch as e:
        line = str(e)
    dist.teardown()
    return {"line": line, "names": [names[p] for p in model.parameters()]}


if __name__ == "__main__":
    name, out_file, *rest = sys.argv[1:]
    result = probe(rest) if name == "probe" else check(rest[0])
    Path(f"{out_file}.{os.environ.get('RANK', '0')}").write_text(json.dumps(result))
    from gptrain.__main__ import exit_quickly

    exit_quickly(0)
