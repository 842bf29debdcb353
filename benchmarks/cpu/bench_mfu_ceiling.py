"""The highest MFU a config's model could reach on this device: a "step" made only of its matmuls.

    .venv/bin/python benchmarks/cpu/bench_mfu_ceiling.py                       # configs/bench.toml, bf16
    .venv/bin/python benchmarks/cpu/bench_mfu_ceiling.py --dtype float32 --repeat 10

One micro-step of a GPT-2 block stack does, per layer, four projections (qkv, attention out, MLP
up, MLP down), each three times (forward, input gradient, weight gradient); attention's two batched
products (Q K^T, P V) forward and four of the same size backward; and the tied output head. This
script times exactly those matmuls in the training dtype, back to back, with nothing else: no GELU,
LayerNorm, softmax, casts, loss or optimizer. Their FLOP/s divided by the peak measured the way
`gptrain bench` measures it is a ceiling on MFU: a real step also does all the
rest. (Causal attention could skip half of its products; the MFU convention counts all of them.)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from gptrain.config.load import load_config  # noqa: E402
from gptrain.logs.mfu import format_flops, measure_peak_flops  # noqa: E402
from gptrain.model.gpt import GPTConfig  # noqa: E402


def matmul_shapes(cfg: GPTConfig, tokens: int) -> list[tuple[int, int, int]]:
    """(M, K, N) of every dense matmul of one forward + backward over `tokens` tokens."""
    c, shapes = cfg.n_embd, []
    projections = [(c, 3 * c), (c, c), (c, 4 * c), (4 * c, c)]
    head = [(c, cfg.padded_vocab_size)]
    for k, n in projections * cfg.n_layer + head:
        shapes += [(tokens, k, n), (tokens, n, k), (k, tokens, n)]  # forward, dX, dW
    return shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "bench.toml"))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    cfg = load_config(args.config, [])
    t, m = cfg.train, cfg.model
    vocab = 257 if cfg.data.tokenizer == "byte" else 50257
    gcfg = GPTConfig(vocab_size=vocab, block_size=t.seq_len, n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd)  # fmt: skip
    dtype = getattr(torch, args.dtype)
    tokens, bh, hd = (
        t.micro_batch_size * t.seq_len,
        t.micro_batch_size * m.n_head,
        m.n_embd // m.n_head,
    )
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, dtype=dtype, generator=gen)

    mats = [(rand(mm, k), rand(k, n)) for mm, k, n in matmul_shapes(gcfg, tokens)]
    q, kt, p = rand(bh, t.seq_len, hd), rand(bh, hd, t.seq_len), rand(bh, t.seq_len, t.seq_len)

    def step() -> None:
        for a, b in mats:
            a @ b
        for _ in range(m.n_layer * 3):  # attention: Q K^T and P V, forward and 2x for backward
            torch.bmm(q, kt)
            torch.bmm(p, q)

    flops = sum(2 * mm * k * n for mm, k, n in matmul_shapes(gcfg, tokens))
    flops += m.n_layer * 3 * 2 * (2 * bh * t.seq_len * t.seq_len * hd)
    for _ in range(3):
        step()
    best = float("inf")
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    peak = measure_peak_flops("cpu", dtype)
    rate = flops / best
    print(f"{args.dtype}, {torch.get_num_threads()} threads, {tokens:,} tokens per micro-step")
    print("| what | ms per micro-step | FLOP/s | share of measured peak |")
    print("|---|---:|---:|---:|")
    print(f"| matmuls only ({flops / 1e9:.1f} GFLOP) | {best * 1e3:.1f} | {format_flops(rate)} | {rate / peak:.1%} |")  # fmt: skip
    print(f"| measured peak | | {format_flops(peak)} | 100% |")


if __name__ == "__main__":
    main()
