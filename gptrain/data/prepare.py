"""`gptrain prepare`: text (files, folders, globs, JSONL, Parquet, HF datasets, built-in corpora)
or llm.c GPT-2 shards in, token shards + document indexes + manifest.json out.

    gptrain prepare --input shakespeare --out data/shakespeare-gpt2 --tokenizer gpt2 --workers 2
    gptrain prepare --input 'web/*.parquet' --out data/web --tokenizer bpe:tok.json
    gptrain prepare --input 'fw/*train*.bin' --val-input 'fw/*val*.bin' --out data/fw  # llm.c
    gptrain prepare --verify data/web

Text: documents are tokenized in parallel (`gptrain.data.encode`) into a temporary token file,
in input order. The val split is --val-input's documents, or documents chosen by a seeded
permutation up to the val budget (--val-fraction of the tokens, at most --val-max-tokens; or
--val-tokens); a single document gives its last val-fraction of characters to val. The train
documents are shuffled (seeded; --no-shuffle keeps input order). Each split's documents,
separated by the end-of-text token, are cut into shards (`gptrain.data.assemble`), each with its
document index. llm.c shards are taken as they are (`gptrain.data.convert`). Everything is
written in a temporary folder that is renamed to --out only when complete.
"""

from __future__ import annotations

import itertools
import os
import shutil
from pathlib import Path

import numpy as np

from gptrain.cache import cache_dir, sha256_file
from gptrain.data import llmc
from gptrain.data.assemble import VAL_MAX_TOKENS, SplitLayout, choose_val, split_sizes, train_order
from gptrain.data.convert import import_llmc
from gptrain.data.encode import tokenize_to_file
from gptrain.data.shards import dtype_for_vocab, write_index, write_manifest, write_shard
from gptrain.data.sources import BUILTIN_CORPORA, Document, expand_inputs, iter_documents
from gptrain.data.tokenizers import load_tokenizer
from gptrain.errors import UserError

__all__ = ["Document", "prepare", "resolve_data_dir", "tokenize_to_file"]


def llmc_files(expanded: list[str]) -> list[bool]:
    """Which inputs are llm.c shards: a .bin file, or any file starting with llm.c's magic."""
    flags = []
    for item in expanded:
        is_file = Path(item).is_file()
        flags.append(is_file and (item.endswith(".bin") or llmc.peek_magic(item) == llmc.MAGIC))
    return flags


def check_args(val_fraction, val_tokens, val_max_tokens, shard_tokens, workers) -> None:
    if val_tokens is None and not 0 < val_fraction < 1:
        raise UserError(
            f"--val-fraction {val_fraction} leaves no validation (or no training) tokens; use a value in (0, 1) or --val-tokens N"
        )
    if val_tokens is not None and val_tokens <= 0:
        raise UserError(f"--val-tokens {val_tokens} leaves no validation tokens; use a positive number")  # fmt: skip
    if val_max_tokens is not None and val_max_tokens <= 0:
        raise UserError(f"--val-max-tokens {val_max_tokens}: must be a positive number of tokens")
    if shard_tokens < 1 or workers < 1:
        raise UserError(f"--shard-tokens {shard_tokens} / --workers {workers}: both must be >= 1")


def counted(docs, counter: list):
    for doc in docs:
        counter[0] += 1
        yield doc


def tokenize_text(inputs, val_inputs, tok, flat, workers, progress, text_field, utf8_errors, stats, val_fraction, val_tokens):  # fmt: skip
    """Tokenize every document into `flat`; return (lengths, forced split per document: 0 auto,
    1 train, 2 val, or None when the split is the single-document character cut, n_docs)."""
    expanded = expand_inputs(inputs) + expand_inputs(val_inputs or [])
    total_bytes = None
    if all(Path(p).is_file() for p in expanded):
        total_bytes = sum(Path(p).stat().st_size for p in expanded)
    stream = (d for d in iter_documents(inputs, text_field, utf8_errors, stats) if d.text)
    head = list(itertools.islice(stream, 2))  # streamed: only the work in flight is in memory
    if not head:
        raise UserError(f"empty input: {' '.join(inputs)} holds no text")
    single = len(head) == 1 and val_tokens is None and not val_inputs
    docs = itertools.chain(head, stream)
    if single:  # the val part is the last val_fraction of the text
        text, cut = head[0].text, int(len(head[0].text) * (1 - val_fraction))
        docs = [Document(head[0].source, text[:cut]), Document(head[0].source, text[cut:])]
    del head
    n_train = [0]
    docs = counted(docs, n_train)
    if val_inputs:
        val_docs = (d for d in iter_documents(val_inputs, text_field, utf8_errors, stats) if d.text)
        docs = itertools.chain(docs, val_docs)
    lengths = tokenize_to_file(docs, tok, flat, workers, progress, total_bytes)
    forced = np.zeros(len(lengths), dtype=np.int8)
    if val_inputs:
        if len(lengths) == n_train[0]:
            raise UserError(f"empty input: --val-input {' '.join(val_inputs)} holds no text")
        forced[: n_train[0]], forced[n_train[0] :] = 1, 2
    elif single:
        forced[:] = (1, 2)
    return lengths, forced, len(lengths) - (1 if single else 0)


def prepare(
    inputs: list[str],
    out: str | Path,
    tokenizer: str | None = None,
    val_fraction: float = 0.1,
    val_tokens: int | None = None,
    shard_tokens: int = 100_000_000,
    workers: int = 1,
    text_field: str = "text",
    seed: int = 1337,
    progress: bool = True,
    utf8_errors: str = "replace",
    command: str | None = None,
    val_inputs: list[str] | None = None,
    val_max_tokens: int | None = VAL_MAX_TOKENS,
    shuffle: bool = True,
    shuffle_seed: int | None = None,
) -> dict:
    """Tokenize `inputs` (or take llm.c shards) into shards + manifest.json in `out`
    (atomically); return the manifest."""
    out = Path(out)
    if not inputs:
        raise UserError("no --input given; pass files, folders, globs or a built-in corpus name")
    check_args(val_fraction, val_tokens, val_max_tokens, shard_tokens, workers)
    if out.exists() and any(out.iterdir()):
        raise UserError(
            f"--out {out} already exists and is not empty; delete it or choose another folder"
        )
    expanded, val_expanded = expand_inputs(inputs), expand_inputs(val_inputs or [])
    flags = llmc_files(expanded + val_expanded)
    if any(flags) and not all(flags):
        kinds = [("llm.c" if f else "text") + f" {p}" for f, p in zip(flags, expanded + val_expanded, strict=True)]  # fmt: skip
        raise UserError(
            f"mixed llm.c shards and text inputs ({kinds[flags.index(True)]}, {kinds[flags.index(False)]}); "
            "prepare them separately: llm.c shards are taken as they are, text is tokenized"
        )
    tok = None if flags and all(flags) else load_tokenizer(tokenizer or "byte")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    stats: dict = {}
    settings = {"inputs": list(inputs), "val_inputs": list(val_inputs or []), "seed": seed}
    try:
        if tok is None:
            manifest = import_llmc(expanded, val_expanded, tmp, tokenizer)
            manifest.update(settings)
        else:
            manifest = prepare_text(inputs, val_inputs, tok, tmp, workers, progress, text_field, utf8_errors, stats, val_fraction, val_tokens, val_max_tokens, shard_tokens, seed, shuffle_seed if shuffle_seed is not None else seed if shuffle else None)  # fmt: skip
            manifest.update(settings)
            manifest["text_field"] = text_field
            manifest["invalid_utf8"] = {"replaced": sum(stats.values()), "files": stats}
        manifest = {"format": "gptrain-shards", "version": 1, **manifest}
        manifest["command"] = command or f"prepare({', '.join(map(repr, inputs))}, tokenizer={tokenizer!r})"  # fmt: skip
        write_manifest(tmp, manifest)
        publish(tmp, out)
        return manifest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def prepare_text(inputs, val_inputs, tok, tmp, workers, progress, text_field, utf8_errors, stats, val_fraction, val_tokens, val_max_tokens, shard_tokens, seed, shuffle_seed) -> dict:  # fmt: skip
    flat = tmp / "tokens.tmp"
    lengths, forced, n_docs = tokenize_text(inputs, val_inputs, tok, flat, workers, progress, text_field, utf8_errors, stats, val_fraction, val_tokens)  # fmt: skip
    if flat.stat().st_size == 0:
        raise UserError(f"empty input: {' '.join(inputs)} gives no tokens")
    dtype = dtype_for_vocab(tok.vocab_size)
    tokens = np.memmap(flat, dtype=dtype, mode="r")
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    if len(lengths) == 1:  # one document and --val-tokens: its last val_tokens tokens
        cut = max(int(lengths[0]) - val_tokens, 0)
        starts, lengths = np.array([0, cut]), np.array([cut, int(lengths[0]) - cut])
        forced = np.array([1, 2], dtype=np.int8)
    is_val = forced == 2
    auto = forced == 0
    if auto.any():
        is_val[auto] = choose_val(lengths[auto], val_fraction, val_tokens, seed, val_max_tokens)
    split_sizes(is_val, lengths)
    orders = {
        "train": train_order(np.flatnonzero(~is_val), shuffle_seed),
        "val": np.flatnonzero(is_val),
    }
    part = np.zeros(len(lengths), dtype=np.int32)
    shards, splits = [], {}
    for split, docs in orders.items():
        layout = SplitLayout.build(docs, lengths, shard_tokens)
        splits[split] = {"tokens": layout.total, "segments": len(docs), "documents": len(docs)}
        for s in range(layout.num_shards):
            buf = layout.fill(s, [tokens], part, starts, tok.eot_id, dtype)
            name = f"{split}_{s:06d}"
            entry = write_shard(tmp / f"{name}.bin", buf, tok.hash, tok.vocab_size)
            entry["index"] = write_index(tmp / f"{name}.docs.npy", layout.doc_starts(s))
            shards.append({**entry, "split": split})
    del tokens
    flat.unlink()
    if tok.name == "bpe":  # keep the tokenizer with the data, for sampling elsewhere
        shutil.copyfile(tok.path, tmp / "tokenizer.json")
    return {
        "tokenizer": tok.identity(),
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "dtype": dtype.name,
        "splits": splits,
        "documents": n_docs,
        "shards": shards,
        "val_fraction": None if val_tokens is not None or val_inputs else val_fraction,
        "val_tokens": val_tokens,
        "val_max_tokens": None if val_tokens is not None or val_inputs else val_max_tokens,
        "shard_tokens": shard_tokens,
        "shuffle": None if shuffle_seed is None else {"seed": shuffle_seed, "split": "train"},
    }


def publish(tmp: Path, out: Path) -> None:
    """fsync the finished folder and rename it to `out` (never over a non-empty folder)."""
    dir_fd = os.open(tmp, os.O_RDONLY)
    os.fsync(dir_fd)
    os.close(dir_fd)
    if out.exists():
        out.rmdir()  # empty (checked before); a non-empty one makes this fail, never overwritten
    try:
        os.rename(tmp, out)
    except OSError as e:
        raise UserError(
            f"--out {out}: cannot publish the prepared folder ({e.strerror}); another process may have written it"
        ) from None


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
