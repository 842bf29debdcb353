"""Tokens/s of `gptrain bench` against nanoGPT's train.py as shipped, at the bench shapes, same CPU.

    git clone https://github.com/karpathy/nanoGPT /path/to/nanoGPT      # where GitHub is reachable
    PYTHONPATH=. python benchmarks/cpu/bench_nanogpt.py --nanogpt /path/to/nanoGPT --rounds 2
    PYTHONPATH=. python benchmarks/cpu/bench_nanogpt.py --nanogpt DIR --compiled   # + gptrain compiled

Both train the bench model (4 layers, 4 heads, width 256, 256-token windows, micro-batch 16, one
micro-step per optimizer step, dropout 0) on tiny shakespeare's characters. nanoGPT runs its own
train.py with its CPU defaults (float32: its autocast context is a no-op on the CPU), once with
`--compile=False` and once with its default `--compile=True`; its per-iteration times are averaged
over the last 12 of 25 iterations. gptrain runs `gptrain bench` with the bench config's defaults
(dtype auto: bf16 autocast where the CPU supports it, eager). The runs alternate (--rounds times)
so that a shared machine's noise hits both, and the ratio uses each side's best round against
nanoGPT's faster setting.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHAPES = ["--n_layer=4", "--n_head=4", "--n_embd=256", "--block_size=256", "--batch_size=16",
          "--dropout=0.0", "--gradient_accumulation_steps=1"]  # fmt: skip
TOKENS_PER_ITER = 16 * 256


def prepare_nanogpt_data(nano: Path, text: Path) -> None:
    """nanoGPT's own data/shakespeare_char/prepare.py, given the text (it downloads it otherwise)."""
    folder = nano / "data" / "shakespeare_char"
    if (folder / "train.bin").is_file():
        return
    shutil.copyfile(text, folder / "input.txt")
    subprocess.run([sys.executable, "prepare.py"], cwd=folder, check=True, capture_output=True)


def nanogpt_tok_s(nano: Path, compile: bool) -> float:
    cmd = [sys.executable, "train.py", "config/train_shakespeare_char.py", "--device=cpu",
           f"--compile={compile}", *SHAPES, "--max_iters=25", "--eval_interval=1000",
           "--eval_iters=1", "--log_interval=1", "--always_save_checkpoint=False"]  # fmt: skip
    out = subprocess.run(cmd, cwd=nano, check=True, capture_output=True, text=True).stdout
    ms = [float(m) for m in re.findall(r"^iter \d+: loss [\d.]+, time ([\d.]+)ms", out, re.M)]
    if len(ms) < 12:
        raise SystemExit(f"nanoGPT printed {len(ms)} iteration times; output tail:\n{out[-2000:]}")
    return TOKENS_PER_ITER / (sum(ms[-12:]) / 12 / 1e3)


def gptrain_tok_s(steps: int, compile: bool = False) -> tuple[float, str]:
    cmd = [sys.executable, "-m", "gptrain", "bench", "--config", str(REPO / "configs" / "bench.toml"),
           "--steps", str(steps), "--warmup", "3", f"--train.compile={str(compile).lower()}"]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True).stdout
    row = [c.strip() for c in out.strip().splitlines()[-1].strip("|").split("|")]
    return float(row[6].replace(",", "")), row[0]  # tok_per_s, dtype


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--nanogpt", required=True, help="a checkout of github.com/karpathy/nanoGPT")
    p.add_argument("--input", default=str(REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"))  # fmt: skip
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=12, help="gptrain bench's timed steps")
    p.add_argument("--compiled", action="store_true", help="also gptrain with train.compile=true")
    args = p.parse_args(argv)
    nano = Path(args.nanogpt)
    if not (nano / "train.py").is_file():
        print(f"bench_nanogpt: error: {nano} has no train.py; pass a nanoGPT checkout", file=sys.stderr)  # fmt: skip
        return 2
    prepare_nanogpt_data(nano, Path(args.input))
    best = {"nanoGPT eager": 0.0, "nanoGPT compiled": 0.0, "gptrain": 0.0}
    if args.compiled:
        best["gptrain compiled"] = 0.0
    dtype = ""
    for r in range(args.rounds):
        eager, compiled = nanogpt_tok_s(nano, False), nanogpt_tok_s(nano, True)
        ours, dtype = gptrain_tok_s(args.steps)
        results = [eager, compiled, ours]
        if args.compiled:
            results.append(gptrain_tok_s(args.steps, compile=True)[0])
        print(f"round {r + 1}: nanoGPT eager {eager:,.0f}, nanoGPT compiled {compiled:,.0f}, "
              f"gptrain ({dtype}) {', '.join(f'{v:,.0f}' for v in results[2:])} tok/s", flush=True)  # fmt: skip
        for k, v in zip(best, results, strict=True):
            best[k] = max(best[k], v)
    ref = max(best["nanoGPT eager"], best["nanoGPT compiled"])
    print("| run | best tokens/s | vs nanoGPT's faster setting |")
    print("|---|---:|---:|")
    for k, v in best.items():
        how = "compiled" if "compiled" in k else "eager"
        label = f"{k} (float32)" if k.startswith("nanoGPT") else f"gptrain bench ({dtype}, {how})"
        print(f"| {label} | {v:,.0f} | {v / ref:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
