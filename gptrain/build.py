"""Building what a run trains: the model (random init, a preset, or pretrained weights), its
parallel wrapping, the optimizer and the precision. Shared by `gptrain train` and `gptrain bench`.
"""

from __future__ import annotations

import torch

from gptrain import dist
from gptrain.config import Config
from gptrain.errors import UserError
from gptrain.precision import mixed_precision, resolve_dtype, set_matmul_precision


def build_model(cfg: Config, vocab_size: int, saved_arch: dict | None = None):
    """The model to train, randomly initialised (preset or n_layer/n_head/n_embd), or from the
    pretrained folder of model.init_from. `saved_arch` (a checkpoint's model config) replaces
    that folder when a run started from it resumes: the checkpoint holds the weights."""
    from gptrain.model import GPT, PRESETS, GPTConfig

    m = cfg.model
    if m.init_from and saved_arch is not None:
        return GPT(GPTConfig(**{**saved_arch, "dropout": m.dropout}))
    if m.init_from:  # pretrained weights: their config.json sets the architecture
        from gptrain.hf import load_hf_folder

        model = load_hf_folder(m.init_from, dropout=m.dropout)
        c = model.config
        if c.vocab_size != vocab_size or c.block_size < cfg.train.seq_len:
            raise UserError(
                f"model.init_from = {m.init_from!r} has vocab {c.vocab_size} and context {c.block_size}, but the data's tokenizer has vocab {vocab_size} and train.seq_len = {cfg.train.seq_len}; "
                "prepare the data with the weights' tokenizer (e.g. --tokenizer gpt2) and use a seq_len within the context"
            )
        return model
    if m.preset and m.preset not in PRESETS:
        raise UserError(f"model.preset = {m.preset!r}; allowed: {', '.join(PRESETS)} or empty")
    arch = (
        PRESETS[m.preset]
        if m.preset
        else {"n_layer": m.n_layer, "n_head": m.n_head, "n_embd": m.n_embd}
    )
    return GPT(
        GPTConfig(
            vocab_size=vocab_size,
            block_size=m.block_size or cfg.train.seq_len,
            dropout=m.dropout,
            **arch,
        )
    )


def build_training(cfg: Config, info: dist.DistInfo, vocab_size: int, dtype: str, compile: bool, saved_arch: dict | None = None):  # fmt: skip
    """(model, wrapped, optimizer, compute dtype, autocast, scaler), in this order: the model with
    the same initialisation on every rank (same seed), parallelism applied from outside, then the
    optimizer over the (possibly sharded) parameters."""
    from gptrain.optim import build_optimizer

    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg, vocab_size, saved_arch).to(info.device)
    fsdp = cfg.dist.mode == "fsdp" and info.world_size > 1
    ptdtype = resolve_dtype(dtype, info.device_type, fsdp)
    set_matmul_precision(info.device_type, cfg.train.tf32)  # before the peak is measured
    wrapped = dist.wrap_model(model, cfg.dist, info=info, compile=compile, param_dtype=ptdtype)
    optimizer = build_optimizer(model, cfg.optim, device_type=info.device_type)
    autocast, scaler = mixed_precision(ptdtype, info.device_type, fsdp)
    return model, wrapped, optimizer, ptdtype, autocast, scaler
