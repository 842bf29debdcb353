"""NanoChat model: config checks, init, causality, meta builds, KV-cache generation, the matmul
attention, FLOPs against torch's counter, and the arch registry. (Equality with transformers'
NanoChatForCausalLM: tests/test_nanochat_hf.py.)"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from gptrain.model import arch
from gptrain.model.decode import KVCache
from gptrain.model.gpt import GPT, GPTConfig
from gptrain.model.gpt import Block as GPTBlock
from gptrain.model.nanochat import Block, NanoChat, NanoChatConfig

VOCAB = 101  # padded to 128


def tiny(**kw) -> NanoChatConfig:
    base = dict(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)
    return NanoChatConfig(**{**base, **kw})


def make(seed: int = 0, randomize: bool = True, **kw) -> NanoChat:
    """A tiny model; randomize: every weight random (the init zeroes both c_proj, which would
    make each block the identity and hide attention and MLP bugs)."""
    torch.manual_seed(seed)
    model = NanoChat(tiny(**kw)).eval()
    if randomize:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.3)
    return model


def test_config_defaults_and_bad_values():
    cfg = NanoChatConfig()
    assert (cfg.kv_heads, cfg.hidden, cfg.head_dim, cfg.padded_vocab_size) == (6, 3072, 128, 50304)
    for kw, match in (
        (dict(n_embd=60, n_head=8), "divisible by n_head"),
        (dict(n_embd=36, n_head=4, n_kv_head=0), "odd"),
        (dict(n_head=4, n_kv_head=3), "n_kv_head"),
        (dict(softcap=-1.0), "softcap"),
        (dict(mlp_hidden=-1), "mlp_hidden"),
    ):
        with pytest.raises(ValueError, match=match):
            tiny(**kw)


def test_init_zero_projections_and_first_loss_is_ln_vocab():
    torch.manual_seed(0)
    cfg = NanoChatConfig(vocab_size=1000, block_size=64, n_layer=2, n_head=4, n_embd=256)
    model = NanoChat(cfg)
    assert list(model.buffers()) == []  # parameters only: nothing to go stale on meta
    assert model.lm_head.weight is not model.transformer.wte.weight  # untied
    bound = math.sqrt(3 / 256)
    for block in model.transformer.h:
        assert torch.all(block.attn.c_proj.weight == 0) and torch.all(block.mlp.c_proj.weight == 0)
        for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.mlp.c_fc):
            w = lin.weight
            assert w.abs().max() <= bound and abs(w.std().item() * math.sqrt(256) - 1) < 0.03
    assert abs(model.transformer.wte.weight.std().item() - 1.0) < 0.02
    assert abs(model.lm_head.weight.std().item() / 0.001 - 1) < 0.03
    idx = torch.randint(0, 1000, (4, 64))
    _, loss = model(idx, idx)
    assert abs(loss.item() - math.log(1000)) < 0.01


def test_meta_build_to_empty_and_init_weights_is_complete():
    """Built on meta (no rotary tables to rebuild), materialised and initialised: the same
    function as a model built directly with the same seed."""
    ref = NanoChat(tiny())
    torch.manual_seed(3)
    ref.init_weights()
    with torch.device("meta"):
        model = NanoChat(tiny())
    model.to_empty(device="cpu")
    torch.manual_seed(3)
    model.init_weights()
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), n
    idx = torch.randint(0, VOCAB, (2, 16))
    torch.testing.assert_close(model(idx)[0], ref(idx)[0], rtol=0, atol=0)


def test_standalone_block_equals_the_block_in_the_model():
    model = make()
    x = torch.randn(2, 16, 64)
    block = Block(model.config)
    block.load_state_dict(model.transformer.h[1].state_dict())
    want = model.transformer.h[1](x, None)  # rope from positions 0..15
    torch.testing.assert_close(block(x), want, rtol=0, atol=0)


def test_shapes_causality_and_too_long_sequence():
    model = make()
    idx = torch.randint(0, VOCAB, (2, 16))
    logits, none = model(idx)
    assert none is None and logits.shape == (2, 16, VOCAB) and logits.dtype == torch.float32
    assert logits.abs().max() <= model.config.softcap
    for t in (0, 7, 15):
        changed = idx.clone()
        changed[:, t:] = (changed[:, t:] + 1 + torch.arange(16 - t)) % VOCAB
        logits2, _ = model(changed)
        torch.testing.assert_close(logits2[:, :t], logits[:, :t], rtol=0, atol=1e-6)
        assert not torch.allclose(logits2[:, t], logits[:, t])
    with pytest.raises(ValueError, match=r"17.*16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def _reference_greedy(model, idx: torch.Tensor, n: int) -> torch.Tensor:
    """No cache: full forward of the cropped context each step, argmax of the last logits."""
    for _ in range(n):
        logits, _ = model(idx[:, -model.config.block_size :])
        idx = torch.cat((idx, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    return idx


@pytest.mark.parametrize("n_kv_head", [2, 4])
def test_generate_with_kv_cache_equals_no_cache_across_block_size_crop(n_kv_head):
    model = make(n_kv_head=n_kv_head)
    idx = torch.randint(0, VOCAB, (3, 5))
    out = model.generate(idx, 30, temperature=0)  # 35 tokens > block_size 16: crops
    assert out.shape == (3, 35) and torch.equal(out[:, :5], idx)
    assert torch.equal(out, _reference_greedy(model, idx, 30))


def test_cached_decode_logits_match_full_forward():
    model = make()
    idx = torch.randint(0, VOCAB, (2, 12))
    caches = [KVCache() for _ in model.blocks()]
    steps = [model._decode(idx[:, :4], caches, pos=0)]  # prefill 4
    steps += [model._decode(idx[:, t : t + 1], caches, pos=t) for t in range(4, 12)]
    assert caches[0].k.shape == (2, 2, 16, 16)  # n_kv_head heads cached
    full, _ = model(idx)
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 3:], rtol=1e-5, atol=1e-5)


def test_matmul_attention_trains_like_sdpa_with_gqa():
    idx = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))
    results = {}
    for impl in ("sdpa", "matmul"):
        model = make().train()
        model.set_attention(impl)
        _, loss = model(idx, idx)
        loss.backward()
        results[impl] = (loss, {n: p.grad for n, p in model.named_parameters()})
    (l1, g1), (l2, g2) = results["sdpa"], results["matmul"]
    torch.testing.assert_close(l2, l1, rtol=1e-6, atol=1e-6)
    for n in g1:
        torch.testing.assert_close(g2[n], g1[n], rtol=1e-4, atol=1e-6, msg=n)
    with pytest.raises(ValueError, match="sdpa or matmul"):
        make().set_attention("flash")


def test_bf16_autocast_loss_is_float32_and_close():
    model = make()
    idx = torch.randint(0, VOCAB, (2, 16))
    _, ref = model(idx, idx)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = model(idx)
        _, loss = model(idx, idx)
    assert loss.dtype == torch.float32 and logits.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=3e-2, atol=3e-2)


def test_compiled_matches_eager():
    torch.compiler.reset()
    model = make()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    idx = torch.randint(0, VOCAB, (2, 16))
    torch.testing.assert_close(compiled(idx)[0], model(idx)[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled(idx, idx)[1], model(idx, idx)[1], rtol=1e-5, atol=1e-5)
    # and the gradients: the block's hand-written backward passes traced as eager runs them
    params = list(model.parameters())
    want = torch.autograd.grad(model(idx, idx)[1], params)
    got = torch.autograd.grad(compiled(idx, idx)[1], params)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def _counted(fn) -> int:
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        fn().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("which", ["gpt2", "nanochat"])
def test_flops_per_token_and_block_flops_match_flop_counter(which):
    """flops_per_token against torch's FLOP counter on a forward + backward (the math SDPA
    backend: full T x T bmm, query heads); NanoChat: untied lm_head counted, wte not, and no
    vectors (GPT's biases and LayerNorms, which the counter skips, are added to it).
    block_flops against the counter on one block, its input needing a gradient as in a model."""
    B, T = 2, 16
    if which == "gpt2":
        model = GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=32))
        block = GPTBlock(model.config)
        C = 32
    else:
        model, C = make(), 64
        block = Block(model.config)
    idx = torch.randint(0, VOCAB, (B, T))
    vectors = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    total = _counted(lambda: model(idx, idx)[1])
    assert model.flops_per_token(T) * B * T == total + 6 * vectors * B * T
    x = torch.randn(B, T, C, requires_grad=True)
    assert model.block_flops(T) * B * T == _counted(lambda: block(x).sum())
    assert model.num_params(non_embedding=False) == sum(p.numel() for p in model.parameters())


def test_arch_registry_round_trips_both_and_reads_old_dicts():
    for config in (tiny(), GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=1)):
        d = arch.config_to_dict(config)
        assert d["arch"] in arch.ARCHS and arch.config_from_dict(d) == config
        model = arch.build(config)
        assert model.arch == d["arch"] and model.blocks() == list(model.transformer.h)
        assert config.shape_key()[0] == d["arch"]
    old = {k: v for k, v in arch.config_to_dict(GPTConfig()).items() if k != "arch"}
    assert arch.config_from_dict(old) == GPTConfig()  # a checkpoint from before "arch"
    assert tiny().shape_key() != tiny(n_kv_head=4).shape_key()
    with pytest.raises(ValueError, match="'llama' is not one of gpt2, nanochat"):
        arch.config_from_dict({"arch": "llama"})
    with pytest.raises(ValueError, match="unknown keys.*bias"):
        arch.config_from_dict({"arch": "nanochat", "bias": True})


def test_relu_squared_mlp_and_rotary_sign():
    """The MLP is relu(x)^2; the rotary rotates pairs (i, i + hs/2) as HF NanoChat's
    rotate_half = cat(x2, -x1): at position p, x1' = x1 cos + x2 sin, x2' = x2 cos - x1 sin."""
    from gptrain.model.nanochat import apply_rotary, rotary

    mlp = make().transformer.h[0].mlp
    x = torch.randn(2, 4, 64)
    torch.testing.assert_close(mlp(x), mlp.c_proj(F.relu(mlp.c_fc(x)) ** 2), rtol=0, atol=0)
    q = torch.randn(1, 1, 3, 8)
    cos, sin = rotary(3, 5, 8, 10000.0, "cpu")
    angle = 5.0 / 10000.0 ** (torch.arange(4) * 2 / 8)  # position 5, pair frequencies
    x1, x2 = q[..., :4], q[..., 4:]
    want = torch.cat((x1 * angle.cos() + x2 * angle.sin(), x2 * angle.cos() - x1 * angle.sin()), -1)
    torch.testing.assert_close(apply_rotary(q, cos, sin)[..., 0, :], want[..., 0, :])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_hand_written_gradients_equal_autograd_of_the_plain_formulas(dtype):
    """The block's RMSNorm, rotary and ReLU² carry their own backward (fewer passes on a CPU):
    values and gradients equal autograd's of the plain formulas (torch's F.rms_norm in float32,
    HF's x * cos + rotate_half(x) * sin with its own tables, relu(x) ** 2); in float64 the
    last two also pass gradcheck, the rotary gradgradcheck, and the other two refuse a second
    derivative (their backward reads values saved without their graph)."""
    from gptrain.model.nanochat import NORM_EPS, _ReluSquared, apply_rotary, norm, rotary

    torch.manual_seed(0)
    cos, sin = (t[:, None, :] for t in rotary(5, 3, 8, 10000.0, "cpu"))  # (T, 1, hs)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 8, 2).float() / 8)  # HF's tables, (T, 1, hs)
    freqs = torch.arange(3, 8).float()[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), -1)[:, None, :]
    rotate_half = lambda x: torch.cat((x[..., 4:], -x[..., :4]), -1)  # noqa: E731  HF NanoChat
    cases = (
        (norm, lambda x: F.rms_norm(x.float(), (8,), eps=NORM_EPS).to(x.dtype)),
        (
            lambda x: apply_rotary(x, cos, sin),
            lambda x: x * emb.cos().to(x.dtype) + rotate_half(x) * emb.sin().to(x.dtype),
        ),
        (_ReluSquared.apply, lambda x: F.relu(x) ** 2),
    )
    for mine, plain in cases:
        x = torch.randn(2, 5, 3, 8, dtype=dtype, requires_grad=True)  # (B, T, heads, hs)
        g = torch.randn(2, 5, 3, 8, dtype=dtype)
        got, want = mine(x), plain(x)
        (dgot,) = torch.autograd.grad(got, x, g)
        (dwant,) = torch.autograd.grad(want, x, g)
        assert got.dtype == dtype and dgot.dtype == dtype
        tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else {}
        if mine is norm and dtype == torch.float64:  # the norm computes in float32, as HF's
            tol = dict(rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(got, want, **tol)
        torch.testing.assert_close(dgot, dwant, **tol)
        if dtype == torch.float64 and mine is not norm:
            assert torch.autograd.gradcheck(mine, (x,))
        if dtype == torch.float64:  # a second derivative: right (the rotary is linear) or refused
            if mine is cases[1][0]:
                assert torch.autograd.gradgradcheck(mine, (x,))
            else:
                (d1,) = torch.autograd.grad(mine(x), x, g.requires_grad_(), create_graph=True)
                with pytest.raises(RuntimeError, match="once_differentiable"):
                    d1.sum().backward()
