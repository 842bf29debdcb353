"""Loader benchmark on a synthetic 2-billion-token shard set (~4 GB of uint16, deleted afterwards).

    .venv/bin/python benchmarks/cpu/bench_loader.py [--tokens 2e9] [--dir /tmp] [--seconds 10]
    .venv/bin/python benchmarks/cpu/bench_loader.py --composed   # what a text prepare makes

Shard files by default; --composed: the same tokens as parts of FineWeb-like documents
(log-normal lengths, mean ~1,000 tokens) read through shuffled span tables, as `gptrain prepare`
writes text (`gptrain/data/composed.py`).

Measures: Dataset + TrainLoader startup time, the first batch, batches/s and tokens/s of
`next_batch` (micro-batch 16 x seq_len 256, the trainer's bench config, which consumes roughly
20k tokens/s), and the growth of resident memory while reading. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from gptrain.data.loader import Dataset, TrainLoader
from gptrain.data.shards import write_manifest, write_shard

NEEDED_TOKENS_PER_S = 20_000
SHARD_TOKENS = 100_000_000


def rss_mb(kind: str = "VmRSS") -> float:
    """Resident memory in MB: VmRSS (all), RssAnon (process memory) or RssFile (mapped files)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(kind + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def make_shards(folder: Path, total: int) -> None:
    tok_hash = hashlib.sha256(b"synthetic 50257").hexdigest()
    rng = np.random.default_rng(0)
    shards, left, i = [], total, 0
    block = rng.integers(0, 50257, size=SHARD_TOKENS, dtype=np.uint16)
    while left > 0:
        n = min(SHARD_TOKENS, left)
        split = "val" if i == 0 else "train"
        block[:8] = i  # shards differ
        shards.append(
            {
                **write_shard(folder / f"{split}_{i:06d}.bin", block[:n], tok_hash, 50257),
                "split": split,
            }
        )
        left, i = left - n, i + 1
    ident = {"name": "synthetic", "vocab_size": 50257, "eot_id": 50256, "hash": tok_hash}
    write_manifest(
        folder, {"tokenizer": ident, "vocab_size": 50257, "eot_id": 50256, "shards": shards}
    )


def make_composed(folder: Path, total: int) -> None:
    """The same token blocks as parts, with documents shuffled into span tables (part 0 is val)."""
    from gptrain.data.assemble import Pieces, split_orders, write_splits

    (folder / "parts").mkdir()
    rng = np.random.default_rng(0)
    block = rng.integers(0, 50257, size=SHARD_TOKENS, dtype=np.uint16)
    records, lengths, parts, left, i = [], [], [], total, 0
    while left > 0:
        n = min(SHARD_TOKENS, left)
        block[:8] = i
        name = f"parts/part_{i:06d}.tok"
        block[:n].tofile(folder / name)
        lens = np.maximum(rng.lognormal(6.5, 0.9, size=n // 300 + 10).astype(np.int64), 1)
        lens = lens[: int(np.searchsorted(np.cumsum(lens), n)) + 1]
        lens[-1] = n - int(lens[:-1].sum())
        lengths.append(lens)
        records.append({"cont": False, "split": 2 if i == 0 else 1, "pieces": len(lens), "tokens": n})  # fmt: skip
        parts.append({"file": name, "tokens": n, "sha256": ""})
        left, i = left - n, i + 1
    p = Pieces.from_parts(records, lambda k: lengths[k])
    orders = split_orders(p, 0.1, None, None, 1337, 1337)  # val: part 0, marked; train shuffled
    shards, spans, _ = write_splits(folder, p, orders, SHARD_TOKENS)
    ident = {"name": "synthetic", "vocab_size": 50257, "eot_id": 50256, "hash": hashlib.sha256(b"synthetic 50257").hexdigest()}  # fmt: skip
    write_manifest(folder, {"tokenizer": ident, "vocab_size": 50257, "eot_id": 50256, "dtype": "uint16", "shards": shards, "parts": parts, "spans": spans})  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=float, default=2e9)
    parser.add_argument("--dir", default="/tmp")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--composed", action="store_true", help="parts + span tables, not files")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="gptrain-bench-loader-", dir=args.dir))
    try:
        t0 = time.perf_counter()
        (make_composed if args.composed else make_shards)(folder, int(args.tokens))
        write_s = time.perf_counter() - t0
        size_gb = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e9
        rss0, anon0, file0 = rss_mb(), rss_mb("RssAnon"), rss_mb("RssFile")
        t0 = time.perf_counter()
        ds = Dataset(folder)
        loader = TrainLoader(ds, args.seq_len, args.batch, rank=0, world_size=1, seed=1337)
        startup = time.perf_counter() - t0
        t0 = time.perf_counter()
        loader.next_batch()
        first = time.perf_counter() - t0
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < args.seconds:
            loader.next_batch()
            n += 1
        dt = time.perf_counter() - t0
        rss_growth = rss_mb() - rss0
        anon_growth, file_growth = rss_mb("RssAnon") - anon0, rss_mb("RssFile") - file0
        tok_s = n * args.batch * args.seq_len / dt
        rows = [
            (
                "data set",
                f"{ds.num_tokens('train') + ds.num_tokens('val'):,} tokens in {len(ds.manifest['shards'])} shards, {size_gb:.2f} GB (written in {write_s:.0f} s)",
            ),
            ("windows per epoch", f"{loader.windows_per_epoch:,}"),
            ("startup (Dataset + TrainLoader)", f"{startup * 1e3:.1f} ms"),
            ("first batch", f"{first * 1e3:.1f} ms"),
            ("batches/s (16 x 256)", f"{n / dt:,.0f}"),
            ("tokens/s", f"{tok_s:,.0f}"),
            (
                f"vs the trainer's ~{NEEDED_TOKENS_PER_S:,} tokens/s",
                f"{tok_s / NEEDED_TOKENS_PER_S:,.0f}x",
            ),
            ("resident memory growth while reading (VmRSS)", f"{rss_growth:.1f} MB"),
            ("  of which process memory (RssAnon)", f"{anon_growth:.1f} MB"),
            ("  of which mapped shard pages (RssFile)", f"{file_growth:.1f} MB"),
        ]
        kind = "composed shards (parts + span tables)" if args.composed else "shard files"
        print(f"\n| loader, {args.tokens / 1e9:g}B-token synthetic {kind} | value |")
        print("| --- | ---: |")
        for name, value in rows:
            print(f"| {name} | {value} |")
        print(
            "\n(memory growth counts pages of the memory-mapped shards touched so far: page cache, not copies)"
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
