"""Workers of the replica tests (run as `python tests/replicas_worker.py WORKER OUT ARGS...` on each
of 2 gloo ranks, started by dist_helpers.spawn; each writes its result to OUT.RANK as JSON):

- `probe OVERRIDES...`: the real `train()` of configs/debug.toml, recording on this rank, before
  each optimizer step, the learning rate it sets and an exact fingerprint of every parameter
  (what the step starts from), and after the run its training time.
- `check MODE...`: `replicas.check` on a small model and its AdamW state after two steps, once
  per mode: `same` (every rank equal), `perturbed` (rank 1's first bias one ulp off at element
  3), `swapped` (two elements of rank 1's first AdamW moment swapped), `cursor` (rank 1's data
  cursor one window ahead), `counts` (rank 1 holds one tensor fewer); {mode: the ReplicaMismatch
  line this rank raised, or None}.
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


def check(modes: list[str]) -> dict:
    from gptrain.distributed import failures, replicas
    from gptrain.distributed import runtime as dist

    info = dist.DistInfo.from_env("cpu")
    dist.init(info, "gloo", 60)
    lines = {}
    for mode in modes:
        model, optimizer = _trained()
        if info.rank == 1 and mode == "perturbed":
            w = model[0].bias.detach()
            w[3] = torch.nextafter(w[3], torch.tensor(float("inf")))
        if info.rank == 1 and mode == "swapped":
            m = optimizer.state[model[0].weight]["exp_avg"].view(-1)
            m[[0, 9]] = m[[9, 0]]
        numbers = {
            "train_state.step": 2,
            "data.windows_consumed": 48 + (info.rank == 1 and mode == "cursor"),
        }
        tensors = replicas.replicated(model, optimizer, numbers)
        if info.rank == 1 and mode == "counts":
            tensors = tensors[:-1]
        try:
            replicas.check(tensors, info, step=2)
            lines[mode] = None
        except failures.ReplicaMismatch as e:
            lines[mode] = str(e)
    dist.teardown()
    return lines


def _trained():
    """A small model and its AdamW state after two steps on the same data: replicas."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(3, 8)).square().sum().backward()
        optimizer.step()
    return model, optimizer


if __name__ == "__main__":
    name, out_file, *rest = sys.argv[1:]
    result = probe(rest) if name == "probe" else check(rest)
    Path(f"{out_file}.{os.environ.get('RANK', '0')}").write_text(json.dumps(result))
    from gptrain.__main__ import exit_quickly

    exit_quickly(0)
