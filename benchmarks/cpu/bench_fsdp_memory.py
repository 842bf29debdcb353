"""Per-rank parameter + optimizer memory: FSDP2 on 2 CPU ranks vs one process (measured RSS).

    PYTHONPATH=. python benchmarks/cpu/bench_fsdp_memory.py [--preset gpt2-medium]

Each worker builds the model exactly as `gptrain train` does (build_training: meta-device build and
sharded init under FSDP2), runs one AdamW step on one 64-token sequence, frees the gradients, and
reports its resident set size (RSS, /proc/self/statm, after glibc's malloc_trim) above the RSS
it had after `import torch` and the process-group start-up: what its parameters and optimizer state occupy (plus allocator
slack), and the peak RSS of the whole process (ru_maxrss). The target: FSDP2 per-rank
<= 0.55 x the single process's parameter + optimizer memory. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def rss_bytes() -> int:
    """Resident memory after glibc returns its free pages to the OS (malloc_trim), so that RSS
    counts live tensors, not what freed activations and gradients left in malloc's arenas."""
    import ctypes

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(preset: str, out: str) -> None:
    import torch

    from gptrain.config.load import load_config
    from gptrain.distributed import runtime as dist
    from gptrain.training.build import build_training

    torch.set_num_threads(1)
    info = dist.DistInfo.from_env("cpu")
    dist.init(info, "gloo", 600)
    cfg = load_config(
        str(REPO / "configs" / "debug.toml"),
        [f"model.preset={preset}", "dist.mode=fsdp", "train.seq_len=64"],
    )
    base = rss_bytes()
    model, wrapped, optimizer, *_ = build_training(cfg, info, 50257, "float32", False)
    built = rss_bytes()
    x = torch.randint(0, 50257, (1, 64))
    _, loss = wrapped(x, x)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    after = rss_bytes()
    params = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters()
    )
    result = {
        "rank": info.rank,
        "world": info.world_size,
        "local_params": params,
        "after_build_mib": (built - base) / 2**20,
        "after_step_mib": (after - base) / 2**20,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    dist.teardown()
    Path(f"{out}.{info.rank}.{info.world_size}").write_text(json.dumps(result))


def run(world: int, preset: str, out: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--worker", "--preset", preset, "--out", out]
    if world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", *cmd[1:]]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    return [json.loads(Path(f"{out}.{r}.{world}").read_text()) for r in range(world)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2-medium")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--out", default="")
    a = p.parse_args()
    if a.worker:
        return worker(a.preset, a.out)
    with tempfile.TemporaryDirectory() as tmp:
        single = run(1, a.preset, f"{tmp}/r")[0]
        sharded = run(2, a.preset, f"{tmp}/r")
    print(f"| {a.preset} | params held | RSS after build | RSS after step 1 | ratio to 1 process | peak RSS |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in [single, *sharded]:
        name = "1 process" if r["world"] == 1 else f"FSDP2 rank {r['rank']} of {r['world']}"
        ratio = r["after_step_mib"] / single["after_step_mib"]
        print(
            f"| {name} | {r['local_params'] / 1e6:.1f} M | {r['after_build_mib']:,.0f} MiB | "
            f"{r['after_step_mib']:,.0f} MiB | {ratio:.2f} | {r['peak_rss_mib']:,.0f} MiB |"
        )


if __name__ == "__main__":
    main()
