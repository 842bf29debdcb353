"""train.micro_split = halves against none: ms per optimizer step, the same model, one process.

    PYTHONPATH=. python benchmarks/bench_split.py                            # bench config
    PYTHONPATH=. python benchmarks/bench_split.py --config configs/race.toml --rounds 8

none runs every op of a micro-step with all intra-op threads (an OpenMP team); halves runs the
micro-batch's two row halves at once on two threads with half of them each
(gptrain/training/halves.py). One model from the config (`build_training`, as `gptrain bench`
builds it) trains on random tokens with train_step, the two settings alternating in blocks of
--steps optimizer steps, so that a shared host's load hits both; each setting's median and best
ms per step are printed. Results: docs/benchmarks.md, "CPU tiers", session 16.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gptrain.config.load import load_config  # noqa: E402
from gptrain.distributed import runtime as dist  # noqa: E402
from gptrain.training import batch  # noqa: E402
from gptrain.training.build import build_training  # noqa: E402
from gptrain.training.halves import Halves  # noqa: E402
from gptrain.training.step import train_step  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs" / "bench.toml"))
    p.add_argument("--rounds", type=int, default=6, help="blocks of steps per variant")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per block")
    a, overrides = p.parse_known_args()
    cfg = load_config(a.config, [o.removeprefix("--") for o in overrides])
    info = dist.DistInfo.from_env("cpu")
    t = cfg.train
    vocab = 257 if cfg.data.tokenizer == "byte" else 50257
    model, wrapped, optimizer, ptdtype, autocast, scaler = build_training(cfg, info, vocab, t.dtype, False)  # fmt: skip
    if wrapped is not model or model.config.dropout or torch.get_num_threads() < 2:
        raise SystemExit("bench_split: one process, no compile, dropout 0, >= 2 threads only")
    mb, accum = batch.resolve(t, info, wrapped, model, autocast, vocab)
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, vocab, (mb, t.seq_len + 1), generator=gen) for _ in range(4)]
    data = [(d[:, :-1], d[:, 1:]) for d in data]
    counter = iter(range(10**12))

    def batches():
        return data[next(counter) % len(data)]

    args = (wrapped, model, optimizer, scaler, batches, accum, autocast, cfg.optim.grad_clip)
    halves = Halves()
    variants = {
        "none": lambda: train_step(*args),
        "halves": lambda: train_step(*args, halves=halves),
    }
    times = {k: [] for k in variants}
    for r in range(a.rounds + 1):  # the first round warms up
        for name, step in variants.items():
            for _ in range(a.steps):
                t0 = time.perf_counter()
                step()
                if r:
                    times[name].append(time.perf_counter() - t0)
    print(f"{a.config}: {ptdtype}, micro-batch {mb} x {accum}, {torch.get_num_threads()} threads, {a.rounds} x {a.steps} steps each")  # fmt: skip
    for name, ts in times.items():
        print(f"  {name:20s} median {1e3 * statistics.median(ts):7.1f} ms  best {1e3 * min(ts):7.1f} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
