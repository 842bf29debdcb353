"""Hugging Face GPT-2 interop without the hub: convert state dicts both ways (NanoChat's: see
hf_nanochat.py; load_hf_folder reads either).

    sd = to_hf_state_dict(model)                  # load into transformers' GPT2LMHeadModel
    cfg = hf_config_dict(model.config, eot_id)    # its config.json (see gptrain/commands/export.py)
    model = from_hf_state_dict(hf.state_dict(), config_from_hf(hf.config))
    model = load_hf_folder("exports/run")        # a folder from save_pretrained / gptrain export

The module names are the same on both sides; the differences are:
  * HF's attention and MLP projections are `Conv1D` layers storing weights as (in, out), the
    transpose of nn.Linear's (out, in);
  * our token embedding (and the tied lm_head) has `padded_vocab_size` rows, HF's `vocab_size`;
    padded rows are dropped on export and zero-filled on import (no real id ever uses them).
transformers itself is not needed by this module, only by whoever builds the HF model.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import Tensor

from gptrain.errors import UserError
from gptrain.model import hf_nanochat
from gptrain.model.gpt import GPT, GPTConfig
from gptrain.model.nanochat import NanoChat

# weights that HF stores as Conv1D (in, out); nn.Linear is (out, in)
CONV1D_SUFFIXES = (
    "attn.c_attn.weight",
    "attn.c_proj.weight",
    "mlp.c_fc.weight",
    "mlp.c_proj.weight",
)
# causal-mask buffers that older transformers versions saved in GPT-2 state dicts
HF_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")


HF_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "erf"}  # HF name -> model.gelu


def config_from_hf(hf_config, dropout: float = 0.0) -> GPTConfig:
    """GPTConfig of a transformers GPT2Config (refusing variants this model does not implement)."""
    c = hf_config
    gelu = HF_GELU.get(c.activation_function)
    if gelu is None:
        raise ValueError(
            f"activation {c.activation_function!r}: only tanh-GELU (GPT-2: gelu_new, gelu_pytorch_tanh) and exact GELU (gelu) are supported"
        )
    if c.layer_norm_epsilon != 1e-5 or not c.scale_attn_weights:
        raise ValueError("only GPT-2's LayerNorm eps 1e-5 and 1/sqrt(head) attention scaling")
    if c.scale_attn_by_inverse_layer_idx or c.reorder_and_upcast_attn:
        raise ValueError("scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn unsupported")
    n_inner = getattr(c, "n_inner", None)
    if n_inner is not None and n_inner != 4 * c.n_embd:
        raise ValueError(f"n_inner={n_inner}: only the 4 * n_embd MLP is supported")
    return GPTConfig(
        vocab_size=c.vocab_size,
        block_size=c.n_positions,
        n_layer=c.n_layer,
        n_head=c.n_head,
        n_embd=c.n_embd,
        dropout=dropout,
        bias=True,
        gelu=gelu,
    )


def hf_config_dict(config: GPTConfig, eot_id: int) -> dict:
    """The config.json of a transformers GPT2LMHeadModel with this architecture."""
    if not config.bias:
        raise ValueError("HF GPT-2 has biases; a bias=False model cannot be exported")
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,  # unpadded: HF has no padding rows
        "n_positions": config.block_size,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,  # 4 * n_embd
        "activation_function": "gelu_new" if config.gelu == "tanh" else "gelu",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "torch_dtype": "float32",
    }


def to_hf_state_dict(model: GPT) -> dict[str, Tensor]:
    """State dict for transformers' GPT2LMHeadModel (copies; padded vocab rows dropped)."""
    if not model.config.bias:
        raise ValueError("HF GPT-2 has biases; a bias=False model cannot be exported")
    V = model.config.vocab_size
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach()
        if name in ("transformer.wte.weight", "lm_head.weight"):
            t = t[:V]  # (V, C)
        elif name.endswith(CONV1D_SUFFIXES):
            t = t.t()  # (out, in) -> (in, out)
        out[name] = t.contiguous().clone()
    return out


def from_hf_state_dict(sd: dict[str, Tensor], config: GPTConfig) -> GPT:
    """A GPT holding the weights of a GPT2LMHeadModel (or GPT2Model) state dict."""
    if not any(k.startswith("transformer.") for k in sd):  # GPT2Model: no "transformer." prefix
        sd = {f"transformer.{k}": v for k, v in sd.items()}
    sd = {k: v for k, v in sd.items() if not k.endswith(HF_BUFFER_SUFFIXES)}
    wte = sd["transformer.wte.weight"]  # (V, C)
    if wte.shape != (config.vocab_size, config.n_embd):
        raise ValueError(
            f"HF token embedding {tuple(wte.shape)} does not match "
            f"vocab_size={config.vocab_size}, n_embd={config.n_embd}"
        )
    padded = wte.new_zeros(config.padded_vocab_size, config.n_embd)  # (padded V, C)
    padded[: config.vocab_size] = wte
    state = {}
    for name, t in sd.items():
        if name == "lm_head.weight":
            continue  # tied to wte (checked below)
        if name.endswith(CONV1D_SUFFIXES):
            t = t.t()  # (in, out) -> (out, in)
        state[name] = t.detach().contiguous().clone()
    if "lm_head.weight" in sd and not torch.equal(sd["lm_head.weight"], wte):
        raise ValueError("HF lm_head.weight differs from wte: an untied head is not GPT-2")
    state["transformer.wte.weight"] = padded
    state["lm_head.weight"] = padded
    with torch.device("meta"):  # no random init: every weight comes from sd
        model = GPT(config)
    model.load_state_dict(state, assign=True)  # strict: a missing or extra key is an error
    model.lm_head.weight = model.transformer.wte.weight  # assign=True replaced both: re-tie
    return model


# GPT2Config's defaults, for config.json files that leave a field out
HF_GPT2_DEFAULTS = {
    "vocab_size": 50257,
    "n_positions": 1024,
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "n_inner": None,
    "activation_function": "gelu_new",
    "layer_norm_epsilon": 1e-5,
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
}


HF_MODEL_TYPES = {"gpt2": "GPT-2", "nanochat": "NanoChat"}  # config.json model_type -> name


def load_hf_folder(folder: str | Path, dropout: float = 0.0) -> GPT | NanoChat:
    """A GPT or NanoChat from a Hugging Face folder (config.json + model.safetensors or
    pytorch_model.bin), e.g. from `save_pretrained`, the hub's files, or `gptrain export`;
    config.json's model_type picks the architecture (absent: gpt2)."""
    folder = Path(folder)
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(
            f"cannot read {folder / 'config.json'} ({e}); give a Hugging Face GPT-2 or NanoChat folder"
        ) from None
    model_type = raw.get("model_type", "gpt2")
    if model_type not in HF_MODEL_TYPES:
        raise UserError(
            f"{folder} holds a {model_type!r} model; only {' and '.join(HF_MODEL_TYPES)} load"
        )
    try:
        if model_type == "nanochat":
            config = hf_nanochat.config_from_hf(raw, dropout=dropout)
            return hf_nanochat.from_hf_state_dict(_read_weights(folder), config)
        config = config_from_hf(SimpleNamespace(**{**HF_GPT2_DEFAULTS, **raw}), dropout=dropout)
        return from_hf_state_dict(_read_weights(folder), config)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        name = HF_MODEL_TYPES[model_type]
        raise UserError(f"cannot load {name} weights from {folder}: {first}") from None


def _read_weights(folder: Path) -> dict[str, Tensor]:
    """model.safetensors, else pytorch_model.bin, of a Hugging Face folder."""
    from safetensors.torch import load_file

    if (folder / "model.safetensors").is_file():
        return load_file(str(folder / "model.safetensors"))
    return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
