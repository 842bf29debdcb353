"""`gptrain export`: transformers loads the folder as it is, and it computes what gptrain computes.

The model: the same logits and the same greedy continuation. The tokenizer: the same ids as the
run's own tokenizer (byte, GPT-2 against tiktoken on all of tiny shakespeare, a trained BPE).
"""

from __future__ import annotations

import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from gptrain.__main__ import main as cli
from gptrain.checkpoint import full
from gptrain.checkpoint import manager as checkpoint
from gptrain.commands.export import bpe_merges, hf_tokenizer_json
from gptrain.data.tokenizers import ByteTokenizer, load_tokenizer
from gptrain.evals.generate import generate_text
from gptrain.model.gpt import GPT, GPTConfig

transformers = pytest.importorskip("transformers")

TRICKY = [
    "ROMEO: But soft! what light through yonder window breaks?\n\n  It is the east.",
    "naïve café — ünïcödé, 東京, emoji 🙂🙃, tabs\tand  double  spaces   ",
    "numbers 12345 67.89 1e-5 and 'contractions' don't won't I'll we've they're",
    "",
]


def _eot_splits(tok, encode) -> None:
    """The exported tokenizer reads the literal end-of-text text as the special id, as HF does."""
    assert encode("a<|endoftext|>b") == [*tok.encode("a"), tok.eot_id, *tok.encode("b")]


def _save_run(run_dir, tokenizer, seed: int = 0) -> GPT:
    """A checkpoint of a small random model (every parameter randomised, LayerNorms included)."""
    cfg = GPTConfig(vocab_size=tokenizer.vocab_size, block_size=64, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(seed)
    model = GPT(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    meta = {"model": asdict(cfg), "tokenizer": tokenizer.identity(), "step": 7}
    full.save(run_dir, 7, model.state_dict(), meta=meta)
    return model


def test_byte_run_exports_a_folder_transformers_loads_and_agrees_with(tmp_path, capsys):
    tok = ByteTokenizer()
    model = _save_run(tmp_path / "run", tok)
    out = tmp_path / "hf"
    assert cli(["export", "--run", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    for text in TRICKY:
        ids = tok.encode(text)
        assert hf_tok(text)["input_ids"] == ids, text
        assert hf_tok.decode(ids) == text
    assert hf_tok.eos_token_id == tok.eot_id == hf.config.eos_token_id
    _eot_splits(tok, lambda t: hf_tok(t)["input_ids"])
    idx = torch.tensor([tok.encode(TRICKY[0])[:64]])
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx)[0], rtol=0, atol=1e-4)
        prompt = torch.tensor([tok.encode("ROMEO:")])
        hf_greedy = hf.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=tok.eot_id)
    ours = generate_text(model, tok, "ROMEO:", max_new_tokens=20, temperature=0, top_k=None, num_samples=1, seed=0, device="cpu")[0]  # fmt: skip
    assert hf_tok.decode(hf_greedy[0, prompt.size(1) :]) == ours


def test_gpt2_tokenizer_export_equals_tiktoken_on_all_of_tiny_shakespeare(
    gpt2_env, shakespeare_txt
):
    from tokenizers import Tokenizer as HFTokenizer

    tok = load_tokenizer("gpt2")
    hf_tok = HFTokenizer.from_str(hf_tokenizer_json(tok))
    text = shakespeare_txt.read_text(encoding="utf-8")
    assert hf_tok.encode(text, add_special_tokens=False).ids == tok.encode(text)
    for t in TRICKY:
        assert hf_tok.encode(t, add_special_tokens=False).ids == tok.encode(t), t
        assert hf_tok.decode(tok.encode(t)) == t
    assert hf_tok.token_to_id("<|endoftext|>") == tok.eot_id == 50256
    _eot_splits(tok, lambda t: hf_tok.encode(t, add_special_tokens=False).ids)
    assert hf_tok.get_vocab_size() == 50257


def test_merges_rebuilt_from_ranks_follow_rank_order():
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"bc": 4, b"abc": 5}
    assert bpe_merges(ranks) == [(b"a", b"b"), (b"b", b"c"), (b"a", b"bc"), (b"ab", b"c")]


def test_bpe_run_exports_its_own_tokenizer(tmp_path, shakespeare_txt):
    from gptrain.data.tokenizers import train_bpe

    text = shakespeare_txt.read_text(encoding="utf-8")[:200_000]
    tok = train_bpe([text], 400, tmp_path / "tok.json")
    _save_run(tmp_path / "run", tok)
    (tmp_path / "tok.json").unlink()  # the checkpoint keeps its own copy
    assert cli(["export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    sample = text[:5000]
    assert hf_tok(sample)["input_ids"] == tok.encode(sample)


def test_bad_input_is_one_line_and_nothing_is_overwritten(tmp_path, capsys):
    _save_run(tmp_path / "run", ByteTokenizer())
    out = tmp_path / "existing"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert cli(["export", "--run", str(tmp_path / "run"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already exists" in err[0]
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert cli(["export", "--run", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli(["export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "y"), "--step", "3"]) == 2  # fmt: skip
    assert "no checkpoint for step 3" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_training_can_start_from_an_exported_folder(byte_data, tmp_path, capsys):
    """Round trip: train, export, start a new run from the export. The new run's step-0 validation
    loss is the first run's final one: the same function, imported exactly."""
    import json

    debug = str(Path(__file__).resolve().parents[1] / "configs" / "debug.toml")
    common = [f"--data.dir={byte_data}", "--log.progress=false", "--log.plot=false", "--eval.sample_every=0"]  # fmt: skip
    first, second, hf_dir = tmp_path / "first", tmp_path / "second", tmp_path / "hf"
    assert cli(["train", "--config", debug, f"--run.dir={first}", "--train.max_steps=8", *common]) == 0  # fmt: skip
    assert cli(["export", "--run", str(first), "--out", str(hf_dir)]) == 0
    init = [f"--run.dir={second}", f"--model.init_from={hf_dir}", "--train.max_steps=2", "--optim.warmup_steps=1"]  # fmt: skip
    assert cli(["train", "--config", debug, *init, *common]) == 0

    def val_losses(run_dir):
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [r["val_loss"] for r in rows if "val_loss" in r]

    assert val_losses(second)[0] == pytest.approx(val_losses(first)[-1], rel=1e-6)
    assert val_losses(second)[0] < 0.9 * val_losses(first)[0]  # far from an untrained model
    shutil.rmtree(hf_dir)  # resuming needs only the run's checkpoint, not the pretrained folder
    longer = [arg.replace("max_steps=2", "max_steps=3") for arg in init]
    assert cli(["train", "--config", debug, *longer, *common]) == 0
    assert "resumed from" in (second / "train.log").read_text()
    assert checkpoint.latest(second).name == "step_00000003"


def test_init_from_refuses_mismatched_or_missing_weights(byte_data, tmp_path, capsys):
    debug = str(Path(__file__).resolve().parents[1] / "configs" / "debug.toml")
    big_vocab = tmp_path / "gpt2-vocab"  # a GPT-2-tokenizer model cannot read byte-level data
    cfg = GPTConfig(vocab_size=50257, block_size=64, n_layer=1, n_head=2, n_embd=32)
    hf = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=50257, n_positions=64, n_layer=1, n_head=2, n_embd=32)
    )
    hf.save_pretrained(big_vocab)
    capsys.readouterr()  # transformers' own progress output
    assert cfg.vocab_size == hf.config.vocab_size
    for folder, needle in [
        (big_vocab, "has vocab 50257 and context 64, but the data's tokenizer has vocab 257"),
        (tmp_path / "missing", "cannot read"),
    ]:
        args = ["train", "--config", debug, f"--data.dir={byte_data}", f"--run.dir={tmp_path / 'r'}", f"--model.init_from={folder}"]  # fmt: skip
        assert cli(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "r").exists()


def test_init_from_refusals_name_the_folders_block(byte_data, tmp_path, capsys):
    """A GPT-2 folder with model.bias = false (its weights have biases); a NanoChat folder using
    a feature the block lacks; a model_type neither gpt2 nor nanochat: one line, exit 2, no run."""
    import json

    debug = str(Path(__file__).resolve().parents[1] / "configs" / "debug.toml")
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=257, n_positions=64, n_layer=1, n_head=2, n_embd=32)
    ).save_pretrained(gpt2)
    gelu = tmp_path / "nanochat-gelu"
    transformers.NanoChatForCausalLM(
        transformers.NanoChatConfig(
            vocab_size=257,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=64,
        )  # fmt: skip
    ).save_pretrained(gelu)
    raw = json.loads((gelu / "config.json").read_text())
    (gelu / "config.json").write_text(json.dumps({**raw, "hidden_act": "gelu"}))
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    capsys.readouterr()
    for folder, extra, needle in [
        (
            gpt2,
            ["--model.bias=false"],
            "which have biases, but model.bias = false; drop --model.bias=false",
        ),
        (gelu, [], "hidden_act='gelu' is not supported"),
        (llama, [], "holds a 'llama' model"),
    ]:
        args = ["train", "--config", debug, f"--data.dir={byte_data}", f"--run.dir={tmp_path / 'r'}", f"--model.init_from={folder}", *extra]  # fmt: skip
        assert cli(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "r").exists()
