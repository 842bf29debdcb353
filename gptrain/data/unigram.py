"""The regime of a race: the cross-entropy of the val tokens under the train split's unigram
distribution, the loss of a model that knows only how often each token occurs in training.

    cross_entropy(train, val, vocab_size)   nats per val token under the train counts, with
                                            add-one (Laplace) smoothing: p(v) = (c_v + 1) / (N + V)
    val_targets(dataset, seq_len, eval_tokens)
                                            the val tokens an evaluation scores: the targets of
                                            the windows gptrain/data/loader.py's val_windows
                                            spreads over the whole val split
    unigram_entropy(data_dir, seq_len, eval_tokens)
                                            both, from a prepared folder: the train split counted
                                            in chunks of CHUNK tokens with numpy's bincount

A loss not well below this entropy has learnt little beyond token frequencies: a comparison of
recipes there (an "early regime") need not hold later in training.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from gptrain.data.loader import Dataset, val_windows

CHUNK = 1 << 24  # tokens counted at a time: memory stays bounded whatever the split's size
SMOOTHING = "add-one (Laplace): p(v) = (count_v + 1) / (train tokens + vocab size)"


def counts(parts: Iterable, vocab_size: int) -> np.ndarray:
    """How often each token id occurs in `parts` (sequences of token ids), read CHUNK at a time."""
    total = np.zeros(vocab_size, dtype=np.int64)
    for part in parts:
        for start in range(0, len(part), CHUNK):
            c = np.bincount(np.asarray(part[start : start + CHUNK], dtype=np.int64))
            if len(c) > len(total):  # an id beyond the manifest's vocab_size: counted anyway
                total = np.concatenate([total, np.zeros(len(c) - len(total), dtype=np.int64)])
            total[: len(c)] += c
    return total


def cross_entropy(train: Iterable, val: Sequence[int], vocab_size: int) -> float:
    """Nats per token of `val` under the add-one-smoothed unigram distribution of `train`."""
    c_train = counts(train, vocab_size)
    c_val = counts([val], len(c_train))
    c_train = np.concatenate([c_train, np.zeros(len(c_val) - len(c_train), dtype=np.int64)])
    if c_val.sum() == 0:
        return math.nan
    n, v = int(c_train.sum()), len(c_train)
    log_p = np.log(c_train + 1.0) - math.log(n + v)
    return float(-(c_val * log_p).sum() / c_val.sum())


def val_targets(dataset: Dataset, seq_len: int, eval_tokens: int) -> np.ndarray:
    """The targets of the windows an evaluation reads (gptrain/data/loader.py's `val_windows`:
    evenly spaced over the whole val split), in order."""
    return val_windows(dataset, seq_len, eval_tokens)[:, 1:].reshape(-1)


def unigram_entropy(data_dir, seq_len: int, eval_tokens: int) -> dict:
    """The regime's numbers for a prepared folder: nats, the counts behind them, the smoothing."""
    dataset = Dataset(data_dir)
    val = val_targets(dataset, seq_len, eval_tokens)
    train = dataset.shards["train"]
    return {
        "nats": cross_entropy(train, val, dataset.vocab_size),
        "train_tokens": dataset.num_tokens("train"),
        "val_tokens": int(len(val)),
        "vocab_size": dataset.vocab_size,
        "smoothing": SMOOTHING,
    }
