"""DDP scaling on one CPU machine: 2 ranks x 1 thread (accumulation 8) vs 1 process x 2 threads
(accumulation 16), the same 65,536-token global batch of configs/bench.toml's model.

    .venv/bin/python benchmarks/cpu/bench_ddp.py                 # 3 timed steps after 1 warm-up step
    .venv/bin/python benchmarks/cpu/bench_ddp.py --steps 5 --dtype float32

Both runs are `gptrain bench` (synthetic tokens, global tokens/s); the 2-rank run goes through
torch.distributed.run and also times the same steps without gradient communication, so that
`comm_share` = 1 - (step time without communication / step time) is the share of the step spent
waiting on the all-reduce. Target: the 2 ranks reach >= 90% of the single process's tokens/s.
Prints the machine load before and after (other jobs on the CPU distort both runs) and a table.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOTAL = 16 * 256 * 8 * 2  # micro-batch x seq_len x accumulation 8 x 2 ranks = 65,536 tokens


def bench(launcher: list[str], threads: int, args) -> dict:
    """Run `gptrain bench` once; its table's data row as a dict."""
    cmd = [sys.executable, *launcher, "-m", "gptrain", "bench", "--config", str(REPO / "configs" / "bench.toml")]  # fmt: skip
    cmd += [f"--train.total_batch_size={TOTAL}", f"--steps={args.steps}", f"--warmup={args.warmup}"]
    if args.dtype:
        cmd.append(f"--train.dtype={args.dtype}")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
    out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"bench failed ({out.returncode}):\n{out.stdout}\n{out.stderr[-3000:]}")
    table = [line for line in out.stdout.splitlines() if line.startswith("|")]
    header = [c.strip() for c in table[0].strip("|").split("|")]
    row = [c.strip() for c in table[2].strip("|").split("|")]
    return dict(zip(header, row, strict=True))


def number(text: str) -> float:
    return float(text.replace(",", "").rstrip("%"))


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps per run")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--dtype", default="", help="train.dtype override (default: the config's)")
    args = p.parse_args()
    print(f"before: {load()}, {os.cpu_count()} CPUs", flush=True)
    single = bench([], 2, args)
    ddp = bench(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"], 1, args)
    print(f"after: {load()}")
    rows = [("1 process x 2 threads", single), ("2 ranks x 1 thread (DDP)", ddp)]
    base = number(single["tok_per_s"])
    print(f"\nbench model (configs/bench.toml), {TOTAL:,} tokens per optimizer step, dtype {single['dtype']}\n")  # fmt: skip
    print("| setup | accum | step ms | tokens/s | vs 1 process | MFU | comm share |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows:
        share = number(r["tok_per_s"]) / base
        comm = r.get("comm_share") or "-"
        print(f"| {name} | {r['accum']} | {r['step_ms']} | {r['tok_per_s']} | {share:.1%} | {r['mfu']} | {comm} |")  # fmt: skip
    ok = number(ddp["tok_per_s"]) >= 0.9 * base
    print(f"\ntarget (2 ranks >= 90% of 1 process): {'met' if ok else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
