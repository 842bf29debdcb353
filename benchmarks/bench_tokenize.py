"""Tokenization throughput of `gptrain prepare` on the default corpus (38 Shakespeare plays).

    .venv/bin/python benchmarks/bench_tokenize.py [--tokenizer gpt2] [--repeat 3]

Prints a markdown table: MB/s of UTF-8 input for tiktoken's own single-thread encode (the
reference), for prepare's tokenization stage with 1 and 2 workers, and for the whole `prepare`
(reading the corpus, tokenizing, splitting, writing and hashing shards). Best of --repeat runs.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from gptrain.data.prepare import Document, prepare, tokenize_to_file
from gptrain.data.sources import shakespeare_documents
from gptrain.data.tokenizers import load_tokenizer


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
                n_tokens = int(tokenize_to_file(docs, tok, path, workers, progress=False).sum())

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
