"""Phase 1 of `gptrain prepare`: work items, each read and tokenized by a worker into one part.

A work item is input a worker reads itself: a whole file (a .txt/.md document, or a compressed
text or JSONL file, streamed), a byte range of a large plain text or JSONL file (cut at a newline;
a text document's later ranges continue it), or one Parquet row group. Documents that only the
main process can produce (hf: datasets, built-in corpora, a single document's val cut) travel
to the workers as text. Items are listed in a fixed order (`plan`); every finished item leaves a
part in the work folder `.<out>.parts/` beside --out:

    <key>.tok       its tokens, the shard dtype (little-endian), documents back to back (no
                    end-of-text); the prepared folder keeps it (hard-linked) as its tokens
    <key>.len.npy   tokens per piece (a document, or the part of one inside this item)
    <key>.json      written last, atomically: its presence means the part is complete (it
                    holds the tokens' count and sha256)

`key` hashes the item (path, size, mtime, range or row group) and the settings that shape its
tokens, so the same command again reuses every finished part and redoes only the rest (a kill
loses the items in flight); a changed file or setting makes new parts. The main process lists
items, hands them out and collects these small records; it never touches tokens here.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import multiprocessing
import os
import sys
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

from gptrain.data import encode
from gptrain.data.shards import dtype_for_vocab
from gptrain.data.sources import (
    BUILTIN_CORPORA,
    base_name,
    decode_utf8,
    iter_documents,
    iter_lines,
    jsonl_text,
    open_binary,
    read_bytes,
    read_error,
)
from gptrain.data.tokenizers import load_tokenizer
from gptrain.errors import UserError

RANGE_BYTES = 32 << 20  # plain text / JSONL files larger than this are read in ranges
ITEM_CHARS = 1 << 20  # documents handed over as text: about this much per item
WRITE_TOKENS = 1 << 22


def fork_context():
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


# --- planning ----------------------------------------------------------------------------------
def _safe_cut(f, target: int, size: int, text: bool) -> int:
    """A byte offset >= target at a newline (text: one after a non-space character, where GPT-2
    pre-tokenization always splits; the newline starts the next range) or `size`."""
    pos = target
    while pos < size:
        f.seek(max(pos - 4, 0))
        window = f.read(1 << 16)
        base = max(pos - 4, 0)
        i = window.find(b"\n", pos - base)
        while i != -1:
            if not text:
                return base + i + 1  # JSONL: the next range starts after the newline
            before = window[max(i - 4, 0) : i].decode("utf-8", errors="replace")
            if i > 0 and before and not before[-1].isspace():
                return base + i
            i = window.find(b"\n", i + 1)
        pos = base + len(window)
        if not window:
            break
    return size


def _file_items(path: str, split: int, text_field: str) -> list[dict]:
    base = base_name(path)
    try:
        st = os.stat(path)
    except OSError as e:
        raise UserError(f"cannot read input file {path}: {e.strerror}") from None
    ident = {"path": path, "size": st.st_size, "mtime": st.st_mtime_ns, "split": split}
    if base.endswith(".parquet"):
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise UserError(
                f"{path}: reading Parquet needs pyarrow; `pip install pyarrow`"
            ) from None
        try:
            meta = pq.ParquetFile(path)
        except Exception as e:
            raise UserError(f"cannot read Parquet file {path}: {e}".splitlines()[0]) from None
        if text_field not in meta.schema_arrow.names:
            raise UserError(
                f"{path}: no column {text_field!r} (found: {', '.join(meta.schema_arrow.names)}); pass --text-field KEY"
            )
        kind = meta.schema_arrow.field(text_field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise UserError(
                f"{path}: column {text_field!r} holds {kind}, not text; pass --text-field KEY with the text column"
            )
        rows = max(meta.metadata.num_rows, 1)
        groups = [meta.metadata.row_group(g).num_rows for g in range(meta.metadata.num_row_groups)]
        return [  # "bytes": the file's share for the progress bar
            {**ident, "kind": "parquet", "group": g, "bytes": st.st_size * n // rows}
            for g, n in enumerate(groups)
        ]
    kind = "jsonl" if base.endswith(".jsonl") else "text"
    if path != base or st.st_size <= RANGE_BYTES:
        return [{**ident, "kind": kind, "range": None, "cont": False, "bytes": st.st_size}]
    items, start = [], 0
    with open(path, "rb") as f:
        while start < st.st_size:
            end = _safe_cut(f, start + RANGE_BYTES, st.st_size, kind == "text")
            items.append(
                {
                    **ident,
                    "kind": kind,
                    "range": [start, end],
                    "cont": kind == "text" and start > 0,
                    "bytes": end - start,
                }
            )
            start = end
    return items


def _text_items(source: str, texts, split: int, cont_first: bool = False):
    """Documents (or pieces of one) handed over as text, about ITEM_CHARS per item."""
    batch, size, k = [], 0, 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= ITEM_CHARS:
            yield _docs_item(source, batch, split, k, cont_first)
            batch, size, k = [], 0, k + 1
    if batch:
        yield _docs_item(source, batch, split, k, cont_first)


def _docs_item(source, texts, split, k, cont_first) -> dict:
    digest = hashlib.sha256()
    for t in texts:
        digest.update(hashlib.sha256(t.encode("utf-8", errors="surrogatepass")).digest())
    return {
        "kind": "docs",
        "source": source,
        "n": k,
        "split": split,
        "texts": texts,
        "cont": cont_first and k > 0,
        "sha": digest.hexdigest(),
        "bytes": sum(map(len, texts)),
    }


def single_cut_items(path: str, val_fraction: float, utf8_errors: str, stats: dict):
    """One document: its first 1 - val_fraction of the characters train, the rest val, each
    cut at safe newlines into pieces of one document."""
    text = decode_utf8(read_bytes(path), path, utf8_errors, stats, warn=False)
    cut = int(len(text) * (1 - val_fraction))
    items = []
    for split, part in ((1, text[:cut]), (2, text[cut:])):
        bounds = [0, *encode.split_points(part, ITEM_CHARS), len(part)]
        pieces = [part[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        for k, piece in enumerate(pieces):
            items.append(_docs_item(f"{path}@{split}", [piece], split, k, True))
    return items


def plan(expanded: list[str], split: int, text_field: str, utf8_errors: str, stats: dict):
    """Work items of one split's inputs, in input order: every file's items listed now (so bad
    files are found before any work), streamed sources read by the main process as it goes."""
    groups = []
    for item in expanded:
        if item.startswith("hf:") or (item in BUILTIN_CORPORA and not Path(item).exists()):
            docs = (
                d.text for d in iter_documents([item], text_field, utf8_errors, stats) if d.text
            )
            groups.append(_text_items(item, docs, split))
        else:
            groups.append(_file_items(item, split, text_field))
    return itertools.chain.from_iterable(groups)


def item_key(item: dict, settings: dict) -> str:
    ident = {k: v for k, v in item.items() if k not in ("texts", "bytes")}
    raw = json.dumps({"item": ident, "settings": settings}, sort_keys=True)
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


# --- reading and tokenizing one item (in a worker) ----------------------------------------------
def _item_texts(item: dict, settings: dict, replaced: dict):
    """The texts (documents, or one document's piece) an item holds, in order."""
    kind, path, errors = item["kind"], item.get("path"), settings["utf8_errors"]
    if kind == "docs":
        yield from (text for text in item["texts"] if text)
    elif kind == "parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.ParquetFile(path).read_row_group(
                item["group"], columns=[settings["text_field"]]
            )
        except Exception as e:
            raise read_error(path, e) from None
        for text in table.column(0).to_pylist():
            if text:
                yield text
    elif item["range"] is not None:  # a plain file's byte range
        a, b = item["range"]
        with open(path, "rb") as f:
            f.seek(a)
            raw = f.read(b - a)
        if kind == "text":
            yield decode_utf8(raw, path, errors, replaced, warn=False, offset=a)
        else:
            for k, line in enumerate(raw.split(b"\n")):
                try:
                    text = jsonl_text(
                        decode_utf8(line, path, errors, replaced, warn=False),
                        path,
                        k + 1,
                        settings["text_field"],
                    )
                except UserError:  # name the line the way an editor counts it
                    with open(path, "rb") as f:
                        before = f.read(a).count(b"\n") + k
                    text = jsonl_text(
                        decode_utf8(line, path, errors, {}, warn=False),
                        path,
                        before + 1,
                        settings["text_field"],
                    )
                if text:
                    yield text
    elif kind == "text":
        text = decode_utf8(read_bytes(path), path, errors, replaced, warn=False)
        if text:
            yield text
    else:  # JSONL, maybe compressed: streamed line by line
        with open_binary(path) as f:
            for lineno, line in enumerate(iter_lines(f, path), 1):
                text = jsonl_text(
                    decode_utf8(line, path, errors, replaced, warn=False),
                    path,
                    lineno,
                    settings["text_field"],
                )
                if text:
                    yield text


_tokenizer = None  # this worker's: inherited under fork, else loaded by _init_worker


def _init_worker(identity: dict) -> None:
    global _tokenizer
    if _tokenizer is None:
        _tokenizer = load_tokenizer(identity)


def encode_long(tok, text: str) -> np.ndarray:
    """Tokens of one text, encoded in ~CHUNK_CHARS pieces cut where GPT-2 pre-tokenization splits."""
    bounds = [0, *encode.split_points(text), len(text)]
    arrays = [tok.encode_array(text[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    return np.concatenate(arrays) if len(arrays) > 1 else arrays[0]


def run_item(item: dict, key: str, workdir: str, settings: dict) -> dict:
    """Read and tokenize one item into its part; return the part's record."""
    tok, folder = _tokenizer, Path(workdir)
    dtype = dtype_for_vocab(tok.vocab_size).newbyteorder("<")
    lengths, replaced, pending, n_pending = [], {}, [], 0
    sha = hashlib.sha256()
    tmp = folder / f".{key}.tok.tmp-{os.getpid()}"

    def put(f, arrays):
        raw = np.concatenate(arrays).tobytes()
        f.write(raw)
        sha.update(raw)

    try:
        with open(tmp, "wb") as f:
            for text in _item_texts(item, settings, replaced):
                arr = encode_long(tok, text).astype(dtype, copy=False)
                lengths.append(len(arr))
                pending.append(arr)
                n_pending += len(arr)
                if n_pending >= WRITE_TOKENS:
                    put(f, pending)
                    pending, n_pending = [], 0
            if pending:
                put(f, pending)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, folder / f"{key}.tok")
    tmp = folder / f".{key}.len.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        np.save(f, np.asarray(lengths, dtype=np.int64), allow_pickle=False)
    os.replace(tmp, folder / f"{key}.len.npy")
    record = {
        "key": key,
        "tokens": int(sum(lengths)),
        "sha256": sha.hexdigest(),
        "pieces": len(lengths),
        "cont": bool(item.get("cont")),
        "split": item["split"],
        "replaced": replaced,
    }
    tmp = folder / f".{key}.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, folder / f"{key}.json")
    return record


def finished(workdir: Path, key: str, itemsize: int) -> dict | None:
    """The record of a complete part (tokens and lengths agree with it), else None."""
    try:
        record = json.loads((workdir / f"{key}.json").read_text())
        lengths = np.load(workdir / f"{key}.len.npy", allow_pickle=False)
        size = (workdir / f"{key}.tok").stat().st_size
    except (OSError, ValueError):
        return None
    if (
        len(lengths) != record["pieces"]
        or size != int(lengths.sum()) * itemsize
        or "sha256" not in record
    ):
        return None
    return record


# --- phase 1 ------------------------------------------------------------------------------------
def run_parts(items, tok, workdir: Path, settings: dict, workers: int, bar) -> list[dict]:
    """Every item's part record, in plan order: finished parts reused, the rest made by
    `workers` processes (at most 2 items each in flight)."""
    global _tokenizer
    itemsize = dtype_for_vocab(tok.vocab_size).itemsize
    for stale in workdir.glob(".*.tmp-*"):  # pieces of a killed run
        stale.unlink()
    keys, records, reused = [], {}, 0

    def todo():
        nonlocal reused
        for item in items:
            key = item_key(item, settings)
            keys.append(key)
            record = finished(workdir, key, itemsize)
            if record is not None:
                records[key], reused = record, reused + 1
                bar.update(item["bytes"])
            else:
                yield item, key

    if workers <= 1:
        _tokenizer = tok
        try:
            for item, key in todo():
                records[key] = run_item(item, key, str(workdir), settings)
                bar.update(item["bytes"])
        finally:
            _tokenizer = None
    else:
        _tokenizer = tok  # what forked workers inherit
        pool = ProcessPoolExecutor(
            workers, mp_context=fork_context(), initializer=_init_worker, initargs=(tok.identity(),)
        )
        try:
            pending = {}
            for item, key in todo():
                pending[pool.submit(run_item, item, key, str(workdir), settings)] = item["bytes"]
                while len(pending) >= 2 * workers:
                    _collect(pending, records, bar, FIRST_COMPLETED)
            while pending:
                _collect(pending, records, bar, FIRST_COMPLETED)
        except BrokenProcessPool:
            raise UserError(
                f"a tokenizing process died (killed, or out of memory?); the {len(records)} finished "
                f"parts are kept in {workdir}: run the same command again (fewer --workers if memory is short)"
            ) from None
        finally:
            _tokenizer = None
            pool.shutdown(wait=True, cancel_futures=True)
    if reused:
        print(
            f"gptrain: resumed: {reused} of {len(keys)} parts were already done in {workdir}",
            file=sys.stderr,
        )
    return [records[k] for k in keys]


def _collect(pending: dict, records: dict, bar, how) -> None:
    done, _ = wait(list(pending), return_when=how)
    for fut in done:
        size = pending.pop(fut)
        record = fut.result()  # a worker's UserError is raised here; finished parts stay
        records[record["key"]] = record
        bar.update(size)
