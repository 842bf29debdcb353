"""optim.head_lr: an untied output head's own AdamW group (nanochat's lm_head), its schedule, its
steps against torch.optim.AdamW with the same per-group lrs, a save/load of the optimizer state
mid-run, and the refusal of a tied head (GPT-2's)."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
import torch

from gptrain.config.sections import OptimConfig
from gptrain.errors import UserError
from gptrain.model.gpt import GPT, GPTConfig
from gptrain.model.nanochat import NanoChat, NanoChatConfig
from gptrain.training.optim import build_optimizer, lr_at, muon_split, set_lr


def _gpt2(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=100, block_size=8, n_layer=2, n_head=2, n_embd=16))


def _nanochat(seed=0):
    torch.manual_seed(seed)
    return NanoChat(NanoChatConfig(vocab_size=100, block_size=8, n_layer=2, n_head=4, n_kv_head=2, n_embd=32))  # fmt: skip


def _names(model, params) -> set[str]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return {by_id[id(p)] for p in params}


def _grads(model, seed):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


@pytest.mark.parametrize("embed_lr", [0.0, 3e-2])
@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_head_group_holds_the_untied_head_alone_each_parameter_once(name, embed_lr):
    """nanochat, head_lr > 0: one group marked "head" with exactly lm_head.weight (from the module
    tree); embed_lr > 0 adds one marked "embed" with the token embedding alone; every parameter in
    exactly one group, no group empty, Muon's matrices as muon_split's."""
    model = _nanochat()
    cfg = OptimConfig(name=name, head_lr=4e-3, embed_lr=embed_lr, weight_decay=0.1, muon_dtype="float32")  # fmt: skip
    opt = build_optimizer(model, cfg, "cpu", muon_dtype=torch.float32)
    head = [g for g in opt.param_groups if g.get("head")]
    assert len(head) == 1 and head[0]["weight_decay"] == 0.1
    assert head[0]["params"] == [model.lm_head.weight]
    embed = [g for g in opt.param_groups if g.get("embed")]
    assert len(embed) == (embed_lr > 0)
    for g in embed:
        assert _names(model, g["params"]) == {"transformer.wte.weight"}
    everything = [p for g in opt.param_groups for p in g["params"]]
    assert len(everything) == len({id(p) for p in everything}) == len(list(model.parameters()))
    assert all(g["params"] for g in opt.param_groups)
    muon = [p for g in opt.param_groups if "ns_steps" in g for p in g["params"]]
    assert _names(model, muon) == (_names(model, muon_split(model, 0.1)[0]) if name == "muon" else set())  # fmt: skip


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_head_lr_on_a_tied_head_is_one_line_naming_the_key(name):
    """GPT-2's head is wte itself: head_lr > 0 is refused (one line, the key and the fix), in both
    modes; head_lr = 0 builds, every parameter once."""
    model = _gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    cfg = OptimConfig(name=name, head_lr=1e-3, muon_dtype="float32")
    with pytest.raises(UserError, match=r"optim\.head_lr = 0\.001 .*tied.*optim\.head_lr=0") as e:
        build_optimizer(model, cfg, "cpu", muon_dtype=torch.float32)
    assert "\n" not in str(e.value)
    opt = build_optimizer(model, replace(cfg, head_lr=0.0), "cpu", muon_dtype=torch.float32)
    everything = [p for g in opt.param_groups for p in g["params"]]
    assert len(everything) == len({id(p) for p in everything}) == len(list(model.parameters()))


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_head_lr_is_scheduled_as_lr(schedule):
    """set_lr gives the head group the schedule of a run whose peak is head_lr with lr's
    min_lr / lr ratio (lr_at of that config), the embed group embed_lr's, at every step."""
    cfg = OptimConfig(name="muon", lr=1e-3, min_lr=2e-4, embed_lr=0.3, head_lr=4e-3, warmup_steps=3, lr_schedule=schedule, decay_fraction=0.5, muon_dtype="float32")  # fmt: skip
    peaks = {"head": 4e-3, "embed": 0.3, "muon": 0.02, "": 1e-3}
    opt = build_optimizer(_nanochat(), cfg, "cpu", muon_dtype=torch.float32)
    for step in [*range(12), 5.5]:
        set_lr(opt, lr_at(step, cfg, 12), cfg)
        for g in opt.param_groups:
            kind = "muon" if "ns_steps" in g else "head" if g.get("head") else "embed" if g.get("embed") else ""  # fmt: skip
            ref = replace(cfg, lr=peaks[kind], min_lr=2e-4 * peaks[kind] / 1e-3)
            assert g["lr"] == pytest.approx(lr_at(step, ref, 12), rel=1e-12), (step, kind)


def test_head_lr_steps_like_torch_adamw_and_resumes_bit_for_bit():
    """AdamW, nanochat, head_lr and embed_lr set: 4 steps equal torch.optim.AdamW with the head at
    head_lr, the embedding at embed_lr and the rest at lr (each times the schedule's fraction); a
    run whose optimizer state is saved after step 2 and loaded into a fresh model and optimizer
    ends equal to the uninterrupted one bit for bit (weights and moments)."""
    cfg = OptimConfig(lr=1e-3, min_lr=1e-4, embed_lr=0.3, head_lr=4e-3, weight_decay=0.1, warmup_steps=1)  # fmt: skip
    a, b = _nanochat(), _nanochat()
    opt = build_optimizer(a, cfg, "cpu")
    head, wte = b.lm_head.weight, b.transformer.wte.weight
    rest = [p for p in b.parameters() if p is not head and p is not wte]
    ref = torch.optim.AdamW(
        [
            {"params": [head], "peak": 4e-3},
            {"params": [wte], "peak": 0.3},
            {"params": rest, "peak": 1e-3},
        ],  # fmt: skip
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        fused=True,
    )
    saved = None
    for step in range(4):
        lr = lr_at(step, cfg, 4)
        set_lr(opt, lr, cfg)
        for g in ref.param_groups:
            g["lr"] = g["peak"] * lr / 1e-3
        _grads(a, step), _grads(b, step)
        opt.step(), ref.step()
        if step == 1:
            buf = io.BytesIO()
            torch.save({"model": a.state_dict(), "optim": opt.state_dict()}, buf)
            saved = buf.getvalue()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-9, msg=n)
    state = torch.load(io.BytesIO(saved), weights_only=True)
    c = _nanochat(seed=1)  # other weights: everything must come from the saved state
    c.load_state_dict(state["model"])
    resumed = build_optimizer(c, cfg, "cpu")
    resumed.load_state_dict(state["optim"])
    assert [g.get("head", False) for g in resumed.param_groups] == [g.get("head", False) for g in opt.param_groups]  # fmt: skip
    for step in (2, 3):
        set_lr(resumed, lr_at(step, cfg, 4), cfg)
        _grads(c, step)
        resumed.step()
    for (n, pa), pc in zip(a.named_parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pc), n
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[pa][k], resumed.state[pc][k]), (n, k)


def test_head_lr_on_gpt2_refuses_the_run_in_one_line_writing_nothing(byte_data, tmp_path, capsys):
    """`gptrain train` of a GPT-2 model (tied head) with optim.head_lr: exit 2, one line naming
    the key and the fix, and no run folder."""
    from train_helpers import DEBUG

    from gptrain.__main__ import main as cli

    run = tmp_path / "run"
    argv = ["train", "--config", str(DEBUG), f"--data.dir={byte_data}", f"--run.dir={run}"]
    assert cli([*argv, "--optim.head_lr=1e-3", "--log.progress=false"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gptrain: error: optim.head_lr = 0.001 ") and "\n" not in err, err
    assert "Traceback" not in err and not run.exists()
