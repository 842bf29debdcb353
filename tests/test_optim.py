"""Weight-decay groups, AdamW construction and the warmup + cosine schedule."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from gptrain.config import OptimConfig
from gptrain.model import GPT, GPTConfig
from gptrain.optim import build_optimizer, cosine_lr, param_groups


def _names(model: nn.Module, params: list) -> set[str]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return {by_id[id(p)] for p in params}


@pytest.mark.parametrize("bias", [True, False])
def test_decay_groups_are_exactly_matrices(bias):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=100, block_size=8, n_layer=2, n_head=2, n_embd=16, bias=bias))
    decay, no_decay = param_groups(model, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    # expected sets, derived from module types rather than tensor dims
    want_decay, want_none = set(), set()
    for mname, m in model.named_modules():
        if mname == "lm_head":
            continue  # tied to transformer.wte.weight, which named_parameters reports
        if isinstance(m, (nn.Linear, nn.Embedding)):
            want_decay.add(f"{mname}.weight")
        if isinstance(m, nn.LayerNorm):
            want_none.add(f"{mname}.weight")
        if isinstance(m, (nn.Linear, nn.LayerNorm)) and m.bias is not None:
            want_none.add(f"{mname}.bias")
    assert _names(model, decay["params"]) == want_decay
    assert _names(model, no_decay["params"]) == want_none
    assert (
        "transformer.wte.weight" in want_decay and "transformer.h.1.mlp.c_proj.weight" in want_decay
    )
    assert any(".ln_1." in n for n in want_none)
    per_block, final = (8, 2) if bias else (2, 1)  # 2 LN x (w, b) + 4 Linear biases; ln_f
    assert len(want_none) == 2 * per_block + final
    # every parameter exactly once, the tied one included once
    all_params = decay["params"] + no_decay["params"]
    assert len(all_params) == len({id(p) for p in all_params}) == len(list(model.parameters()))


def test_build_optimizer_settings():
    model = GPT(GPTConfig(vocab_size=100, block_size=8, n_layer=1, n_head=2, n_embd=16))
    opt = build_optimizer(model, OptimConfig(lr=3e-4, weight_decay=0.1), device_type="cpu")
    assert isinstance(opt, torch.optim.AdamW)
    d = opt.defaults
    assert d["betas"] == (0.9, 0.95) and d["eps"] == 1e-8 and d["lr"] == 3e-4
    assert d["foreach"] is True and not d["fused"]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    cuda = build_optimizer(model, OptimConfig(lr=3e-4, weight_decay=0.1), device_type="cuda")
    assert cuda.defaults["fused"] is True and not cuda.defaults["foreach"]
    # one step changes parameters and decays only the matrices when gradients are zero
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    for n, p in model.named_parameters():
        if p.dim() >= 2:
            torch.testing.assert_close(p, before[n] * (1 - 3e-4 * 0.1))
        else:
            assert torch.equal(p, before[n]), n


def _reference_lr(step, lr, min_lr, warmup, max_steps):
    if step < warmup:
        return lr * (step + 1) / warmup
    # cosine over the steps warmup .. max_steps-1 inclusive
    n = max_steps - 1 - warmup
    t = min(step - warmup, n)
    return min_lr + (lr - min_lr) * (1 + math.cos(math.pi * t / n)) / 2


def test_lr_schedule_points():
    kw = dict(lr=6e-4, min_lr=6e-5, warmup_steps=10, max_steps=101)
    assert cosine_lr(0, **kw) == pytest.approx(6e-5)  # lr / warmup
    assert cosine_lr(9, **kw) == pytest.approx(6e-4)  # end of warmup: peak
    assert cosine_lr(10, **kw) == pytest.approx(6e-4)  # first cosine step: peak
    assert cosine_lr(55, **kw) == pytest.approx((6e-4 + 6e-5) / 2)  # cosine midpoint
    assert cosine_lr(100, **kw) == pytest.approx(6e-5)  # max_steps - 1
    assert cosine_lr(500, **kw) == pytest.approx(6e-5)  # held
    for step in range(150):
        ref = _reference_lr(step, 6e-4, 6e-5, 10, 101)
        assert cosine_lr(step, **kw) == pytest.approx(ref, rel=1e-12), step


def test_lr_schedule_monotonic():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=7, max_steps=60)
    values = [cosine_lr(s, **kw) for s in range(80)]
    warm, decay = values[:7], values[6:]
    assert all(a < b for a, b in zip(warm, warm[1:], strict=False))
    assert all(a >= b for a, b in zip(decay, decay[1:], strict=False))
    assert all(0.1 <= v <= 1.0 for v in values)


def test_lr_schedule_without_warmup_and_bad_arguments():
    assert cosine_lr(0, lr=1.0, min_lr=0.0, warmup_steps=0, max_steps=11) == 1.0
    assert cosine_lr(10, lr=1.0, min_lr=0.0, warmup_steps=0, max_steps=11) == 0.0
    assert cosine_lr(0, lr=1.0, min_lr=0.5, warmup_steps=0, max_steps=1) == 0.5
    with pytest.raises(ValueError):
        cosine_lr(0, lr=1.0, min_lr=0.0, warmup_steps=-1, max_steps=10)
    with pytest.raises(ValueError):
        cosine_lr(-1, lr=1.0, min_lr=0.0, warmup_steps=0, max_steps=10)
