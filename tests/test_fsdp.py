"""Activation checkpointing, the wrap_model order, the meta-device build and FSDP2 numerics.

Single process: activation checkpointing changes neither the loss nor the gradients, nor the
state-dict keys; the meta-device build keeps the tied head tied. Two gloo ranks
(tests/fsdp_worker.py): the sharded init equals the single-process init bit for bit; FSDP2 with
per-block compile + checkpointing trains like eager FSDP2 with no recompile after the first step;
bf16 FSDP2 keeps DDP + autocast's float32 residual stream and agrees with DDP within bf16 noise.
"""

import json

import dist_helpers as h
import pytest
import torch

from gptrain import dist
from gptrain.build import build_model
from gptrain.config import DistConfig, load_config
from gptrain.model import GPT, GPTConfig

CFG = GPTConfig(vocab_size=65, block_size=32, n_layer=3, n_head=2, n_embd=32, dropout=0.1)


def _loss_and_grads(activation_checkpointing: str):
    torch.manual_seed(0)
    model = GPT(CFG)
    dist.wrap_model(
        model,
        DistConfig(),
        info=dist.DistInfo(),
        compile=False,
        param_dtype=torch.float32,
        activation_checkpointing=activation_checkpointing,
    )
    x = torch.randint(0, 65, (4, 32), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)  # dropout masks: the recompute must replay the same ones
    _, loss = model(x, x)
    loss.backward()
    return model, loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_activation_checkpointing_same_loss_gradients_and_keys():
    plain, loss, grads = _loss_and_grads("none")
    ac, loss_ac, grads_ac = _loss_and_grads("blocks")
    assert torch.equal(loss, loss_ac)
    for name, g in grads.items():
        torch.testing.assert_close(grads_ac[name], g, rtol=0, atol=0, msg=name)
    assert list(ac.state_dict()) == list(plain.state_dict())  # no wrapper prefixes
    # it really recomputes: during backward, block 0's forward runs a second time
    calls = []
    ac.transformer.h[0].attn.register_forward_hook(lambda *a: calls.append(torch.is_grad_enabled()))
    _, loss = ac(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))
    loss.backward()
    assert len(calls) == 2
    with torch.no_grad():  # evaluation and sampling run the block once, without checkpointing
        ac(torch.zeros(1, 8, dtype=torch.long))
    assert len(calls) == 3


def test_meta_build_is_tied_and_seeded():
    cfg = load_config(h.DEBUG)
    torch.manual_seed(5)
    a = build_model(cfg, 257)
    torch.manual_seed(5)
    b = build_model(cfg, 257)
    assert a.lm_head.weight is a.transformer.wte.weight
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    assert not any(p.is_meta for p in a.parameters())
    torch.manual_seed(6)
    c = build_model(cfg, 257)
    assert not torch.equal(c.transformer.wte.weight, a.transformer.wte.weight)


@pytest.fixture(scope="module")
def fsdp_runs(byte_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp") / "result"
    procs = h.spawn(
        ["tests/fsdp_worker.py", str(out), str(byte_data)],
        TORCH_LOGS="recompiles,graph_breaks",
    )
    results = h.wait_all(procs, 400)
    h.check_ok(results)
    return [json.loads(out.with_name(f"result.{r}").read_text()) for r in (0, 1)], results


@pytest.mark.slow
def test_sharded_init_equals_single_process_init(fsdp_runs):
    for rank_result in fsdp_runs[0]:
        init = rank_result["init"]
        assert init["tied"] and init["keys_equal"]
        assert init["differ"] == []
        assert init["local_fraction"] <= 0.51  # each rank holds only its half


@pytest.mark.slow
def test_fsdp_compile_and_checkpointing_match_eager_without_recompiles(fsdp_runs):
    results, procs = fsdp_runs
    eager, compiled = results[0]["fsdp"]["losses"], results[0]["fsdp_compile_ac"]["losses"]
    assert eager[-1] < eager[0]  # it trains
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-4, atol=1e-5)
    for rank, (_, _, stderr) in enumerate(procs):
        start = stderr.index("GPTRAIN-TEST STEP 1 done")  # compiled run: first step finished
        end = stderr.index("GPTRAIN-TEST STEP 3 done")
        assert "Recompiling" not in stderr[start:end], f"rank {rank}:\n{stderr[start:end][-3000:]}"


@pytest.mark.slow
def test_fsdp_bf16_matches_ddp_autocast(fsdp_runs):
    r = fsdp_runs[0][0]
    ddp, fsdp = r["ddp_bf16"], r["fsdp_bf16"]
    # the same dtypes as DDP + autocast: a float32 residual stream and loss
    assert ddp["residual"] == fsdp["residual"] == "torch.float32"
    assert ddp["loss"] == fsdp["loss"] == "torch.float32"
    torch.testing.assert_close(
        torch.tensor(fsdp["losses"]), torch.tensor(ddp["losses"]), rtol=1e-3, atol=0
    )
    # and bf16 really was on: the float32 FSDP2 run differs by more than the float32 noise
    assert max(abs(a - b) for a, b in zip(r["fsdp"]["losses"], ddp["losses"], strict=True)) > 1e-5
