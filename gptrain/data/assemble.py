"""From tokenized documents to shards: the val split, the train shuffle, the span tables and the
shards' document indexes. Nothing here tokenizes or touches a token.

`Pieces` describes the tokenized text: each piece (a document, or the part of one that one work
item held) by its `length` (tokens, no end-of-text) and `start` inside its part, and each
document by its first piece (`doc_first`; None in the usual case where every document is one
piece, so document i is piece i). A split is a list of document ids in order; its token stream is
those documents with one end-of-text token between neighbours, cut into shards of
`shard_tokens`. `write_split` streams that order in chunks into the split's span table (the tokens
stay in the parts: `gptrain.data.composed`) and each shard's document index.

Memory: what lives for the whole corpus is ~14 bytes per document (length and start int32, the
split int8, the val mask, the order int32), ~22 while the val split is drawn; everything else is
made CHUNK documents at a time, so the span tables and indexes of a 10M-document corpus cost no
more memory than those of a small one.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gptrain.data.shards import write_index
from gptrain.errors import UserError

VAL_MAX_TOKENS = 100_000_000
CHUNK = 1 << 18  # documents handled at a time


@dataclass
class Pieces:
    """Every tokenized piece and the documents they make, as NumPy arrays."""

    length: np.ndarray  # int32: each piece's tokens
    start: (
        np.ndarray
    )  # int32 (int64 for a part of 2^31 tokens or more): where it begins in its part
    part_end: np.ndarray  # int64: pieces in parts 0..k (the part of piece i: searchsorted)
    doc_first: np.ndarray | None  # int64: each document's first piece; None: one piece each
    doc_split: np.ndarray  # int8: 0 chosen later, 1 train, 2 val

    @classmethod
    def from_parts(cls, records: list[dict], lengths) -> Pieces:
        """From the parts' records and `lengths(k)`: part k's piece lengths (read one at a time)."""
        counts = np.array([r["pieces"] for r in records], dtype=np.int64)
        n, longest = int(counts.sum()), max((r["tokens"] for r in records), default=0)
        length, start = (
            np.empty(n, np.int32),
            np.empty(n, np.int32 if longest < 2**31 else np.int64),
        )
        new_doc, splits, at = np.ones(n, dtype=bool), np.empty(n, np.int8), 0
        for k, record in enumerate(records):
            x = lengths(k)
            length[at : at + len(x)] = x
            start[at : at + len(x)] = np.cumsum(x) - x
            splits[at : at + len(x)] = record["split"]
            if record["cont"] and len(x) and at > 0:  # its first piece continues a document
                new_doc[at] = False
            at += len(x)
        if new_doc.all():
            return cls(length, start, np.cumsum(counts), None, splits)
        doc_first = np.flatnonzero(new_doc)
        return cls(length, start, np.cumsum(counts), doc_first, splits[doc_first])

    @property
    def num_docs(self) -> int:
        return len(self.doc_split)

    def doc_pieces(self, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(piece ids of `docs`, in order; pieces per document)."""
        if self.doc_first is None:
            return docs, np.ones(len(docs), dtype=np.int64)
        ends = np.append(self.doc_first[1:], len(self.length))
        firsts, counts = self.doc_first[docs], ends[docs] - self.doc_first[docs]
        offs = np.cumsum(counts) - counts
        return np.repeat(firsts - offs, counts) + np.arange(int(counts.sum())), counts

    def doc_lengths(self, docs: np.ndarray) -> np.ndarray:
        """int64 tokens of each of `docs`."""
        pieces, counts = self.doc_pieces(docs)
        lens = self.length[pieces].astype(np.int64)
        if self.doc_first is None:
            return lens
        return np.add.reduceat(lens, np.cumsum(counts) - counts) if len(lens) else lens

    def tokens(self, docs: np.ndarray) -> int:
        """Tokens of `docs` (no separators), summed CHUNK documents at a time."""
        return sum(
            int(self.doc_lengths(docs[i : i + CHUNK]).sum()) for i in range(0, len(docs), CHUNK)
        )

    def cut_single(self, keep: int) -> Pieces:
        """The one document cut after `keep` tokens: a train document and a val document."""
        ends = np.cumsum(self.length, dtype=np.int64)
        k = min(int(np.searchsorted(ends, keep, side="right")), len(self.length) - 1)
        before = keep - (int(ends[k - 1]) if k else 0)
        length = np.insert(self.length, k + 1, self.length[k] - before)
        length[k] = before
        start = np.insert(self.start, k + 1, self.start[k] + before)
        part_end = self.part_end + (self.part_end > k)  # the new piece lies in piece k's part
        return Pieces(length, start, part_end, np.array([0, k + 1]), np.array([1, 2], np.int8))


def choose_val(
    p: Pieces,
    candidates: np.ndarray,
    val_fraction: float,
    val_tokens: int | None,
    seed: int,
    val_max_tokens: int | None = VAL_MAX_TOKENS,
) -> np.ndarray:
    """The validation documents among `candidates`. They are taken in a seeded random order
    until they reach the budget: `val_tokens`, else `val_fraction` of the candidates' tokens
    (the last document may pass it); with a fraction, never more than `val_max_tokens` in all."""
    target = (
        val_tokens if val_tokens is not None else math.ceil(val_fraction * p.tokens(candidates))
    )
    cap = val_max_tokens if val_tokens is None and val_max_tokens is not None else None
    order = np.random.default_rng(seed).permutation(
        np.arange(len(candidates), dtype=candidates.dtype)
    )
    take, carry = len(order), 0
    for i in range(0, len(order), CHUNK):
        running = carry + np.cumsum(p.doc_lengths(candidates[order[i : i + CHUNK]]))
        n = len(running)
        reach = (
            int(np.searchsorted(running, target, side="left")) + 1
        )  # up to the first to reach it
        under = int(np.searchsorted(running, cap, side="right")) if cap is not None else n + 1
        if reach <= n or under < n:  # the target reached, or the cap passed, in this chunk
            take = i + min(reach, under)
            break
        carry = int(running[-1])
    return np.sort(candidates[order[:take]])


def ids(mask: np.ndarray) -> np.ndarray:
    """np.flatnonzero(mask) as int32 where that holds every id, made CHUNK at a time."""
    out = np.empty(int(np.count_nonzero(mask)), dtype=np.int32 if len(mask) < 2**31 else np.int64)
    at = 0
    for i in range(0, len(mask), CHUNK):
        found = np.flatnonzero(mask[i : i + CHUNK]) + i
        out[at : at + len(found)] = found
        at += len(found)
    return out


def train_order(train_ids: np.ndarray, shuffle_seed: int | None) -> np.ndarray:
    """The train split's documents: a seeded permutation (None: input order), made in place."""
    if shuffle_seed is not None:
        np.random.default_rng([shuffle_seed, 0x5EED]).shuffle(train_ids)
    return train_ids


def check_sizes(train: int, val: int) -> None:
    """Refuse an empty split (token counts without separators)."""
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


def split_orders(
    p: Pieces,
    val_fraction: float,
    val_tokens: int | None,
    val_max_tokens: int | None,
    seed: int,
    shuffle_seed: int | None,
) -> dict[str, np.ndarray]:
    """Each split's documents in stream order: val (those marked val, and those choose_val draws
    from the unmarked ones; input order) and train (the rest, shuffled unless shuffle_seed is
    None). Refuses an empty split."""
    is_val = p.doc_split == 2
    candidates = ids(p.doc_split == 0)
    if len(candidates):
        is_val[choose_val(p, candidates, val_fraction, val_tokens, seed, val_max_tokens)] = True
    del candidates
    orders = {"val": ids(is_val)}
    orders = {"train": ids(np.logical_not(is_val, out=is_val)), **orders}
    del is_val
    check_sizes(p.tokens(orders["train"]), p.tokens(orders["val"]))
    orders["train"] = train_order(orders["train"], shuffle_seed)
    return orders


# --- the folder: span tables and document indexes (the tokens stay in the parts) ---------------
def write_split(
    folder: Path, split: str, p: Pieces, docs: np.ndarray, shard_tokens: int
) -> tuple[list[dict], dict, int]:
    """`split`'s span table (int64 (4, pieces): stream position, length, part, start; written
    one row at a time, CHUNK documents at a time) and its shards' document indexes. Returns
    (manifest shard entries, the span table's record, tokens in the stream)."""
    n_pieces = sum(len(p.doc_pieces(docs[i : i + CHUNK])[0]) for i in range(0, len(docs), CHUNK))
    total = p.tokens(docs) + max(len(docs) - 1, 0)
    num_shards = -(-total // shard_tokens)
    path = folder / f"{split}.spans.npy"
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    sha, index = hashlib.sha256(), _Indexes(folder, split, shard_tokens, num_shards)
    with open(tmp, "wb") as f:
        header = {"descr": "<i8", "fortran_order": False, "shape": (4, n_pieces)}
        np.lib.format.write_array_header_1_0(f, header)
        f.flush()
        sha.update(tmp.read_bytes())
        for row in range(4):
            carry = 0
            for i in range(0, len(docs), CHUNK):
                pieces, counts = p.doc_pieces(docs[i : i + CHUNK])
                lens = p.length[pieces].astype(np.int64)
                if (
                    row == 0
                ):  # stream positions: one end-of-text before every document but the first
                    sep = np.zeros(len(pieces), dtype=np.int64)
                    sep[np.cumsum(counts) - counts] = 1
                    if i == 0 and len(sep):
                        sep[0] = 0
                    values = carry + np.cumsum(lens + sep) - lens
                    carry = int(values[-1] + lens[-1]) if len(values) else carry
                    index.add(values[np.cumsum(counts) - counts])
                elif row == 1:
                    values = lens
                elif row == 2:
                    values = np.searchsorted(p.part_end, pieces, side="right").astype(np.int64)
                else:
                    values = p.start[pieces]
                raw = np.ascontiguousarray(values, dtype="<i8").tobytes()
                f.write(raw)
                sha.update(raw)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    record = {"file": path.name, "pieces": n_pieces, "sha256": sha.hexdigest()}
    entries = []
    for s, idx in enumerate(index.finish()):
        a, b = s * shard_tokens, min((s + 1) * shard_tokens, total)
        entries.append(
            {
                "file": f"{split}_{s:06d}",
                "format": "composed",
                "split": split,
                "start": a,
                "tokens": b - a,
                "spans": path.name,
                "index": idx,
            }
        )
    return entries, record, total


def write_splits(
    folder: Path, p: Pieces, orders: dict, shard_tokens: int
) -> tuple[list[dict], dict, dict]:
    """write_split for every split (train first): (manifest shard entries, span table records,
    each split's tokens and documents)."""
    shards, spans, splits = [], {}, {}
    for split, docs in orders.items():
        entries, spans[split], total = write_split(folder, split, p, docs, shard_tokens)
        shards += entries
        splits[split] = {"tokens": total, "segments": len(docs), "documents": len(docs)}
    return shards, spans, splits


class _Indexes:
    """Document starts arriving in stream order, written as each shard's index once complete."""

    def __init__(self, folder: Path, split: str, shard_tokens: int, num_shards: int):
        self.folder, self.split, self.shard_tokens = folder, split, shard_tokens
        self.num_shards, self.pending, self.written = num_shards, [], []

    def add(self, starts: np.ndarray) -> None:
        while len(starts):
            end = (len(self.written) + 1) * self.shard_tokens
            k = int(np.searchsorted(starts, end, side="left"))
            self.pending.append(starts[:k])
            starts = starts[k:]
            if len(starts):  # the shard is complete
                self._flush()

    def _flush(self) -> None:
        s = len(self.written)
        starts = np.concatenate([np.zeros(0, np.int64), *self.pending]) - s * self.shard_tokens
        name = f"{self.split}_{s:06d}.docs.npy"
        self.written.append(write_index(self.folder / name, starts))
        self.pending = []

    def finish(self) -> list[dict]:
        while len(self.written) < self.num_shards:
            self._flush()
        return self.written
