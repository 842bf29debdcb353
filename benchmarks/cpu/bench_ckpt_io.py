"""Checkpoint write and hash speed against checkpoint.io_threads: one process.

    PYTHONPATH=. python benchmarks/cpu/bench_ckpt_io.py                       # 2 GiB, threads 1 2 4
    PYTHONPATH=. python benchmarks/cpu/bench_ckpt_io.py --gib 8 --threads 1 4 8 --dir /local/nvme
    PYTHONPATH=. python benchmarks/cpu/bench_ckpt_io.py --layout full --gib 1.5 --threads 1 2

For each thread count, in alternating rounds (a shared host's load hits every count):
- dcp: writes --gib GiB of float32 tensors with DCP's FileSystemWriter(thread_count=N) as a
  sharded checkpoint does (one file per thread, fsynced), then hashes the files as
  folder.file_records(files, N) does for meta.json (both columns);
- full: a whole full checkpoint by full.save(..., threads=N), a third of --gib as weights
  (model.safetensors) and two thirds as AdamW moments (state.pt), as a one-process or DDP run
  writes it: the two files, their hashes, meta.json, the publishing renames (write column).
Prints seconds and GiB/s per round, and the thread count auto picks here (folder.io_threads).
Results: benchmarks/RESULTS.md, "Checkpoint I/O".
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from gptrain.checkpoint import folder, full
from gptrain.distributed.runtime import cpu_cores


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=2.0, help="GiB of tensors to write")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    p.add_argument("--layout", choices=("dcp", "full"), default="dcp")
    a = p.parse_args()
    n = max(1, round(a.gib * 4))  # tensors of 256 MiB
    state = {f"w{i}": torch.randn(64, 1024, 1024) for i in range(n)}
    gib = n / 4
    if a.layout == "full":  # weights, and AdamW's two moments of a third as much each
        weights = {k: v for i, (k, v) in enumerate(state.items()) if i % 3 == 0}
        moments = {k: v for i, (k, v) in enumerate(state.items()) if i % 3}
        optim = {"optimizer": {"state": moments}}
    print(f"{gib:g} GiB in {n} tensors; {cpu_cores()} cores; auto: {folder.io_threads(1)} threads")
    print("| threads | files | write s | write GiB/s | hash s |\n|---:|---:|---:|---:|---:|")
    root = Path(tempfile.mkdtemp(dir=a.dir, prefix="bench_ckpt_io_"))
    try:
        for _ in range(a.rounds):
            for threads in a.threads:
                out = root / f"t{threads}"
                shutil.rmtree(out, ignore_errors=True)
                t = time.perf_counter()
                if a.layout == "full":  # write, hash, meta.json, publish: one number
                    full.save(out, 1, weights, {}, optim, threads=threads)
                    write, hashed = time.perf_counter() - t, None  # inside `write`
                    files = list((out / "checkpoints" / "step_00000001").iterdir())
                else:
                    with warnings.catch_warnings():  # "assuming ... a single process": it is
                        warnings.simplefilter("ignore")
                        writer = dcp.FileSystemWriter(out, thread_count=threads)
                        dcp.save(state, storage_writer=writer, no_dist=True)
                    write = time.perf_counter() - t
                    files = sorted(out.glob("*.distcp"))
                    t = time.perf_counter()
                    folder.file_records(files, threads)
                    hashed = time.perf_counter() - t
                print(f"| {threads} | {len(files)} | {write:.2f} | {gib / write:.2f} | {'in write' if hashed is None else f'{hashed:.2f}'} |")  # fmt: skip
                shutil.rmtree(out)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
