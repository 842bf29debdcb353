"""Checkpoint write and hash speed against checkpoint.io_threads: one process, DCP's file writer.

    PYTHONPATH=. python benchmarks/bench_ckpt_io.py                       # 2 GiB, threads 1 2 4
    PYTHONPATH=. python benchmarks/bench_ckpt_io.py --gib 8 --threads 1 4 8 --dir /local/nvme

For each thread count, in alternating rounds (a shared host's load hits every count): writes
--gib GiB of float32 tensors with DCP's FileSystemWriter(thread_count=N) as a sharded checkpoint
does (one file per thread, fsynced), then hashes the files as folder.file_records(files, N) does
for meta.json. Prints seconds and GiB/s per round, and the thread count auto picks here
(folder.io_threads). Results: docs/resume.md, "Save speed".
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

from gptrain.checkpoint import folder
from gptrain.distributed.runtime import cpu_cores


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=2.0, help="GiB of tensors to write")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    a = p.parse_args()
    n = max(1, round(a.gib * 4))  # tensors of 256 MiB
    state = {f"w{i}": torch.randn(64, 1024, 1024) for i in range(n)}
    gib = n / 4
    print(f"{gib:g} GiB in {n} tensors; {cpu_cores()} cores; auto: {folder.io_threads(1)} threads")
    print("| threads | files | write s | write GiB/s | hash s |\n|---:|---:|---:|---:|---:|")
    root = Path(tempfile.mkdtemp(dir=a.dir, prefix="bench_ckpt_io_"))
    try:
        for _ in range(a.rounds):
            for threads in a.threads:
                out = root / f"t{threads}"
                shutil.rmtree(out, ignore_errors=True)
                t = time.perf_counter()
                with warnings.catch_warnings():  # "assuming ... a single process": it is one
                    warnings.simplefilter("ignore")
                    writer = dcp.FileSystemWriter(out, thread_count=threads)
                    dcp.save(state, storage_writer=writer, no_dist=True)
                write = time.perf_counter() - t
                files = sorted(out.glob("*.distcp"))
                t = time.perf_counter()
                folder.file_records(files, threads)
                hashed = time.perf_counter() - t
                print(f"| {threads} | {len(files)} | {write:.2f} | {gib / write:.2f} | {hashed:.2f} |")  # fmt: skip
                shutil.rmtree(out)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
