"""Weight-decay groups, AdamW and Muon + AdamW construction, and the cosine and wsd schedules."""

from __future__ import annotations

import copy
import io
import math
from dataclasses import replace

import pytest
import torch
import torch.nn as nn

from gptrain.config.sections import OptimConfig
from gptrain.errors import UserError
from gptrain.model.gpt import GPT, GPTConfig
from gptrain.training.optim import (
    MuonAdamW,
    beta2_at,
    build_optimizer,
    cosine_lr,
    lr_at,
    muon_split,
    param_groups,
    set_lr,
    wsd_lr,
)


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
    assert d["fused"] is True and not d["foreach"]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    mps = build_optimizer(model, OptimConfig(lr=3e-4, weight_decay=0.1), device_type="mps")
    assert mps.defaults["foreach"] is True and not mps.defaults["fused"]
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


def test_wsd_schedule_breakpoints():
    # 100 steps, warmup 10, decay over the last 20: stable on steps 10..79, decay on 80..99
    kw = dict(lr=1e-2, min_lr=1e-3, warmup_steps=10, max_steps=100, decay_fraction=0.2)
    assert wsd_lr(0, **kw) == pytest.approx(1e-3)  # lr / warmup
    assert wsd_lr(9, **kw) == 1e-2  # last warmup step: peak
    assert wsd_lr(10, **kw) == 1e-2 and wsd_lr(79, **kw) == 1e-2  # stable, to the last step
    assert wsd_lr(80, **kw) == pytest.approx(1e-2 - 9e-3 / 20)  # first decay step
    assert wsd_lr(89, **kw) == pytest.approx((1e-2 + 1e-3) / 2)  # decay midpoint
    assert wsd_lr(99, **kw) == 1e-3 and wsd_lr(500, **kw) == 1e-3  # last step, then held
    decay = [wsd_lr(s, **kw) for s in range(79, 100)]
    steps = [a - b for a, b in zip(decay, decay[1:], strict=False)]
    assert all(d == pytest.approx(9e-3 / 20, rel=1e-9) for d in steps)  # linear
    # lr_at dispatches on the config
    cfg = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=10, lr_schedule="wsd", decay_fraction=0.2)
    assert [lr_at(s, cfg, 100) for s in range(120)] == [wsd_lr(s, **kw) for s in range(120)]
    cos = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=10)
    assert lr_at(50, cos, 100) == cosine_lr(
        50, lr=1e-2, min_lr=1e-3, warmup_steps=10, max_steps=100
    )


def test_wsd_edge_cases():
    # decay_fraction = 1: linear decay straight after warmup (it never eats into the warmup)
    kw = dict(lr=1.0, min_lr=0.0, warmup_steps=4, max_steps=14)
    assert wsd_lr(3, decay_fraction=1.0, **kw) == 1.0
    assert [wsd_lr(s, decay_fraction=1.0, **kw) for s in range(4, 14)] == pytest.approx(
        [1 - (s - 3) / 10 for s in range(4, 14)]
    )
    # a tiny fraction still decays over one step, the last one
    assert (
        wsd_lr(12, decay_fraction=1e-6, **kw) == 1.0
        and wsd_lr(13, decay_fraction=1e-6, **kw) == 0.0
    )
    assert wsd_lr(0, lr=1.0, min_lr=0.5, warmup_steps=0, max_steps=1, decay_fraction=0.5) == 0.5
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError):
            wsd_lr(0, decay_fraction=bad, **kw)


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=100, block_size=8, n_layer=2, n_head=2, n_embd=16, **kw))


@pytest.mark.parametrize("bias", [True, False])
def test_muon_split_is_exactly_the_block_matrices(bias):
    model = _model(bias=bias)
    muon, (decay, no_decay) = muon_split(model, weight_decay=0.1)
    want_muon = {
        f"transformer.h.{i}.{m}.weight"
        for i in range(2)
        for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    }
    assert _names(model, muon) == want_muon
    assert _names(model, decay["params"]) == {"transformer.wte.weight", "transformer.wpe.weight"}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 1 for p in no_decay["params"])  # biases and LayerNorms
    everything = muon + decay["params"] + no_decay["params"]
    assert len(everything) == len({id(p) for p in everything}) == len(list(model.parameters()))
    assert model.lm_head.weight is model.transformer.wte.weight  # the tied head: with AdamW


def test_nanochat_muon_split_keeps_the_untied_head_with_adamw():
    """nanochat: Muon gets exactly the blocks' Linear weights (c_q, c_k, c_v, c_proj, c_fc,
    c_proj, named from the module tree); AdamW the embedding and the untied lm_head; the
    no-decay group is empty (no 1-D parameters), and a step with it runs and moves the head."""
    from gptrain.model.nanochat import NanoChat, NanoChatConfig

    torch.manual_seed(0)
    model = NanoChat(NanoChatConfig(vocab_size=100, block_size=8, n_layer=2, n_head=4, n_kv_head=2, n_embd=32))  # fmt: skip
    muon, (decay, no_decay) = muon_split(model, weight_decay=0.1)
    want_muon = {
        f"{name}.weight"
        for name, m in model.named_modules()
        if name.startswith("transformer.h.") and isinstance(m, nn.Linear)
    }
    assert len(want_muon) == 2 * 6 and _names(model, muon) == want_muon
    assert _names(model, decay["params"]) == {"transformer.wte.weight", "lm_head.weight"}
    assert no_decay["params"] == []
    everything = muon + decay["params"] + no_decay["params"]
    assert len(everything) == len({id(p) for p in everything}) == len(list(model.parameters()))
    cfg = OptimConfig(name="muon", muon_dtype="float32")
    opt = build_optimizer(model, cfg, device_type="cpu", muon_dtype=torch.float32)
    head = model.lm_head.weight.detach().clone()
    _grads(model, 0)
    opt.step()
    assert not torch.equal(head, model.lm_head.weight)


def _grads(model, seed):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def test_muon_adamw_steps_like_the_two_torch_optimizers():
    """One MuonAdamW step == torch.optim.Muon on the block matrices + torch.optim.AdamW on the
    rest, with the schedule's lr set through set_lr (Muon's lr scaled by the same fraction), and
    each with its own weight decay: optim.muon_weight_decay for Muon, optim.weight_decay for AdamW."""
    cfg = OptimConfig(name="muon", lr=1e-3, muon_lr=0.05, weight_decay=0.1, muon_weight_decay=0.3, muon_momentum=0.9)  # fmt: skip
    a, b = _model(), _model()
    opt = build_optimizer(a, cfg, "cpu")
    assert isinstance(opt, MuonAdamW) and not isinstance(opt, torch.optim.AdamW)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.3, 0.1, 0.0]
    muon_b, groups_b = muon_split(b, 0.1)
    ref_muon = torch.optim.Muon(muon_b, lr=0.05, weight_decay=0.3, momentum=0.9, adjust_lr_fn="original")  # fmt: skip
    ref_adamw = torch.optim.AdamW(groups_b, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)
    for step in range(3):
        scale = 0.5 if step == 2 else 1.0
        set_lr(opt, 1e-3 * scale, cfg)
        for g in ref_muon.param_groups:
            g["lr"] = 0.05 * scale
        for g in ref_adamw.param_groups:
            g["lr"] = 1e-3 * scale
        _grads(a, step), _grads(b, step)
        opt.step()
        ref_muon.step(), ref_adamw.step()
        opt.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in a.parameters())
    for (n, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), n
    assert [g["lr"] for g in opt.param_groups] == [0.025, 5e-4, 5e-4]
    assert opt.muon.defaults["adjust_lr_fn"] == "original"  # lr * sqrt(max(1, rows / cols))


def test_muon_adamw_state_dict_round_trip_and_exact_continuation():
    """Save after 3 steps (through torch.distributed.checkpoint.state_dict, as checkpoint.py does,
    and torch.save), load into a fresh model + optimizer: the next 3 steps are bit-identical."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    cfg = OptimConfig(name="muon", weight_decay=0.1)
    model = _model()
    opt = build_optimizer(model, cfg, "cpu")
    x = torch.randint(0, 100, (4, 8), generator=torch.Generator().manual_seed(1))

    def step(m, o):
        _, loss = m(x, x)
        loss.backward()
        o.step()
        o.zero_grad(set_to_none=True)

    for _ in range(3):
        step(model, opt)
    saved = get_optimizer_state_dict(model, opt)
    assert "transformer.h.0.mlp.c_fc.weight" in saved["state"]  # keys are parameter names
    assert set(saved["state"]["transformer.h.0.mlp.c_fc.weight"]) == {"momentum_buffer"}
    assert set(saved["state"]["transformer.wte.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    buf = io.BytesIO()
    torch.save(saved, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)

    model2 = copy.deepcopy(model)
    opt2 = build_optimizer(model2, cfg, "cpu")
    set_optimizer_state_dict(model2, opt2, loaded)
    # the inner optimizers follow the loaded groups and state
    assert opt2.muon.param_groups[0] is opt2.param_groups[0] and opt2.adamw.state is opt2.state
    assert opt2.muon.state is opt2.state and len(opt2.state) == len(list(model.parameters()))
    for _ in range(3):
        step(model, opt)
        step(model2, opt2)
    for (n, pa), pb in zip(model.named_parameters(), model2.parameters(), strict=True):
        assert torch.equal(pa, pb), n
    sa, sb = opt.state_dict(), opt2.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for k, v in sa["state"].items():
        for name, t in v.items():
            assert torch.equal(t, sb["state"][k][name]), (k, name)


def test_muon_weight_decay_and_weight_decay_each_decay_their_own_matrices():
    """One MuonAdamW step with zero gradients is weight decay alone, computed by hand: each Muon
    matrix is multiplied by 1 - lr x optim.muon_weight_decay (Muon's scheduled lr, without its
    sqrt(rows / cols) factor), each AdamW matrix (wte, wpe) by 1 - lr x optim.weight_decay, and the
    1-D parameters are left as they are; after set_lr both decays follow the schedule."""
    muon_lr, lr, muon_wd, wd = (
        0.2,
        0.1,
        1.5,
        0.5,
    )  # factors 0.7 and 0.95: told apart at any rounding
    cfg = OptimConfig(name="muon", lr=lr, muon_lr=muon_lr, weight_decay=wd, muon_weight_decay=muon_wd)  # fmt: skip
    model = _model()
    opt = build_optimizer(model, cfg, "cpu")
    muon_names = _names(model, muon_split(model, wd)[0])
    assert len(muon_names) == 8  # 2 blocks x (c_attn, attn c_proj, c_fc, mlp c_proj)
    for scale in (1.0, 0.5):  # the peak, then half of it (set_lr scales both lrs alike)
        set_lr(opt, lr * scale, cfg)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        for n, p in model.named_parameters():
            if n in muon_names:
                factor = 1 - muon_lr * scale * muon_wd
            elif p.dim() >= 2:
                factor = 1 - lr * scale * wd
            else:
                factor = 1.0
            torch.testing.assert_close(p.detach(), before[n] * factor, rtol=1e-6, atol=0, msg=n)


def test_set_lr_adamw_groups():
    cfg = OptimConfig(lr=1e-3)
    opt = build_optimizer(_model(), cfg, "cpu")
    set_lr(opt, 2e-4, cfg)
    assert [g["lr"] for g in opt.param_groups] == [2e-4, 2e-4]


def test_muon_under_fsdp_splits_and_is_built_without_torch_optim_muon(monkeypatch):
    """FSDP2 takes Muon with the work split (auto or split) and refuses redundant in one line (no
    rank holds a whole matrix); a torch without torch.optim.Muon (< 2.9) trains Muon anyway: the
    update is gptrain's own (training/muon.py)."""
    from gptrain.config.load import load_config

    for split in ("auto", "split"):
        load_config(None, ["optim.name=muon", "dist.mode=fsdp", f"optim.muon_split={split}"])
    with pytest.raises(UserError, match="optim.muon_split = 'redundant' with dist.mode = 'fsdp'"):
        load_config(None, ["optim.name=muon", "dist.mode=fsdp", "optim.muon_split=redundant"])
    monkeypatch.delattr(torch.optim, "Muon")
    cfg = load_config(None, ["optim.name=muon"]).optim
    model = _model()
    opt = build_optimizer(model, cfg, "cpu")
    before = model.transformer.h[0].mlp.c_fc.weight.detach().clone()
    _grads(model, 0)
    opt.step()
    assert not torch.equal(model.transformer.h[0].mlp.c_fc.weight, before)


needs_torch_muon = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch < 2.9: no torch.optim.Muon to compare with")  # fmt: skip
SHAPES = [(48, 16), (16, 16), (64, 16), (16, 64), (37, 200)]  # tall, square, wide, odd


def _pairs(seed=0):
    g = torch.Generator().manual_seed(seed)
    a = [nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in SHAPES]
    return a, [nn.Parameter(p.detach().clone()) for p in a]


@needs_torch_muon
@pytest.mark.parametrize("nesterov", [True, False])
def test_our_muon_in_bf16_equals_torch_muon_bit_for_bit(nesterov):
    """Five steps (the lr changed on the way) of training/muon.py's Muon in bf16 against
    torch.optim.Muon(adjust_lr_fn="original"): parameters, momentum buffers and the state dict
    (the checkpoint layout) identical, and each one's state dict continues the other's exactly."""
    from gptrain.training.muon import Muon

    ours, theirs = _pairs()
    kw = dict(lr=0.05, weight_decay=0.1, momentum=0.9, nesterov=nesterov)
    a = Muon(ours, **kw, dtype=torch.bfloat16)
    b = torch.optim.Muon(theirs, **kw, adjust_lr_fn="original")
    g = torch.Generator().manual_seed(1)

    def step(scale):
        for p, q in zip(ours, theirs, strict=True):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        for opt in (a, b):
            for group in opt.param_groups:
                group["lr"] = 0.05 * scale
            opt.step()

    for i in range(5):
        step(0.5 if i >= 3 else 1.0)
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i, state in sb["state"].items():
        assert set(state) == {"momentum_buffer"}
        assert torch.equal(sa["state"][i]["momentum_buffer"], state["momentum_buffer"])
    a.load_state_dict(sb)  # a torch.optim.Muon checkpoint resumes in ours, and the reverse
    b.load_state_dict(sa)
    step(1.0)
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)


def _newton_schulz_float64(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The reference: Keller Jordan's quintic iteration, written out in float64."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    x = x.T if g.shape[0] > g.shape[1] else x
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.shape[0] > g.shape[1] else x


def test_float32_orthogonalisation_is_within_1e_5_of_float64():
    """The tolerance the module docstring states: max abs error <= 1e-5 against float64 (measured
    ~7e-7; entries are ~0.1-0.6); bf16, torch's only dtype, is ~1e-2 off."""
    from gptrain.training.muon import orthogonalise

    g = torch.Generator().manual_seed(0)
    for shape in SHAPES + [(384, 128), (128, 512)]:
        grad = torch.randn(shape, generator=g)
        kept = grad.clone()
        ref = _newton_schulz_float64(grad)
        f32 = orthogonalise(grad, 5, torch.float32)
        assert f32.dtype == torch.float32 and f32.shape == grad.shape
        assert (f32.double() - ref).abs().max() <= 1e-5, shape
        bf16 = orthogonalise(grad, 5, torch.bfloat16)
        assert (bf16.double() - ref).abs().max() > 1e-3, shape  # the dtype is really used
        assert torch.equal(grad, kept)  # the input (a momentum buffer, without nesterov) untouched


def test_muon_adamw_orthogonalises_in_the_chosen_dtype():
    """optim.muon_dtype = float32 (or the measured choice passed in): one step moves each block
    matrix by lr * sqrt(max(1, rows / cols)) * NS(grad) (after decay), NS within 1e-5 of float64."""
    cfg = OptimConfig(name="muon", muon_lr=0.05, muon_weight_decay=0.1, muon_dtype="float32")
    model = _model()
    opt = build_optimizer(model, cfg, "cpu")
    assert opt.muon.dtype == torch.float32
    assert build_optimizer(_model(), cfg, "cpu", muon_dtype=torch.bfloat16).muon.dtype == torch.bfloat16  # fmt: skip
    assert build_optimizer(_model(), OptimConfig(name="muon"), "cpu").muon.dtype == torch.bfloat16
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _grads(model, 3)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    w = "transformer.h.1.attn.c_attn.weight"  # 48 x 16: scale sqrt(3)
    # first step, nesterov: update = grad.lerp(buf, momentum) with buf = (1 - momentum) * grad
    update = grads[w] * (1 - 0.95**2)
    want = before[w] * (1 - 0.05 * 0.1) - 0.05 * math.sqrt(3) * _newton_schulz_float64(update)
    assert (model.get_parameter(w).double() - want).abs().max() < 1e-6


class _Products(torch.overrides.TorchFunctionMode):
    """Records the batch size of every matrix product computed inside it (1 for a 2-D one)."""

    BATCHED = {torch.bmm, torch.baddbmm, torch.Tensor.bmm, torch.Tensor.baddbmm}
    PLAIN = {torch.mm, torch.addmm, torch.matmul, torch.Tensor.mm, torch.Tensor.matmul, torch.Tensor.__matmul__}  # fmt: skip

    def __init__(self):
        super().__init__()
        self.batches = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.BATCHED or func in self.PLAIN:
            a = args[-2]
            self.batches.append(a.shape[0] if a.dim() == 3 else 1)
        return func(*args, **(kwargs or {}))


# bf16 keeps 8 significant bits: 4 of its steps at 0.5, the size of the largest entries
BF16_TOLERANCE = 4 * 2**-9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_stack_is_orthogonalised_like_each_of_its_matrices(dtype):
    """orthogonalise on a (B, m, n) stack (tall, wide, square) == each matrix on its own, within
    float32 rounding (1e-5) or a few bf16 steps, in 5 x 3 batched products of B, no 2-D one."""
    from gptrain.training.muon import orthogonalise

    g = torch.Generator().manual_seed(0)
    for shape in [(48, 16), (16, 64), (37, 200), (64, 64)]:
        stack = torch.randn(4, *shape, generator=g)
        stack[2] *= 100  # each matrix its own norm
        with _Products() as products:
            got = orthogonalise(stack, 5, dtype)
        assert products.batches == [4] * 15, shape
        want = torch.stack([orthogonalise(m, 5, dtype) for m in stack])
        assert got.dtype == dtype and got.shape == stack.shape
        tolerance = 1e-5 if dtype == torch.float32 else BF16_TOLERANCE
        assert (got.float() - want.float()).abs().max() <= tolerance, shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nesterov", [True, False])
def test_batched_muon_steps_like_the_per_matrix_path(dtype, nesterov):
    """Muon over same-shape and mixed-shape matrices in two groups (one with other ns_steps):
    batched (the default), each group's matrices of one shape are one stack (batch sizes counted:
    3 and 2 in group 0; group 1's (48, 16) pair, with other ns_steps, apart), and 4 steps end
    within rounding of the per-matrix path (batched=False), parameters and momentum alike."""
    from gptrain.training.muon import Muon

    shapes = [(48, 16), (16, 64), (48, 16), (37, 200), (16, 64), (48, 16)]
    g = torch.Generator().manual_seed(0)
    ours = [nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in shapes + [(48, 16)] * 2]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]

    def build(params, batched):
        groups = [{"params": params[:6]}, {"params": params[6:], "ns_steps": 3}]
        kw = dict(lr=0.05, weight_decay=0.1, momentum=0.9, nesterov=nesterov)
        return Muon(groups, **kw, dtype=dtype, batched=batched)

    a, b = build(ours, True), build(theirs, False)
    for _ in range(4):
        for p, q in zip(ours, theirs, strict=True):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        with _Products() as batched:
            a.step()
        with _Products() as one_by_one:
            b.step()
        assert sorted(set(batched.batches)) == [1, 2, 3] and set(one_by_one.batches) == {1}
        assert batched.batches.count(3) == 15 and batched.batches.count(2) == 15 + 3 * 3
    tolerance = 1e-5 if dtype == torch.float32 else 0.05 * BF16_TOLERANCE  # the lr: 0.05
    for p, q in zip(ours, theirs, strict=True):
        assert (p - q).abs().max() <= 4 * tolerance * math.sqrt(3)
        torch.testing.assert_close(a.state[p]["momentum_buffer"], b.state[q]["momentum_buffer"])


def _nanochat(seed=0):
    from gptrain.model.nanochat import NanoChat, NanoChatConfig

    torch.manual_seed(seed)
    return NanoChat(NanoChatConfig(vocab_size=100, block_size=8, n_layer=2, n_head=4, n_kv_head=2, n_embd=32))  # fmt: skip


EMBED_HEAD = {  # from the module tree: the embeddings and the output head of each block
    "gpt2": {"transformer.wte.weight", "transformer.wpe.weight"},  # lm_head IS wte (tied)
    "nanochat": {"transformer.wte.weight", "lm_head.weight"},  # untied head
}


@pytest.mark.parametrize("name", ["adamw", "muon"])
@pytest.mark.parametrize("arch", ["gpt2", "nanochat"])
def test_embed_lr_group_holds_the_embeddings_and_head_each_parameter_once(arch, name):
    """optim.embed_lr > 0: one AdamW group, marked "embed", with exactly the embeddings and the
    output head (GPT-2's tied head is wte: one parameter; nanochat's untied head and embedding
    both), decayed as matrices; every parameter in exactly one group, no group empty (a
    checkpoint's optimizer may hold one empty group only); Muon's matrices as without it.
    embed_lr = 0 leaves the groups as they were."""
    model = _model() if arch == "gpt2" else _nanochat()
    cfg = OptimConfig(name=name, embed_lr=3e-3, weight_decay=0.1, muon_dtype="float32")
    opt = build_optimizer(model, cfg, "cpu", muon_dtype=torch.float32)
    embed = [g for g in opt.param_groups if g.get("embed")]
    assert len(embed) == 1 and embed[0]["weight_decay"] == 0.1
    assert _names(model, embed[0]["params"]) == EMBED_HEAD[arch]
    assert (model.lm_head.weight is model.transformer.wte.weight) == (arch == "gpt2")
    everything = [p for g in opt.param_groups for p in g["params"]]
    assert len(everything) == len({id(p) for p in everything}) == len(list(model.parameters()))
    assert all(g["params"] for g in opt.param_groups)
    muon = [p for g in opt.param_groups if "ns_steps" in g for p in g["params"]]
    assert _names(model, muon) == (_names(model, muon_split(model, 0.1)[0]) if name == "muon" else set())  # fmt: skip
    plain = build_optimizer(model, replace(cfg, embed_lr=0.0), "cpu", muon_dtype=torch.float32)
    assert not any(g.get("embed") for g in plain.param_groups)
    assert len(plain.param_groups) == (2 if name == "adamw" else 3)  # as before the key


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_embed_lr_is_scheduled_as_lr(schedule):
    """set_lr gives the embed group the schedule of a run whose peak is embed_lr and whose min_lr
    keeps the min_lr / lr ratio (lr_at of that config, an independent reading), at every step:
    warmup, decay and end; the other AdamW groups keep lr, Muon's muon_lr scaled alike."""
    cfg = OptimConfig(name="muon", lr=1e-3, min_lr=2e-4, embed_lr=5e-3, muon_lr=0.02, warmup_steps=3, lr_schedule=schedule, decay_fraction=0.5, muon_dtype="float32")  # fmt: skip
    as_embed = replace(cfg, lr=5e-3, min_lr=2e-4 * 5)
    as_muon = replace(cfg, lr=0.02, min_lr=2e-4 * 20)
    opt = build_optimizer(_nanochat(), cfg, "cpu", muon_dtype=torch.float32)
    for step in [*range(12), 5.5]:
        lr = lr_at(step, cfg, 12)
        set_lr(opt, lr, cfg)
        for g in opt.param_groups:
            ref = as_muon if "ns_steps" in g else as_embed if g.get("embed") else cfg
            assert g["lr"] == pytest.approx(lr_at(step, ref, 12), rel=1e-12), (step, g.keys())
    assert lr_at(11, as_embed, 12) == pytest.approx(1e-3)  # the end: min_lr x embed_lr / lr


def test_embed_lr_steps_like_one_torch_adamw_per_lr():
    """AdamW with embed_lr: a few steps equal torch.optim.AdamW with the embeddings and head at
    embed_lr and the rest at lr, each scaled by the schedule's fraction; embed_lr = lr equals
    embed_lr = 0 bit for bit (taking the group out changes nothing else)."""
    cfg = OptimConfig(lr=1e-3, min_lr=1e-4, embed_lr=4e-3, weight_decay=0.1, warmup_steps=2)
    a, b = _nanochat(), _nanochat()
    opt = build_optimizer(a, cfg, "cpu")
    embed = {id(p) for p in (b.transformer.wte.weight, b.lm_head.weight)}
    ref = torch.optim.AdamW(
        [
            {"params": [p for p in b.parameters() if id(p) in embed], "peak": 4e-3},
            {"params": [p for p in b.parameters() if id(p) not in embed], "peak": 1e-3},
        ],
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        fused=True,
    )
    for step in range(4):
        set_lr(opt, lr_at(step, cfg, 4), cfg)
        for g in ref.param_groups:
            g["lr"] = g["peak"] * lr_at(step, cfg, 4) / 1e-3
        _grads(a, step), _grads(b, step)
        opt.step(), ref.step()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-9, msg=n)
    runs = []
    for embed_lr in (0.0, 1e-3):
        model, c = _model(), replace(cfg, embed_lr=embed_lr)
        o = build_optimizer(model, c, "cpu")
        for step in range(3):
            set_lr(o, lr_at(step, c, 4), c)
            _grads(model, step)
            o.step()
        runs.append(dict(model.named_parameters()))
    for n, p in runs[0].items():
        assert torch.equal(p, runs[1][n]), n


@pytest.mark.parametrize("batch_tokens", [4096, 2**14, 2**19, 2**21])
def test_beta2_at_keeps_the_half_life_in_tokens(batch_tokens):
    """The tokens after which the second moment's weight of a gradient falls to 1/2 are the same
    at any batch as 0.95's at 2**19 tokens: from the half-life formula, and by multiplying the
    per-step decay over as many steps as one 2**19-token step holds (4096: 128 steps)."""
    beta2 = beta2_at(batch_tokens)
    assert 0 < beta2 < 1

    def half_life_tokens(beta, batch):  # beta ** (tokens / batch) = 1/2
        return batch * math.log(0.5) / math.log(beta)

    want = half_life_tokens(0.95, 2**19)
    assert half_life_tokens(beta2, batch_tokens) == pytest.approx(want, rel=1e-9)
    if batch_tokens <= 2**19:
        weight = 1.0
        for _ in range(2**19 // batch_tokens):
            weight *= beta2
        assert weight == pytest.approx(0.95, rel=1e-9)
    assert beta2_at(2**19) == 0.95 and beta2_at(2**18, 0.99, 2**18) == 0.99
    assert beta2_at(4096) == pytest.approx(0.9996, abs=1e-5)
    for bad in ((0,), (4096, 1.0), (4096, 0.95, 0)):
        with pytest.raises(ValueError):
            beta2_at(*bad)
