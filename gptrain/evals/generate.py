"""Text generation: `load_model` (a run's checkpoint, full or sharded, with its tokenizer) and
`generate_text`, which the trainer calls for in-training samples and `gptrain sample`
(gptrain/commands/sample.py) for the command line. It accepts the model as the trainer holds it
(plain, compiled in place, DDP, or FSDP2 on every rank in lockstep)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from gptrain.checkpoint import manager as checkpoint
from gptrain.errors import UserError


def _generation_module(model: nn.Module) -> nn.Module:
    """The module whose .generate to call: unwrap DDP; let FSDP2 gather params for generate."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return model.module
    try:
        from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
    except ImportError:  # older torch without FSDP2
        return model
    if isinstance(model, FSDPModule) and not getattr(model, "_gptrain_generate_hooked", False):
        # generate() touches root params (wte, wpe, ln_f) outside forward: have FSDP2 gather them
        register_fsdp_forward_method(model, "generate")
        model._gptrain_generate_hooked = True
    return model


def generate_text(
    model: nn.Module,
    tokenizer,
    prompt: str,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    num_samples: int,
    seed: int,
    device,
) -> list[str]:
    """num_samples continuations of `prompt` (the continuation text only, without the prompt).

    An empty prompt starts from the end-of-text token. Sampling uses its own generator seeded
    with `seed`, so the result is reproducible and the global RNG is untouched. The model is put
    in eval mode for the call and its previous mode restored.
    """
    ids = tokenizer.encode(prompt) if prompt else [tokenizer.eot_id]
    if not ids:  # a prompt that encodes to nothing
        ids = [tokenizer.eot_id]
    device = torch.device(device)
    idx = torch.tensor([ids] * num_samples, dtype=torch.long, device=device)  # (N, T)
    generator = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        out = _generation_module(model).generate(
            idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=generator
        )  # (N, T + max_new_tokens)
    finally:
        model.train(was_training)
    return [tokenizer.decode(row[len(ids) :].tolist()) for row in out]


def load_model(run_dir, step: int | None = None, device="cpu") -> tuple[nn.Module, object, dict]:
    """(model in eval mode on `device`, its tokenizer, checkpoint meta) of a run's checkpoint: the
    block its meta.json names (gptrain/model/arch.py; none named: gpt2). Weights tied in the
    model's own construction (GPT-2's head and wte) are tied again after the load; an untied
    head (nanochat's) keeps its own."""
    from gptrain.data.tokenizers import load_tokenizer
    from gptrain.model.arch import build, config_from_dict

    if not Path(run_dir).is_dir():
        raise UserError(f"run directory {run_dir} does not exist; pass --run with a trained run")
    folder = checkpoint.find(run_dir, step)
    state, meta = checkpoint.load_model_state(folder)
    if "model" not in meta or "tokenizer" not in meta:
        raise UserError(f"{folder}/meta.json lacks the model config or tokenizer identity")
    try:
        config = config_from_dict(meta["model"])
    except (TypeError, ValueError) as e:
        raise UserError(
            f"{folder}/meta.json has a model config this gptrain cannot build: {e}"
        ) from None
    identity = dict(meta["tokenizer"])
    if (folder / checkpoint.TOKENIZER_FILE).is_file():  # a trained BPE travels with the weights
        identity["path"] = str(folder / checkpoint.TOKENIZER_FILE)
    tokenizer = load_tokenizer(identity)
    if tokenizer.vocab_size != config.vocab_size:
        raise UserError(
            f"tokenizer vocab {tokenizer.vocab_size} != model vocab {config.vocab_size} in {folder}"
        )
    with torch.device("meta"):  # no random init: the weights come from the checkpoint
        model = build(config)
    aliases = checkpoint.shared_parameters(model)  # {alias: source}: tied in construction
    for alias, source in aliases.items():  # a checkpoint may store a tied weight once
        state.setdefault(alias, state.get(source))
    try:
        model.load_state_dict(state, assign=True)
    except RuntimeError as e:
        raise UserError(f"checkpoint {folder} does not match its model config: {e}") from None
    for alias, source in aliases.items():  # assign=True replaced both: tie again
        owner, _, name = alias.rpartition(".")
        setattr(model.get_submodule(owner), name, model.get_parameter(source))
    return model.to(device).eval(), tokenizer, meta
