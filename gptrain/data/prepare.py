"""`gptrain prepare`: text in (files, folders, globs, JSONL, Parquet, HF datasets, built-in corpora),
token shards + manifest.json out.

    gptrain prepare --input shakespeare --out data/shakespeare-gpt2 --tokenizer gpt2 --workers 2
    gptrain prepare --input 'web/*.parquet' --out data/web --tokenizer bpe:tok.json
    gptrain prepare --verify data/web

Pipeline: documents are read in order (reading and UTF-8 checking in the main thread), cut into
~1 MB work units (long documents only at a newline that follows a non-space character, where
GPT-2-style pre-tokenization always splits, so the tokens are the same as for the whole text), and
tokenized by a process pool (forked workers inherit the tokenizer; threads would stop scaling
because tokenizers hold the GIL for part of each call). Results come back in
order, so the output is byte-identical for any --workers. Tokens go to a temporary file; then the
train/val split is chosen by documents (a seeded permutation, greedy up to the val budget; a single
document gives its last val-fraction of characters to val) and each split's documents, separated
by the end-of-text token, are cut into shards. Everything is written in a temporary folder that is
renamed to --out only when complete.
"""

from __future__ import annotations

import itertools
import math
import multiprocessing
import os
import shutil
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from gptrain.cache import cache_dir, sha256_file
from gptrain.data.shards import dtype_for_vocab, write_manifest, write_shard
from gptrain.data.sources import BUILTIN_CORPORA, Document, expand_inputs, iter_documents
from gptrain.data.tokenizers import load_tokenizer
from gptrain.errors import UserError

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
        with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(tok.identity(),)) as pool:  # fmt: skip
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


def choose_val(
    lengths: np.ndarray, val_fraction: float, val_tokens: int | None, seed: int
) -> np.ndarray:
    """Boolean mask of validation documents: seeded permutation, greedy up to the val budget."""
    total = int(lengths.sum())
    target = val_tokens if val_tokens is not None else math.ceil(val_fraction * total)
    is_val = np.zeros(len(lengths), dtype=bool)
    got = 0
    for i in np.random.default_rng(seed).permutation(len(lengths)):
        if got >= target:
            break
        is_val[i] = True
        got += int(lengths[i])
    return is_val


def write_split(name, segments, tokens, eot, shard_tokens, folder, tok_hash, vocab) -> list[dict]:
    """Concatenate segments (start, end) of `tokens` with EOT between them; cut into shards."""
    entries, buf, fill = [], np.empty(shard_tokens, dtype=tokens.dtype), 0

    def flush():
        nonlocal fill
        entry = write_shard(folder / f"{name}_{len(entries):06d}.bin", buf[:fill], tok_hash, vocab)
        entries.append({**entry, "split": name})
        fill = 0

    for k, (a, b) in enumerate(segments):
        pieces = [tokens[a:b]] if k == 0 else [np.array([eot], dtype=tokens.dtype), tokens[a:b]]
        for piece in pieces:
            while len(piece):
                n = min(len(piece), shard_tokens - fill)
                buf[fill : fill + n] = piece[:n]
                fill, piece = fill + n, piece[n:]
                if fill == shard_tokens:
                    flush()
    if fill:
        flush()
    return entries


def prepare(
    inputs: list[str],
    out: str | Path,
    tokenizer: str = "byte",
    val_fraction: float = 0.1,
    val_tokens: int | None = None,
    shard_tokens: int = 100_000_000,
    workers: int = 1,
    text_field: str = "text",
    seed: int = 1337,
    progress: bool = True,
    utf8_errors: str = "replace",
    command: str | None = None,
) -> dict:
    """Tokenize `inputs` into shards + manifest.json in `out` (atomically); return the manifest."""
    out = Path(out)
    if not inputs:
        raise UserError("no --input given; pass files, folders, globs or a built-in corpus name")
    if val_tokens is None and not 0 < val_fraction < 1:
        raise UserError(
            f"--val-fraction {val_fraction} leaves no validation (or no training) tokens; use a value in (0, 1) or --val-tokens N"
        )
    if val_tokens is not None and val_tokens <= 0:
        raise UserError(
            f"--val-tokens {val_tokens} leaves no validation tokens; use a positive number"
        )
    if shard_tokens < 1 or workers < 1:
        raise UserError(f"--shard-tokens {shard_tokens} / --workers {workers}: both must be >= 1")
    if out.exists() and any(out.iterdir()):
        raise UserError(
            f"--out {out} already exists and is not empty; delete it or choose another folder"
        )
    tok = load_tokenizer(tokenizer)
    expanded = expand_inputs(inputs)
    total_bytes = None
    if all(Path(p).is_file() for p in expanded):
        total_bytes = sum(Path(p).stat().st_size for p in expanded)
    stats: dict = {}
    stream = (d for d in iter_documents(inputs, text_field, utf8_errors, stats) if d.text)
    head = list(itertools.islice(stream, 2))  # streamed: only the work in flight is in memory
    if not head:
        raise UserError(f"empty input: {' '.join(inputs)} holds no text")
    single = len(head) == 1 and val_tokens is None
    docs = itertools.chain(head, stream)
    if single:  # issue 2: the val part is the last val_fraction of the text
        text, cut = head[0].text, int(len(head[0].text) * (1 - val_fraction))
        docs = [Document(head[0].source, text[:cut]), Document(head[0].source, text[cut:])]
    del head
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        flat = tmp / "tokens.tmp"
        lengths = tokenize_to_file(docs, tok, flat, workers, progress, total_bytes)
        n_docs = len(lengths) - (1 if single else 0)
        del docs
        if flat.stat().st_size == 0:
            raise UserError(f"empty input: {' '.join(inputs)} gives no tokens")
        tokens = np.memmap(flat, dtype=dtype_for_vocab(tok.vocab_size), mode="r")
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        if single:
            segments = {
                "train": [(0, int(lengths[0]))],
                "val": [(int(lengths[0]), int(tokens.size))],
            }
        elif n_docs == 1:  # one document and --val-tokens: the last val_tokens tokens
            cut = tokens.size - val_tokens
            segments = {"train": [(0, cut)], "val": [(max(cut, 0), int(tokens.size))]}
        else:
            is_val = choose_val(lengths, val_fraction, val_tokens, seed)
            segments = {
                split: [
                    (int(starts[i]), int(starts[i] + lengths[i]))
                    for i in range(len(lengths))
                    if is_val[i] == want
                ]
                for split, want in (("train", False), ("val", True))
            }
        counts = {
            s: sum(b - a for a, b in segs) + max(len(segs) - 1, 0) for s, segs in segments.items()
        }
        if counts["val"] <= 0 or not segments["val"] or sum(b - a for a, b in segments["val"]) == 0:
            raise UserError(
                f"val split leaves no validation tokens ({tokens.size} tokens in all); raise --val-fraction or --val-tokens"
            )
        if sum(b - a for a, b in segments["train"]) <= 0:
            raise UserError(
                f"val split takes all {tokens.size} tokens, leaving none for training; lower --val-fraction or --val-tokens"
            )
        shards = []
        for split in ("train", "val"):
            shards += write_split(
                split,
                segments[split],
                tokens,
                tok.eot_id,
                shard_tokens,
                tmp,
                tok.hash,
                tok.vocab_size,
            )
        del tokens
        flat.unlink()
        if tok.name == "bpe":  # keep the tokenizer with the data, for sampling elsewhere
            shutil.copyfile(tok.path, tmp / "tokenizer.json")
        manifest = {
            "format": "gptrain-shards",
            "version": 1,
            "tokenizer": tok.identity(),
            "vocab_size": tok.vocab_size,
            "eot_id": tok.eot_id,
            "dtype": dtype_for_vocab(tok.vocab_size).name,
            "splits": {s: {"tokens": counts[s], "segments": len(segments[s])} for s in segments},
            "documents": n_docs,
            "shards": shards,
            "inputs": list(inputs),
            "seed": seed,
            "val_fraction": None if val_tokens is not None else val_fraction,
            "val_tokens": val_tokens,
            "shard_tokens": shard_tokens,
            "text_field": text_field,
            "invalid_utf8": {"replaced": sum(stats.values()), "files": stats},
            "command": command
            or "prepare(" + ", ".join(map(repr, inputs)) + f", tokenizer={tokenizer!r})",
        }
        write_manifest(tmp, manifest)
        dir_fd = os.open(tmp, os.O_RDONLY)
        os.fsync(dir_fd)
        os.close(dir_fd)
        if out.exists():
            out.rmdir()  # empty (checked above); a non-empty one makes this fail, never overwritten
        try:
            os.rename(tmp, out)
        except OSError as e:
            raise UserError(
                f"--out {out}: cannot publish the prepared folder ({e.strerror}); another process may have written it"
            ) from None
        return manifest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _tokenizer_dirname(tokenizer: str) -> str:
    if tokenizer.startswith("bpe:"):
        return "bpe-" + sha256_file(tokenizer[4:])[:12] if Path(tokenizer[4:]).is_file() else "bpe"
    return tokenizer


def resolve_data_dir(spec: str, tokenizer: str = "byte") -> Path:
    """A prepared data folder for `spec`: a folder holding manifest.json, or a built-in corpus
    name prepared once (atomically) into cache_dir()/data/<name>-<tokenizer>/."""
    path = Path(spec)
    if (path / "manifest.json").is_file():
        return path
    if spec in BUILTIN_CORPORA:
        out = cache_dir() / "data" / f"{spec}-{_tokenizer_dirname(tokenizer)}"
        if (out / "manifest.json").is_file():
            return out
        try:
            prepare([spec], out, tokenizer=tokenizer, progress=False)
        except UserError:
            if not (out / "manifest.json").is_file():  # another process may have won the race
                raise
        return out
    raise UserError(
        f"data {spec!r} is neither a prepared folder (no manifest.json there; make one with "
        f"`gptrain prepare --input ... --out DIR`) nor a built-in corpus ({', '.join(BUILTIN_CORPORA)})"
    )
