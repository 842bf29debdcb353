"""Muon's step on GPT-2 124M's block matrices: batched (the matrices of one shape as one stack,
one batched product per Newton-Schulz product) against one matrix at a time, and against AdamW.

    PYTHONPATH=. python benchmarks/bench_muon.py                      # bf16 and float32, 5 rounds
    PYTHONPATH=. python benchmarks/bench_muon.py --dtypes bfloat16 --rounds 9

The 48 matrices of GPT-2 124M's 12 blocks, in nn.Linear's layout: c_attn (2304, 768), attn c_proj
(768, 768), c_fc (3072, 768), mlp c_proj (768, 3072), with fixed random gradients. Per dtype of
the orthogonalisation, in rounds that alternate the order of the candidates (a shared machine's
load then slows one timing of each rather than one candidate): `Muon.step` batched, per-matrix
(`Muon(batched=False)`), and batched with ns_steps = 0 (the momentum, the norm and the update
alone: the step's elementwise part); then torch's fused AdamW over the same matrices and over the
whole model (124M parameters, the 50304 x 768 embedding included). Medians over the rounds; the
cores other processes took meanwhile (/proc/stat) are printed, as on a shared machine they move
every number. Also the largest difference between the two paths' parameters after one step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gptrain.distributed.host import keep_freed_memory
from gptrain.training.muon import Muon
from gptrain.training.timing import cpu_now, crowding_since

C, LAYERS, VOCAB = 768, 12, 50304
SHAPES = [(3 * C, C), (C, C), (4 * C, C), (C, 4 * C)]


def matrices(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = []
    for _ in range(LAYERS):
        for shape in SHAPES:
            p = torch.nn.Parameter(torch.randn(shape, generator=g) * 0.02)
            p.grad = torch.randn(shape, generator=g)
            params.append(p)
    return params


def rest_of_model(seed: int = 1) -> list[torch.nn.Parameter]:
    """The parameters AdamW trains beside the block matrices: embeddings, biases, LayerNorms."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(VOCAB, C), (1024, C)] + [(n,) for n in (3 * C, C, 4 * C, C, C, C, C, C)] * LAYERS
    params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in shapes + [(C,)] * 2]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    return params


def timed(step) -> float:
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def candidates(dtype: torch.dtype) -> dict:
    def muon(**kw):
        return Muon(matrices(), lr=0.02, weight_decay=0.1, dtype=dtype, **kw).step

    return {
        "batched": muon(batched=True),
        "per-matrix": muon(batched=False),
        "elementwise only": muon(batched=True, ns_steps=0),
    }


def adamw_candidates() -> dict:
    kw = dict(lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    return {
        "AdamW, same matrices": torch.optim.AdamW(matrices(), **kw).step,
        "AdamW, whole model": torch.optim.AdamW(matrices() + rest_of_model(), **kw).step,
    }


def median_times(steps: dict, rounds: int) -> dict:
    times = {name: [] for name in steps}
    for step in steps.values():
        step()  # warm-up: momentum buffers, allocator
    for r in range(rounds):
        for name in list(steps) if r % 2 == 0 else list(steps)[::-1]:
            times[name].append(timed(steps[name]))
    return {name: statistics.median(t) for name, t in times.items()}


def path_difference(dtype: torch.dtype) -> float:
    """The largest difference between the two paths' parameters after one step."""
    a, b = matrices(), matrices()
    Muon(a, lr=0.02, dtype=dtype, batched=True).step()
    Muon(b, lr=0.02, dtype=dtype, batched=False).step()
    return max((p - q).abs().max().item() for p, q in zip(a, b, strict=True))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtypes", default="bfloat16,float32")
    args = p.parse_args()
    keep_freed_memory()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds")
    start = cpu_now()
    adamw = median_times(adamw_candidates(), args.rounds)
    for name, t in adamw.items():
        print(f"{name}: {t * 1e3:.1f} ms")
    base = adamw["AdamW, same matrices"]
    print("| dtype | batched ms | per-matrix ms | per-matrix / batched | elementwise ms | batched / AdamW (same matrices) | max param difference |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        t = median_times(candidates(dtype), args.rounds)
        b, m, e = t["batched"], t["per-matrix"], t["elementwise only"]
        diff = path_difference(dtype)
        print(f"| {name} | {b * 1e3:.0f} | {m * 1e3:.0f} | {m / b:.2f}x | {e * 1e3:.0f} | {b / base:.1f}x | {diff:.1e} |")  # fmt: skip
    print(f"other processes took {crowding_since(start):.2f} CPU cores on average meanwhile")


if __name__ == "__main__":
    main()
