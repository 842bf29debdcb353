"""`gptrain bench`: time training steps of a config on synthetic tokens; tokens/s and MFU.

    gptrain bench --config configs/bench.toml                       # the config's dtype/compile
    gptrain bench --config configs/bench.toml --matrix              # float32/bf16 x eager/compiled table
    gptrain bench --config configs/gpt2_124m.toml --train.total_batch_size=65536 --json rows.json
    torchrun --nproc_per_node=2 -m gptrain bench --config configs/bench.toml --train.total_batch_size=65536

On a GPU each row also gives its peak memory (torch.cuda.max_memory_allocated, MiB): the
model, its optimizer state and the activations of the timed steps.
MFU's peak is MEASURED in the same run on this device (matmuls in the training dtype, see
gptrain/logs/mfu.py), never looked up by name; a row that achieves more raises it with a warning,
so MFU never exceeds 100%. Under torchrun the numbers are global, and the step is timed a second
time with gradient communication switched off to report the share of time spent on communication.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from gptrain.config.load import load_config
from gptrain.distributed import runtime as dist
from gptrain.errors import ArgParser
from gptrain.logs.mfu import checked_mfu, format_flops, measure_peak_flops, synchronize
from gptrain.training import batch
from gptrain.training.build import build_training
from gptrain.training.step import train_step

VOCAB = {"byte": 257, "gpt2": 50257}


def bench_one(
    cfg, info: dist.DistInfo, dtype: str, compile: bool, steps: int, warmup: int, peaks: dict
) -> dict:
    """Time `steps` optimizer steps (after `warmup`) of cfg's model on random tokens."""
    t = cfg.train
    vocab = VOCAB.get(cfg.data.tokenizer, 50257)
    cuda = torch.device(info.device).type == "cuda"
    if cuda:  # each row's own peak: the model, its optimizer state and the steps' activations
        torch.cuda.reset_peak_memory_stats(info.device)
    built = build_training(cfg, info, vocab, dtype, compile)
    model, wrapped, _, ptdtype, autocast, _ = built
    mb, accum = batch.resolve(t, info, wrapped, model, autocast, vocab)
    timed = _timer(cfg, info, built, (mb, accum), vocab, warmup)
    step_s = timed(steps, sync=True)
    key = str(ptdtype)
    if key not in peaks:
        peaks[key] = measure_peak_flops(info.device, ptdtype)
    tok_per_s = t.total_batch_size / step_s
    fpt = model.flops_per_token(t.seq_len)
    mfu, peaks[key], warning = checked_mfu(tok_per_s, fpt, peaks[key], info.world_size)  # <= 1
    if warning and info.is_main:
        print(f"warning: {key.removeprefix('torch.')}: {warning}")
    row = {
        "dtype": key.removeprefix("torch."),
        "compile": compile,
        "world_size": info.world_size,
        "micro_batch": mb,
        "accum": accum,
        "step_ms": step_s * 1e3,
        "tok_per_s": tok_per_s,
        "peak_tflops": peaks[key] / 1e12,
        "mfu": mfu,
    }
    if cuda:
        row["peak_mem_mib"] = torch.cuda.max_memory_allocated(info.device) / 2**20
    if info.world_size > 1 and cfg.dist.mode == "ddp":  # the same steps without communication
        row["comm_share"] = max(0.0, 1 - timed(steps, sync=False) / step_s)
    return row


def _timer(cfg, info: dist.DistInfo, built, batching: tuple[int, int], vocab: int, warmup: int):
    """timed(n, sync) -> seconds per optimizer step of n steps on random tokens, after `warmup`
    untimed ones; sync=False skips the gradients' all-reduce."""
    t, (mb, accum) = cfg.train, batching
    model, wrapped, optimizer, _, autocast, scaler = built
    gen = torch.Generator().manual_seed(t.seed + info.rank)
    batches = [torch.randint(0, vocab, (mb, t.seq_len + 1), generator=gen) for _ in range(4)]
    batches = [(b[:, :-1].to(info.device), b[:, 1:].to(info.device)) for b in batches]
    counter = iter(range(10**12))

    def next_batch():
        return batches[next(counter) % len(batches)]

    def run_steps(n: int, sync: bool) -> None:
        clip = cfg.optim.grad_clip
        for _ in range(n):
            train_step(
                wrapped, model, optimizer, scaler, next_batch, accum, autocast, clip, sync=sync
            )

    def timed(n: int, sync: bool) -> float:
        run_steps(warmup, sync)
        synchronize(info.device)
        dist.barrier()
        t0 = time.perf_counter()
        run_steps(n, sync)
        synchronize(info.device)
        dist.barrier()
        return (time.perf_counter() - t0) / n

    return timed


def format_table(rows: list[dict]) -> str:
    cols = [
        "dtype",
        "compile",
        "world_size",
        "micro_batch",
        "accum",
        "step_ms",
        "tok_per_s",
        "peak",
        "mfu",
    ]
    cols += [c for c in ("peak_mem_mib", "comm_share") if any(c in r for r in rows)]
    fmt = {
        "step_ms": "{:.1f}",
        "tok_per_s": "{:,.0f}",
        "mfu": "{:.1%}",
        "comm_share": "{:.1%}",
        "peak_mem_mib": "{:,.0f}",
    }
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        r = {**r, "peak": format_flops(r["peak_tflops"] * 1e12)}  # GFLOP/s where TFLOP/s shows 0.00
        lines.append(
            "| " + " | ".join(fmt.get(c, "{}").format(r[c]) if c in r else "" for c in cols) + " |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = ArgParser(prog="gptrain bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", default="configs/bench.toml", help="config file (default configs/bench.toml)"
    )
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    parser.add_argument(
        "--warmup", type=int, default=3, help="untimed steps first (compilation, allocator)"
    )
    parser.add_argument("--matrix", action="store_true", help="float32/bfloat16 x eager/compiled")
    parser.add_argument("--json", default="", help="also write the rows to this file as JSON")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if not (o.startswith("--") and "=" in o)]
    if bad:
        parser.error(f"unexpected argument {bad[0]!r}; overrides look like --train.seq_len=128")
    cfg = load_config(args.config, [o[2:] for o in overrides])
    info = dist.DistInfo.from_env(cfg.train.device)
    dist.init(info, cfg.dist.backend, cfg.dist.timeout_s)
    try:
        if args.matrix:
            combos = [(d, c) for d in ("float32", "bfloat16") for c in (False, True)]
        else:
            combos = [(cfg.train.dtype, cfg.train.compile)]
        peaks: dict = {}
        rows = [bench_one(cfg, info, d, c, args.steps, args.warmup, peaks) for d, c in combos]
        if info.is_main:
            m = cfg.model
            print(
                f"bench: {m.arch} {m.preset or f'{m.n_layer} layers, {m.n_head} heads, width {m.n_embd}'}, seq_len {cfg.train.seq_len}, "
                f"micro-batch {cfg.train.micro_batch_size}, {cfg.train.total_batch_size} tokens/step, device {info.device}, "
                f"{torch.get_num_threads()} threads"
            )
            print(format_table(rows))
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=1))
    finally:
        dist.teardown()
    return 0
