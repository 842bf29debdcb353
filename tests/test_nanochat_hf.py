"""NanoChat equals transformers' NanoChatForCausalLM: the same weights give the same logits,
losses, gradients and greedy tokens, both directions, through state dicts and through folders.

Random weights everywhere (no hub download); T = 16 so that the rotary sign between positions
matters; GQA and the softcap each on and off; vocabulary 101 (padded to 128 on our side).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from gptrain.errors import UserError
from gptrain.model.hf import load_hf_folder
from gptrain.model.hf_nanochat import (
    config_from_hf,
    from_hf_state_dict,
    hf_config_dict,
    hf_name,
    to_hf_state_dict,
)
from gptrain.model.nanochat import NanoChat, NanoChatConfig

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True, scope="module")
def _has_nanochat():
    """Asked when the tests run, not at collection: the class's first use imports its modeling
    code (seconds), which a pytest worker that runs none of these tests should not pay."""
    if not hasattr(transformers, "NanoChatForCausalLM"):
        pytest.skip("this transformers has no NanoChatForCausalLM")


VOCAB = 101
VARIANTS = [(4, 15.0), (2, 15.0), (1, 0.0), (4, 0.0)]  # (n_kv_head, softcap)


def _config(n_kv_head: int = 2, softcap: float = 15.0, **kw) -> NanoChatConfig:
    base = dict(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=4, n_embd=64)
    return NanoChatConfig(**{**base, "n_kv_head": n_kv_head, "softcap": softcap, **kw})


def _randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _hf_model(config: NanoChatConfig, seed: int = 0):
    hf = transformers.NanoChatForCausalLM(
        transformers.NanoChatConfig(**hf_config_dict(config, eot_id=0))
    ).eval()
    _randomize(hf, seed)
    return hf


def _batch(seed: int = 0, T: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n_kv_head,softcap", VARIANTS)
def test_hf_to_gptrain_and_back_same_logits(n_kv_head, softcap):
    config = _config(n_kv_head, softcap)
    hf = _hf_model(config)
    assert config_from_hf(hf.config) == config
    model = from_hf_state_dict(hf.state_dict(), config).eval()
    idx = _batch()
    with torch.no_grad():
        want = hf(idx).logits
        logits, _ = model(idx)
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-5)
    assert torch.all(model.lm_head.weight[VOCAB:] == 0)  # padded rows zero-filled
    assert torch.all(model.transformer.wte.weight[VOCAB:] == 0)
    back = to_hf_state_dict(model)
    assert back.keys() == hf.state_dict().keys()
    for k, v in hf.state_dict().items():
        assert torch.equal(back[k], v), k


@pytest.mark.parametrize("n_kv_head,softcap", VARIANTS)
def test_gptrain_to_hf_same_logits(n_kv_head, softcap):
    config = _config(n_kv_head, softcap)
    torch.manual_seed(0)
    model = NanoChat(config).eval()
    _randomize(model, seed=1)
    hf = transformers.NanoChatForCausalLM(
        transformers.NanoChatConfig(**hf_config_dict(config, eot_id=0))
    ).eval()
    hf.load_state_dict(to_hf_state_dict(model), strict=True)
    idx = _batch(1)
    with torch.no_grad():
        logits, _ = model(idx)
        torch.testing.assert_close(hf(idx).logits, logits, rtol=0, atol=1e-5)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16: close, float32 out
            low, _ = model(idx)
    assert low.dtype == torch.float32
    assert (low - logits).abs().max() < 0.1 * logits.abs().max()


@pytest.mark.parametrize("softcap", [15.0, 0.0])
def test_losses_and_gradients_equal_cross_entropy_over_hf_logits(softcap):
    """Chunked (uneven chunks) and full mean losses, and every parameter gradient, equal
    F.cross_entropy over HF's logits and HF's gradients; the per-token losses equal it unreduced."""
    config = _config(2, softcap)
    hf = _hf_model(config, seed=2)
    model = from_hf_state_dict(hf.state_dict(), config)
    idx, targets = _batch(2), _batch(3)
    targets[0, :5] = -1
    hf_logits = hf(idx).logits  # (B, T, V)
    ref = F.cross_entropy(hf_logits.transpose(1, 2), targets, ignore_index=-1)
    ref.backward()
    hf_grads = {k: p.grad for k, p in hf.named_parameters()}
    model.loss_chunk_rows = 7
    for path in ("chunked", "full"):
        model.set_loss(path)
        model.zero_grad(set_to_none=True)
        _, loss = model(idx, targets)
        loss.backward()
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
        for name, p in model.named_parameters():
            g = p.grad[:VOCAB] if name in ("transformer.wte.weight", "lm_head.weight") else p.grad
            torch.testing.assert_close(g, hf_grads[hf_name(name)], rtol=1e-4, atol=1e-5, msg=name)
        assert torch.all(model.lm_head.weight.grad[VOCAB:] == 0)
    with torch.no_grad():
        want = F.cross_entropy(
            hf_logits.transpose(1, 2), targets, ignore_index=-1, reduction="none"
        )
        _, per_token = model(idx, targets, reduction="none")
    torch.testing.assert_close(per_token, want, rtol=1e-5, atol=1e-5)


def test_greedy_generation_matches_hf_generate():
    config = _config(2, 15.0)
    hf = _hf_model(config, seed=4)
    model = from_hf_state_dict(hf.state_dict(), config).eval()
    idx = _batch(4)[:, :4]
    ours = model.generate(idx, 8, temperature=0)
    with torch.no_grad():
        theirs = hf.generate(idx, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, theirs)


def test_save_pretrained_folder_loads_and_exported_folder_loads_in_transformers(tmp_path):
    from safetensors.torch import save_file

    config = _config(2, 15.0)
    hf = _hf_model(config, seed=5)
    hf.save_pretrained(tmp_path / "hf")
    model = load_hf_folder(tmp_path / "hf")
    assert isinstance(model, NanoChat) and model.config == config
    idx = _batch(5)
    with torch.no_grad():
        want = hf(idx).logits
        torch.testing.assert_close(model.eval()(idx)[0], want, rtol=0, atol=1e-5)
    out = tmp_path / "ours"  # what an export writes: config.json + model.safetensors
    out.mkdir()
    (out / "config.json").write_text(json.dumps(hf_config_dict(config, eot_id=0)))
    save_file(to_hf_state_dict(model), str(out / "model.safetensors"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded).__name__ == "NanoChatForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx).logits, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(attention_bias=True), "attention_bias"),
        (dict(tie_word_embeddings=True), "tie_word_embeddings"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(rms_norm_eps=1e-5), "rms_norm_eps"),
        (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), "rope_type"),
        (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_scaling"),
        (dict(head_dim=32), "head_dim"),
        (dict(num_attention_heads=8, hidden_size=72), "odd"),
        (dict(num_key_value_heads=3), "n_kv_head"),
    ],
)
def test_unsupported_hf_configs_are_refused(change, match):
    d = {**hf_config_dict(_config(), eot_id=0), **change}
    with pytest.raises(UserError, match=match):
        config_from_hf(d)


def test_bad_folders_and_state_dicts_are_refused(tmp_path):
    config = _config()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UserError, match="'llama'.*gpt2 and nanochat"):
        load_hf_folder(tmp_path)
    sd = to_hf_state_dict(NanoChat(config))
    with pytest.raises(ValueError, match="does not match"):
        from_hf_state_dict(sd, _config(vocab_size=VOCAB + 1))
    with pytest.raises(ValueError, match="missing.*lm_head"):
        from_hf_state_dict({k: v for k, v in sd.items() if k != "lm_head.weight"}, config)
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(config, eot_id=0)))
    sd.pop("model.layers.1.mlp.fc2.weight")
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(UserError, match="cannot load NanoChat weights.*fc2"):
        load_hf_folder(tmp_path)
