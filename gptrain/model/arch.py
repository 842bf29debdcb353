"""The model architectures by name: one config dict (a checkpoint's "model" entry) -> config ->
model, so nothing outside model/ branches on the architecture.

    config = config_from_dict({"arch": "nanochat", "n_layer": 4, ...})
    model = build(config)                 # GPT or NanoChat
    meta["model"] = config_to_dict(config)  # asdict + "arch"

A dict without "arch" is GPT-2's (checkpoints written before there were two).
"""

from __future__ import annotations

from dataclasses import asdict, fields

import torch.nn as nn

from gptrain.model.gpt import GPT, GPTConfig
from gptrain.model.nanochat import NanoChat, NanoChatConfig

ARCHS = ("gpt2", "nanochat")
_CLASSES = {"gpt2": (GPTConfig, GPT), "nanochat": (NanoChatConfig, NanoChat)}


def config_from_dict(d: dict) -> GPTConfig | NanoChatConfig:
    """The config a dict describes: d["arch"] (default "gpt2") picks the class, the other keys
    are its fields. An unknown arch or field is a ValueError naming it."""
    arch = d.get("arch", "gpt2")
    if arch not in _CLASSES:
        raise ValueError(f"model arch {arch!r} is not one of {', '.join(ARCHS)}")
    cls = _CLASSES[arch][0]
    known = {f.name for f in fields(cls)}
    extra = sorted(set(d) - known - {"arch"})
    if extra:
        raise ValueError(f"{arch} model config has unknown keys {extra}; known: {sorted(known)}")
    return cls(**{k: v for k, v in d.items() if k != "arch"})


def config_to_dict(config: GPTConfig | NanoChatConfig) -> dict:
    """The config's fields plus "arch": what config_from_dict reads back."""
    return {**asdict(config), "arch": arch_of(config)}


def arch_of(config: GPTConfig | NanoChatConfig) -> str:
    for arch, (cls, _) in _CLASSES.items():
        if type(config) is cls:
            return arch
    raise ValueError(f"{type(config).__name__} is not a model config ({', '.join(ARCHS)})")


def build(config: GPTConfig | NanoChatConfig) -> nn.Module:
    """The model of a config (initialised; build under torch.device("meta") to skip that)."""
    return _CLASSES[arch_of(config)][1](config)
