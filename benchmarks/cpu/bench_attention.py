"""Attention kernels on this CPU: time and accuracy of `train.attention = sdpa | matmul` in bf16.

    PYTHONPATH=. python benchmarks/cpu/bench_attention.py            # T = 128 ... 1024, 4 heads of 64
    PYTHONPATH=. python benchmarks/cpu/bench_attention.py --rounds 20

Per window length T (micro-batch chosen so that B x T = 4,096 tokens, as the bench config): one
layer's forward + backward on bf16 q, k, v (median over alternating rounds, after host.py's
allocator setting, as a training run has it), and the relative error of the q, k and v gradients
against float64 SDPA (queries scaled by 3 for sharp attention, where rounding matters). The third
column set is every matmul product in bf16 (a softmax in float32 between): a variant that trains
worse (benchmarks/RESULTS.md, "Attention kernel"), kept here as the reference for what rounding costs.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F

from gptrain.distributed.host import keep_freed_memory
from gptrain.model.attention import matmul_attention


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def all_bf16(q, k, v):
    """Every product in q's dtype, the softmax in float32 (no hand-written backward)."""
    mask = torch.full((q.size(-2), q.size(-2)), float("-inf")).triu(1)
    att = ((q @ k.transpose(-2, -1)).float() / math.sqrt(q.size(-1)) + mask).softmax(-1)
    return att.to(v.dtype) @ v


KERNELS = {"sdpa": sdpa, "matmul": matmul_attention, "all-bf16": all_bf16}


def grad_errors(fn, shape) -> list[float]:
    g = torch.Generator().manual_seed(0)
    q, k, v, go = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(4))
    q = q * 3
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad((sdpa(*ref_in) * go).sum(), ref_in)
    low = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    ours = torch.autograd.grad((fn(*low) * go.to(torch.bfloat16)).sum(), low)
    return [((a.double() - b).norm() / b.norm()).item() for a, b in zip(ours, ref, strict=True)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--seq-lens", default="128,256,512,1024")
    args = p.parse_args()
    keep_freed_memory()
    print("| T | B | sdpa ms | matmul ms | matmul / sdpa | grad error dq, dk, dv: sdpa | matmul | all-bf16 |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---|---|---|")
    for T in (int(t) for t in args.seq_lens.split(",")):
        shape = (max(1, 4096 // T), 4, T, 64)  # (B, nh, T, hs)
        q, k, v = (torch.randn(shape, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        go = torch.randn(shape, dtype=torch.bfloat16)
        times: dict[str, list[float]] = {"sdpa": [], "matmul": []}
        for _ in range(args.rounds):
            for name in times:
                t0 = time.perf_counter()
                KERNELS[name](q, k, v).backward(go)
                times[name].append(time.perf_counter() - t0)
        ms = {n: statistics.median(t[2:]) * 1e3 for n, t in times.items()}
        err = {n: ", ".join(f"{e:.4f}" for e in grad_errors(f, shape)) for n, f in KERNELS.items()}
        print(f"| {T} | {shape[0]} | {ms['sdpa']:.1f} | {ms['matmul']:.1f} | {ms['matmul'] / ms['sdpa']:.2f}x "
              f"| {err['sdpa']} | {err['matmul']} | {err['all-bf16']} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
