"""GPT-2, exactly: token + learned position embeddings, pre-LayerNorm blocks, tied output head.

Module names follow nanoGPT / Hugging Face (`transformer.h.3.attn.c_attn`, ...) so weights map
one to one (see gptrain/model/hf.py). This file imports only torch (and gptrain/model/losses.py and
gptrain/model/attention.py, which import only torch) and knows nothing about distributed training:
DDP, FSDP2 `fully_shard` (per `transformer.h[i]`, then the root), activation checkpointing,
torch.compile and the choice of attention kernel are applied from outside.

Vocabulary padding: the embedding table has `padded_vocab_size` rows (a multiple of 64, faster
matmuls), but logits are only returned for the `vocab_size` real tokens. Padded ids therefore
can never be sampled, and a padded id given as a target is out of range for cross-entropy
(an error, not a silent bug).

The loss (`loss = "chunked"`, the default) never materialises the (B, T, V) float32 logits:
`linear_cross_entropy` (losses.py) runs the output head and the cross-entropy over chunks of rows,
and (when gradients are needed) computes the chunk's input and weight gradients right there, so at
most one chunk's logits are alive in forward and none in backward. Same value and gradients as the
plain computation, `loss = "full"` (`full_cross_entropy`: the full logits, then F.cross_entropy),
which is faster where its memory is at hand; chosen from outside (set_loss, train.loss).

Shapes: B batch, T time (sequence), C n_embd, nh heads, hs head size (C // nh), V vocab_size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from gptrain.model.attention import matmul_attention
from gptrain.model.base import LanguageModel
from gptrain.model.decode import KVCache
from gptrain.model.losses import (
    chunk_rows,
    chunked_loss,
    full_cross_entropy,
    linear_cross_entropy,
)


@dataclass
class GPTConfig:
    vocab_size: int = 50257  # the tokenizer's real vocabulary
    block_size: int = 1024  # max sequence length (learned position embeddings)
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm layers (GPT-2: True)
    # tanh: GPT-2's approximation (HF "gelu_new"); erf: exact (nanoGPT, HF "gelu")
    gelu: str = "tanh"

    @property
    def padded_vocab_size(self) -> int:
        """vocab_size rounded up to a multiple of 64 (the embedding / lm_head row count)."""
        return (self.vocab_size + 63) // 64 * 64

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.gelu not in ("tanh", "erf"):
            raise ValueError(f"gelu={self.gelu!r} must be tanh or erf")

    def shape_key(self) -> tuple:
        """Everything that changes one block's shapes or ops (speed choices are cached by it)."""
        return ("gpt2", self.n_layer, self.n_embd, self.n_head, self.gelu, self.bias)


PRESETS: dict[str, dict] = {
    "tiny": dict(n_layer=2, n_head=2, n_embd=64),
    "small": dict(n_layer=4, n_head=4, n_embd=256),
    "mini": dict(n_layer=6, n_head=6, n_embd=384),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.block_size = config.block_size
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        # "sdpa" or "matmul" (see matmul_attention), chosen from outside: GPT.set_attention
        self.impl = "sdpa"

    def forward(self, x: Tensor, cache: KVCache | None = None, pos: int = 0) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # q, k, v: (B, nh, T, hs)
        if cache is None:
            dropout_p = self.dropout if self.training else 0.0
            if self.impl == "matmul":
                y = matmul_attention(q, k, v, dropout_p)
            else:
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        else:
            # Prefill (pos 0, T tokens): causal over the prompt. Decode (T == 1): the new token
            # attends to every cached position, so no mask. (is_causal aligns the mask top-left,
            # which would be wrong for T > 1 at pos > 0; generate never does that.)
            assert pos == 0 or T == 1, "KV cache: prefill from position 0, then one token at a time"
            k, v = cache.update(k, v, pos, self.block_size)  # (B, nh, pos+T, hs)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh" if config.gelu == "tanh" else "none")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, C)


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, cache: KVCache | None = None, pos: int = 0) -> Tensor:
        x = x + self.attn(self.ln_1(x), cache, pos)  # (B, T, C)
        return x + self.mlp(self.ln_2(x))


class GPT(LanguageModel):
    """GPT-2 (see the module docstring); `set_loss`, `set_attention`, `blocks` and `generate`:
    base.LanguageModel."""

    arch = "gpt2"

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied: one Parameter, two names
        self.loss_chunk_rows: int | None = None  # None: losses.chunk_rows's default
        self.loss = "chunked"  # the training loss's path: set_loss
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 init: N(0, 0.02) weights, N(0, 0.02/sqrt(2*n_layer)) residual projections, zero biases."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, (nn.Linear, nn.LayerNorm)) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.transformer.h:
            nn.init.normal_(block.attn.c_proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.c_proj.weight, mean=0.0, std=residual_std)

    def forward(
        self, idx: Tensor, targets: Tensor | None = None, reduction: str = "mean"
    ) -> tuple[Tensor | None, Tensor | None]:
        """idx (B, T) int64 -> (logits (B, T, vocab_size) float32, None) without targets, or
        (None, mean cross-entropy float32) with targets (B, T) int64 (IGNORE_INDEX positions left
        out): the chunked loss path never builds the full logits (see set_loss). Both float32
        even under autocast. reduction="none" (no gradients; for scoring, e.g. HellaSwag) gives
        the per-token losses (B, T) instead of their mean, 0 at IGNORE_INDEX positions.
        """
        x = self._embed(idx, pos=0)  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            rows = chunk_rows(targets.numel(), self.config.padded_vocab_size, self.loss_chunk_rows)
            if reduction == "none":
                per_token = torch.zeros(targets.numel(), dtype=torch.float32, device=x.device)
                with torch.no_grad():
                    chunked_loss(
                        x.reshape(-1, x.size(-1)),
                        self.lm_head.weight,
                        targets.reshape(-1),
                        self.config.vocab_size,
                        rows,
                        False,
                        per_token,
                    )
                return None, per_token.view(targets.shape)  # (B, T)
            args = (x.reshape(-1, x.size(-1)), self.lm_head.weight, targets.reshape(-1))
            if self.loss == "full":  # (B*T, C), (padded V, C), (B*T,)
                return None, full_cross_entropy(*args, self.config.vocab_size)
            return None, linear_cross_entropy(*args, self.config.vocab_size, rows)
        logits = self.lm_head(x)  # (B, T, padded V): the matmul runs on the aligned padded size
        if logits.size(-1) != self.config.vocab_size:
            logits = logits[..., : self.config.vocab_size]  # (B, T, V), padded ids dropped
        # A float32 copy, not a view (FSDP2 warns on views).
        return logits.float().contiguous(), None

    def _embed(self, idx: Tensor, pos: int) -> Tensor:
        """Token + position embeddings of idx (B, T) placed at positions pos..pos+T-1."""
        T = idx.size(1)
        if pos + T > self.config.block_size:
            raise ValueError(
                f"sequence length {pos + T} exceeds the model's block_size {self.config.block_size}"
            )
        positions = torch.arange(pos, pos + T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.transformer.wte(idx) + self.transformer.wpe(positions)  # (B, T, C)
        return self.transformer.drop(x)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count, the tied wte/lm_head weight counted once (padded rows included).

        non_embedding=True subtracts the position embeddings (a lookup, no compute) but keeps
        the token embeddings, because as lm_head they are a real matmul (nanoGPT's convention).
        """
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training (forward + backward) FLOPs per token at sequence length seq_len.

        PaLM appendix B convention: 6*N + 12*n_layer*n_embd*seq_len, with N = num_params()
        (weights incl. the lm_head matmul, no position embeddings). The attention term counts
        q@k^T and att@v over the full seq_len x seq_len matrix (forward 4*L*C*T, backward twice
        that), i.e. it does NOT halve for causality; this makes MFU comparable with PaLM and
        nanoGPT numbers.
        """
        cfg = self.config
        return 6.0 * self.num_params() + 12.0 * cfg.n_layer * cfg.n_embd * seq_len

    def _decode(self, idx: Tensor, caches: list[KVCache], pos: int) -> Tensor:
        """Run idx (B, T) at positions pos.. through the cached blocks; logits (B, V) of the last."""
        x = self._embed(idx, pos)  # (B, T, C)
        for block, cache in zip(self.transformer.h, caches, strict=True):
            x = block(x, cache, pos)
        x = self.transformer.ln_f(x[:, -1, :])  # (B, C)
        return self.lm_head(x)[:, : self.config.vocab_size]  # (B, V)

    def block_flops(self, seq_len: int) -> float:
        """Training FLOPs of one block per token at seq_len: 3x the forward's matmuls, i.e.
        6 * (its matrices' weights: 12*C^2) + 12*C*seq_len (attention, as flops_per_token)."""
        C = self.config.n_embd
        return 6.0 * 12 * C * C + 12.0 * C * seq_len
