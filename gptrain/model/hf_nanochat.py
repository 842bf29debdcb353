"""Hugging Face NanoChat interop without the hub: NanoChat <-> transformers' NanoChatForCausalLM.

    cfg = hf_config_dict(model.config, eot_id)    # its config.json
    sd = to_hf_state_dict(model)                  # model.safetensors
    model = from_hf_state_dict(hf.state_dict(), config_from_hf(hf.config))

The weights map by name only (no transposes, nothing tied):
  transformer.wte                      <-> model.embed_tokens
  transformer.h.{i}.attn.c_q/c_k/c_v   <-> model.layers.{i}.self_attn.q_proj/k_proj/v_proj
  transformer.h.{i}.attn.c_proj        <-> model.layers.{i}.self_attn.o_proj
  transformer.h.{i}.mlp.c_fc/c_proj    <-> model.layers.{i}.mlp.fc1/fc2
  lm_head                              <-> lm_head
wte and lm_head have `padded_vocab_size` rows here and `vocab_size` in HF: the padded rows of each
are dropped on export and zero-filled on import. transformers itself is not needed here.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gptrain.errors import UserError
from gptrain.model.nanochat import NORM_EPS, NanoChat, NanoChatConfig

_LAYER_MAP = {
    "attn.c_q.weight": "self_attn.q_proj.weight",
    "attn.c_k.weight": "self_attn.k_proj.weight",
    "attn.c_v.weight": "self_attn.v_proj.weight",
    "attn.c_proj.weight": "self_attn.o_proj.weight",
    "mlp.c_fc.weight": "mlp.fc1.weight",
    "mlp.c_proj.weight": "mlp.fc2.weight",
}
_PADDED = {
    "transformer.wte.weight": "model.embed_tokens.weight",
    "lm_head.weight": "lm_head.weight",
}

# NanoChatConfig's (transformers) defaults, for config.json files that leave a field out
HF_NANOCHAT_DEFAULTS = {
    "vocab_size": 50304,
    "hidden_size": 768,
    "intermediate_size": 8192,
    "num_hidden_layers": 12,
    "num_attention_heads": 6,
    "num_key_value_heads": None,
    "max_position_embeddings": 2048,
    "hidden_act": "relu2",
    "rms_norm_eps": 1e-6,
    "final_logit_softcapping": 15.0,
    "attention_bias": False,
    "tie_word_embeddings": False,
}


def hf_name(name: str) -> str:
    """Our parameter name -> transformers NanoChatForCausalLM's."""
    if name in _PADDED:
        return _PADDED[name]
    prefix, _, rest = name.partition(".h.")
    layer, _, suffix = rest.partition(".")
    if prefix != "transformer" or suffix not in _LAYER_MAP:
        raise KeyError(f"no Hugging Face name for {name!r}")
    return f"model.layers.{layer}.{_LAYER_MAP[suffix]}"


def hf_config_dict(config: NanoChatConfig, eot_id: int) -> dict:
    """The config.json of a transformers NanoChatForCausalLM with this architecture."""
    return {
        "architectures": ["NanoChatForCausalLM"],
        "model_type": "nanochat",
        "vocab_size": config.vocab_size,  # unpadded: HF has no padding rows
        "hidden_size": config.n_embd,
        "intermediate_size": config.hidden,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.kv_heads,
        "max_position_embeddings": config.block_size,
        "hidden_act": "relu2",
        "rms_norm_eps": NORM_EPS,
        # transformers 5 reads rope_parameters; rope_theta is its legacy spelling (4.x)
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "rope_theta": config.rope_theta,
        "final_logit_softcapping": config.softcap or None,
        "attention_dropout": config.dropout,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "pad_token_id": eot_id,
        "torch_dtype": "float32",
    }


def _get(c, key: str):
    """A field of a config dict or object, transformers' default when absent."""
    if isinstance(c, dict):
        return c.get(key, HF_NANOCHAT_DEFAULTS.get(key))
    return getattr(c, key, HF_NANOCHAT_DEFAULTS.get(key))


def _refuse(key: str, value, fix: str) -> UserError:
    return UserError(f"Hugging Face NanoChat config {key}={value!r} is not supported: {fix}")


def _rope_theta(c) -> float:
    """rope_parameters' (or the legacy rope_theta's) theta; any other rope type (there, or in
    the legacy rope_scaling, which transformers 5 reads as rope_parameters) refused."""
    for key in ("rope_scaling", "rope_parameters"):
        rope = _get(c, key) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise _refuse(f"{key}.rope_type", rope_type, "only the default rope loads")
    rope = _get(c, "rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", _get(c, "partial_rotary_factor"))
    if factor not in (None, 1, 1.0):
        raise _refuse("partial_rotary_factor", factor, "only full-width rotary (1.0) loads")
    return float(rope.get("rope_theta") or _get(c, "rope_theta") or 10000.0)


def config_from_hf(hf_config, dropout: float = 0.0) -> NanoChatConfig:
    """NanoChatConfig of a transformers NanoChatConfig (object, or its config.json dict),
    refusing what this model does not implement (UserError naming the key and the fix)."""
    c = hf_config
    checks = (
        ("hidden_act", "relu2", "the MLP is relu(x)^2 (relu2)"),
        ("attention_bias", False, "the model has no biases: attention_bias must be false"),
        ("tie_word_embeddings", False, "lm_head is untied: tie_word_embeddings must be false"),
    )
    for key, want, fix in checks:
        if _get(c, key) != want:
            raise _refuse(key, _get(c, key), fix)
    eps = _get(c, "rms_norm_eps")
    if not math.isclose(eps, NORM_EPS, rel_tol=1e-9):
        raise _refuse("rms_norm_eps", eps, f"the RMSNorm eps is {NORM_EPS}")
    hidden, heads = _get(c, "hidden_size"), _get(c, "num_attention_heads")
    head_dim = _get(c, "head_dim")
    if head_dim is not None and head_dim * heads != hidden:
        raise _refuse("head_dim", head_dim, "head_dim must be hidden_size / num_attention_heads")
    kv = _get(c, "num_key_value_heads") or heads
    inner = _get(c, "intermediate_size")
    cap = _get(c, "final_logit_softcapping")
    try:
        return NanoChatConfig(
            vocab_size=_get(c, "vocab_size"),
            block_size=_get(c, "max_position_embeddings"),
            n_layer=_get(c, "num_hidden_layers"),
            n_head=heads,
            n_kv_head=kv,
            n_embd=hidden,
            mlp_hidden=inner,
            softcap=float(cap or 0.0),
            rope_theta=_rope_theta(c),
            dropout=dropout,
        )
    except ValueError as e:
        raise UserError(f"Hugging Face NanoChat config: {e}") from None


def to_hf_state_dict(model: NanoChat) -> dict[str, Tensor]:
    """State dict for transformers' NanoChatForCausalLM (copies; padded vocab rows dropped)."""
    V = model.config.vocab_size
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach()
        if name in _PADDED:
            t = t[:V]  # (V, C)
        out[hf_name(name)] = t.contiguous().clone()
    return out


def from_hf_state_dict(sd: dict[str, Tensor], config: NanoChatConfig) -> NanoChat:
    """A NanoChat holding the weights of a NanoChatForCausalLM state dict (padded rows zero).
    Weights load as float32. A missing or extra weight, or a wrong shape, is a ValueError."""
    with torch.device("meta"):  # no random init: every weight comes from sd
        model = NanoChat(config)
    sd = {k: v for k, v in sd.items() if ".rotary_emb." not in k}
    state, wanted = {}, {hf_name(n): (n, p.shape) for n, p in model.named_parameters()}
    missing = sorted(set(wanted) - set(sd))
    extra = sorted(set(sd) - set(wanted))
    if missing or extra:
        raise ValueError(f"NanoChat weights: missing {missing[:3]}, unexpected {extra[:3]}")
    for key, (name, shape) in wanted.items():
        t = sd[key].detach()
        if name in _PADDED:
            if t.shape != (config.vocab_size, config.n_embd):
                raise ValueError(
                    f"HF {key} {tuple(t.shape)} does not match "
                    f"vocab_size={config.vocab_size}, n_embd={config.n_embd}"
                )
            padded = t.new_zeros(shape)  # (padded V, C)
            padded[: config.vocab_size] = t
            t = padded
        elif t.shape != shape:
            raise ValueError(f"HF {key} {tuple(t.shape)} does not match {tuple(shape)}")
        state[name] = t.float().contiguous().clone() if t.is_floating_point() else t
    model.load_state_dict(state, assign=True, strict=True)
    return model
