"""Hugging Face GPT-2 equivalence: same weights give the same logits and loss, both directions.

This is the proof that gptrain's model is GPT-2 exactly. Random weights (no hub download);
every parameter, LayerNorm and biases included, is randomized so each mapping is exercised.
"""

from __future__ import annotations

import pytest
import torch

from gptrain.model.gpt import GPT, PRESETS, GPTConfig
from gptrain.model.hf import config_from_hf, from_hf_state_dict, hf_config_dict, to_hf_state_dict

transformers = pytest.importorskip("transformers")

VOCAB = 100  # padded to 128 on our side


def _hf_config(**kw):
    base = dict(
        n_layer=2, n_head=2, n_embd=64, vocab_size=VOCAB, n_positions=32, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2Config(**{**base, **kw})


def _randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # a tied parameter is visited once
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.dim() == 1 else 0.0))


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (3, 32), generator=g)


def _our_loss_like_hf(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """HF shifts labels inside: logits[:, t] predicts idx[:, t + 1]. Same with targets=-1 last."""
    targets = torch.cat((idx[:, 1:], torch.full_like(idx[:, :1], -1)), dim=1)
    return model(idx, targets)[1]


def test_hf_to_gptrain_same_logits_and_loss():
    hf = transformers.GPT2LMHeadModel(_hf_config()).eval()
    _randomize(hf, seed=0)
    model = from_hf_state_dict(hf.state_dict(), config_from_hf(hf.config)).eval()
    assert model.config.padded_vocab_size == 128
    assert model.lm_head.weight is model.transformer.wte.weight
    idx = _batch()
    with torch.no_grad():
        out = hf(idx, labels=idx)
        logits, _ = model(idx)
        loss = _our_loss_like_hf(model, idx)
    torch.testing.assert_close(logits, out.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(loss, out.loss, rtol=0, atol=1e-5)


@pytest.mark.parametrize("gelu", ["tanh", "erf"])
def test_gptrain_to_hf_same_logits_and_loss(gelu):
    """Both GELUs: tanh is GPT-2's (HF gelu_new), erf the exact one (HF gelu)."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=2, n_embd=64, gelu=gelu)
    model = GPT(config).eval()
    _randomize(model, seed=1)
    hf_config = _hf_config(**hf_config_dict(config, eot_id=0))
    assert hf_config.activation_function == {"tanh": "gelu_new", "erf": "gelu"}[gelu]
    assert config_from_hf(hf_config) == config
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    hf.load_state_dict(to_hf_state_dict(model), strict=True)
    idx = _batch(1)
    with torch.no_grad():
        out = hf(idx, labels=idx)
        logits, _ = model(idx)
        loss = _our_loss_like_hf(model, idx)
    torch.testing.assert_close(out.logits, logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.loss, loss, rtol=0, atol=1e-5)
    # and back again: the same weights (padded rows aside: they are not part of the function)
    back = from_hf_state_dict(hf.state_dict(), model.config).state_dict()
    for k, v in model.state_dict().items():
        rows = VOCAB if k in ("transformer.wte.weight", "lm_head.weight") else None
        torch.testing.assert_close(back[k][:rows], v[:rows], rtol=0, atol=0, msg=k)


def test_greedy_generation_matches_hf():
    hf = transformers.GPT2LMHeadModel(_hf_config()).eval()
    _randomize(hf, seed=2)
    model = from_hf_state_dict(hf.state_dict(), config_from_hf(hf.config)).eval()
    idx = _batch(2)[:, :4]
    ours = model.generate(idx, 20, temperature=0)
    hf_ids = idx
    with torch.no_grad():  # HF reference: plain argmax loop, no cache
        for _ in range(20):
            nxt = hf(hf_ids).logits[:, -1].argmax(-1, keepdim=True)
            hf_ids = torch.cat((hf_ids, nxt), dim=1)
    assert torch.equal(ours, hf_ids)


@pytest.mark.parametrize("name", ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"])
def test_presets_have_hf_gpt2_shapes(name):
    """Each preset has HF GPT-2's parameter count plus the padded vocab rows (meta: no memory)."""
    arch = PRESETS[name]
    hf_cfg = transformers.GPT2Config(**arch)  # vocab 50257, n_positions 1024 by default
    with torch.device("meta"):
        hf = transformers.GPT2LMHeadModel(hf_cfg)
        ours = GPT(GPTConfig(**arch))
    hf_count = sum(p.numel() for p in hf.parameters())
    pad = (ours.config.padded_vocab_size - hf_cfg.vocab_size) * hf_cfg.n_embd
    assert ours.num_params(non_embedding=False) == hf_count + pad
    assert config_from_hf(hf_cfg) == GPTConfig(**arch)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="activation"):
        config_from_hf(_hf_config(activation_function="relu"))
    hf = transformers.GPT2LMHeadModel(_hf_config())
    wrong = GPTConfig(vocab_size=VOCAB + 1, block_size=32, n_layer=2, n_head=2, n_embd=64)
    with pytest.raises(ValueError, match="does not match"):
        from_hf_state_dict(hf.state_dict(), wrong)
    with pytest.raises(ValueError, match="bias"):
        tiny = GPTConfig(vocab_size=VOCAB, block_size=8, n_layer=1, n_head=1, n_embd=8, bias=False)
        to_hf_state_dict(GPT(tiny))
