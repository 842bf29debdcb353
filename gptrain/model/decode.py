"""KV-cache generation shared by every model class: the cache of one attention layer, sampling
one token from logits, and the prefill / one-token / crop loop (`Generates.generate`), which
calls the model's own `_decode(idx, caches, pos) -> logits (B, V)` and `blocks()`. Imports only
torch."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor


class KVCache:
    """Keys and values of one attention layer, preallocated to block_size, filled from position 0."""

    def __init__(self) -> None:
        self.k: Tensor | None = None  # (B, n_kv, block_size, hs)
        self.v: Tensor | None = None

    def update(self, k: Tensor, v: Tensor, pos: int, max_len: int) -> tuple[Tensor, Tensor]:
        """Store k, v (B, n_kv, T, hs) at positions pos..pos+T-1; return all keys/values so far."""
        if self.k is None:
            B, nh, _, hs = k.shape
            self.k = k.new_zeros(B, nh, max_len, hs)
            self.v = v.new_zeros(B, nh, max_len, hs)
        end = pos + k.size(2)
        self.k[:, :, pos:end] = k
        self.v[:, :, pos:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]  # (B, n_kv, end, hs)


def sample_next(
    logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> Tensor:
    """One token id per row of logits (B, V) -> (B, 1): argmax at temperature 0, else sampled."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, [-1]]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)  # (B, V)
    return torch.multinomial(probs, num_samples=1, generator=generator)


class Generates:
    """`generate` for a model with `config.block_size`, `blocks()` and `_decode`."""

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Extend idx (B, T) by max_new_tokens sampled tokens -> (B, T + max_new_tokens).

        Uses a KV cache: the prompt is prefilled once, then one token is fed at a time. Once the
        sequence is longer than block_size, the context is cropped to the last block_size tokens;
        positions then shift, so the cache is recomputed from the cropped context at each step.
        temperature 0 is greedy (argmax); top_k keeps only the k most likely tokens. Call
        model.eval() first if the model has dropout.
        """
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
        if idx.size(1) < 1:
            raise ValueError("generate needs at least one prompt token (e.g. the EOT token)")
        # Blocks may be compiled in place (the trainer does so under FSDP). Decoding changes shapes
        # and cache state every step, which would only cause recompiles: run eagerly.
        set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
        with set_stance("force_eager") if set_stance else contextlib.nullcontext():
            return self._generate(idx, max_new_tokens, temperature, top_k, generator)

    def _generate(self, idx, max_new_tokens, temperature, top_k, generator) -> Tensor:
        block_size = self.config.block_size
        caches: list[KVCache] | None = None
        for _ in range(max_new_tokens):
            if caches is None or idx.size(1) > block_size:  # (re)fill from the cropped context
                caches = [KVCache() for _ in self.blocks()]
                logits = self._decode(idx[:, -block_size:], caches, pos=0)  # (B, V)
            else:  # the cache holds positions 0..T-2; feed the newest token at T-1
                logits = self._decode(idx[:, -1:], caches, pos=idx.size(1) - 1)  # (B, V)
            idx_next = sample_next(logits, temperature, top_k, generator)  # (B, 1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx
