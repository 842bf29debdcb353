"""Shard format: round trip, header checks (bad magic, truncated, wrong count), --verify, and
manifests that name files outside their folder."""

import hashlib

import numpy as np
import pytest

from gptrain.__main__ import main as cli
from gptrain.data.shards import (
    HEADER_SIZE,
    MAGIC,
    open_shard,
    read_header,
    read_manifest,
    verify_dir,
    write_manifest,
    write_shard,
)
from gptrain.errors import UserError

HASH = hashlib.sha256(b"test tokenizer").hexdigest()


def make_dir(tmp_path, tokens, vocab=1000):
    entry = write_shard(tmp_path / "train_000000.bin", tokens, HASH, vocab)
    manifest = {
        "tokenizer": {"name": "test", "hash": HASH, "vocab_size": vocab, "eot_id": 0},
        "vocab_size": vocab,
        "eot_id": 0,
        "shards": [{**entry, "split": "train"}],
    }
    write_manifest(tmp_path, manifest)
    return tmp_path / "train_000000.bin", manifest


@pytest.mark.parametrize("vocab,itemsize", [(257, 2), (65_535, 2), (70_000, 4)])
def test_round_trip(tmp_path, vocab, itemsize):
    tokens = np.random.default_rng(0).integers(0, vocab, size=10_001)
    entry = write_shard(tmp_path / "s.bin", tokens, HASH, vocab)
    assert entry["tokens"] == 10_001 and entry["file"] == "s.bin"
    assert entry["sha256"] == hashlib.sha256((tmp_path / "s.bin").read_bytes()).hexdigest()
    assert (tmp_path / "s.bin").stat().st_size == HEADER_SIZE + 10_001 * itemsize
    got = open_shard(tmp_path / "s.bin", 10_001, HASH)
    assert isinstance(got, np.memmap) and got.dtype.itemsize == itemsize
    assert np.array_equal(got, tokens)
    assert read_header(tmp_path / "s.bin") == (itemsize, 10_001, HASH)
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary left behind


def test_bad_magic(tmp_path):
    write_shard(tmp_path / "s.bin", np.arange(100), HASH, 257)
    raw = bytearray((tmp_path / "s.bin").read_bytes())
    raw[:8] = b"NOTSHARD"
    (tmp_path / "s.bin").write_bytes(bytes(raw))
    with pytest.raises(UserError, match="bad magic"):
        open_shard(tmp_path / "s.bin")
    assert MAGIC == b"GPTRSHRD"


def test_truncated(tmp_path):
    write_shard(tmp_path / "s.bin", np.arange(100), HASH, 257)
    raw = (tmp_path / "s.bin").read_bytes()
    (tmp_path / "s.bin").write_bytes(raw[:-10])
    with pytest.raises(UserError, match="truncated shard .*header says 100 tokens, file holds 95"):
        open_shard(tmp_path / "s.bin")
    (tmp_path / "s.bin").write_bytes(raw[:20])
    with pytest.raises(UserError, match="truncated shard .*shorter than the 64-byte header"):
        open_shard(tmp_path / "s.bin")


def test_wrong_count_and_tokenizer(tmp_path):
    write_shard(tmp_path / "s.bin", np.arange(100), HASH, 257)
    with pytest.raises(UserError, match="holds 100 tokens, the manifest says 99"):
        open_shard(tmp_path / "s.bin", expected_tokens=99)
    with pytest.raises(UserError, match="made with tokenizer"):
        open_shard(tmp_path / "s.bin", tokenizer_hash="0" * 64)


def test_write_refuses_ids_outside_vocab(tmp_path):
    with pytest.raises(UserError, match="outside the vocabulary"):
        write_shard(tmp_path / "s.bin", np.array([1, 2, 257]), HASH, 257)
    assert not list(tmp_path.iterdir())


def test_verify_dir(tmp_path, capsys):
    path, manifest = make_dir(tmp_path, np.arange(500))
    verify_dir(tmp_path)
    assert cli(["prepare", "--verify", str(tmp_path)]) == 0
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1  # same size, same header: only the hash can tell
    path.write_bytes(bytes(raw))
    assert cli(["prepare", "--verify", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "hash mismatch" in err and err.count("\n") == 1 and "Traceback" not in err


def test_verify_catches_ids_outside_vocab(tmp_path):
    make_dir(tmp_path, np.arange(500), vocab=1000)
    manifest = {
        **__import__("json").loads((tmp_path / "manifest.json").read_text()),
        "vocab_size": 300,
    }
    write_manifest(tmp_path, manifest)
    with pytest.raises(UserError, match="token id 499 >= vocabulary size 300"):
        verify_dir(tmp_path)


def test_missing_manifest(tmp_path, capsys):
    assert cli(["prepare", "--verify", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no manifest.json" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "where,bad",
    [
        ("file", "/etc/passwd"),
        ("file", "../outside.bin"),
        ("file", "sub/../../outside.bin"),
        ("index", "../outside.docs.npy"),
        ("parts", "/tmp/part_000000.tok"),
        ("spans", "../train.spans.npy"),
        ("composed_spans", "/abs/train.spans.npy"),
    ],
)
def test_manifest_paths_outside_the_folder_are_refused(tmp_path, capsys, where, bad):
    """A manifest names only files inside its folder: an absolute path or one with `..` is one
    line naming the manifest and the fix, exit 2."""
    _, manifest = make_dir(tmp_path, np.arange(500))
    entry = manifest["shards"][0]
    if where == "file":
        entry["file"] = bad
    elif where == "index":
        entry["index"] = {"file": bad, "documents": 1, "sha256": "0" * 64}
    elif where == "parts":
        manifest["parts"] = [{"file": bad, "tokens": 1, "sha256": "0" * 64}]
    elif where == "spans":
        manifest["spans"] = {"train": {"file": bad, "sha256": "0" * 64}}
    else:
        manifest["shards"].append({"file": "train_000001", "format": "composed", "spans": bad})
    write_manifest(tmp_path, manifest)
    with pytest.raises(UserError, match="is not a path inside the folder"):
        read_manifest(tmp_path)
    assert cli(["prepare", "--verify", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert (
        str(tmp_path / "manifest.json") in err
        and repr(bad) in err
        and "re-run gptrain prepare" in err
    )


def test_llmc_entries_alone_may_name_an_absolute_file(tmp_path):
    """llm.c conversion names the original by its absolute path where it cannot hard-link it."""
    _, manifest = make_dir(tmp_path, np.arange(500))
    original = str((tmp_path / "train_000000.bin").resolve())
    manifest["shards"][0] |= {"file": original, "format": "llmc"}
    write_manifest(tmp_path, manifest)
    assert read_manifest(tmp_path)["shards"][0]["file"] == original
    manifest["shards"][0]["file"] = "../train_000000.bin"  # `..` is refused even there
    write_manifest(tmp_path, manifest)
    with pytest.raises(UserError, match="is not a path inside the folder"):
        read_manifest(tmp_path)
