"""GPT model: shapes, causality, init, tying, vocab padding, KV-cache generation, compile, FLOPs."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from gptrain.model.attention import matmul_attention
from gptrain.model.gpt import GPT, PRESETS, GPTConfig, KVCache


def tiny(**kw) -> GPTConfig:
    base = dict(vocab_size=100, block_size=16, n_layer=2, n_head=2, n_embd=32)
    return GPTConfig(**{**base, **kw})


def make(seed: int = 0, **kw) -> GPT:
    torch.manual_seed(seed)
    return GPT(tiny(**kw)).eval()


def test_padded_vocab_size():
    assert GPTConfig(vocab_size=50257).padded_vocab_size == 50304
    assert GPTConfig(vocab_size=64).padded_vocab_size == 64
    assert GPTConfig(vocab_size=65).padded_vocab_size == 128
    assert GPTConfig(vocab_size=257).padded_vocab_size == 320


def test_shapes_and_loss_matches_reference_cross_entropy():
    model = make()
    idx = torch.randint(0, 100, (3, 16))
    targets = torch.randint(0, 100, (3, 16))
    targets[0, :5] = -1  # ignored positions
    logits, _ = model(idx)
    assert logits.shape == (3, 16, 100) and logits.dtype == torch.float32
    no_logits, loss = model(idx, targets)  # the loss path never builds the logits
    assert no_logits is None
    assert model.transformer.wte.weight.shape == (128, 32)  # padded table
    keep = targets != -1
    logp = F.log_softmax(logits.double(), dim=-1)[keep]  # (N, V)
    ref = -logp.gather(1, targets[keep][:, None]).mean()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    assert model(idx)[1] is None


def test_too_long_sequence_names_both_lengths():
    model = make()
    with pytest.raises(ValueError, match=r"17.*16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_causality_later_tokens_never_change_earlier_logits():
    model = make()
    idx = torch.randint(0, 100, (2, 16))
    logits, _ = model(idx)
    for t in (0, 7, 15):
        changed = idx.clone()
        changed[:, t:] = (changed[:, t:] + 1 + torch.arange(16 - t)) % 100
        logits2, _ = model(changed)
        torch.testing.assert_close(logits2[:, :t], logits[:, :t], rtol=0, atol=1e-6)
        assert not torch.allclose(logits2[:, t], logits[:, t])  # the change is visible at t


def test_init_statistics():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=1000, block_size=256, n_layer=4, n_head=4, n_embd=256)
    model = GPT(cfg)
    residual_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    checked = 0
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight"):
            expected = residual_std
        elif p.dim() == 2:
            expected = 0.02
        elif ".ln_" in name or "ln_f" in name:
            want = 1.0 if name.endswith("weight") else 0.0
            assert torch.all(p == want), name
            continue
        else:
            assert name.endswith(".bias") and torch.all(p == 0), name
            continue
        # >= 65k samples each: std within 2%, mean within a few standard errors
        assert abs(p.std().item() / expected - 1) < 0.02, (name, p.std().item(), expected)
        assert abs(p.mean().item()) < 5 * expected / math.sqrt(p.numel()), name
        checked += 1
    assert checked == 2 + 4 * cfg.n_layer  # wte, wpe, and 4 matrices per block


def test_weight_tying_and_state_dict_roundtrip():
    model = make(seed=0)
    assert model.lm_head.weight is model.transformer.wte.weight
    # the tied matrix is one parameter: counted once, in one optimizer slot
    assert sum(1 for p in model.parameters() if p is model.lm_head.weight) == 1
    other = make(seed=1)
    other.load_state_dict(model.state_dict())
    assert other.lm_head.weight is other.transformer.wte.weight  # still tied after loading
    idx = torch.randint(0, 100, (2, 16))
    torch.testing.assert_close(other(idx)[0], model(idx)[0], rtol=0, atol=0)
    # the tied gradient is the sum of both uses' gradients, taken from an untied copy
    untied = copy.deepcopy(model)
    untied.lm_head.weight = torch.nn.Parameter(untied.transformer.wte.weight.detach().clone())
    model(idx, idx)[1].backward()
    untied(idx, idx)[1].backward()
    both = untied.transformer.wte.weight.grad + untied.lm_head.weight.grad
    assert (
        untied.lm_head.weight.grad.abs().sum() > 0
        and untied.transformer.wte.weight.grad.abs().sum() > 0
    )
    torch.testing.assert_close(model.transformer.wte.weight.grad, both, rtol=1e-5, atol=1e-7)


def _padded_rows_dominate(model: GPT) -> None:
    """Make every padded row win the argmax if it were in the logits."""
    V = model.config.vocab_size
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.fill_(1.0)  # final hidden state == ones
        model.transformer.wte.weight[V:] = 10.0  # padded logit = 10 * C, real ones ~ 0.02 * C


def test_padded_ids_never_sampled():
    model = make(vocab_size=65)  # padded to 128
    assert model.config.padded_vocab_size == 128
    _padded_rows_dominate(model)
    full = model.transformer.ln_f(torch.zeros(1, 32)) @ model.lm_head.weight.T  # (1, 128)
    assert full.argmax().item() >= 65  # the setup bites: the padded head would pick a pad id
    idx = torch.randint(0, 65, (4, 3))
    g = torch.Generator().manual_seed(0)
    for temperature, top_k in ((0.0, None), (1.0, None), (5.0, 3), (1.0, 200)):
        out = model.generate(idx, 20, temperature=temperature, top_k=top_k, generator=g)
        assert out.max().item() < 65


def test_padded_ids_rejected_as_targets():
    model = make(vocab_size=65)
    idx = torch.randint(0, 65, (1, 8))
    targets = idx.clone()
    targets[0, 3] = 100  # a padded id
    with pytest.raises((IndexError, RuntimeError)):
        model(idx, targets)


def _reference_greedy(model: GPT, idx: torch.Tensor, n: int) -> torch.Tensor:
    """No cache: full forward of the cropped context each step, argmax of the last logits."""
    for _ in range(n):
        logits, _ = model(idx[:, -model.config.block_size :])
        idx = torch.cat((idx, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    return idx


def test_generate_with_kv_cache_equals_no_cache_across_block_size_crop():
    model = make()
    # a random model is nearly uniform; sharpen it so argmax is decided by real margins
    with torch.no_grad():
        model.transformer.wte.weight.mul_(20)
    idx = torch.randint(0, 100, (3, 5))
    out = model.generate(idx, 30, temperature=0)  # 35 tokens > block_size 16: crops
    assert out.shape == (3, 35)
    assert torch.equal(out[:, :5], idx)
    assert torch.equal(out, _reference_greedy(model, idx, 30))


def test_cached_decode_logits_match_full_forward():
    model = make()
    idx = torch.randint(0, 100, (2, 12))
    caches = [KVCache() for _ in model.transformer.h]
    first = model._decode(idx[:, :4], caches, pos=0)  # prefill 4
    steps = [first] + [model._decode(idx[:, t : t + 1], caches, pos=t) for t in range(4, 12)]
    full, _ = model(idx)
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 3:], rtol=1e-5, atol=1e-5)


def test_generate_seeded_sampling_is_deterministic_and_top_k_1_is_greedy():
    model = make()
    idx = torch.randint(0, 100, (2, 4))
    a = model.generate(idx, 20, temperature=1.0, generator=torch.Generator().manual_seed(7))
    b = model.generate(idx, 20, temperature=1.0, generator=torch.Generator().manual_seed(7))
    c = model.generate(idx, 20, temperature=1.0, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    greedy = model.generate(idx, 20, temperature=0)
    top1 = model.generate(idx, 20, temperature=1.0, top_k=1, generator=torch.Generator())
    assert torch.equal(greedy, top1)
    with pytest.raises(ValueError):
        model.generate(idx, 1, temperature=-1)


def _check_compiled(backend: str) -> None:
    torch.compiler.reset()  # earlier tests' compilations count towards dynamo's recompile limit
    model = make()
    compiled = torch.compile(model, backend=backend, fullgraph=True)  # fullgraph: no graph breaks
    idx = torch.randint(0, 100, (2, 16))
    logits, _ = compiled(idx)
    ref_logits, _ = model(idx)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    _, loss = compiled(idx, idx)
    _, ref_loss = model(idx, idx)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    keys = list(model.state_dict())
    assert keys == list(make().state_dict())
    assert not any("_orig_mod" in k for k in keys)
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())  # the wrapper's keys


def _check_compiled_matmul_attention(backend: str) -> None:
    """The hand-written autograd Function of matmul_attention compiles without graph breaks, under
    bf16 autocast as auto picks it on CPUs, with eager's loss and gradients (to kernel rounding)."""
    torch.compiler.reset()
    idx = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(1))
    results = []
    for compile_it in (False, True):
        model = make(block_size=32).train()
        model.set_attention("matmul")
        run = torch.compile(model, backend=backend, fullgraph=True) if compile_it else model
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = run(idx, idx)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (eager_loss, eager_grads), (loss, grads) = results
    torch.testing.assert_close(loss, eager_loss, rtol=1e-3, atol=1e-3)
    for n, g in eager_grads.items():  # bf16 products: compare relative to each gradient's scale
        err = (grads[n] - g).norm() / g.norm().clamp_min(1e-12)
        assert err < 5e-3, f"{n}: compiled gradient differs from eager by {err:.4f} (relative)"


def test_torch_compile_matches_eager_and_keeps_clean_state_dict_keys():
    _check_compiled("aot_eager")  # dynamo capture + AOT autograd, seconds
    _check_compiled_matmul_attention("aot_eager")


@pytest.mark.slow
def test_torch_compile_inductor_matches_eager():
    """Real code generation of the hand-written attention, as the model calls it under bf16
    autocast (strided q, k, v views of one projection's output): the same output and gradients
    as eager (to kernel rounding). The attention alone is compiled: about a third of the whole
    model's code generation time on a CPU; the model's own inductor graphs are trained against
    eager by tests/test_train.py's compiled run, and traced with this attention without graph
    breaks by the aot_eager test above."""
    torch.compiler.reset()
    B, T, nh, hs = 2, 16, 2, 16
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, nh * hs, generator=g)
    w = torch.randn(3 * nh * hs, nh * hs, generator=g) / hs

    def attend(x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            q, k, v = F.linear(x, w).split(nh * hs, dim=2)  # bf16 (B, T, C) views, as c_attn's
            q, k, v = (t.view(B, T, nh, hs).transpose(1, 2) for t in (q, k, v))
            return matmul_attention(q, k, v)

    results = []
    for fn in (attend, torch.compile(attend, backend="inductor", fullgraph=True)):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xs, ws)
        y.float().square().sum().backward()
        results.append((y.detach().float(), xs.grad, ws.grad))
    (y0, *grads0), (y1, *grads1) = results
    # bf16 products: each tensor compared relative to its own scale; the output as closely as
    # the whole model's loss was, the gradients as closely as its gradients
    for name, a, b, bound in zip(("output", "x", "w"), (y0, *grads0), (y1, *grads1), (1e-3, 5e-3, 5e-3), strict=True):  # fmt: skip
        err = (b - a).norm() / a.norm()
        assert err < bound, f"{name}: compiled differs from eager by {err:.5f} (relative)"


def test_gradient_accumulation_equals_full_batch():
    model = make()
    model.train()
    idx = torch.randint(0, 100, (8, 16))
    targets = torch.randint(0, 100, (8, 16))
    _, loss = model(idx, targets)
    loss.backward()
    full = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    for i in range(4):
        _, loss = model(idx[2 * i : 2 * i + 2], targets[2 * i : 2 * i + 2])
        (loss / 4).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, full[n], rtol=1e-5, atol=1e-7, msg=n)


def test_bf16_autocast_loss_is_float32_and_close():
    model = make()
    idx = torch.randint(0, 100, (2, 16))
    _, ref = model(idx, idx)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = model(idx)
        _, loss = model(idx, idx)
    assert loss.dtype == torch.float32 and logits.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=2e-2, atol=2e-2)


def test_flops_per_token_matches_flop_counter():
    """6N + 12*L*C*T against torch's FLOP counter on a real forward + backward pass.

    The math SDPA backend runs attention as explicit bmm over the full T x T matrix, so the
    counter sees the PaLM convention. The counter counts matmuls only, so the 6 FLOPs per
    token of each bias / LayerNorm parameter are added to it.
    """
    model = make()
    B, T = 2, 16
    idx = torch.randint(0, 100, (B, T))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        _, loss = model(idx, idx)
        loss.backward()
    vectors = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    assert model.flops_per_token(T) * B * T == counter.get_total_flops() + 6 * vectors * B * T


def test_num_params_and_presets():
    model = make()
    total = sum(p.numel() for p in model.parameters())
    assert model.num_params(non_embedding=False) == total
    assert model.num_params() == total - 16 * 32
    with torch.device("meta"):  # no memory, no init cost
        gpt2 = GPT(GPTConfig(**PRESETS["gpt2"]))
    # GPT-2 small has 124,439,808 parameters; +47 padded rows of 768
    assert gpt2.num_params(non_embedding=False) == 124_439_808 + 47 * 768
    for name in ("tiny", "small", "mini", "gpt2-medium", "gpt2-large", "gpt2-xl"):
        cfg = GPTConfig(**PRESETS[name])
        assert cfg.n_embd % cfg.n_head == 0, name


def test_fsdp2_fully_shard_from_outside_matches_plain_model(one_process_group):
    """One-process gloo group: per-block then root fully_shard, same losses and weights."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    from gptrain.config.sections import OptimConfig
    from gptrain.training.optim import build_optimizer

    ref = make()
    sharded = copy.deepcopy(ref)
    for block in sharded.transformer.h:
        fully_shard(block)
    fully_shard(sharded)
    register_fsdp_forward_method(sharded, "generate")
    assert sharded.lm_head.weight is sharded.transformer.wte.weight
    opts = [
        build_optimizer(m, OptimConfig(lr=1e-2, weight_decay=0.1), "cpu") for m in (ref, sharded)
    ]
    idx = torch.randint(0, 100, (2, 16))
    for _ in range(2):
        losses = []
        for m, opt in zip((ref, sharded), opts, strict=True):
            _, loss = m(idx, idx)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss)
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    full = {k: v.full_tensor() for k, v in sharded.state_dict().items()}
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=k)
    prompt = idx[:, :3]
    assert torch.equal(sharded.generate(prompt, 5, temperature=0), ref.generate(prompt, 5, 0))


def test_model_with_matmul_attention_trains_like_sdpa():
    """set_attention("matmul"): same loss and gradients in float32, close under bf16 autocast."""
    idx = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    results = {}
    for impl in ("sdpa", "matmul"):
        model = make().train()
        model.set_attention(impl)
        _, loss = model(idx, idx)
        loss.backward()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, bf16 = model(idx, idx)
        results[impl] = (loss, bf16, {n: p.grad for n, p in model.named_parameters()})
    (l1, b1, g1), (l2, b2, g2) = results["sdpa"], results["matmul"]
    torch.testing.assert_close(l2, l1, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(b2, b1, rtol=2e-2, atol=2e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the result in the inputs' dtype
        q = torch.randn(2, 2, 8, 16, dtype=torch.bfloat16)
        assert matmul_attention(q, q, q).dtype == torch.bfloat16
    for n in g1:
        torch.testing.assert_close(g2[n], g1[n], rtol=1e-4, atol=1e-6, msg=n)
    with pytest.raises(ValueError, match="sdpa or matmul"):
        make().set_attention("flash")


def test_gelu_choice_is_the_mlp_activation():
    x = torch.randn(4, 8, 32)
    for gelu, approximate in (("tanh", "tanh"), ("erf", "none")):
        mlp = make(gelu=gelu).transformer.h[0].mlp
        want = mlp.c_proj(F.gelu(mlp.c_fc(x), approximate=approximate))
        torch.testing.assert_close(mlp(x), want, rtol=0, atol=0)
    assert not torch.equal(make(gelu="tanh")(torch.arange(16)[None])[0], make(gelu="erf")(torch.arange(16)[None])[0])  # fmt: skip
    with pytest.raises(ValueError, match="tanh or erf"):
        tiny(gelu="relu")
