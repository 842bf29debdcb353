"""Feeding training from prepared token shards: exactly once per epoch, resumable at any step.

Shards (gptrain's own files, composed shards read from the parts of a text prepare, or llm.c
shards taken as they are) are memory-mapped or read with pread (nothing read up front: memory
does not grow with the data set).
A training sample is a window of seq_len + 1 tokens inside one shard, windows starting every
`stride` tokens (default seq_len: no overlap). Each epoch visits every window exactly once:

    epoch order = for shard in permutation(shards; seed, epoch):
                      for window in permutation(windows of that shard; seed, epoch, shard)

(shuffled at both levels; one shard's permutation in memory at a time, so reads stay local).
The position is ONE global counter, `windows_consumed`, over that stream. Each `next_batch` on
every rank consumes the next micro_batch_size * world_size windows, rank r taking the r-th block
of micro_batch_size: the k-th global batch never depends on the world size, and a loader resumes
at any step on any world size from `state_dict()`. The next batch is prepared in a background
thread (pinned memory and a non_blocking copy when the device is CUDA).

Validation (`val_batches`) reads eval_tokens // seq_len non-overlapping windows spread evenly
over the whole val split (`val_windows`; eval.tokens = 0: all of them; auto: 65,536 tokens' worth,
or all of a smaller split; a number larger than the split is refused): a split written source by
source is scored on every source in proportion to its tokens, the same tokens on every run and
world size.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from gptrain.data.shards import open_entries, open_entry, read_manifest
from gptrain.data.tokenizers import Tokenizer, load_tokenizer
from gptrain.errors import UserError

IGNORE_INDEX = -1
# Reading a window through a mapping makes the kernel map the page-cache folio around it (up to
# ~2 MB each with large folios), so resident memory would grow to the whole shard. Mapping the
# shards afresh every this many windows keeps growth ~50 MB, for ~30 us per remap.
REMAP_EVERY_WINDOWS = 32


class Dataset:
    """An opened prepared folder: manifest checked, every shard's header checked and memmapped."""

    def __init__(self, data_dir):
        self.data_dir = Path(data_dir)
        self.manifest = read_manifest(self.data_dir)
        self.vocab_size = int(self.manifest["vocab_size"])
        self.eot_id = int(self.manifest["eot_id"])
        self.shards: dict[str, list[np.ndarray]] = {"train": [], "val": []}
        self.entries: dict[str, list[dict]] = {"train": [], "val": []}
        for entry in self.manifest["shards"]:
            if entry.get("split") not in self.shards:
                raise UserError(
                    f"{self.data_dir}/manifest.json: shard {entry.get('file')} has split {entry.get('split')!r}; allowed: train, val"
                )
        for entry, tokens in zip(
            self.manifest["shards"], open_entries(self.data_dir, self.manifest), strict=True
        ):
            self.shards[entry["split"]].append(tokens)
            self.entries[entry["split"]].append(entry)
        self._tokenizer: Tokenizer | None = None

    @property
    def tokenizer(self) -> Tokenizer:
        """The manifest's tokenizer (loaded on first use; a BPE tokenizer.json kept beside the data wins)."""
        if self._tokenizer is None:
            ident = dict(self.manifest["tokenizer"])
            if ident["name"] == "bpe" and (self.data_dir / "tokenizer.json").is_file():
                ident["path"] = str(self.data_dir / "tokenizer.json")
            self._tokenizer = load_tokenizer(ident)
        return self._tokenizer

    def remap(self, split: str, index: int) -> np.ndarray:
        """Map shard `index` afresh: pages touched through the old mapping leave our resident
        memory (they stay in the kernel's page cache), so memory does not grow while reading."""
        entry, tok_hash = self.entries[split][index], self.manifest["tokenizer"]["hash"]
        if entry.get("format") == "composed":  # read with pread: nothing mapped
            return self.shards[split][index]
        self.shards[split][index] = open_entry(self.data_dir, entry, tok_hash)
        return self.shards[split][index]

    def num_tokens(self, split: str) -> int:
        if split not in self.shards:
            raise UserError(f"unknown split {split!r}; allowed: train, val")
        return int(sum(len(s) for s in self.shards[split]))


class TrainLoader:
    """Batches of (x, y) windows over the train split; see the module docstring for the order."""

    def __init__(
        self,
        dataset: Dataset,
        seq_len: int,
        micro_batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        stride: int | None = None,
        device: str | torch.device = "cpu",
    ):
        self.dataset, self.seq_len, self.micro_batch_size = (
            dataset,
            int(seq_len),
            int(micro_batch_size),
        )
        self.rank, self.world_size, self.seed = int(rank), int(world_size), int(seed)
        self.stride = int(stride or seq_len)
        self.device = torch.device(device)
        if self.seq_len < 1 or self.stride < 1 or self.micro_batch_size < 1:
            raise UserError(
                f"seq_len {seq_len}, stride {stride}, micro_batch_size {micro_batch_size}: all must be >= 1"
            )
        if not 0 <= self.rank < self.world_size:
            raise UserError(f"rank {rank} outside world size {world_size}")
        self.shards = dataset.shards["train"]
        span = self.seq_len + 1
        self.shard_windows = np.array(
            [(len(s) - span) // self.stride + 1 if len(s) >= span else 0 for s in self.shards],
            dtype=np.int64,
        )
        self.windows_per_epoch = int(self.shard_windows.sum())
        if self.windows_per_epoch == 0:
            longest = max((len(s) for s in self.shards), default=0)
            raise UserError(
                f"seq_len {self.seq_len} (+1) is longer than every train shard of {dataset.data_dir} (longest: {longest} tokens); use a shorter seq_len or more data"
            )
        self.windows_consumed = 0
        self._epoch_cache: tuple[int, np.ndarray, np.ndarray] | None = None
        self._perm_cache: dict[tuple[int, int], np.ndarray] = {}
        self._touched: dict[int, int] = {}  # windows read per shard since its last remap
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="gptrain-loader")
        self._ahead = None  # (windows_consumed it was made for, future)

    @property
    def epoch(self) -> int:
        return self.windows_consumed // self.windows_per_epoch

    # --- the global stream -------------------------------------------------------------------
    def _epoch_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(shard order, cumulative window counts in that order) for an epoch."""
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.shards))
            self._epoch_cache = (epoch, order, np.cumsum(self.shard_windows[order]))
        return self._epoch_cache[1], self._epoch_cache[2]

    def _shard_perm(self, epoch: int, shard: int) -> np.ndarray:
        key = (epoch, shard)
        if key not in self._perm_cache:
            if len(self._perm_cache) >= 4:  # a batch touches at most a few shards
                self._perm_cache.pop(next(iter(self._perm_cache)))
            rng = np.random.default_rng([self.seed, epoch, shard])
            self._perm_cache[key] = rng.permutation(int(self.shard_windows[shard]))
        return self._perm_cache[key]

    def window(self, index: int) -> tuple[int, int]:
        """(shard, start token) of global stream position `index` (any epoch)."""
        epoch, i = divmod(int(index), self.windows_per_epoch)
        order, cum = self._epoch_order(epoch)
        j = int(np.searchsorted(cum, i, side="right"))
        shard = int(order[j])
        local = i - (int(cum[j - 1]) if j else 0)
        return shard, int(self._shard_perm(epoch, shard)[local]) * self.stride

    def _make_batch(self, consumed: int) -> tuple[torch.Tensor, torch.Tensor]:
        first = consumed + self.rank * self.micro_batch_size
        span = self.seq_len + 1
        buf = np.empty((self.micro_batch_size, span), dtype=np.int64)
        with self._lock:  # the caches are shared with the prefetch thread
            for b in range(self.micro_batch_size):
                shard, start = self.window(first + b)
                buf[b] = self.shards[shard][start : start + span]
                self._touched[shard] = self._touched.get(shard, 0) + 1
            if sum(self._touched.values()) >= REMAP_EVERY_WINDOWS:
                for shard in self._touched:
                    self.dataset.remap("train", shard)
                self._touched = {}
        x, y = torch.from_numpy(buf[:, :-1].copy()), torch.from_numpy(buf[:, 1:].copy())
        if self.device.type == "cuda":
            x, y = x.pin_memory(), y.pin_memory()
        return x, y

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y int64 (micro_batch_size, seq_len) on the device; y is x shifted by one token."""
        consumed = self.windows_consumed
        if self._ahead is not None and self._ahead[0] == consumed:
            x, y = self._ahead[1].result()
        else:
            x, y = self._make_batch(consumed)
        self.windows_consumed = consumed + self.micro_batch_size * self.world_size
        self._ahead = (
            self.windows_consumed,
            self._pool.submit(self._make_batch, self.windows_consumed),
        )
        if self.device.type == "cpu":
            return x, y
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def close(self) -> None:
        """Stop the prefetch thread (so that nothing reads shards while the process tears down)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._ahead = None

    # --- resume --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "windows_consumed": self.windows_consumed,
            "seq_len": self.seq_len,
            "stride": self.stride,
            "seed": self.seed,
            "windows_per_epoch": self.windows_per_epoch,
        }

    def skip_windows(self, n: int) -> None:
        """Move the cursor n >= 0 windows forward without reading them (a rollback skips the
        batch that went wrong)."""
        if n < 0:
            raise ValueError(f"skip_windows({n}): the cursor only moves forward")
        self.windows_consumed += n
        self._ahead = None

    def load_state_dict(self, state: dict) -> None:
        for key in ("seq_len", "stride", "seed", "windows_per_epoch"):
            if key in state and int(state[key]) != getattr(self, key):
                raise UserError(
                    f"data loader state has {key}={state[key]}, this run has {getattr(self, key)}; "
                    f"resume with the same {key} (and the same data) or start a new run"
                )
        self.windows_consumed = int(state["windows_consumed"])
        self._ahead = None


AUTO_VAL_TOKENS = 65536  # eval.tokens = auto: this many, or the whole split where it holds fewer


def val_window_count(dataset: Dataset, seq_len: int, eval_tokens: int | str) -> int:
    """How many windows of seq_len an evaluation of `eval_tokens` scores (eval.tokens): of the
    split's `available` = (tokens - 1) // seq_len non-overlapping slots, eval_tokens // seq_len
    (at least 1); 0 is every slot; auto is AUTO_VAL_TOKENS' windows or every slot, the fewer. A
    number asking for more windows than the split holds is a UserError."""
    total = sum(len(s) for s in dataset.shards["val"])
    available = (total - 1) // seq_len if total > seq_len else 0
    if available == 0:
        raise UserError(
            f"the val split of {dataset.data_dir} has {total} tokens, fewer than one window of seq_len {seq_len} + 1; prepare more validation data (--val-fraction / --val-tokens) or use a shorter seq_len"
        )
    if eval_tokens == 0:
        return available
    if eval_tokens == "auto":
        return min(max(AUTO_VAL_TOKENS // seq_len, 1), available)
    n = max(eval_tokens // seq_len, 1)
    if n > available:
        raise UserError(
            f"eval.tokens = {eval_tokens:,} is more than the val split of {dataset.data_dir} holds ({available * seq_len:,} tokens in whole windows of seq_len {seq_len}); set eval.tokens=0 to score all of it, or at most {available * seq_len}"
        )
    return n


def val_windows(dataset: Dataset, seq_len: int, eval_tokens: int | str) -> np.ndarray:
    """The val windows an evaluation scores, (n, seq_len + 1) token ids: of the split's
    `available` = (tokens - 1) // seq_len non-overlapping window slots, n = val_window_count()
    evenly spaced ones, slot floor(i * available / n) for i < n. The split is read as one stream
    (a window may span two shards); only these windows are read."""
    shards = dataset.shards["val"]
    lengths = [len(s) for s in shards]
    available = (sum(lengths) - 1) // seq_len
    n = val_window_count(dataset, seq_len, eval_tokens)
    firsts = np.cumsum([0, *lengths[:-1]])  # each shard's first position in the stream
    out = np.empty((n, seq_len + 1), dtype=np.int64)
    for row, slot in enumerate(np.arange(n, dtype=np.int64) * available // n):
        pos, got = int(slot) * seq_len, 0
        i = int(np.searchsorted(firsts, pos, side="right")) - 1
        while got < seq_len + 1:  # across a shard's end into the next
            piece = shards[i][pos - firsts[i] : pos - firsts[i] + seq_len + 1 - got]
            out[row, got : got + len(piece)] = piece
            got, pos, i = got + len(piece), pos + len(piece), i + 1
    return out


def val_batches(
    dataset: Dataset,
    seq_len: int,
    micro_batch_size: int,
    eval_tokens: int,
    rank: int,
    world_size: int,
    device="cpu",
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The val windows (`val_windows`), window i on rank i % world_size.

    Every rank yields the same number of (micro_batch_size, seq_len) batches; rows without a real
    window have y == -1 (the ignore index), so the count of y != -1 over all ranks is windows * seq_len.
    """
    windows = torch.from_numpy(val_windows(dataset, seq_len, eval_tokens))
    n = len(windows)
    mine = list(range(rank, n, world_size))
    per_rank = -(-n // world_size)
    num_batches = -(-per_rank // micro_batch_size)
    device = torch.device(device)
    for b in range(num_batches):
        x = torch.zeros((micro_batch_size, seq_len), dtype=torch.int64)
        y = torch.full((micro_batch_size, seq_len), IGNORE_INDEX, dtype=torch.int64)
        for row, w in enumerate(mine[b * micro_batch_size : (b + 1) * micro_batch_size]):
            x[row] = windows[w, :-1]
            y[row] = windows[w, 1:]
        yield x.to(device), y.to(device)
