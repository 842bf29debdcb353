"""Loader: every window exactly once per epoch on any world size, exact resume, val batches."""

import hashlib

import numpy as np
import pytest
import torch

from gptrain.data.loader import Dataset, TrainLoader, val_batches, val_windows
from gptrain.data.shards import write_manifest, write_shard
from gptrain.errors import UserError

HASH = hashlib.sha256(b"synthetic").hexdigest()
VOCAB = 20_000


def make_data(folder, train_lens=(1000, 777, 1500, 64), val_len=700):
    """Shards whose token at global position p is p: a window is identified by its first token."""
    shards, pos = [], 0
    for i, n in enumerate(train_lens):
        shards.append(
            {
                **write_shard(folder / f"train_{i:06d}.bin", np.arange(pos, pos + n), HASH, VOCAB),
                "split": "train",
            }
        )
        pos += n
    shards.append(
        {
            **write_shard(folder / "val_000000.bin", np.arange(val_len) + 10_000, HASH, VOCAB),
            "split": "val",
        }
    )
    ident = {"name": "synthetic", "vocab_size": VOCAB, "eot_id": 0, "hash": HASH}
    write_manifest(folder, {"tokenizer": ident, "vocab_size": VOCAB, "eot_id": 0, "shards": shards})
    return Dataset(folder)


def all_windows(ds, seq_len, stride):
    starts, pos = [], 0
    for shard in ds.shards["train"]:
        starts += [pos + s for s in range(0, len(shard) - seq_len, stride)]
        pos += len(shard)
    return starts


def global_stream(ds, n_steps, world, seq_len=32, batch=4, stride=None, seed=7, state=None):
    """First tokens of the windows, in global stream order, from `world` ranks stepping together."""
    loaders = [TrainLoader(ds, seq_len, batch, r, world, seed, stride=stride) for r in range(world)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    out = []
    for _ in range(n_steps):
        for loader in loaders:
            x, y = loader.next_batch()
            assert x.shape == y.shape == (batch, seq_len) and x.dtype == y.dtype == torch.int64
            assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(y[:, -1], x[:, -1] + 1)
            out += x[:, 0].tolist()
    states = {loader.state_dict()["windows_consumed"] for loader in loaders}
    assert len(states) == 1
    return out, loaders[0].state_dict()


@pytest.fixture
def ds(tmp_path):
    return make_data(tmp_path)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("stride", [None, 20])
def test_every_window_exactly_once_per_epoch(ds, world, stride):
    seq_len, batch = 32, 4
    expected = sorted(all_windows(ds, seq_len, stride or seq_len))
    loader = TrainLoader(ds, seq_len, batch, 0, world, 7, stride=stride)
    W = loader.windows_per_epoch
    assert W == len(expected)
    steps = -(-2 * W // (batch * world))  # two epochs
    stream, _ = global_stream(ds, steps, world, seq_len, batch, stride)
    assert sorted(stream[:W]) == expected  # each exactly once, no overlap between ranks
    assert sorted(stream[W : 2 * W]) == expected
    assert stream[:W] != stream[W : 2 * W]  # a new permutation each epoch
    reference, _ = global_stream(ds, -(-len(stream) // batch), 1, seq_len, batch, stride)
    assert stream == reference[: len(stream)]  # the same global stream on every world size


def test_shards_and_windows_shuffled(ds):
    stream, _ = global_stream(ds, 20, 1)
    assert stream != sorted(stream)
    shard_of = np.searchsorted(np.cumsum([1000, 777, 1500, 64]), stream, side="right")
    assert len(set(shard_of[:10].tolist())) == 1  # one shard at a time (locality)


def test_resume_mid_epoch(ds):
    full, _ = global_stream(ds, 30, 1)
    first, state = global_stream(ds, 12, 1)
    rest, _ = global_stream(ds, 18, 1, state=state)
    assert first + rest == full
    assert state["windows_consumed"] == 48 and {"seq_len", "stride", "seed"} <= set(state)


def test_resume_exact_tensors(ds):
    a = TrainLoader(ds, 32, 4, 0, 1, 3)
    for _ in range(5):
        a.next_batch()
    b = TrainLoader(ds, 32, 4, 0, 1, 3)
    b.load_state_dict(a.state_dict())
    for _ in range(40):  # crosses an epoch boundary
        xa, ya = a.next_batch()
        xb, yb = b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert a.epoch == b.epoch >= 1


def test_skip_windows_moves_the_cursor_as_reading_would(ds):
    """skip_windows(n) (what a rollback uses) lands where reading n windows would, prefetch
    included; the cursor never moves back."""
    read = TrainLoader(ds, 32, 4, 0, 1, 3)
    for _ in range(3):
        read.next_batch()
    skipped = TrainLoader(ds, 32, 4, 0, 1, 3)
    skipped.next_batch()  # a prefetch for window 4 is in flight: skipping must drop it
    skipped.skip_windows(8)
    assert skipped.state_dict() == read.state_dict()
    for a, b in zip(read.next_batch(), skipped.next_batch(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError):
        skipped.skip_windows(-1)


@pytest.mark.parametrize("before,after", [(2, 1), (2, 3), (3, 2), (1, 2)])
def test_resume_on_another_world_size(ds, before, after):
    full, _ = global_stream(ds, 60, 1, batch=2)
    head, state = global_stream(ds, 12 // before, before, batch=2)
    tail, _ = global_stream(ds, 6, after, batch=2, state=state)
    assert head + tail == full[: len(head) + len(tail)]


def test_state_mismatch_is_refused(ds):
    state = TrainLoader(ds, 32, 4, 0, 1, 7).state_dict()
    for kwargs in ({"seq_len": 16}, {"stride": 8}, {"seed": 8}):
        args = {"seq_len": 32, "seed": 7, **kwargs}
        loader = TrainLoader(
            ds, args["seq_len"], 4, 0, 1, args["seed"], stride=kwargs.get("stride")
        )
        with pytest.raises(UserError, match=f"{next(iter(kwargs))}="):
            loader.load_state_dict(state)


def test_seq_len_longer_than_every_shard(ds):
    with pytest.raises(UserError, match="seq_len 5000 .* longer than every train shard"):
        TrainLoader(ds, 5000, 1, 0, 1, 0)


def test_dataset_memmaps_and_counts(ds):
    assert all(isinstance(s, np.memmap) for s in ds.shards["train"])
    assert ds.num_tokens("train") == 1000 + 777 + 1500 + 64 and ds.num_tokens("val") == 700
    assert ds.vocab_size == VOCAB and ds.eot_id == 0


@pytest.mark.parametrize("world", [1, 2, 3])
def test_val_batches_fixed_and_aligned(ds, world):
    seq_len, batch, eval_tokens = 32, 4, 500  # 15 windows
    per_rank = [list(val_batches(ds, seq_len, batch, eval_tokens, r, world)) for r in range(world)]
    assert len({len(b) for b in per_rank}) == 1  # same number of batches on every rank
    rows = []
    for batches in per_rank:
        for x, y in batches:
            assert x.shape == y.shape == (batch, seq_len)
            for xr, yr in zip(x, y, strict=True):
                if (yr != -1).any():
                    assert (yr != -1).all() and torch.equal(xr[1:], yr[:-1])
                    rows.append(int(xr[0]))
    assert sum(int((y != -1).sum()) for b in per_rank for _, y in b) == 15 * seq_len
    # 15 of the split's 699 // 32 = 21 window slots, evenly spaced: slot i * 21 // 15
    assert sorted(rows) == [10_000 + (i * 21 // 15) * seq_len for i in range(15)]  # any world size


def test_the_val_sample_covers_every_source_in_proportion_on_any_world_size(tmp_path):
    """A val split written source by source (three shards of 3000, 1000 and 6000 tokens, each
    source's tokens in its own range): 100 windows of 16 tokens fall on each source in proportion
    to its tokens (within a window), the same windows on 1 and 2 ranks, and the regime's val
    tokens (gptrain/data/unigram.py) are their targets."""
    from gptrain.data.unigram import val_targets

    sizes, shards = (3000, 1000, 6000), []
    for k, n in enumerate(sizes):
        tokens = np.arange(n) + 100_000 * (k + 1)  # source k: 100000 (k + 1) + position
        shards.append({**write_shard(tmp_path / f"val_{k:06d}.bin", tokens, HASH, 10**6), "split": "val"})  # fmt: skip
    train = write_shard(tmp_path / "train_000000.bin", np.arange(100), HASH, 10**6)
    ident = {"name": "synthetic", "vocab_size": 10**6, "eot_id": 0, "hash": HASH}
    manifest = {"tokenizer": ident, "vocab_size": 10**6, "eot_id": 0}
    write_manifest(tmp_path, manifest | {"shards": [{**train, "split": "train"}, *shards]})
    ds, seq_len = Dataset(tmp_path), 16
    worlds = {}
    for world in (1, 2):
        rows = []
        for rank in range(world):
            for x, y in val_batches(ds, seq_len, 8, 100 * seq_len, rank, world):
                rows += [(tuple(xr.tolist()), tuple(yr.tolist())) for xr, yr in zip(x, y, strict=True) if (yr != -1).all()]  # fmt: skip
        worlds[world] = sorted(rows)
    assert worlds[1] == worlds[2] and len(worlds[1]) == 100
    seen = np.array([t for x, _ in worlds[1] for t in x])
    for k, n in enumerate(sizes):
        share = np.mean((seen // 100_000) == k + 1)
        assert abs(share - n / sum(sizes)) <= seq_len / len(seen) + 1e-12, (k, share)
    targets = val_targets(ds, seq_len, 100 * seq_len)
    assert sorted(targets.tolist()) == sorted(t for _, y in worlds[1] for t in y)
    whole = val_targets(ds, seq_len, 0)  # 0: all of it
    assert len(whole) == (sum(sizes) - 1) // seq_len * seq_len


def test_the_val_sample_is_a_number_the_split_holds_all_of_it_or_auto(ds):
    """700 val tokens hold 699 // 32 = 21 windows of 32: eval.tokens 672 (21 windows) is taken,
    one window more is refused naming 0 and the largest number; 0 is all 21; auto is 65,536
    tokens' worth or all of a smaller split."""
    from gptrain.data.loader import val_window_count

    assert val_window_count(ds, 32, 21 * 32) == 21 and val_window_count(ds, 32, 100) == 3
    with pytest.raises(UserError, match=r"eval.tokens = 704 is more than .* set eval.tokens=0 .* at most 672$"):  # fmt: skip
        val_window_count(ds, 32, 22 * 32)
    assert val_window_count(ds, 32, 0) == 21 == val_window_count(ds, 32, "auto")
    assert val_window_count(ds, 1, "auto") == 699  # fewer than 65,536 windows of 1: all
    assert len(val_windows(ds, 32, 0)) == 21


def test_val_split_too_short(tmp_path):
    ds = make_data(tmp_path, val_len=20)
    with pytest.raises(UserError, match="val split .* has 20 tokens"):
        next(val_batches(ds, 32, 4, 1000, 0, 1))


def test_dataset_errors(tmp_path):
    with pytest.raises(UserError, match="no manifest.json"):
        Dataset(tmp_path)
    make_data(tmp_path)
    raw = (tmp_path / "train_000001.bin").read_bytes()
    (tmp_path / "train_000001.bin").write_bytes(raw[:-2])
    with pytest.raises(UserError, match="truncated shard"):
        Dataset(tmp_path)


def test_close_stops_the_prefetch_thread(tmp_path):
    import threading

    loader = TrainLoader(make_data(tmp_path), 32, 4, 0, 1, seed=7)
    before = set(threading.enumerate())
    loader.next_batch()  # starts prefetching the next batch
    started = [t for t in threading.enumerate() if t not in before]
    assert [t.name.split("_")[0] for t in started] == ["gptrain-loader"]
    loader.close()
    assert not started[0].is_alive()
