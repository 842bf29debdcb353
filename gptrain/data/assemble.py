"""From tokenized documents to shards: the val split, the train shuffle, the shards and their
document indexes. Everything per document is a NumPy array; nothing here tokenizes.

Documents are described by three arrays: `part` (which token array holds it), `start` (where it
begins there) and `length` (its tokens, no end-of-text). A split is a list of document ids in
order; its token stream is those documents with one end-of-text token between neighbours, cut
into shards of `shard_tokens`. `SplitLayout` places every document in that stream, so any shard
can be filled on its own (in any process, in any order) and its document index is arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

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
class SplitLayout:
    """Where each document of a split lies in the split's token stream."""

    docs: np.ndarray  # document ids in stream order
    pos: np.ndarray  # stream position of each one's first token
    length: np.ndarray  # its tokens
    total: int  # tokens in the stream (documents + separators)
    shard_tokens: int

    @classmethod
    def build(cls, docs: np.ndarray, lengths: np.ndarray, shard_tokens: int) -> SplitLayout:
        length = lengths[docs].astype(np.int64)
        pos = np.zeros(len(docs), dtype=np.int64)
        if len(docs) > 1:
            pos[1:] = np.cumsum(length[:-1] + 1)
        total = int(pos[-1] + length[-1]) if len(docs) else 0
        return cls(docs, pos, length, total, shard_tokens)

    @property
    def num_shards(self) -> int:
        return -(-self.total // self.shard_tokens)

    def shard_range(self, s: int) -> tuple[int, int, int, int]:
        """(first token, end token, first document, end document) of shard s."""
        a, b = s * self.shard_tokens, min((s + 1) * self.shard_tokens, self.total)
        first = int(np.searchsorted(self.pos + self.length, a, side="right"))
        end = int(np.searchsorted(self.pos, b, side="left"))
        return a, b, first, end

    def doc_starts(self, s: int) -> np.ndarray:
        """Positions inside shard s where a document's first token lies."""
        a, b, _, _ = self.shard_range(s)
        lo, hi = np.searchsorted(self.pos, [a, b], side="left")
        return (self.pos[lo:hi] - a).astype(np.int64)

    def fill(self, s: int, parts, part: np.ndarray, start: np.ndarray, eot: int, dtype):
        """Shard s's tokens: end-of-text everywhere, each overlapping document copied over it."""
        a, b, first, end = self.shard_range(s)
        buf = np.full(b - a, eot, dtype=dtype)
        for k in range(first, end):
            d, p, n = int(self.docs[k]), int(self.pos[k]), int(self.length[k])
            lo, hi = max(p, a), min(p + n, b)
            if hi > lo:
                src = int(start[d]) + lo - p
                buf[lo - a : hi - a] = parts[int(part[d])][src : src + hi - lo]
        return buf


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
