"""Where a training step's time goes, gptrain beside nanoGPT, against this CPU's measured peak.

    PYTHONPATH=. python benchmarks/cpu/bench_profile.py --nanogpt /path/to/nanoGPT
    PYTHONPATH=. python benchmarks/cpu/bench_profile.py --nanogpt DIR --dtype float32   # one dtype
    PYTHONPATH=. python benchmarks/cpu/bench_profile.py --nanogpt DIR --ablate 8        # unprofiled

Both sides take the bench shapes of benchmarks/cpu/bench_nanogpt.py (4 layers, 4 heads, width 256,
16 x 256 tokens, dropout 0, one micro-step): gptrain's step is `train_step` of the model
`gptrain bench --config configs/bench.toml` builds (the dtype given, or the one `auto` measures);
nanoGPT's is its model.py's GPT (its train.py defaults: no biases, 65 characters) with forward,
backward, clipping and its own AdamW (float32: its autocast is a no-op on the CPU). torch's
profiler sorts every op's own time into the groups below, per step; the matmul rows also give
the FLOP/s they reach, against the peak `gptrain bench` measures for that dtype.

The profiler's own cost inflates each op's time (the sum of the groups exceeds the unprofiled
step). `--ablate` measures without it: the step is timed whole and with one part replaced by
(almost) nothing (GELU and LayerNorm by the identity, attention by y = v with dq = dk = dv = dy),
the variants alternating step by step; what a part costs is the whole step's time minus the
step's without it, where it runs, with the caches as the rest of the step leaves them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import gptrain.model.gpt as gpt
from gptrain.config.load import load_config
from gptrain.distributed import runtime as dist
from gptrain.logs.mfu import measure_peak_flops
from gptrain.training import batch
from gptrain.training.build import build_training
from gptrain.training.step import train_step

REPO = Path(__file__).resolve().parents[2]
B, T, L, C = 16, 256, 4, 256
GROUPS = {  # profiler op name -> group; unlisted ops are "other"
    "aten::mm": "linear layers (mm)",
    "aten::addmm": "linear layers (mm)",
    "aten::bmm": "attention",
    "aten::baddbmm": "attention",
    "aten::_softmax": "attention",
    "aten::_softmax_backward_data": "attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "attention",
    "aten::gelu": "GELU",
    "aten::gelu_backward": "GELU",
    "aten::native_layer_norm": "LayerNorm",
    "aten::native_layer_norm_backward": "LayerNorm",
    "aten::copy_": "copies and casts",
    "aten::clone": "copies and casts",
    "aten::_to_copy": "copies and casts",
    "aten::cat": "copies and casts",
    "aten::_fused_adamw_": "optimizer and clipping",
}


def linear_flops(vocab: int) -> int:
    """Forward + backward FLOPs of the matmuls in the mm group: the blocks' and the output head's."""
    return 6 * B * T * (L * 12 * C * C + C * vocab)


def group_of(name: str) -> str:
    if name in GROUPS:
        return GROUPS[name]
    if name.startswith("aten::_foreach") or "adam" in name.lower() or "vector_norm" in name:
        return "optimizer and clipping"
    return "other"


def profiled(step, steps: int) -> tuple[float, dict]:
    """(ms per step unprofiled, {group: ms per step}) of `steps` steps after 3 warm-up steps."""
    for _ in range(3):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    wall = (time.perf_counter() - t0) / steps * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    groups: dict[str, float] = {}
    for e in prof.key_averages():
        groups[group_of(e.key)] = groups.get(group_of(e.key), 0.0) + e.self_cpu_time_total / 1e3
    return wall, {k: v / steps for k, v in groups.items()}


def gptrain_step(dtype: str, ablate: str = ""):
    """gptrain's step and its dtype; `ablate` ("GELU", "LayerNorm", "attention") leaves that out."""
    cfg = load_config(str(REPO / "configs" / "bench.toml"))
    info = dist.DistInfo.from_env("cpu")
    model, wrapped, opt, ptdtype, autocast, scaler = build_training(cfg, info, 257, dtype, False)
    for block in model.transformer.h:
        if ablate == "GELU":
            block.mlp.gelu = torch.nn.Identity()
        elif ablate == "LayerNorm":
            block.ln_1 = block.ln_2 = torch.nn.Identity()
    mb, accum = batch.resolve(cfg.train, info, wrapped, model, autocast, 257)
    x = torch.randint(0, 257, (mb, T + 1))
    xy = (x[:, :-1], x[:, 1:])
    kernels = [b.attn.impl for b in model.transformer.h]

    def step():
        for b, impl in zip(model.transformer.h, kernels, strict=True):  # the model calls
            b.attn.impl = "matmul" if ablate == "attention" else impl  # gpt.matmul_attention:
        gpt.matmul_attention = _stand_in if ablate == "attention" else _attention  # the stand-in
        train_step(wrapped, model, opt, scaler, lambda: xy, accum, autocast, 1.0, sync=True)

    return step, ptdtype


_attention = gpt.matmul_attention


class _StandIn(torch.autograd.Function):
    """Attention left out: y = v, and dq = dk = dv = dy (the shapes and dtypes of the real one)."""

    @staticmethod
    def forward(ctx, q, k, v):
        return v.clone()

    @staticmethod
    def backward(ctx, dy):
        return dy, dy, dy


def _stand_in(q, k, v, dropout_p=0.0):
    return _StandIn.apply(q, k, v)


def ablation(dtype: str, rounds: int) -> None:
    """Print what each part costs in an unprofiled step: the whole step's median time minus the
    median of the step without it, the variants alternating (a few steps each per round)."""
    parts = ["", "GELU", "LayerNorm", "attention"]
    steps = {part: gptrain_step(dtype, part)[0] for part in parts}
    times: dict[str, list] = {part: [] for part in parts}
    for _ in range(rounds):
        for part, step in steps.items():
            step()
            for _ in range(3):
                t0 = time.perf_counter()
                step()
                times[part].append(time.perf_counter() - t0)
    whole = statistics.median(times[""]) * 1e3
    print(f"| part | ms per step (whole step {whole:.1f} ms, median of {3 * rounds}; best {min(times['']) * 1e3:.1f}) |")  # fmt: skip
    print("|---|---:|")
    for part in parts[1:]:
        print(f"| {part} | {whole - statistics.median(times[part]) * 1e3:.1f} |")


def nanogpt_step(nano: Path):
    sys.path.insert(0, str(nano))
    from model import GPT, GPTConfig  # nanoGPT's model.py

    model = GPT(GPTConfig(block_size=T, vocab_size=65, n_layer=L, n_head=4, n_embd=C, dropout=0.0, bias=False))  # fmt: skip
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")
    data = torch.randint(0, 65, (B, T + 1))
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()  # as train.py's get_batch stacks

    def step():
        with nullcontext():  # train.py's ctx on the CPU
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--nanogpt", required=True, help="a checkout of github.com/karpathy/nanoGPT")
    p.add_argument("--dtype", default="auto", help="gptrain's train.dtype (auto, float32, bfloat16)")  # fmt: skip
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--ablate", type=int, default=0, metavar="ROUNDS", help="time the step without GELU, LayerNorm, attention (ROUNDS alternating rounds) instead of profiling")  # fmt: skip
    args = p.parse_args(argv)
    nano = Path(args.nanogpt)
    if not (nano / "model.py").is_file():
        print(f"bench_profile: error: {nano} has no model.py; pass a nanoGPT checkout", file=sys.stderr)  # fmt: skip
        return 2
    if args.ablate:
        ablation(args.dtype, args.ablate)
        return 0
    ours, ptdtype = gptrain_step(args.dtype)
    our_wall, our_groups = profiled(ours, args.steps)
    their_wall, their_groups = profiled(nanogpt_step(nano), args.steps)
    peaks = {d: measure_peak_flops("cpu", d) for d in {ptdtype, torch.float32}}
    name = str(ptdtype).removeprefix("torch.")
    peak_text = ", ".join(f"{str(d).removeprefix('torch.')} {v / 1e9:.0f} GFLOP/s" for d, v in peaks.items())  # fmt: skip
    print(f"capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads; measured peak: {peak_text}")  # fmt: skip
    print(f"| ms per step | gptrain ({name}) | nanoGPT (float32) |")
    print("|---|---:|---:|")
    order = sorted(set(our_groups) | set(their_groups), key=lambda g: -our_groups.get(g, 0.0))
    for g in order:
        print(f"| {g} | {our_groups.get(g, 0.0):.1f} | {their_groups.get(g, 0.0):.1f} |")
    print(f"| **step, unprofiled** | **{our_wall:.1f}** | **{their_wall:.1f}** |")
    for who, groups, peak, vocab in (("gptrain", our_groups, peaks[ptdtype], 257), ("nanoGPT", their_groups, peaks[torch.float32], 65)):  # fmt: skip
        ms = groups.get("linear layers (mm)", 0.0)
        rate = linear_flops(vocab) / (ms / 1e3) if ms else 0.0
        print(f"{who}: the linear layers' matmuls at {rate / 1e9:.0f} GFLOP/s = {rate / peak:.0%} of the measured peak")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
