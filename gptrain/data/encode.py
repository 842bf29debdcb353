"""Cutting long texts where GPT-2-style pre-tokenization always splits (`split_points`: at a
newline that follows a non-space character), so tokenizing the pieces gives the tokens of the
whole text; `gptrain prepare`'s workers (`gptrain.data.parts`) use it.

Also the earlier in-memory pipeline (`tokenize_to_file`: documents read in the main process, ~1 MB
work units, a process pool, results in input order), kept for benchmarks/bench_tokenize.py's
"tokenization stage" row; `gptrain prepare` no longer uses it.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from gptrain.data.shards import dtype_for_vocab
from gptrain.data.tokenizers import load_tokenizer

CHUNK_CHARS = 1 << 17


def split_points(text: str, chunk: int | None = None) -> list[int]:
    """Cut positions ~chunk apart, each at a "\\n" right after a non-space character."""
    chunk = chunk or CHUNK_CHARS
    cuts, pos = [], chunk
    while pos < len(text):
        p = text.find("\n", pos)
        while p != -1 and text[p - 1].isspace():
            p = text.find("\n", p + 1)
        if p == -1:
            break
        cuts.append(p)
        pos = p + chunk
    return cuts


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
# identity by `_init_worker` under spawn (macOS, Windows). Only prepare's workers read it.
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


def tokenize_to_file(
    docs, tok, path: Path, workers: int, progress: bool, total_bytes=None
) -> np.ndarray:
    """Tokenize documents into a flat token file; return each document's token count."""
    from tqdm import tqdm

    dtype = dtype_for_vocab(tok.vocab_size)
    lengths: list[int] = []
    t0, n_tokens = time.perf_counter(), 0
    bar = tqdm(
        total=total_bytes,
        unit="B",
        unit_scale=True,
        desc="tokenize",
        disable=not progress,
        mininterval=0.5,
    )
    with open(path, "wb") as f, bar:
        for unit, arrays in encode_units(tok, work_units(docs), workers):
            for (doc_idx, piece), arr in zip(unit, arrays, strict=True):
                while len(lengths) <= doc_idx:
                    lengths.append(0)
                lengths[doc_idx] += len(arr)
                arr.astype(dtype, copy=False).tofile(f)
                n_tokens += len(arr)
                bar.update(len(piece.encode("utf-8", errors="surrogatepass")) if progress else 0)
            bar.set_postfix_str(
                f"{n_tokens / max(time.perf_counter() - t0, 1e-9) / 1e3:.0f}k tok/s", refresh=False
            )
        f.flush()
        os.fsync(f.fileno())
    return np.array(lengths, dtype=np.int64)
