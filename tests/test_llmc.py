"""llm.c GPT-2 shards in and out: imported shards train on the same windows as gptrain's own copy of
the same text; gptrain -> llm.c -> gptrain is identical; bad shards are one line, exit 2."""

import json
from pathlib import Path

import numpy as np
import pytest

from gptrain.__main__ import main as cli
from gptrain.data import convert
from gptrain.data.loader import Dataset, TrainLoader, val_batches
from gptrain.data.shards import open_entry, read_index, verify_dir

EOT = 50256


def reference_encoding(gpt2_dir: Path):
    """GPT-2 BPE built with tiktoken straight from OpenAI's files (not through gptrain)."""
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(gpt2_dir / "vocab.bpe"), encoder_json_file=str(gpt2_dir / "encoder.json")
    )
    pat = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
    return tiktoken.Encoding(
        name="gpt2-ref",
        pat_str=pat,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT},
        explicit_n_vocab=50257,
    )


def llmc_write(path: Path, tokens) -> None:
    """llm.c's dev/data/data_common.py write_datafile, re-stated: 256 int32 header, uint16 tokens."""
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = 20240520, 1, len(tokens)
    path.write_bytes(header.tobytes() + np.array(tokens, dtype=np.uint16).tobytes())


def llmc_read(path: Path) -> np.ndarray:
    """llm.c's train_gpt2.py _peek_data_shard/_load_data_shard, re-stated, plus the C loader's
    size check."""
    raw = path.read_bytes()
    header = np.frombuffer(raw[:1024], dtype=np.int32)
    assert header[0] == 20240520 and header[1] == 1
    ntok = int(header[2])
    tokens = np.frombuffer(raw[1024:], dtype=np.uint16)
    assert len(tokens) == ntok and len(raw) == 1024 + 2 * ntok
    return tokens


def run_cli(capsys, *args):
    code = cli(["prepare", "--no-progress", *map(str, args)])
    return code, capsys.readouterr().err


def stream(folder, steps=150, seq_len=64, batch=4):
    loader = TrainLoader(Dataset(folder), seq_len, batch, 0, 1, seed=5)
    out = [loader.next_batch()[0].numpy() for _ in range(steps)]
    loader.close()
    return np.concatenate(out), loader.windows_per_epoch


def shard_tokens(folder, split):
    ds = Dataset(folder)
    return [np.asarray(s) for s in ds.shards[split]]


def indexes(folder):
    m = json.loads((Path(folder) / "manifest.json").read_text())
    return [read_index(folder, e).tolist() for e in m["shards"]]


def test_imported_shards_train_like_a_prepared_copy(shakespeare_txt, gpt2_env, tmp_path, capsys):
    text = shakespeare_txt.read_text()
    cut = int(len(text) * 0.9)
    docs = tmp_path / "docs"
    docs.mkdir()
    bounds = [0, 300_000, 650_000, cut]
    for i in range(3):
        (docs / f"{i}.txt").write_text(text[bounds[i] : bounds[i + 1]])
    (tmp_path / "val.txt").write_text(text[cut:])
    code, err = run_cli(capsys, "--input", docs, "--val-input", tmp_path / "val.txt", "--out", tmp_path / "ours", "--tokenizer", "gpt2", "--no-shuffle", "--shard-tokens", 100_000, "--workers", 2)  # fmt: skip
    assert code == 0, err
    # the same text as llm.c shards, made without gptrain: tiktoken + llm.c's writer, same cuts
    enc = reference_encoding(gpt2_env)
    train = []
    for i in range(3):
        train += ([EOT] if i else []) + enc.encode_ordinary(text[bounds[i] : bounds[i + 1]])
    llm = tmp_path / "llmc"
    llm.mkdir()
    for s in range(0, len(train), 100_000):
        llmc_write(llm / f"x_train_{s // 100_000:06d}.bin", train[s : s + 100_000])
    llmc_write(llm / "x_val_000000.bin", enc.encode_ordinary(text[cut:]))
    code, err = run_cli(capsys, "--input", f"{llm}/*train*.bin", "--val-input", f"{llm}/*val*.bin", "--out", tmp_path / "imported")  # fmt: skip
    assert code == 0, err
    m = json.loads((tmp_path / "imported" / "manifest.json").read_text())
    assert m["tokenizer"]["name"] == "gpt2" and {e["format"] for e in m["shards"]} == {"llmc"}
    assert m["splits"]["train"]["tokens"] == len(train) and m["splits"]["train"]["documents"] == 3
    assert len(shard_tokens(tmp_path / "imported", "train")) == 4
    for split in ("train", "val"):
        a, b = shard_tokens(tmp_path / "ours", split), shard_tokens(tmp_path / "imported", split)
        assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    ours, imported = stream(tmp_path / "ours"), stream(tmp_path / "imported")
    assert ours[1] == imported[1] and np.array_equal(ours[0], imported[0])
    va = list(val_batches(Dataset(tmp_path / "ours"), 64, 4, 4096, 0, 1))
    vb = list(val_batches(Dataset(tmp_path / "imported"), 64, 4, 4096, 0, 1))
    assert all((x == y).all() for p, q in zip(va, vb, strict=True) for x, y in zip(p, q, strict=True))  # fmt: skip
    assert indexes(tmp_path / "ours") == indexes(tmp_path / "imported")
    verify_dir(tmp_path / "imported")


def test_round_trip_gptrain_llmc_gptrain(gpt2_env, tmp_path, capsys):
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "the", "of", "and", "\n"]
    docs = tmp_path / "a.jsonl"
    rows = [" ".join(rng.choice(words, size=int(rng.integers(5, 400)))) for _ in range(300)]
    docs.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    code, err = run_cli(capsys, "--input", docs, "--out", tmp_path / "a", "--tokenizer", "gpt2", "--shard-tokens", 7000)  # fmt: skip
    assert code == 0, err
    code, err = run_cli(capsys, "--export-llmc", tmp_path / "a", "--out", tmp_path / "e")
    assert code == 0, err
    files = sorted(p.name for p in (tmp_path / "e").iterdir())
    a = {s: shard_tokens(tmp_path / "a", s) for s in ("train", "val")}
    assert len(a["train"]) >= 3 and len(a["val"]) >= 1
    assert files == [f"{s}_{i:06d}.bin" for s in a for i in range(len(a[s]))]
    for split, shards in a.items():  # llm.c's own reader accepts them, tokens as they were
        for i, tokens in enumerate(shards):
            assert np.array_equal(llmc_read(tmp_path / "e" / f"{split}_{i:06d}.bin"), tokens)
    code, err = run_cli(capsys, "--input", tmp_path / "e" / "train_*.bin", "--val-input", tmp_path / "e" / "val_*.bin", "--out", tmp_path / "b")  # fmt: skip
    assert code == 0, err
    b = {s: shard_tokens(tmp_path / "b", s) for s in ("train", "val")}
    for split in a:
        assert len(a[split]) == len(b[split])
        assert all(np.array_equal(x, y) for x, y in zip(a[split], b[split], strict=True))
    assert indexes(tmp_path / "a") == indexes(tmp_path / "b")
    ma, mb = (json.loads((tmp_path / f / "manifest.json").read_text()) for f in "ab")
    assert [ma["splits"][s]["tokens"] for s in a] == [mb["splits"][s]["tokens"] for s in a]
    assert [ma["splits"][s]["documents"] for s in a] == [mb["splits"][s]["documents"] for s in a]
    assert stream(tmp_path / "a", 40, 32)[0].tolist() == stream(tmp_path / "b", 40, 32)[0].tolist()
    code, err = run_cli(capsys, "--export-llmc", tmp_path / "b", "--out", tmp_path / "e2")
    assert code == 0, err
    for f in files:
        assert (tmp_path / "e" / f).read_bytes() == (tmp_path / "e2" / f).read_bytes()


def test_not_linked_then_referenced_and_verified(tmp_path, monkeypatch, capsys):
    tokens = np.arange(5000) % 50257
    llmc_write(tmp_path / "t.bin", tokens)
    llmc_write(tmp_path / "v.bin", tokens[:900])

    def no_link(*a, **k):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(convert.os, "link", no_link)
    code, err = run_cli(capsys, "--input", tmp_path / "t.bin", "--val-input", tmp_path / "v.bin", "--out", tmp_path / "d")  # fmt: skip
    assert code == 0, err
    m = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert m["shards"][0]["file"] == str((tmp_path / "t.bin").resolve())
    assert not list((tmp_path / "d").glob("*.bin"))  # nothing copied
    assert np.array_equal(open_entry(tmp_path / "d", m["shards"][0]), tokens)
    assert cli(["prepare", "--verify", str(tmp_path / "d")]) == 0
    raw = bytearray((tmp_path / "t.bin").read_bytes())
    raw[-1] ^= 1  # same size: only the hash can tell
    (tmp_path / "t.bin").write_bytes(bytes(raw))
    capsys.readouterr()
    assert cli(["prepare", "--verify", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "hash mismatch" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "case,message",
    [
        ("truncated", "header says 1000 tokens, the file holds 990"),
        ("short", "shorter than llm.c's 1024-byte header"),
        ("foreign", "expected llm.c's GPT-2 magic 20240520: not an llm.c token shard"),
        ("llama3", "is an llm.c LLaMA-3 shard"),
        ("version", "llm.c shard version 2"),
        ("big_id", "token id 60000 >= GPT-2's vocabulary size 50257"),
        ("mixed", "mixed llm.c shards and text inputs"),
        ("mixed_val", "mixed llm.c shards and text inputs"),
        ("tokenizer", "--tokenizer byte: llm.c shards hold GPT-2 tokens"),
        ("no_val", "pass --val-input"),
    ],
)
def test_bad_llmc_input_one_line(tmp_path, capsys, case, message):
    good = np.arange(1000) % 50000
    llmc_write(tmp_path / "train.bin", good)
    llmc_write(tmp_path / "val.bin", good[:300])
    (tmp_path / "a.txt").write_text("some text\n" * 50)
    args = ["--input", tmp_path / "train.bin", "--val-input", tmp_path / "val.bin"]
    raw = (tmp_path / "train.bin").read_bytes()
    header = np.frombuffer(raw[:1024], dtype=np.int32).copy()
    if case == "truncated":
        (tmp_path / "train.bin").write_bytes(raw[:-20])
    elif case == "short":
        (tmp_path / "train.bin").write_bytes(raw[:100])
    elif case == "foreign":
        (tmp_path / "train.bin").write_bytes(b"\x7fELF" + bytes(3000))
    elif case in ("llama3", "version"):
        header[0 if case == "llama3" else 1] = 20240801 if case == "llama3" else 2
        (tmp_path / "train.bin").write_bytes(header.tobytes() + raw[1024:])
    elif case == "big_id":
        llmc_write(tmp_path / "train.bin", np.full(1000, 60000))
    elif case == "mixed":
        args = ["--input", tmp_path / "train.bin", tmp_path / "a.txt", "--val-input", tmp_path / "val.bin"]  # fmt: skip
    elif case == "mixed_val":
        args[3] = tmp_path / "a.txt"
    elif case == "tokenizer":
        args += ["--tokenizer", "byte"]
    elif case == "no_val":
        args = args[:2]
    code, err = run_cli(capsys, *args, "--out", tmp_path / "out")
    assert code == 2 and message in err, err
    assert err.count("\n") == 1 and err.startswith("gptrain: error: ") and "Traceback" not in err
    if case in ("truncated", "short", "foreign", "llama3", "version", "big_id"):
        assert str(tmp_path / "train.bin") in err  # names the file
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_export_refuses_other_tokenizers(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("byte level text\n" * 100)
    assert run_cli(capsys, "--input", tmp_path / "a.txt", "--out", tmp_path / "d")[0] == 0
    code, err = run_cli(capsys, "--export-llmc", tmp_path / "d", "--out", tmp_path / "e")
    assert code == 2 and "made with tokenizer 'byte'" in err and err.count("\n") == 1
    assert not (tmp_path / "e").exists()
