"""nanochat and Hugging Face: `gptrain export` of a nanochat run is a folder transformers loads
as NanoChatForCausalLM (the same float32 logits, the same greedy text); `gptrain eval` scores a
run and its export alike; a folder transformers' own NanoChatForCausalLM saved starts a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gptrain.__main__ import main as cli
from gptrain.checkpoint import full
from gptrain.checkpoint import manager as checkpoint
from gptrain.data.tokenizers import ByteTokenizer
from gptrain.evals.generate import generate_text
from gptrain.model.arch import build, config_from_dict, config_to_dict

transformers = pytest.importorskip("transformers")

DEBUG = str(Path(__file__).resolve().parents[1] / "configs" / "debug.toml")
HELD_OUT = "KING HENRY: Once more unto the breach, dear friends, once more; or close the wall up."


def save_nanochat_run(run_dir, tokenizer, block_size: int = 64, seed: int = 0):
    """A checkpoint of a small random nanochat (GQA, every weight random: the zero-initialised
    projections too, the untied head at a scale whose softcap bites)."""
    cfg = config_from_dict(
        dict(
            arch="nanochat",
            vocab_size=tokenizer.vocab_size,
            block_size=block_size,
            n_layer=2,
            n_head=4,
            n_kv_head=2,
            n_embd=32,
        )  # fmt: skip
    )
    model = build(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (3.0 if name == "lm_head.weight" else 0.2))
    meta = {"model": config_to_dict(cfg), "tokenizer": tokenizer.identity(), "step": 3}
    full.save(run_dir, 3, model.state_dict(), meta=meta)
    return model


def test_nanochat_export_is_a_folder_transformers_loads_and_agrees_with(tmp_path, capsys):
    tok = ByteTokenizer()
    model = save_nanochat_run(tmp_path / "run", tok)
    out = tmp_path / "hf"
    assert cli(["export", "--run", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert "(Hugging Face NanoChat format)" in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "NanoChatForCausalLM"
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok.encode(HELD_OUT)[:64]
    assert hf_tok(HELD_OUT)["input_ids"][:64] == ids
    idx = torch.tensor([ids])
    with torch.no_grad():
        ours = model(idx)[0]
        assert ours.abs().max() > 10  # the softcap (15) bends these logits
        torch.testing.assert_close(hf(idx).logits.float(), ours, rtol=0, atol=1e-4)
        prompt = torch.tensor([tok.encode("ROMEO:")])
        greedy = hf.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=tok.eot_id)
    text = generate_text(model, tok, "ROMEO:", max_new_tokens=20, temperature=0, top_k=None, num_samples=1, seed=0, device="cpu")[0]  # fmt: skip
    assert hf_tok.decode(greedy[0, prompt.size(1) :]) == text


def test_eval_of_a_nanochat_run_equals_its_export(byte_data, tmp_path, capsys):
    """`gptrain eval --run` and `--hf` of its export: the same val loss and HellaSwag numbers
    (a small HellaSwag file written here)."""
    tok = ByteTokenizer()
    save_nanochat_run(tmp_path / "run", tok)
    assert cli(["export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    rows = [
        {
            "ctx": f"The {w} walked into the",
            "endings": ["room.", "sea of", "tree", "x"],
            "label": i % 4,
        }  # fmt: skip
        for i, w in enumerate(("king", "fool", "queen", "ghost", "nurse", "friar"))
    ]
    hs = tmp_path / "hs.jsonl"
    hs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["--tasks", "val,hellaswag", "--hellaswag", str(hs), "--val-tokens", "4096", "--data", str(byte_data)]  # fmt: skip
    results = []
    for source in (["--run", str(tmp_path / "run")], ["--hf", str(tmp_path / "hf")]):  # fmt: skip
        out = tmp_path / f"eval-{len(results)}.json"
        assert cli(["eval", *source, *common, "--out", str(out)]) == 0
        capsys.readouterr()
        results.append(json.loads(out.read_text()))
    ours, hf = results
    assert ours["hellaswag_examples"] == 6
    for key in ("hellaswag_acc", "hellaswag_acc_norm", "val_loss", "val_bpb"):
        assert hf[key] == pytest.approx(ours[key], rel=1e-5), key


def test_a_transformers_nanochat_folder_starts_a_run_that_resumes(byte_data, tmp_path, capsys):
    """NanoChatForCausalLM.save_pretrained (transformers' own, built here) -> model.init_from:
    the run's step-0 val loss is `gptrain eval --hf`'s of the folder, it trains, and it resumes
    from its checkpoint without the folder."""
    import shutil

    hf_cfg = transformers.NanoChatConfig(
        vocab_size=257, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    folder = tmp_path / "hf"
    transformers.NanoChatForCausalLM(hf_cfg).save_pretrained(folder)
    capsys.readouterr()
    out = tmp_path / "eval.json"
    args = ["--hf", str(folder), "--data", str(byte_data), "--tokenizer", "byte", "--tasks", "val"]
    assert cli(["eval", *args, "--val-tokens", "8192", "--out", str(out)]) == 0
    want = json.loads(out.read_text())["val_loss"]
    run = tmp_path / "run"
    common = ["--config", DEBUG, f"--data.dir={byte_data}", f"--run.dir={run}", "--log.progress=false", "--log.plot=false", "--eval.sample_every=0"]  # fmt: skip
    init = [f"--model.init_from={folder}", "--optim.warmup_steps=1", "--eval.every=2"]
    assert cli(["train", *common, *init, "--train.max_steps=2"]) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert vals[0] == pytest.approx(want, rel=1e-5) and vals[-1] < vals[0]
    shutil.rmtree(folder)
    assert cli(["train", *common, *init, "--train.max_steps=3"]) == 0
    assert "resumed from" in (run / "train.log").read_text()
    assert checkpoint.latest(run).name == "step_00000003"
    assert checkpoint.load_meta(checkpoint.latest(run))["model"]["arch"] == "nanochat"
