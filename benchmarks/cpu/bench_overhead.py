"""Per-step overhead: the fraction of an optimizer step's wall time spent outside torch ops.

Runs the training loop's per-step work (lr_at + set_lr, then train_step: micro-batches from the
real TrainLoader, forward/backward under autocast, clipping, optimizer step, zero_grad) for two
shapes and reports, per shape:
  - step ms without the profiler (median of --steps timed steps after --warmup),
  - under torch.profiler: the union of the time intervals covered by `aten::` ops on the main
    thread, divided by the profiled wall time; "outside torch ops" = 1 - that fraction (Python,
    context managers, batch hand-off, optimizer bookkeeping, host syncs, ...).

    PYTHONPATH=. python benchmarks/cpu/bench_overhead.py                  # both shapes
    PYTHONPATH=. python benchmarks/cpu/bench_overhead.py --shape small --steps 50
    # another checkout's code and config (an A/B between two versions), the same script
    PYTHONPATH=/path/to/old python benchmarks/cpu/bench_overhead.py --config /path/to/old/configs/bench.toml

small = nanoGPT's CPU recipe (4 layers, 4 heads, width 128, 12 x 64 = 768 tokens/step);
bench = configs/bench.toml (4 layers, width 256, 16 x 256 tokens/step). Byte-level tiny
shakespeare, prepared into a temporary folder. Works on checkouts without set_lr or
gptrain/training/step.py too, so the same script compares two versions.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
SHAPES = {
    "small": ["model.n_layer=4", "model.n_head=4", "model.n_embd=128", "train.seq_len=64",
              "train.micro_batch_size=12", "train.total_batch_size=768"],
    "bench": [],
}  # fmt: skip


def setup(shape: str, data_dir: Path, dtype: str, optim: str, config: str | None = None):
    from gptrain.config.load import load_config
    from gptrain.config.sections import accumulation_steps
    from gptrain.data.loader import Dataset, TrainLoader
    from gptrain.distributed.runtime import DistInfo
    from gptrain.training.build import build_training

    overrides = [f"data.dir={data_dir}", f"train.dtype={dtype}", "train.max_steps=1000",
                 f"optim.name={optim}", *SHAPES[shape]]  # fmt: skip
    cfg = load_config(config or str(REPO / "configs" / "bench.toml"), overrides)
    info = DistInfo()
    ds = Dataset(data_dir)
    t = cfg.train
    loader = TrainLoader(ds, t.seq_len, t.micro_batch_size, 0, 1, t.seed)
    model, wrapped, opt, ptdtype, autocast, scaler = build_training(cfg, info, ds.vocab_size, t.dtype, False)  # fmt: skip
    accum = accumulation_steps(t.total_batch_size, t.micro_batch_size, t.seq_len, 1)
    return cfg, model, wrapped, opt, autocast, scaler, loader, accum


def make_step(cfg, model, wrapped, opt, autocast, scaler, loader, accum):
    from gptrain.training import optim as goptim

    try:
        from gptrain.training.step import train_step
    except ImportError:  # a checkout without gptrain/training/step.py
        from gptrain.commands.train import train_step

    set_lr = getattr(goptim, "set_lr", None)
    state = {"step": 0}

    def step():
        lr = goptim.lr_at(state["step"], cfg.optim, cfg.train.max_steps)
        if set_lr is not None:
            set_lr(opt, lr, cfg.optim)
        else:  # a checkout without set_lr
            for group in opt.param_groups:
                group["lr"] = lr
        train_step(wrapped, model, opt, scaler, loader.next_batch, accum, autocast, cfg.optim.grad_clip)  # fmt: skip
        state["step"] += 1

    return step


def op_fraction(prof, wall_us: float) -> float:
    """Union of the intervals of aten:: ops on the training thread / wall time."""
    thread = prof_thread(prof)
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.name.startswith("aten::") and e.thread == thread
    )
    covered, end = 0.0, -1.0
    for s, e in spans:
        if e > end:
            covered += e - max(s, end)
            end = e
    return covered / wall_us


def prof_thread(prof):
    """The thread that ran the profiled steps: the training thread."""
    return next(e.thread for e in prof.events() if e.name == "gptrain_step")


def measure(shape, data_dir, dtype, optim, steps, warmup, config=None):
    parts = setup(shape, data_dir, dtype, optim, config)
    step = make_step(*parts)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    from torch.profiler import ProfilerActivity, profile, record_function

    step()  # the profiler's own first-step costs are not the loop's
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(max(5, steps // 2)):
            with record_function("gptrain_step"):
                step()
    # wall: the sum of the profiled step spans
    spans = [e for e in prof.events() if e.name == "gptrain_step"]
    wall_us = sum(e.time_range.end - e.time_range.start for e in spans)
    inside = op_fraction(prof, wall_us)
    parts[-2].close()
    return statistics.median(times) * 1e3, 1 - inside


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--shape", choices=["small", "bench", "both"], default="both")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--optim", default="adamw")
    p.add_argument("--config", help="the bench model's config file (default configs/bench.toml); pass an older checkout's to compare the same model")  # fmt: skip
    p.add_argument("--input", default=str(REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"))  # fmt: skip
    args = p.parse_args(argv)
    from gptrain.data.prepare import prepare

    shapes = ["small", "bench"] if args.shape == "both" else [args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        prepare([args.input], data, tokenizer="byte", progress=False)
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, dtype {args.dtype}, optim {args.optim}")  # fmt: skip
        print("| shape | tokens/step | step ms | outside torch ops |")
        print("|---|---:|---:|---:|")
        for shape in shapes:
            ms, outside = measure(shape, data, args.dtype, args.optim, args.steps, args.warmup, args.config)  # fmt: skip
            tokens = 768 if shape == "small" else 4096
            print(f"| {shape} | {tokens} | {ms:.1f} | {outside:.1%} |")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
