"""NanoChat's transformer, exactly as transformers' NanoChatForCausalLM computes it.

token embedding -> RMSNorm -> n_layer pre-norm blocks (x + attn(norm x), then x + mlp(norm x))
-> RMSNorm -> untied lm_head -> logits capped as softcap * tanh(logits / softcap) in float32.
Every RMSNorm is parameter-free (eps 1e-6, computed in float32 and cast back; a block's two,
under autocast, cast to the autocast dtype their Linear layers read). Attention: q, k, v
projections (grouped-query: n_kv_head key/value heads), rotary position embeddings (HF's
rotate_half(x) = cat(x2, -x1) on the two halves of each head, theta = rope_theta), then an
RMSNorm of q and k over the head dim, causal attention scaled by hs^-1/2, output projection.
MLP: c_fc -> relu(x)^2 -> c_proj. No biases anywhere. The RMSNorm (off CUDA, which has torch's
fused kernel), the rotary embeddings and relu(x)^2 carry hand-written gradients
(autograd.Function): the same values in fewer passes.

The module names follow nanochat (`transformer.h.3.attn.c_q`, `mlp.c_fc`, `lm_head`), so code
that walks `model.transformer.h` or calls `blocks()` serves GPT and NanoChat alike; the Hugging
Face names are mapped in hf_nanochat.py. The model has parameters only: rotary cos/sin are
computed from the positions in each forward (no buffers), so a model built on `meta`,
`to_empty`'d and `init_weights()`'d is complete, and `Block(config)(x)` runs on its own.

Vocabulary padding and the losses work as in gpt.py (padded rows of wte and lm_head, never in the
logits; the chunked loss never holds the full logits), with the softcap applied inside the loss
(losses.py). Shapes: B batch, T time, C n_embd, nh heads, nkv key/value heads, hs head size,
V vocab_size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from gptrain.model.attention import matmul_attention
from gptrain.model.base import LanguageModel
from gptrain.model.decode import KVCache
from gptrain.model.losses import (
    chunk_rows,
    chunked_loss,
    full_cross_entropy,
    linear_cross_entropy,
)

NORM_EPS = 1e-6  # every RMSNorm's eps (HF NanoChatConfig.rms_norm_eps's default)


@dataclass
class NanoChatConfig:
    vocab_size: int = 50257  # the tokenizer's real vocabulary
    block_size: int = 1024  # max sequence length
    n_layer: int = 12
    n_head: int = 6
    n_kv_head: int = 0  # key/value heads (grouped-query attention); 0: n_head (set so)
    n_embd: int = 768
    mlp_hidden: int = 0  # the MLP's inner width; 0: 4 * n_embd (set so)
    softcap: float = 15.0  # logits -> softcap * tanh(logits / softcap); 0: none
    rope_theta: float = 10000.0
    dropout: float = 0.0

    @property
    def padded_vocab_size(self) -> int:
        """vocab_size rounded up to a multiple of 64 (the embedding / lm_head row count)."""
        return (self.vocab_size + 63) // 64 * 64

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        """The number of key/value heads (n_kv_head, or n_head when that is 0)."""
        return self.n_kv_head or self.n_head

    @property
    def hidden(self) -> int:
        """The MLP's inner width (mlp_hidden, or 4 * n_embd when that is 0)."""
        return self.mlp_hidden or 4 * self.n_embd

    def __post_init__(self) -> None:
        # canonical: 0 becomes what it stands for, so equal architectures compare equal
        if self.n_kv_head == 0:
            self.n_kv_head = self.n_head
        if self.mlp_hidden == 0:
            self.mlp_hidden = 4 * self.n_embd
        if self.n_head < 1 or self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.head_dim % 2:
            raise ValueError(
                f"head size n_embd/n_head={self.head_dim} is odd; rotary embeddings rotate pairs: "
                "choose an even head size"
            )
        if self.n_kv_head < 0 or self.n_head % self.kv_heads != 0:
            raise ValueError(
                f"n_head={self.n_head} must be divisible by n_kv_head={self.n_kv_head} "
                "(0: n_kv_head = n_head)"
            )
        if self.softcap < 0:
            raise ValueError(f"softcap={self.softcap} must be >= 0 (0: no cap)")
        if self.mlp_hidden < 0:
            raise ValueError(f"mlp_hidden={self.mlp_hidden} must be >= 0 (0: 4 * n_embd)")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta={self.rope_theta} must be > 0")

    def shape_key(self) -> tuple:
        """Everything that changes one block's shapes or ops (speed choices are cached by it)."""
        return ("nanochat", self.n_layer, self.n_embd, self.n_head, self.kv_heads, self.hidden)


class _RMSNorm(torch.autograd.Function):
    """y = x * r, r = rsqrt(|x|^2 / C + eps) of a float32 x, the sum of squares in one reduction;
    its gradient in one expression, dx = g * r - y * (r * mean(g * y)), rather than autograd's
    walk back through pow, mean, rsqrt and two products (F.rms_norm is that composite on a CPU):
    the same values to float32 rounding, fewer passes."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        r = torch.rsqrt(
            torch.linalg.vector_norm(x, dim=-1, keepdim=True).square() / x.size(-1) + NORM_EPS
        )
        y = x * r
        ctx.save_for_backward(y, r)
        return y

    @staticmethod
    @once_differentiable  # r is saved without its graph: no second derivative
    def backward(ctx, g: Tensor) -> Tensor:
        y, r = ctx.saved_tensors
        m = (g * y).mean(-1, keepdim=True)
        return torch.addcmul(g * r, y, -(m * r))


def _rms_norm(x: Tensor) -> Tensor:
    """The float32 RMSNorm of float32 x: CUDA's fused kernel where torch has one (F.rms_norm),
    the hand-written gradient elsewhere (F.rms_norm is a composite on a CPU)."""
    if x.is_cuda:
        return F.rms_norm(x, (x.size(-1),), eps=NORM_EPS)
    return _RMSNorm.apply(x)


def norm(x: Tensor) -> Tensor:
    """Parameter-free RMSNorm over the last dim, in float32, cast back to x's dtype."""
    return _rms_norm(x.float()).to(x.dtype)


def norm_for_matmul(x: Tensor) -> Tensor:
    """norm(x) for Linear layers' input: under autocast already in its dtype, the one rounding
    each of the layers would make, made once (attention's three projections read it)."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    return _rms_norm(x.float()).to(dtype)


def rotary(T: int, pos: int, head_dim: int, theta: float, device) -> tuple[Tensor, Tensor]:
    """HF's default rope at positions pos..pos+T-1 as two float32 (T, head_dim) tables for
    apply_rotary: (cos, cos) and (sin, -sin), each half a head's pair frequencies."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
    )
    positions = torch.arange(pos, pos + T, device=device).float()
    freqs = positions[:, None] * inv_freq[None, :]  # (T, hs/2)
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), -1), torch.cat((sin, -sin), -1)


class _Rotary(torch.autograd.Function):
    """y = x * cos + roll(x) * sin (roll by half a head: its own inverse), so
    dx = g * cos + roll(g * sin) = g * cos + roll(g) * roll(sin): three passes each way."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        return torch.addcmul(x * cos, x.roll(x.size(-1) // 2, dims=-1), sin)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        half = g.size(-1) // 2
        return torch.addcmul(g * cos, g.roll(half, dims=-1), sin.roll(half, dims=-1)), None, None


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF NanoChat's x * cos + rotate_half(x) * sin, rotate_half(x) = cat(x2, -x1): with rotary's
    tables that is x * cos + roll(x, hs/2) * sin (roll(x) = cat(x2, x1)), the same products and
    sums in fewer passes. x (..., T, [heads,] hs), cos/sin broadcast to it ((T, hs) or (T, 1, hs)).
    The result in x's dtype."""
    return _Rotary.apply(x, cos.to(x.dtype), sin.to(x.dtype))


class CausalSelfAttention(nn.Module):
    def __init__(self, config: NanoChatConfig):
        super().__init__()
        self.n_head, self.n_kv, self.hs = config.n_head, config.kv_heads, config.head_dim
        self.block_size, self.theta = config.block_size, config.rope_theta
        self.dropout = config.dropout
        C = config.n_embd
        self.c_q = nn.Linear(C, self.n_head * self.hs, bias=False)
        self.c_k = nn.Linear(C, self.n_kv * self.hs, bias=False)
        self.c_v = nn.Linear(C, self.n_kv * self.hs, bias=False)
        self.c_proj = nn.Linear(C, C, bias=False)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.impl = "sdpa"  # or "matmul" (matmul_attention): NanoChat.set_attention

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor] | None = None, cache=None, pos: int = 0
    ) -> Tensor:
        B, T, C = x.shape
        cos, sin = rope if rope is not None else rotary(T, pos, self.hs, self.theta, x.device)
        q = self.c_q(x).view(B, T, self.n_head, self.hs)
        k = self.c_k(x).view(B, T, self.n_kv, self.hs)
        # (T, 1, hs), in q's dtype: over the heads of (B, T, nh, hs)
        cos, sin = (t[:, None, :].to(q.dtype) for t in (cos, sin))
        # RoPE, then norm, on the projections' own contiguous layout; then heads first
        q, k = norm(apply_rotary(q, cos, sin)), norm(apply_rotary(k, cos, sin))
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, nh, T, hs), (B, nkv, T, hs)
        v = self.c_v(x).view(B, T, self.n_kv, self.hs).transpose(1, 2)  # (B, nkv, T, hs)
        gqa = self.n_kv != self.n_head
        if cache is None:
            dropout_p = self.dropout if self.training else 0.0
            if self.impl == "matmul":
                if gqa:  # query head i reads key/value head i // (nh / nkv)
                    k, v = (t.repeat_interleave(self.n_head // self.n_kv, dim=1) for t in (k, v))
                y = matmul_attention(q, k, v, dropout_p)
            else:
                y = F.scaled_dot_product_attention(
                    q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=gqa
                )
        else:
            # Prefill from position 0 (causal over the prompt), then one token at a time (sees
            # every cached position): see gpt.py's attention.
            assert pos == 0 or T == 1, "KV cache: prefill from position 0, then one token at a time"
            k, v = cache.update(k, v, pos, self.block_size)  # (B, nkv, pos+T, hs)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=gqa)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class _ReluSquared(torch.autograd.Function):
    """relu(x)^2 with its gradient 2 * g * relu(x) in two passes (autograd's pow and threshold
    gradients take three): the same values, bit for bit (doubling is exact)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        r = F.relu(x)
        ctx.save_for_backward(r)
        return r.square()

    @staticmethod
    @once_differentiable  # r is saved without its graph: no second derivative
    def backward(ctx, g: Tensor) -> Tensor:
        (r,) = ctx.saved_tensors
        return (g * r).mul_(2)


class MLP(nn.Module):
    def __init__(self, config: NanoChatConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.hidden, bias=False)
        self.c_proj = nn.Linear(config.hidden, config.n_embd, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(_ReluSquared.apply(self.c_fc(x))))  # (B, T, C)


class Block(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)). `rope` (cos, sin) is computed
    from the positions when not given (standalone use: Block(config)(x))."""

    def __init__(self, config: NanoChatConfig):
        super().__init__()
        self.attn = CausalSelfAttention(config)
        self.mlp = MLP(config)

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor] | None = None, cache=None, pos: int = 0
    ) -> Tensor:
        x = x + self.attn(norm_for_matmul(x), rope, cache, pos)  # (B, T, C)
        return x + self.mlp(norm_for_matmul(x))


class NanoChat(LanguageModel):
    """The NanoChat model (see the module docstring); `set_loss`, `set_attention`, `blocks` and `generate`:
    base.LanguageModel."""

    arch = "nanochat"

    def __init__(self, config: NanoChatConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)  # untied
        self.loss_chunk_rows: int | None = None  # None: losses.chunk_rows's default
        self.loss = "chunked"  # the training loss's path: set_loss
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """nanochat's initialisation (karpathy/nanochat nanochat/gpt.py init_weights, as of the
        version with this block; later versions add per-layer scalars): wte N(0, 1); c_q, c_k,
        c_v and c_fc uniform on [-s, s] with s = sqrt(3 / n_embd) (std 1/sqrt(n_embd)); both
        c_proj zero (each block starts as the identity); lm_head N(0, 0.001) (so the first loss
        is ~ln(vocab_size))."""
        C = self.config.n_embd
        nn.init.normal_(self.transformer.wte.weight, mean=0.0, std=1.0)
        nn.init.normal_(self.lm_head.weight, mean=0.0, std=0.001)
        s = math.sqrt(3.0 / C)
        for block in self.transformer.h:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.mlp.c_fc):
                nn.init.uniform_(lin.weight, -s, s)
            nn.init.zeros_(block.attn.c_proj.weight)
            nn.init.zeros_(block.mlp.c_proj.weight)

    def forward(
        self, idx: Tensor, targets: Tensor | None = None, reduction: str = "mean"
    ) -> tuple[Tensor | None, Tensor | None]:
        """idx (B, T) int64 -> (logits (B, T, vocab_size) float32, softcapped, None) without
        targets, or (None, mean cross-entropy float32) with targets (B, T) int64 (IGNORE_INDEX
        positions left out); reduction="none" (no gradients) gives the per-token losses (B, T),
        0 at IGNORE_INDEX positions. The same contract as GPT.forward."""
        x = self._trunk(idx, pos=0)  # (B, T, C), normed
        cap = self.config.softcap
        if targets is not None:
            rows = chunk_rows(targets.numel(), self.config.padded_vocab_size, self.loss_chunk_rows)
            args = (x.reshape(-1, x.size(-1)), self.lm_head.weight, targets.reshape(-1))
            if reduction == "none":
                per_token = torch.zeros(targets.numel(), dtype=torch.float32, device=x.device)
                with torch.no_grad():
                    chunked_loss(*args, self.config.vocab_size, rows, False, per_token, cap)
                return None, per_token.view(targets.shape)  # (B, T)
            if self.loss == "full":
                return None, full_cross_entropy(*args, self.config.vocab_size, cap)
            return None, linear_cross_entropy(*args, self.config.vocab_size, rows, cap)
        return self._logits(x).contiguous(), None  # (B, T, V)

    def _trunk(self, idx: Tensor, pos: int, cache: list[KVCache] | None = None) -> Tensor:
        """idx (B, T) at positions pos.. through embedding, norm, blocks and the final norm."""
        T = idx.size(1)
        if pos + T > self.config.block_size:
            raise ValueError(
                f"sequence length {pos + T} exceeds the model's block_size {self.config.block_size}"
            )
        rope = rotary(T, pos, self.config.head_dim, self.config.rope_theta, idx.device)
        x = self.transformer.drop(norm(self.transformer.wte(idx)))  # (B, T, C)
        for i, block in enumerate(self.transformer.h):
            x = block(x, rope, None if cache is None else cache[i], pos)
        return norm(x)

    def _logits(self, x: Tensor) -> Tensor:
        """float32 logits (..., V) of the final hidden states x (..., C): padded ids dropped,
        then the softcap."""
        logits = self.lm_head(x)[..., : self.config.vocab_size].float()  # a float32 copy
        cap = self.config.softcap
        return cap * torch.tanh(logits / cap) if cap else logits

    def _decode(self, idx: Tensor, caches: list[KVCache], pos: int) -> Tensor:
        """Run idx (B, T) at positions pos.. through the cached blocks; logits (B, V) of the last."""
        x = self._trunk(idx, pos, caches)  # (B, T, C)
        return self._logits(x[:, -1, :])  # (B, V)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count (padded rows included). non_embedding=True leaves out the token
        embedding (a lookup); the untied lm_head is a real matmul and stays in."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wte.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training (forward + backward) FLOPs per token at seq_len: 6 * num_params() (lm_head
        in, wte out) + 12 * n_layer * n_head * head_dim * seq_len (q@k^T and att@v over the
        full T x T matrix with the query heads, not halved for causality: the PaLM convention,
        as GPT.flops_per_token). Matmuls only: the RMSNorms, rotary embeddings, ReLU² and the
        softcap are elementwise (under 1% of the matmuls' FLOPs at width 768) and left out, as
        GPT-2's LayerNorms and GELU are."""
        cfg = self.config
        attn = 12.0 * cfg.n_layer * cfg.n_head * cfg.head_dim * seq_len
        return 6.0 * self.num_params() + attn

    def block_flops(self, seq_len: int) -> float:
        """Training FLOPs of one block per token at seq_len: 6 * its weights + attention."""
        cfg = self.config
        weights = sum(p.numel() for p in self.transformer.h[0].parameters()) if cfg.n_layer else 0
        return 6.0 * weights + 12.0 * cfg.n_head * cfg.head_dim * seq_len
