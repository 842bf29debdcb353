"""Time to quality: wall time of a whole `gptrain train` process and the held-out bits/byte it ends at.

    # tiny shakespeare, first 90% of the characters for training, last 10% held out (byte tokens)
    PYTHONPATH=. python benchmarks/cpu/bench_race.py --config configs/race.toml \\
        --input ../shared/data/tinyshakespeare/input.txt --target 2.72 --limit-s 50
    # the same race with nanoGPT's README CPU recipe run as a whole process beside it (same 90%)
    PYTHONPATH=. python benchmarks/cpu/bench_race.py --config configs/race.toml \\
        --input ../shared/data/tinyshakespeare/input.txt --target 2.72 --nanogpt /path/to/nanoGPT
    # what `make train` runs (built-in corpus, its own val split)
    PYTHONPATH=. python benchmarks/cpu/bench_race.py --config configs/default.toml --target 2.60 --limit-s 300

The clock covers the whole process (imports, data, peak measurement, training, the final
evaluation of the whole val split, checkpoint, plot), as a user would time it. With --input the
text is prepared first (not timed) into a temporary folder with prepare's default split (one file:
the last 10% of its characters are the val split). Prints one table row and exits 1 when the
target or the time limit is missed, so regressions show.

With --nanogpt DIR (a checkout of github.com/karpathy/nanoGPT) the same text is prepared with
nanoGPT's own data/shakespeare_char/prepare.py (the first 90% of the characters for training, the
last 10% held out, as ours) and its README's CPU recipe runs as a whole process (`train.py
config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20 --log_interval=1
--block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000
--lr_decay_iters=2000 --dropout=0.0`); its last held-out loss (nats per character, estimated by
nanoGPT on 20 random batches) / ln 2 is its bits per byte (the text is ASCII). The time limit
becomes half of nanoGPT's wall time (the race target) unless --limit-s is given.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def nanogpt_recipe(nano: Path, text: Path) -> tuple[float, float]:
    """(wall seconds, held-out bits/byte) of nanoGPT's README CPU recipe as a whole process."""
    import re
    import shutil

    folder = nano / "data" / "shakespeare_char"
    if not (folder / "train.bin").is_file():
        shutil.copyfile(text, folder / "input.txt")
        subprocess.run([sys.executable, "prepare.py"], cwd=folder, check=True, capture_output=True)
    cmd = [sys.executable, "train.py", "config/train_shakespeare_char.py", "--device=cpu",
           "--compile=False", "--eval_iters=20", "--log_interval=1", "--block_size=64",
           "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128", "--max_iters=2000",
           "--lr_decay_iters=2000", "--dropout=0.0", "--always_save_checkpoint=False"]  # fmt: skip
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=nano, check=True, capture_output=True, text=True).stdout
    wall = time.perf_counter() - t0
    vals = re.findall(r"^step \d+: train loss [\d.]+, val loss ([\d.]+)", out, re.M)
    return wall, float(vals[-1]) / math.log(2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--config", default=str(REPO / "configs" / "race.toml"))
    p.add_argument("--input", help="a text file to prepare (byte tokenizer) and train on")
    p.add_argument(
        "--data", help="a prepared folder instead of --input (else the config's data.dir)"
    )
    p.add_argument("--target", type=float, default=2.72, help="val bits/byte to reach")
    p.add_argument(
        "--limit-s",
        type=float,
        default=None,
        help="wall-time budget in seconds (default 50, or half of nanoGPT's with --nanogpt)",
    )
    p.add_argument("--nanogpt", help="a nanoGPT checkout: run its README CPU recipe beside ours")
    p.add_argument("overrides", nargs="*", help="extra --section.key=value for gptrain train")
    args = p.parse_args(argv)
    nano = nanogpt_recipe(Path(args.nanogpt), Path(args.input)) if args.nanogpt else None
    if args.limit_s is None:
        args.limit_s = nano[0] / 2 if nano else 50.0
    with tempfile.TemporaryDirectory() as tmp:
        extra = []
        if args.input:
            data = Path(tmp) / "data"
            subprocess.run([sys.executable, "-m", "gptrain", "prepare", "--input", args.input, "--out", str(data), "--no-progress"], check=True, cwd=REPO)  # fmt: skip
            extra.append(f"--data.dir={data}")
        elif args.data:
            extra.append(f"--data.dir={args.data}")
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "gptrain", "train", "--config", args.config, f"--run.dir={run_dir}", "--log.progress=false", *extra, *args.overrides]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
            return proc.returncode
        summary = json.loads((run_dir / "summary.json").read_text())
    bpb = summary.get("val_bpb", float("nan"))
    ok = bpb <= args.target and wall <= args.limit_s
    print(f"{cpu_name()}, {os.cpu_count()} CPUs, config {Path(args.config).name}")
    print("| config | steps | tokens | wall s | val bits/byte | target | met |")
    print("|---|---:|---:|---:|---:|---|---|")
    if nano:
        print(f"| nanoGPT README CPU recipe | 2000 | {2000 * 12 * 64:,} | {nano[0]:.1f} | {nano[1]:.4f} | | |")  # fmt: skip
    print(f"| {Path(args.config).name} | {summary['steps']} | {summary['tokens']:,} | {wall:.1f} | "
          f"{bpb:.4f} | <= {args.target} in <= {args.limit_s:.0f} s | {'yes' if ok else 'NO'} |")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
