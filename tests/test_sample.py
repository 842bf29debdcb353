"""Sampling from a saved run: loading, determinism, greedy == argmax, the CLI and its errors."""

from __future__ import annotations

import pytest
import torch

from gptrain.__main__ import main as cli
from gptrain.checkpoint import full
from gptrain.data.tokenizers import ByteTokenizer
from gptrain.errors import UserError
from gptrain.evals.generate import generate_text, load_model
from gptrain.model.arch import build, config_from_dict, config_to_dict
from gptrain.model.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=257, block_size=32, n_layer=2, n_head=2, n_embd=32)
# nanochat: 4 query heads reading 2 key/value heads (the cache holds the 2)
NANOCHAT = dict(arch="nanochat", vocab_size=257, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)  # fmt: skip


def _model(seed: int, arch: str = "gpt2"):
    torch.manual_seed(seed)
    if arch == "gpt2":
        model = GPT(CFG).eval()
        with torch.no_grad():  # a sharper distribution: greedy decisions by clear margins
            model.transformer.wte.weight.mul_(30)
        return model
    model = build(config_from_dict(NANOCHAT)).eval()
    with torch.no_grad():  # the zero-initialised projections too: every block reads the context
        for name, p in model.named_parameters():
            p.normal_(0.0, 1.0 if name == "lm_head.weight" else 0.2)
    return model


def _save(run_dir, step: int, model) -> None:
    meta = {"model": config_to_dict(model.config), "tokenizer": ByteTokenizer().identity()}
    full.save(run_dir, step, model.state_dict(), meta=meta)


@pytest.fixture(params=["gpt2", "nanochat"])
def run(tmp_path, request):
    """A run of each block with checkpoints at steps 1 and 2 (different weights); returns (dir,
    models)."""
    models = {1: _model(1, request.param), 2: _model(2, request.param)}
    for step, model in models.items():
        _save(tmp_path, step, model)
    return tmp_path, models


def _argmax_continuation(model: GPT, ids: list[int], n: int) -> list[int]:
    """Reference greedy decoding: full forward each step, no cache."""
    idx = torch.tensor([ids])
    for _ in range(n):
        logits, _ = model(idx[:, -model.config.block_size :])
        idx = torch.cat((idx, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    return idx[0, len(ids) :].tolist()


def test_load_model_latest_and_by_step(run):
    run_dir, models = run
    idx = torch.randint(0, 257, (2, 16))
    for step, want in ((None, models[2]), (1, models[1]), (2, models[2])):
        model, tok, meta = load_model(run_dir, step)
        assert meta["step"] == (step or 2) and tok.vocab_size == 257
        tied = model.lm_head.weight is model.transformer.wte.weight
        assert tied == (model.arch == "gpt2") and model.arch == want.arch  # never re-tied
        torch.testing.assert_close(model.lm_head.weight, want.lm_head.weight, rtol=0, atol=0)
        assert not model.training
        torch.testing.assert_close(model(idx)[0], want(idx)[0], rtol=0, atol=0)


def test_greedy_equals_argmax_continuation_past_block_size(run):
    run_dir, models = run
    model, tok, _ = load_model(run_dir)
    prompt = "To be, or not"
    (text,) = generate_text(
        model, tok, prompt, max_new_tokens=40, temperature=0, top_k=None, num_samples=1, seed=0,
        device="cpu",
    )  # fmt: skip
    assert text == tok.decode(_argmax_continuation(models[2], tok.encode(prompt), 40))


def test_empty_prompt_starts_from_eot(run):
    run_dir, models = run
    model, tok, _ = load_model(run_dir)
    kw = dict(max_new_tokens=10, temperature=0, top_k=None, num_samples=1, seed=0, device="cpu")
    (text,) = generate_text(model, tok, "", **kw)
    assert text == tok.decode(_argmax_continuation(models[2], [tok.eot_id], 10))


def test_sampling_is_deterministic_with_a_seed_and_restores_mode():
    torch.manual_seed(0)
    model, tok = GPT(CFG).train(), ByteTokenizer()  # random init: a broad distribution
    kw = dict(max_new_tokens=30, temperature=1.0, top_k=50, num_samples=3, device="cpu")
    rng_before = torch.random.get_rng_state()
    a = generate_text(model, tok, "ab", seed=5, **kw)
    b = generate_text(model, tok, "ab", seed=5, **kw)
    c = generate_text(model, tok, "ab", seed=6, **kw)
    assert len(a) == 3 and a == b and a != c
    assert len(set(a)) > 1  # the samples of one call differ from each other
    assert model.training  # mode restored
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # global RNG untouched


def test_cli_prints_prompt_and_greedy_continuation(run, capsys):
    run_dir, models = run
    argv = ["sample", "--run", str(run_dir), "--prompt", "Hi", "--temperature", "0"]
    assert cli([*argv, "--max-new-tokens", "12", "--step", "1"]) == 0
    out = capsys.readouterr().out
    tok = ByteTokenizer()
    assert out == "Hi" + tok.decode(_argmax_continuation(models[1], tok.encode("Hi"), 12)) + "\n"


def test_cli_num_samples(run, capsys):
    run_dir, _ = run
    assert (
        cli(["sample", "--run", str(run_dir), "--num-samples", "2", "--max-new-tokens", "5"]) == 0
    )
    out = capsys.readouterr().out
    assert out.count("--- sample ") == 2 and "(step 2)" in out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--temperature", "-0.5"], "--temperature"),
        (["--top-k", "0"], "--top-k"),
        (["--num-samples", "0"], "--num-samples"),
        (["--step", "7"], "no checkpoint for step 7"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(run, capsys, extra, message):
    run_dir, _ = run
    assert cli(["sample", "--run", str(run_dir), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gptrain: error: ") and message in err and err.count("\n") == 1


def test_missing_run_dir_and_run_without_checkpoint(tmp_path, capsys):
    assert cli(["sample", "--run", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(UserError, match="no checkpoint"):
        load_model(tmp_path)


def test_generate_text_accepts_ddp_and_fsdp2_wrapped_models(one_process_group):
    """The trainer passes its wrapped model; one-process gloo group, same text as unwrapped."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    tok = ByteTokenizer()
    kw = dict(max_new_tokens=12, temperature=1.0, top_k=None, num_samples=2, seed=3)
    want = generate_text(_model(0), tok, "xy", device="cpu", **kw)
    ddp = DistributedDataParallel(_model(0))
    assert generate_text(ddp, tok, "xy", device="cpu", **kw) == want
    sharded = _model(0)
    for block in sharded.transformer.h:
        block.compile()  # as the trainer does under FSDP; generation runs eagerly
        fully_shard(block)
    fully_shard(sharded)
    assert generate_text(sharded, tok, "xy", device="cpu", **kw) == want
    assert generate_text(sharded, tok, "xy", device="cpu", **kw) == want  # hook added once
