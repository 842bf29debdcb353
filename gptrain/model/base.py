"""What every model class shares: the switches set from outside (the training loss's path, the
attention kernel), its blocks, and KV-cache generation (decode.Generates). A model keeps its
blocks in `transformer.h`, each with an `attn.impl`, and sets `self.loss`. Imports only torch."""

from __future__ import annotations

from torch import nn

from gptrain.model.decode import Generates


class LanguageModel(Generates, nn.Module):
    def set_loss(self, impl: str) -> None:
        """The mean loss's path: "chunked" (linear_cross_entropy, no full logits) or "full"
        (full_cross_entropy); the same value and gradients. Per-token losses stay chunked."""
        if impl not in ("chunked", "full"):
            raise ValueError(f"loss {impl!r} must be chunked or full")
        self.loss = impl

    def set_attention(self, impl: str) -> None:
        """Attention kernel for training and evaluation: "sdpa" or "matmul" (matmul_attention)."""
        if impl not in ("sdpa", "matmul"):
            raise ValueError(f"attention {impl!r} must be sdpa or matmul")
        for block in self.transformer.h:
            block.attn.impl = impl

    def blocks(self) -> list[nn.Module]:
        """The transformer blocks, in order (what FSDP, checkpointing and compile wrap one by one)."""
        return list(self.transformer.h)
