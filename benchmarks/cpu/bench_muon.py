"""Muon's step on GPT-2 124M's block matrices: batched (the matrices of one shape as one stack,
one batched product per Newton-Schulz product) against one matrix at a time, and against AdamW.

    PYTHONPATH=. python benchmarks/cpu/bench_muon.py                      # bf16 and float32, 5 rounds
    PYTHONPATH=. python benchmarks/cpu/bench_muon.py --dtypes bfloat16 --rounds 9

The 48 matrices of GPT-2 124M's 12 blocks, in nn.Linear's layout: c_attn (2304, 768), attn c_proj
(768, 768), c_fc (3072, 768), mlp c_proj (768, 3072), with fixed random gradients. Per dtype of
the orthogonalisation, in rounds that alternate the order of the candidates (a shared machine's
load then slows one timing of each rather than one candidate): `Muon.step` batched, per-matrix
(`Muon(batched=False)`), and batched with ns_steps = 0 (the momentum, the norm and the update
alone: the step's elementwise part), and torch's fused AdamW over the same matrices and over the
whole model (124M parameters, the 50304 x 768 embedding included), all in the same rounds.
Medians over the rounds, ratios per round (both sides under the same load) and then their
median; the cores other processes took meanwhile (/proc/stat) are printed, as on a shared machine
they move every number. Also the largest difference between the two paths' parameters after one
step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

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


def candidates(dtypes: list[str]) -> dict:
    """{name: step}: every candidate steps the same matrices (and gradients), each with its own
    optimizer state; the whole-model AdamW also the rest of the model."""
    params = matrices()
    kw = dict(lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    steps = {
        "AdamW, same matrices": torch.optim.AdamW(params, **kw).step,
        "AdamW, whole model": torch.optim.AdamW(params + rest_of_model(), **kw).step,
    }
    for name in dtypes:
        muon = partial(Muon, params, lr=0.02, weight_decay=0.1, dtype=getattr(torch, name))
        steps[f"{name} batched"] = muon(batched=True).step
        steps[f"{name} per-matrix"] = muon(batched=False).step
        steps[f"{name} elementwise only"] = muon(batched=True, ns_steps=0).step
    return steps


def timings(steps: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds of each step per round, the order alternating from round to round."""
    times = {name: [] for name in steps}
    for step in steps.values():
        step()  # warm-up: optimizer state, allocator
    for r in range(rounds):
        for name in list(steps) if r % 2 == 0 else list(steps)[::-1]:
            t0 = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - t0)
    return times


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
    dtypes = args.dtypes.split(",")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds")
    start = cpu_now()
    times = timings(candidates(dtypes), args.rounds)
    crowding = crowding_since(start)
    med = {name: statistics.median(t) for name, t in times.items()}

    def ratio(a: str, b: str) -> float:  # per round (the same load on both), then the median
        return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))

    for name in ("AdamW, same matrices", "AdamW, whole model"):
        print(f"{name}: {med[name] * 1e3:.0f} ms")
    print("| Muon dtype | batched ms | per-matrix ms | per-matrix / batched | elementwise ms | batched / AdamW (same matrices) | batched / AdamW (whole model) | max param difference |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in dtypes:
        b, m, e = (f"{name} {k}" for k in ("batched", "per-matrix", "elementwise only"))
        same, whole = ratio(b, "AdamW, same matrices"), ratio(b, "AdamW, whole model")
        diff = path_difference(getattr(torch, name))
        print(f"| {name} | {med[b] * 1e3:.0f} | {med[m] * 1e3:.0f} | {ratio(m, b):.2f}x | {med[e] * 1e3:.0f} | {same:.0f}x | {whole:.0f}x | {diff:.1e} |")  # fmt: skip
    print(f"other processes took {crowding:.2f} CPU cores on average while it timed")


if __name__ == "__main__":
    main()
