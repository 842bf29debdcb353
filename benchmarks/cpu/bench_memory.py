"""Peak memory of GPT-2 124M training steps: the plain loss (full float32 logits) against the
chunked loss gptrain uses, optionally with activation checkpointing.

    .venv/bin/python benchmarks/cpu/bench_memory.py                      # CPU, float32, 4 x 1024
    .venv/bin/python benchmarks/cpu/bench_memory.py --device cuda --dtype bfloat16 --micro-batch 16
    .venv/bin/python benchmarks/cpu/bench_memory.py --activation-checkpointing   # also blocks recomputed

Each configuration runs in a fresh subprocess (random weights, random tokens, AdamW): `--steps`
full optimizer steps (forward, backward, clip, AdamW step), the first of which allocates the
optimizer state. On the CPU the number is the process's peak resident set size (VmHWM, the kernel's
high-water mark: everything, Python and torch included); on CUDA `torch.cuda.max_memory_allocated`.
"plain" is the reference loss without chunks: `logits, _ = model(x)` (a float32 (B, T, V) copy,
which the caller keeps alive through backward), then F.cross_entropy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def measure(args) -> dict:
    """One configuration, in this process (the child)."""
    import torch
    import torch.nn.functional as F

    from gptrain.config.load import load_config
    from gptrain.distributed.runtime import DistInfo
    from gptrain.errors import UserError
    from gptrain.training.build import build_training
    from gptrain.training.step import train_step

    overrides = [
        "model.preset=gpt2",
        f"train.seq_len={args.seq_len}",
        f"train.micro_batch_size={args.micro_batch}",
        f"train.total_batch_size={args.micro_batch * args.seq_len}",
        f"train.device={args.device}",
    ]
    if args.ac:
        overrides.append("train.activation_checkpointing=blocks")
    try:
        cfg = load_config(None, overrides)
    except UserError as e:
        raise SystemExit(f"bench_memory: this checkout cannot do that configuration: {e}") from None
    info = DistInfo(device="cuda:0" if args.device == "cuda" else "cpu")
    vocab = 50257
    model, wrapped, optimizer, _, autocast, scaler = build_training(
        cfg, info, vocab, args.dtype, compile=False
    )
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (args.micro_batch, args.seq_len + 1), generator=gen)
    x, y = tokens[:, :-1].to(info.device), tokens[:, 1:].to(info.device)

    def plain(x, y):
        logits, _ = model(x)  # (B, T, V) float32
        loss = F.cross_entropy(logits.view(-1, vocab), y.reshape(-1), ignore_index=-1)
        return logits, loss  # the caller's `_` keeps the logits alive through backward

    step_model = plain if args.loss == "plain" else wrapped
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        train_step(step_model, model, optimizer, scaler, lambda: (x, y), 1, autocast, 1.0)
    step_s = (time.perf_counter() - t0) / args.steps
    out = {"step_s": step_s}
    if args.device == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    else:
        status = Path("/proc/self/status").read_text()
        kb = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")))
        out["peak_gb"] = kb * 1024 / 1e9
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--activation-checkpointing", dest="ac", action="store_true",
                   help="also measure the chunked loss with train.activation_checkpointing=blocks")  # fmt: skip
    p.add_argument("--one", nargs=2, metavar=("LOSS", "AC"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:  # child: measure one configuration, print it as JSON
        args.loss, args.ac = args.one[0], args.one[1] == "1"
        print(json.dumps(measure(args)))
        return
    configs = [("plain", False), ("chunked", False)] + ([("chunked", True)] if args.ac else [])
    base = [f"--device={args.device}", f"--dtype={args.dtype}", f"--micro-batch={args.micro_batch}", f"--seq-len={args.seq_len}", f"--steps={args.steps}"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    unit = "peak_gib" if args.device == "cuda" else "peak_gb"
    print(f"GPT-2 124M, micro-batch {args.micro_batch} x {args.seq_len}, {args.dtype}, {args.device}, {args.steps} AdamW steps")  # fmt: skip
    print(f"| loss | activation checkpointing | {'max_memory_allocated GiB' if args.device == 'cuda' else 'peak RSS GB'} | s/step |")  # fmt: skip
    print("|---|---|---:|---:|")
    for loss, ac in configs:
        cmd = [sys.executable, __file__, *base, "--one", loss, "1" if ac else "0"]
        run = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
        if run.returncode != 0:
            print(f"| {loss} | {'blocks' if ac else 'none'} | failed: {run.stderr.strip().splitlines()[-1]} | |")  # fmt: skip
            continue
        r = json.loads(run.stdout.strip().splitlines()[-1])
        print(f"| {loss} | {'blocks' if ac else 'none'} | {r[unit]:.2f} | {r['step_s']:.1f} |")


if __name__ == "__main__":
    main()
