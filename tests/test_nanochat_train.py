"""The nanochat block through gptrain's training side: a resume of the other block is refused
before anything is written, a checkpoint without "arch" is GPT-2's, the timed block is the
model's own with its FLOPs counted by torch, and the speed choices' cache keys keep the blocks
apart."""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from train_helpers import DEBUG, run

from gptrain.__main__ import main as cli
from gptrain.config.load import load_config
from gptrain.evals.generate import load_model
from gptrain.model import gpt, nanochat
from gptrain.training import timing
from gptrain.training.build import ModelShapes, block_key, build_model, timed_block_config

SHORT = (
    "train.max_steps=2",
    "optim.warmup_steps=1",
    "checkpoint.every=2",
    "eval.every=0",
    "eval.sample_every=0",
)


def _files(folder) -> dict:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file() and p.name != ".lock"}


def test_resuming_the_other_block_is_refused_and_writes_nothing(byte_data, tmp_path, capsys):
    """A nanochat run resumed as gpt2 (and back): one line naming model.arch and the fix, exit
    2, no file of the run folder added or changed (its lock aside)."""
    runs = {"nanochat": tmp_path / "nanochat", "gpt2": tmp_path / "gpt2"}
    run(byte_data, runs["nanochat"], "model.arch=nanochat", *SHORT)
    run(byte_data, runs["gpt2"], *SHORT)
    for saved, other in (("nanochat", "gpt2"), ("gpt2", "nanochat")):
        before = _files(runs[saved])
        argv = ["train", "--config", DEBUG, f"--data.dir={byte_data}", f"--run.dir={runs[saved]}"]
        assert (
            cli([*argv, f"--model.arch={other}", "--train.max_steps=4", "--optim.warmup_steps=1"])
            == 2
        )
        err = capsys.readouterr().err.strip()
        want = f"model.arch = '{other}' but the checkpoint being resumed holds the '{saved}' block"
        assert want in err and f"--model.arch={saved}" in err and "\n" not in err
        assert _files(runs[saved]) == before


def test_a_checkpoint_without_arch_loads_as_gpt2(byte_data, tmp_path):
    """meta.json's model config as written before there were two blocks (no "arch"): GPT-2's,
    tied head, the same logits."""
    run(byte_data, tmp_path, *SHORT)
    model, _, meta = load_model(tmp_path)
    assert meta["model"]["arch"] == "gpt2"
    path = next(tmp_path.glob("checkpoints/step_*/meta.json"))
    old = json.loads(path.read_text())
    del old["model"]["arch"]
    path.write_text(json.dumps(old))
    again, _, _ = load_model(tmp_path)
    assert isinstance(again, gpt.GPT) and again.lm_head.weight is again.transformer.wte.weight
    idx = torch.randint(0, 257, (2, 16))
    torch.testing.assert_close(again(idx)[0], model(idx)[0], rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["gpt2", "nanochat"])
def test_the_timed_block_is_the_models_own_and_its_flops_are_counted(arch):
    """block_run times the run's own block class (nanochat: GQA, its MLP width); block_flops
    per sequence equals torch's FLOP counter on that block's forward + backward (matmuls only;
    math SDPA: the full T x T matrix)."""
    extra = ["model.n_head=4", "model.n_kv_head=2", "model.mlp_hidden=96"]
    cfg = load_config(DEBUG, [f"model.arch={arch}", *(extra if arch == "nanochat" else [])])
    model = build_model(cfg, 257, meta=True)
    c = model.config
    gelu, bias = block_key(model)
    s = ModelShapes(2, 16, c.n_layer, c.n_embd, c.n_head, gelu, bias, model=timed_block_config(model))  # fmt: skip
    block = timing.timed_model(s).blocks()[0]
    assert type(block) is {"gpt2": gpt.Block, "nanochat": nanochat.Block}[arch]
    if arch == "nanochat":
        assert block.attn.c_k.out_features == 2 * 16 and block.mlp.c_fc.out_features == 96
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        timing.block_run("cpu", s, 1, "float32/sdpa")()
    assert timing.block_flops(s) == counter.get_total_flops()


def test_the_blocks_never_share_a_cached_timing():
    """The block's cache key: GPT-2's (gelu, bias) as before; nanochat's names the block and
    its shape_key, so a nanochat block of GPT-2's width and heads is timed on its own."""
    g = build_model(load_config(DEBUG, []), 257, meta=True)
    n = build_model(load_config(DEBUG, ["model.arch=nanochat"]), 257, meta=True)
    assert block_key(g) == ("tanh", True)
    gelu, bias = block_key(n)
    assert gelu.split()[0] == "nanochat" and gelu != block_key(g)[0] and bias is False
    assert str(n.config.shape_key()[-1]) in gelu


def test_bench_times_nanochat_and_its_mfu_uses_the_models_flops(tmp_path, capsys):
    """`gptrain bench --model.arch=nanochat`: a row whose MFU is tokens/s x NanoChat's own
    flops_per_token over the peak (the model's count, not GPT-2's formula)."""
    out = tmp_path / "rows.json"
    argv = ["bench", "--config", DEBUG, "--model.arch=nanochat", "--steps", "1", "--warmup", "0"]
    assert cli([*argv, "--json", str(out)]) == 0
    assert capsys.readouterr().out.startswith("bench: nanochat 2 layers")
    (row,) = json.loads(out.read_text())
    model = build_model(load_config(DEBUG, ["model.arch=nanochat"]), 257, meta=True)
    assert isinstance(model, nanochat.NanoChat)
    flops = row["tok_per_s"] * model.flops_per_token(64) / (row["peak_tflops"] * 1e12)
    assert row["mfu"] == pytest.approx(flops, rel=1e-6)


def test_nanochat_activation_checkpointing_keeps_loss_gradients_and_keys():
    """wrap_model's per-block activation checkpointing on nanochat (dropout on: the recompute
    replays its masks): the same loss and gradients, bit for bit, and plain state-dict keys."""
    from gptrain.config.sections import DistConfig
    from gptrain.distributed import parallelize
    from gptrain.distributed.runtime import DistInfo

    def loss_and_grads(ac: str):
        cfg = load_config(DEBUG, ["model.arch=nanochat", "model.dropout=0.1", "model.n_head=4", "model.n_kv_head=2"])  # fmt: skip
        torch.manual_seed(0)
        model = build_model(cfg, 257)
        parallelize.wrap_model(model, DistConfig(), info=DistInfo(), compile=False, param_dtype=torch.float32, activation_checkpointing=ac)  # fmt: skip
        x = torch.randint(0, 257, (4, 32), generator=torch.Generator().manual_seed(1))
        torch.manual_seed(2)
        _, loss = model(x, x)
        loss.backward()
        return model, loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    plain, loss, grads = loss_and_grads("none")
    ac, loss_ac, grads_ac = loss_and_grads("blocks")
    assert torch.equal(loss, loss_ac) and list(ac.state_dict()) == list(plain.state_dict())
    for name, g in grads.items():
        torch.testing.assert_close(grads_ac[name], g, rtol=0, atol=0, msg=name)
    calls = []  # it recomputes: block 0's attention runs again during backward
    ac.transformer.h[0].attn.register_forward_hook(lambda *a: calls.append(1))
    x = torch.zeros(1, 8, dtype=torch.long)
    ac(x, x)[1].backward()
    assert len(calls) == 2
