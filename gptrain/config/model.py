"""The [model] section: which block (model.arch) and its shape, and the keys each block alone has.
Loading refuses a key of the other block set explicitly (load.py check_arch_keys)."""

from __future__ import annotations

from dataclasses import dataclass

from gptrain.config.fields import check, opt

ARCHS = ("gpt2", "nanochat")  # gptrain/model/arch.py ARCHS (config/ does not import model/)
GPT2_ONLY = ("gelu", "bias")  # model keys only the gpt2 block has
NANOCHAT_ONLY = ("n_kv_head", "mlp_hidden", "softcap")  # ... and only the nanochat block


@dataclass(frozen=True)
class ModelConfig:
    arch: str = opt(
        "gpt2",
        "the transformer block: gpt2 (LayerNorm, GELU, learned positions, tied head) or nanochat (RMSNorm, RoPE, QK-norm, ReLU², untied head, logit softcap)",
        ARCHS,
    )
    preset: str = opt(
        "",
        "gpt2 only: named architecture (gpt2, gpt2-medium, gpt2-large, gpt2-xl, mini, small, tiny); empty: use n_layer/n_head/n_embd",
    )
    n_layer: int = opt(4, "transformer blocks (ignored when preset is set)")
    n_head: int = opt(4, "attention heads per block (ignored when preset is set)")
    n_embd: int = opt(256, "model width; must be divisible by n_head (ignored when preset is set)")
    n_kv_head: int = opt(0, "nanochat only: key/value heads, dividing n_head; 0 means n_head")
    mlp_hidden: int = opt(0, "nanochat only: the MLP's hidden width; 0 means 4 x n_embd")
    softcap: float = opt(
        15.0, "nanochat only: logits become softcap x tanh(logits / softcap); 0 means none"
    )
    dropout: float = opt(0.0, "dropout probability in [0, 1)")
    gelu: str = opt(
        "tanh",
        "gpt2 only: the MLP's GELU: tanh (GPT-2's approximation; Hugging Face gelu_new) or erf (exact, as nanoGPT; Hugging Face gelu)",
        ("tanh", "erf"),
    )
    bias: bool = opt(
        True,
        "gpt2 only: biases in the Linear and LayerNorm layers: true as GPT-2, false as nanoGPT's train.py (a model without them has no Hugging Face export)",
    )
    block_size: int = opt(0, "maximum context length; 0 means train.seq_len")
    init_from: str = opt(
        "",
        "start from the weights of a Hugging Face GPT-2 or NanoChat folder (config.json + model.safetensors, from gptrain export or save_pretrained); its config.json sets the architecture",
    )

    def check(self) -> None:
        check(0 <= self.dropout < 1, f"model.dropout = {self.dropout} must be in [0, 1)")
        check(
            not (self.init_from and self.preset),
            f"model.init_from = {self.init_from!r} and model.preset = {self.preset!r}: the weights' config.json sets the architecture; leave model.preset empty",
        )
        check(
            not (self.preset and self.arch != "gpt2"),
            f"model.preset = {self.preset!r} names a GPT-2 size, but model.arch = {self.arch!r}; leave model.preset empty and set model.n_layer/n_head/n_embd",
        )
        for key in ("n_kv_head", "mlp_hidden"):
            check(
                getattr(self, key) >= 0,
                f"model.{key} = {getattr(self, key)} must be >= 0 (0: the default)",
            )
        check(self.softcap >= 0, f"model.softcap = {self.softcap} must be >= 0 (0: no softcap)")
        if not self.preset:
            for key in ("n_layer", "n_head", "n_embd"):
                check(getattr(self, key) >= 1, f"model.{key} = {getattr(self, key)} must be >= 1")
            check(
                self.n_embd % self.n_head == 0,
                f"model.n_embd = {self.n_embd} is not divisible by model.n_head = {self.n_head}",
            )
        if self.arch == "nanochat" and not self.init_from:
            head = self.n_embd // self.n_head
            check(
                head % 2 == 0,
                f"model.n_embd / model.n_head = {head} is odd; RoPE rotates pairs of a head's channels: use an even head size",
            )
            check(
                self.n_kv_head == 0 or self.n_head % self.n_kv_head == 0,
                f"model.n_kv_head = {self.n_kv_head} does not divide model.n_head = {self.n_head}; use a divisor of n_head (0: n_head)",
            )
