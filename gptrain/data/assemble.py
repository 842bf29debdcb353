"""From tokenized documents to shards: the val split, the train shuffle, the shards and their
document indexes. Everything per document is a NumPy array; nothing here tokenizes.

`Pieces` describes the tokenized text: each piece (a document, or the part of one that one work
item held) by `part` (which part file holds it), `start` (where it begins there) and `length`
(its tokens, no end-of-text), and each document by its first piece and piece count. A split is a
list of document ids in order; its token stream is those documents with one end-of-text token
between neighbours, cut into shards of `shard_tokens`. `SplitLayout` places every piece in that
stream, so any shard can be written on its own (`write_shards`: in any process, in any order,
straight from the part files) and its document index is arithmetic.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gptrain.data.shards import HEADER_SIZE, write_index, write_shard_chunks
from gptrain.errors import UserError

VAL_MAX_TOKENS = 100_000_000


def choose_val(
    lengths: np.ndarray,
    val_fraction: float,
    val_tokens: int | None,
    seed: int,
    val_max_tokens: int | None = VAL_MAX_TOKENS,
) -> np.ndarray:
    """Boolean mask of validation documents. Documents are taken in a seeded random order until
    they reach the budget: `val_tokens`, else `val_fraction` of all tokens (the last document may
    pass it); with a fraction, never more than `val_max_tokens` in all (the cap)."""
    total = int(lengths.sum())
    target = val_tokens if val_tokens is not None else math.ceil(val_fraction * total)
    order = np.random.default_rng(seed).permutation(len(lengths))
    running = np.cumsum(lengths[order])
    take = int(np.searchsorted(running, target, side="left")) + 1  # first to reach the target
    if val_tokens is None and val_max_tokens is not None:
        take = min(take, int(np.searchsorted(running, val_max_tokens, side="right")))
    is_val = np.zeros(len(lengths), dtype=bool)
    is_val[order[:take]] = True
    return is_val


def train_order(train_ids: np.ndarray, shuffle_seed: int | None) -> np.ndarray:
    """The train split's documents: a seeded permutation (None: input order)."""
    if shuffle_seed is None:
        return train_ids
    return train_ids[np.random.default_rng([shuffle_seed, 0x5EED]).permutation(len(train_ids))]


@dataclass
class Pieces:
    """Every tokenized piece (a document, or the part of one inside one part file) and the
    documents they make, as NumPy arrays."""

    part: np.ndarray  # int32: which part holds the piece
    start: np.ndarray  # int64: where in that part
    length: np.ndarray  # int32: its tokens
    doc_first: np.ndarray  # int64: each document's first piece
    doc_count: np.ndarray  # int32: its pieces
    doc_len: np.ndarray  # int64: its tokens
    doc_split: np.ndarray  # int8: 0 chosen later, 1 train, 2 val

    @classmethod
    def from_parts(cls, records: list[dict], lengths: list[np.ndarray]) -> Pieces:
        counts = np.array([len(x) for x in lengths], dtype=np.int64)
        length = np.concatenate([np.zeros(0, np.int32), *lengths]).astype(np.int32)
        part = np.repeat(np.arange(len(lengths), dtype=np.int32), counts)
        first_of_part = np.cumsum(counts) - counts
        within = np.cumsum(length, dtype=np.int64) - length
        start = within - np.repeat(within[first_of_part[counts > 0]], counts[counts > 0])
        del within
        new_doc = np.ones(len(length), dtype=bool)
        for p, record in enumerate(records):  # a part whose first piece continues a document
            if record["cont"] and counts[p] and first_of_part[p] > 0:
                new_doc[first_of_part[p]] = False
        doc_first = np.flatnonzero(new_doc).astype(np.int64)
        doc_count = np.diff(np.append(doc_first, len(length))).astype(np.int32)
        doc_len = np.add.reduceat(length.astype(np.int64), doc_first) if len(doc_first) else np.zeros(0, np.int64)  # fmt: skip
        splits = np.array([r["split"] for r in records], dtype=np.int8)
        return cls(part, start, length, doc_first, doc_count, doc_len, splits[part[doc_first]])

    def cut_single(self, keep: int) -> Pieces:
        """The one document cut after `keep` tokens: a train document and a val document."""
        ends = np.cumsum(self.length, dtype=np.int64)
        k = int(np.searchsorted(ends, keep, side="right"))  # the piece holding token `keep`
        if k >= len(self.length):
            k = len(self.length) - 1
        before = keep - (int(ends[k - 1]) if k else 0)
        part = np.insert(self.part, k + 1, self.part[k])
        start = np.insert(self.start, k + 1, self.start[k] + before)
        length = np.insert(self.length, k + 1, self.length[k] - before)
        length[k] = before
        doc_first = np.array([0, k + 1], dtype=np.int64)
        doc_count = np.array([k + 1, len(length) - k - 1], dtype=np.int64)
        doc_len = np.array([keep, int(self.length.sum()) - keep], dtype=np.int64)
        return Pieces(part, start, length, doc_first, doc_count, doc_len, np.array([1, 2], np.int8))  # fmt: skip


@dataclass
class SplitLayout:
    """Where each piece of a split's documents lies in the split's token stream."""

    pieces: np.ndarray  # piece ids in stream order
    pos: np.ndarray  # stream position of each one's first token
    length: np.ndarray  # its tokens
    doc_pos: np.ndarray  # stream position of each document's first token
    total: int  # tokens in the stream (documents + separators)
    shard_tokens: int

    @classmethod
    def build(cls, p: Pieces, docs: np.ndarray, shard_tokens: int) -> SplitLayout:
        counts, firsts = p.doc_count[docs], p.doc_first[docs]
        if (counts == 1).all():  # the usual case: every document is one piece
            idx, offs = firsts, np.arange(len(docs), dtype=np.int64)
            length = p.length[idx].astype(np.int64)
            pos = np.cumsum(length + 1) - length - 1  # one end-of-text between documents
        else:
            offs = np.cumsum(counts) - counts
            idx = np.arange(int(counts.sum()), dtype=np.int64)
            idx += np.repeat(firsts - offs, counts)
            length = p.length[idx].astype(np.int64)
            sep = np.zeros(len(idx), dtype=np.int64)
            sep[offs[1:]] = 1  # one end-of-text before every document but the first
            pos = np.cumsum(length) - length + np.cumsum(sep)
            del sep
        total = int(pos[-1] + length[-1]) if len(idx) else 0
        return cls(idx, pos, length, pos[offs], total, shard_tokens)

    @property
    def num_shards(self) -> int:
        return -(-self.total // self.shard_tokens)

    def shard_range(self, s: int) -> tuple[int, int, int, int]:
        """(first token, end token, first piece, end piece) of shard s."""
        a, b = s * self.shard_tokens, min((s + 1) * self.shard_tokens, self.total)
        first = int(np.searchsorted(self.pos + self.length, a, side="right"))
        end = int(np.searchsorted(self.pos, b, side="left"))
        return a, b, first, end

    def doc_starts(self, s: int) -> np.ndarray:
        """Positions inside shard s where a document's first token lies."""
        a, b, _, _ = self.shard_range(s)
        lo, hi = np.searchsorted(self.doc_pos, [a, b], side="left")
        return (self.doc_pos[lo:hi] - a).astype(np.int64)

    def chunks(self, s: int, p: Pieces, parts, eot: int, dtype):
        """Shard s's tokens as consecutive arrays: pieces, and end-of-text between documents."""
        a, b, first, end = self.shard_range(s)
        cursor = a
        for k in range(first, end):
            pos, n, piece = int(self.pos[k]), int(self.length[k]), int(self.pieces[k])
            if pos > cursor:  # the separator before this document
                yield np.full(pos - cursor, eot, dtype=dtype)
                cursor = pos
            lo, hi = max(pos, a), min(pos + n, b)
            if hi > lo:
                src = int(p.start[piece]) + lo - pos
                yield parts(int(p.part[piece]))[src : src + hi - lo]
                cursor = hi
        if cursor < b:
            yield np.full(b - cursor, eot, dtype=dtype)


def split_sizes(is_val: np.ndarray, lengths: np.ndarray) -> tuple[int, int]:
    """(train tokens, val tokens) without separators; refuses an empty split."""
    val = int(lengths[is_val].sum())
    train = int(lengths[~is_val].sum())
    if val <= 0:
        raise UserError(
            f"val split leaves no validation tokens ({train + val} tokens in all); raise "
            "--val-fraction, --val-tokens or --val-max-tokens"
        )
    if train <= 0:
        raise UserError(
            f"val split takes all {train + val} tokens, leaving none for training; lower "
            "--val-fraction or --val-tokens"
        )
    return train, val


# --- writing the shards (in parallel: each shard is independent) ---------------------------------
_job: dict = {}  # set before the pool forks: what every shard writer reads


class _PartReader:
    """A part's tokens read with pread on demand: nothing mapped, so a writer's memory stays the
    pieces in hand however much it reads (a memmap would keep every touched page resident)."""

    def __init__(self, path, dtype):
        self.path, self.dtype = path, np.dtype(dtype)

    def __getitem__(self, sl: slice) -> np.ndarray:
        fds = _job.setdefault("fds", {})
        fd = fds.get(self.path)
        if fd is None:
            if len(fds) >= 256:  # stay far below the open-files limit
                os.close(fds.pop(next(iter(fds))))
            fd = fds[self.path] = os.open(self.path, os.O_RDONLY)
        n, size = sl.stop - sl.start, self.dtype.itemsize
        raw = os.pread(fd, n * size, sl.start * size)
        if len(raw) != n * size:
            raise UserError(f"{self.path} is shorter than its record says; delete it and run the same command again")  # fmt: skip
        return np.frombuffer(raw, dtype=self.dtype)


def _part(i: int) -> _PartReader:
    return _PartReader(_job["part_paths"][i], _job["dtype"])


def _write_one(task: tuple[str, int]) -> dict:
    """One shard and its index; a shard finished by an earlier run (its record beside it) is kept."""
    split, s = task
    j = _job
    layout: SplitLayout = j["layouts"][split]
    a, b, _, _ = layout.shard_range(s)
    name, folder = f"{split}_{s:06d}", j["folder"]
    record = folder / f".{name}.done.json"
    try:
        entry = json.loads(record.read_text())
        if (folder / entry["file"]).stat().st_size == HEADER_SIZE + (b - a) * np.dtype(j["dtype"]).itemsize and (folder / entry["index"]["file"]).is_file():  # fmt: skip
            return entry
    except (OSError, ValueError, KeyError):
        pass
    chunks = layout.chunks(s, j["pieces"], _part, j["eot"], j["dtype"])
    entry = write_shard_chunks(folder / f"{name}.bin", b - a, chunks, j["tok_hash"], j["dtype"])
    entry["index"] = write_index(folder / f"{name}.docs.npy", layout.doc_starts(s))
    entry = {**entry, "split": split}
    tmp = record.with_name(record.name + ".tmp")
    tmp.write_text(json.dumps(entry))
    os.replace(tmp, record)
    return entry


def write_shards(folder: Path, layouts: dict, pieces: Pieces, part_paths: list, tok, dtype, workers: int) -> list[dict]:  # fmt: skip
    """Every shard of every split (train first) with its document index; manifest entries."""
    _job.clear()
    _job.update(folder=folder, layouts=layouts, pieces=pieces, part_paths=part_paths, dtype=dtype, eot=tok.eot_id, tok_hash=tok.hash)  # fmt: skip
    tasks = [(split, s) for split, lay in layouts.items() for s in range(lay.num_shards)]
    for stale in folder.glob(".*.tmp*"):  # a shard cut short by a kill
        stale.unlink()
    try:
        if workers <= 1 or len(tasks) <= 1 or "fork" not in multiprocessing.get_all_start_methods():
            return [_write_one(t) for t in tasks]
        ctx = multiprocessing.get_context("fork")  # the writers inherit _job
        with ProcessPoolExecutor(min(workers, len(tasks)), mp_context=ctx) as pool:
            return list(pool.map(_write_one, tasks))
    finally:
        for fd in _job.get("fds", {}).values():
            os.close(fd)
        _job.clear()
