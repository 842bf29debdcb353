"""`gptrain prepare`: text (files, folders, globs, JSONL, Parquet, HF datasets, built-in corpora)
or llm.c GPT-2 shards in, token shards + document indexes + manifest.json out.

    gptrain prepare --input shakespeare --out data/shakespeare-gpt2 --tokenizer gpt2 --workers 2
    gptrain prepare --input 'web/*.parquet' --out data/web --tokenizer bpe:tok.json
    gptrain prepare --input 'fw/*train*.bin' --val-input 'fw/*val*.bin' --out data/fw  # llm.c
    gptrain prepare --verify data/web

Text: work items (files, byte ranges, Parquet row groups) are read and tokenized by the workers
into resumable parts in `.<out>.parts/` (`gptrain.data.parts`; the same command again reuses
finished parts), and the parts are the prepared folder's tokens: they are written once. The val
split is --val-input's documents, or documents chosen by a seeded permutation up to the val
budget (--val-fraction of the tokens, at most --val-max-tokens; or --val-tokens); a single text
file gives its last val-fraction of characters to val. The train documents are shuffled (seeded;
--no-shuffle keeps input order). Each split's documents, separated by the end-of-text token, make
its token stream, cut into shards that are ranges of it read through the split's span table
(`gptrain.data.assemble`, `gptrain.data.composed`), each with its document index, in a folder
renamed to --out only when complete. llm.c shards are taken as they are (`gptrain.data.convert`).
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from gptrain.cache import cache_dir, sha256_file
from gptrain.data import encode, llmc, parts
from gptrain.data.assemble import VAL_MAX_TOKENS, Pieces, split_orders, write_splits
from gptrain.data.convert import import_llmc
from gptrain.data.parts import plan, single_cut_items
from gptrain.data.shards import dtype_for_vocab, write_manifest
from gptrain.data.sources import BUILTIN_CORPORA, base_name, expand_inputs
from gptrain.data.tokenizers import load_tokenizer
from gptrain.errors import UserError


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
        raise UserError(
            f"--val-tokens {val_tokens} leaves no validation tokens; use a positive number"
        )
    if val_max_tokens is not None and val_max_tokens <= 0:
        raise UserError(f"--val-max-tokens {val_max_tokens}: must be a positive number of tokens")
    if shard_tokens < 1 or workers < 1:
        raise UserError(f"--shard-tokens {shard_tokens} / --workers {workers}: both must be >= 1")


def is_single_text(expanded: list[str], val_inputs, val_tokens) -> bool:
    """One text file and nothing else: one document, split by characters."""
    if len(expanded) != 1 or val_inputs or val_tokens is not None:
        return False
    item = expanded[0]
    if item.startswith("hf:") or not Path(item).is_file():
        return False
    return not base_name(item).endswith((".jsonl", ".parquet"))


@dataclass(frozen=True)
class TextOptions:
    """How text inputs are read, tokenized, split and cut into shards (prepare's arguments)."""

    workers: int
    progress: bool
    text_field: str
    utf8_errors: str
    val_fraction: float
    val_tokens: int | None
    val_max_tokens: int | None
    shard_tokens: int
    seed: int
    shuffle_seed: int | None  # None: the train documents keep input order


def tokenize_parts(expanded, val_expanded, tok, workdir, stats, opts: TextOptions):
    """Phase 1: every work item tokenized into its part (finished parts of an earlier run
    reused). Returns (Pieces, part records, part token files, whether it was the single-document
    cut)."""
    from tqdm import tqdm

    single = is_single_text(expanded, val_expanded, opts.val_tokens)
    if single:
        items = iter(single_cut_items(expanded[0], opts.val_fraction, opts.utf8_errors, stats))
    else:
        items = itertools.chain(
            plan(expanded, 1 if val_expanded else 0, opts.text_field, opts.utf8_errors, stats),
            plan(val_expanded, 2, opts.text_field, opts.utf8_errors, stats),
        )
    total = None
    if all(Path(p).is_file() for p in expanded + val_expanded):
        total = sum(Path(p).stat().st_size for p in expanded + val_expanded)
    settings = {
        "tokenizer": tok.hash,
        "text_field": opts.text_field,
        "utf8_errors": opts.utf8_errors,
        "chunk": encode.CHUNK_CHARS,
        "range": parts.RANGE_BYTES,
        "item": parts.ITEM_CHARS,
    }
    workdir.mkdir(parents=True, exist_ok=True)
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc="tokenize",
        disable=not opts.progress,
        mininterval=0.5,
    )
    with bar:
        records = parts.run_parts(items, tok, workdir, settings, opts.workers, bar)
    for record in records:
        for source, n in record["replaced"].items():
            stats[source] = stats.get(source, 0) + n
    for source, n in stats.items():
        print(
            f"gptrain: warning: {source}: replaced {n} invalid UTF-8 sequence(s) with U+FFFD",
            file=sys.stderr,
        )
    pieces = Pieces.from_parts(
        records, lambda k: np.load(workdir / f"{records[k]['key']}.len.npy", allow_pickle=False)
    )
    return pieces, records, [workdir / f"{r['key']}.tok" for r in records], single


def refuse_nonempty(out: Path) -> None:
    """Refuse an --out that already holds something."""
    if out.exists() and any(out.iterdir()):
        raise UserError(
            f"--out {out} already exists and is not empty; delete it or choose another folder"
        )


def all_llmc(expanded: list[str]) -> bool:
    """Whether the inputs are llm.c shards (True) or text (False); a mix of the two is refused."""
    flags = llmc_files(expanded)
    if any(flags) and not all(flags):
        kinds = [("llm.c" if f else "text") + f" {p}" for f, p in zip(flags, expanded, strict=True)]
        raise UserError(
            f"mixed llm.c shards and text inputs ({kinds[flags.index(True)]}, {kinds[flags.index(False)]}); "
            "prepare them separately: llm.c shards are taken as they are, text is tokenized"
        )
    return bool(flags) and all(flags)


def import_shards(expanded, val_expanded, tmp: Path, tokenizer) -> tuple[dict, Path]:
    """llm.c shards taken into a fresh folder `tmp`: (manifest fields, that folder)."""
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return import_llmc(expanded, val_expanded, tmp, tokenizer), tmp


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
    refuse_nonempty(out)
    expanded, val_expanded = expand_inputs(inputs), expand_inputs(val_inputs or [])
    tok = None if all_llmc(expanded + val_expanded) else load_tokenizer(tokenizer or "byte")
    out.parent.mkdir(parents=True, exist_ok=True)
    workdir = out.parent / f".{out.name}.parts"  # finished work, kept until --out is published
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"  # llm.c imports are written here
    if tok is None:
        make = partial(import_shards, expanded, val_expanded, tmp, tokenizer)
    else:
        shuffle_seed = shuffle_seed if shuffle_seed is not None else seed if shuffle else None
        opts = TextOptions(
            workers,
            progress,
            text_field,
            utf8_errors,
            val_fraction,
            val_tokens,
            val_max_tokens,
            shard_tokens,
            seed,
            shuffle_seed,
        )
        make = partial(prepare_text, inputs, val_inputs, tok, workdir, opts)
    settings = {"inputs": list(inputs), "val_inputs": list(val_inputs or []), "seed": seed}
    command = command or f"prepare({', '.join(map(repr, inputs))}, tokenizer={tokenizer!r})"
    return build_and_publish(out, workdir, tmp, make, settings, command)


def build_and_publish(out: Path, workdir: Path, tmp: Path, make, settings, command) -> dict:
    """Under --out's lock (one prepare per --out at a time): the folder made (`make()` returns
    its manifest fields and the folder), its manifest written, the folder published as `out`;
    returns the manifest. A UserError keeps the work folder where it holds tokens (the same
    command again reuses them)."""
    lock = exclusive(out.parent / f".{out.name}.lock")
    try:
        refuse_nonempty(out)  # another process published it meanwhile
        manifest, folder = make()
        manifest = {
            "format": "gptrain-shards",
            "version": 2 if "parts" in manifest else 1,
            **manifest,
            **settings,
        }
        manifest["command"] = command
        write_manifest(folder, manifest)
        publish(folder, out)
        shutil.rmtree(workdir, ignore_errors=True)
        Path(lock.name).unlink(missing_ok=True)  # waiting processes find --out published
        return manifest
    except UserError:
        if not any(p.stat().st_size for p in workdir.glob("*.tok")):  # no tokens worth keeping
            shutil.rmtree(workdir, ignore_errors=True)
            Path(lock.name).unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        lock.close()


def exclusive(path: Path):
    """An open file holding an exclusive lock (flock; waits while another process holds it)."""
    f = open(path, "a")
    try:
        import fcntl

        fcntl.flock(f, fcntl.LOCK_EX)
    except (ImportError, OSError):  # no flock here (Windows, some network file systems)
        pass
    return f


def cut_single_document(pieces: Pieces, opts: TextOptions) -> Pieces:
    """One document with no split of its own: its last val tokens become the val split."""
    n = int(pieces.length.sum(dtype=np.int64))
    want = opts.val_tokens if opts.val_tokens is not None else math.ceil(opts.val_fraction * n)
    if opts.val_tokens is None and opts.val_max_tokens is not None:
        want = min(want, opts.val_max_tokens)
    if want >= n:
        raise UserError(
            f"val split takes all {n} tokens, leaving none for training; lower --val-fraction or --val-tokens"
        )
    return pieces.cut_single(n - want)


def link_parts(folder: Path, part_paths: list[Path], records: list[dict]) -> list[dict]:
    """The parts as folder/parts/part_NNNNNN.tok (hard links where possible); their entries."""
    (folder / "parts").mkdir(parents=True)
    entries = []
    for i, (path, record) in enumerate(zip(part_paths, records, strict=True)):
        name = f"parts/part_{i:06d}.tok"
        link_or_copy(path, folder / name)
        entries.append({"file": name, "tokens": record["tokens"], "sha256": record["sha256"]})
    return entries


def prepare_text(inputs, val_inputs, tok, workdir, opts: TextOptions) -> tuple[dict, Path]:
    """Phase 1 (parts), then the split, shuffle and shards: a folder inside the work folder that
    holds the parts (hard links: the tokens are written once), each split's span table and each
    shard's document index. Returns (manifest fields, that folder)."""
    expanded, val_expanded = expand_inputs(inputs), expand_inputs(val_inputs or [])
    stats: dict = {}
    pieces, records, part_paths, single = tokenize_parts(
        expanded, val_expanded, tok, workdir, stats, opts
    )
    if int(pieces.length.sum(dtype=np.int64)) == 0:
        raise UserError(f"empty input: {' '.join(inputs)} holds no text")
    if val_inputs and not (pieces.doc_split == 2).any():
        raise UserError(f"empty input: --val-input {' '.join(val_inputs)} holds no text")
    n_docs = pieces.num_docs - (1 if single else 0)
    if pieces.num_docs == 1 and pieces.doc_split[0] == 0:
        pieces = cut_single_document(pieces, opts)
    orders = split_orders(
        pieces,
        opts.val_fraction,
        opts.val_tokens,
        opts.val_max_tokens,
        opts.seed,
        opts.shuffle_seed,
    )
    dtype = dtype_for_vocab(tok.vocab_size)
    tmp = workdir / "folder"  # published as --out; made afresh (it holds no tokens of its own)
    shutil.rmtree(tmp, ignore_errors=True)
    part_entries = link_parts(tmp, part_paths, records)
    shards, spans, splits = write_splits(tmp, pieces, orders, opts.shard_tokens)
    del orders, pieces
    if tok.name == "bpe":  # keep the tokenizer with the data, for sampling elsewhere
        shutil.copyfile(tok.path, tmp / "tokenizer.json")
    held_out = opts.val_tokens is not None or val_inputs  # the val size is not a fraction
    shuffle = None if opts.shuffle_seed is None else {"seed": opts.shuffle_seed, "split": "train"}
    return {
        "tokenizer": tok.identity(),
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "dtype": dtype.name,
        "splits": splits,
        "documents": n_docs,
        "shards": shards,
        "parts": part_entries,
        "spans": spans,
        "val_fraction": None if held_out else opts.val_fraction,
        "val_tokens": opts.val_tokens,
        "val_max_tokens": None if held_out else opts.val_max_tokens,
        "shard_tokens": opts.shard_tokens,
        "shuffle": shuffle,
        "text_field": opts.text_field,
        "invalid_utf8": {"replaced": sum(stats.values()), "files": stats},
    }, tmp


def link_or_copy(src: Path, dst: Path) -> None:
    """dst as a second name of src's data (a hard link: nothing written), or a copy where the
    file system has no hard links."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


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
