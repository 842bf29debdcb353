"""Tokenization throughput of `gptrain prepare` on the default corpus (38 Shakespeare plays).

    .venv/bin/python benchmarks/cpu/bench_tokenize.py [--tokenizer gpt2] [--repeat 3]

Prints a markdown table: MB/s of UTF-8 input for tiktoken's own single-thread encode (the
reference), for a tokenization stage with 1 and 2 workers, and for the whole `prepare` (reading
the corpus, tokenizing, splitting, writing and hashing shards). Best of --repeat runs.

The tokenization stage is this file's in-memory pipeline (`tokenize_to_file`): the documents held
in the main process, cut where GPT-2 pre-tokenization splits (`gptrain.data.encode.split_points`)
into work units of ~CHUNK_CHARS characters, encoded by a process pool, results in input order.
`gptrain prepare` itself tokenizes through resumable parts (`gptrain.data.parts`).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from gptrain.data.encode import CHUNK_CHARS, split_points
from gptrain.data.prepare import prepare
from gptrain.data.shards import dtype_for_vocab
from gptrain.data.sources import Document, shakespeare_documents
from gptrain.data.tokenizers import load_tokenizer


def work_units(docs, chunk: int | None = None):
    """Group (doc index, text piece) pairs into units of ~chunk characters, in document order."""
    chunk = chunk or CHUNK_CHARS
    unit, size = [], 0
    for i, doc in enumerate(docs):
        bounds = [0, *split_points(doc.text, chunk), len(doc.text)]
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            unit.append((i, doc.text[a:b]))
            size += b - a
            if size >= chunk:
                yield unit
                unit, size = [], 0
    if unit:
        yield unit


# The tokenizer of this worker process: inherited from the parent under fork, loaded from its
# identity by `_init_worker` under spawn (macOS, Windows). Only the pool's workers read it.
_worker_tokenizer = None


def _init_worker(identity: dict) -> None:
    global _worker_tokenizer
    if _worker_tokenizer is None:
        _worker_tokenizer = load_tokenizer(identity)


def _encode_pieces(pieces: list[str]) -> list[np.ndarray]:
    """In a worker: token arrays already in the shard dtype (half the bytes to send back)."""
    dtype = dtype_for_vocab(_worker_tokenizer.vocab_size)
    return [_worker_tokenizer.encode_array(p).astype(dtype, copy=False) for p in pieces]


def encode_units(tok, units, workers: int):
    """(unit, token arrays of its pieces) in input order. One worker encodes in this process;
    more use a process pool (tokenizers hold the GIL for part of each call, so threads stop
    scaling), at most 4*workers units in flight (bounded memory)."""
    global _worker_tokenizer
    if workers <= 1:
        for unit in units:
            yield unit, [tok.encode_array(piece) for _, piece in unit]
        return
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    _worker_tokenizer = tok  # what forked workers inherit
    try:
        with ProcessPoolExecutor(
            workers, mp_context=ctx, initializer=_init_worker, initargs=(tok.identity(),)
        ) as pool:
            pending = deque()
            for unit in units:
                pending.append((unit, pool.submit(_encode_pieces, [p for _, p in unit])))
                if len(pending) >= 4 * workers:
                    first, fut = pending.popleft()
                    yield first, fut.result()
            while pending:
                first, fut = pending.popleft()
                yield first, fut.result()
    finally:
        _worker_tokenizer = None


def tokenize_to_file(docs, tok, path: Path, workers: int) -> np.ndarray:
    """Tokenize documents into a flat token file; return each document's token count."""
    dtype = dtype_for_vocab(tok.vocab_size)
    lengths: list[int] = []
    with open(path, "wb") as f:
        for unit, arrays in encode_units(tok, work_units(docs), workers):
            for (doc_idx, _), arr in zip(unit, arrays, strict=True):
                while len(lengths) <= doc_idx:
                    lengths.append(0)
                lengths[doc_idx] += len(arr)
                arr.astype(dtype, copy=False).tofile(f)
        f.flush()
        os.fsync(f.fileno())
    return np.array(lengths, dtype=np.int64)


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default="gpt2")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    docs = [Document(name, text) for name, text in shakespeare_documents()]
    mb = sum(len(d.text.encode()) for d in docs) / 1e6
    tok = load_tokenizer(args.tokenizer)
    rows = []
    if args.tokenizer == "gpt2":
        enc = tok.enc
        run = lambda: [enc.encode_ordinary(d.text) for d in docs]  # noqa: E731
        run()  # warm up
        rows.append(("tiktoken encode_ordinary, 1 thread (reference)", mb / best(run, args.repeat)))
    n_tokens = 0
    with tempfile.TemporaryDirectory() as tmp:
        for workers in (1, 2):
            path = Path(tmp) / "tokens.bin"

            def stage(workers=workers, path=path):
                nonlocal n_tokens
                n_tokens = int(tokenize_to_file(docs, tok, path, workers).sum())

            stage()  # warm up the worker threads' tokenizer state
            rows.append(
                (f"prepare tokenization stage, {workers} worker(s)", mb / best(stage, args.repeat))
            )
        for workers in (1, 2):

            def whole(workers=workers):
                out = Path(tmp) / f"out{workers}-{time.perf_counter_ns()}"
                prepare(["shakespeare"], out, args.tokenizer, workers=workers, progress=False)

            rows.append(
                (
                    f"`prepare --input shakespeare` end to end, {workers} worker(s)",
                    mb / best(whole, args.repeat),
                )
            )
    print(
        f"\nTokenizer {args.tokenizer}: {mb:.2f} MB of text, {n_tokens:,} tokens, {os.cpu_count()} CPU cores\n"
    )
    print("| what | MB/s | vs reference |")
    print("| --- | ---: | ---: |")
    ref = rows[0][1]
    for name, rate in rows:
        print(f"| {name} | {rate:.2f} | {rate / ref:.2f}x |")
    stage1 = next(r for n, r in rows if n.startswith("prepare tokenization stage, 1"))
    stage2 = next(r for n, r in rows if n.startswith("prepare tokenization stage, 2"))
    print(f"\n2 workers / 1 worker (tokenization stage): {stage2 / stage1:.2f}x")


if __name__ == "__main__":
    main()
