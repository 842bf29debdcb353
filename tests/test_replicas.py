"""The replica check (gptrain/distributed/replicas.py): exact checksums against a hand computation
in Python integers; what is compared under DDP and FSDP2; on 2 gloo ranks a perturbed weight, two
swapped optimizer entries, a data cursor ahead and a missing tensor are each one line naming rank
1 and the tensor, on both ranks, and equal replicas pass. Drills with `gptrain train` under DDP:
GPTRAIN_FAULT=perturb stops the run at its next checkpoint with that line and exit 5, `latest`
still at the previous checkpoint; a time-budget run whose ranks' steps take unequal times passes
the check at every step."""

import json
import re

import dist_helpers as h
import pytest
import replicas_worker
import torch

from gptrain.checkpoint import manager as checkpoint
from gptrain.config.sections import DistConfig
from gptrain.distributed import faults, parallelize, replicas
from gptrain.distributed.failures import EXIT_DIVERGED
from gptrain.distributed.runtime import DistInfo
from gptrain.model.gpt import GPT, GPTConfig


def by_hand(t: torch.Tensor) -> list[int]:
    """The checksum in Python integers: the bytes as little-endian signed integers of the
    element's width (one byte: unsigned), summed plainly and weighted by position (from 1), modulo 2^64 as int64."""
    raw, width = bytes(t.detach().clone().untyped_storage().tolist()), t.element_size()
    ints = [int.from_bytes(raw[i : i + width], "little", signed=width > 1) for i in range(0, len(raw), width)]  # fmt: skip
    plain, weighted = sum(ints), sum(v * (i + 1) for i, v in enumerate(ints))
    return [(x + 2**63) % 2**64 - 2**63 for x in (plain, weighted)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool])  # fmt: skip
def test_checksum_equals_the_hand_computation(dtype, monkeypatch):
    torch.manual_seed(0)
    t = (torch.randn(37, 5) * 1e6).to(dtype)
    assert replicas.checksum(t).tolist() == by_hand(t)
    monkeypatch.setitem(replicas._CHUNK, "cpu", 16)  # many chunks: the same sums
    assert replicas.checksum(t).tolist() == by_hand(t)
    assert replicas.checksum(t[:, 1]).tolist() == by_hand(t[:, 1])  # not contiguous
    assert replicas.checksum(torch.empty(0, dtype=dtype)).tolist() == [0, 0]


def test_a_changed_or_moved_element_changes_the_checksum():
    torch.manual_seed(0)
    t = torch.randn(1000)
    base = replicas.checksum(t)
    ulp = t.clone()
    ulp[500] = torch.nextafter(ulp[500], torch.tensor(float("inf")))
    swapped = t.clone()
    swapped[[10, 900]] = swapped[[900, 10]]
    zero, negative_zero = torch.zeros(3), torch.tensor([0.0, -0.0, 0.0])
    assert not torch.equal(replicas.checksum(ulp), base)
    assert replicas.checksum(swapped)[0] == base[0]  # the plain sum cannot see a swap...
    assert replicas.checksum(swapped)[1] != base[1]  # ...the weighted one does
    assert not torch.equal(replicas.checksum(zero), replicas.checksum(negative_zero))  # bytes


def test_ddp_compares_every_parameter_and_optimizer_tensor():
    model, optimizer = replicas_worker._trained()
    named = dict(replicas.replicated(model, optimizer, {"data.windows_consumed": 48}))
    params = [n for n, _ in model.named_parameters()]
    state = [f"optimizer {n}.{k}" for n in params for k in ("exp_avg", "exp_avg_sq", "step")]
    assert list(named)[: len(params)] == params
    assert set(state) <= set(named)
    assert named["optimizer group 0 lr"].tolist() == [1e-2]
    assert named["data.windows_consumed"].tolist() == [48]
    for n, p in model.named_parameters():
        assert named[n] is p  # the tensor itself, read where it lives


def test_fsdp2_compares_only_what_is_replicated(one_process_group):
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(3, 8)).sum().backward()
    optimizer.step()
    named = dict(replicas.replicated(model, optimizer, {"train_state.step": 1}))
    assert not any(k.startswith("0.") or k.startswith("1.") for k in named)  # shards: skipped
    assert not any(k.endswith(".exp_avg") or k.endswith(".exp_avg_sq") for k in named)
    assert named["optimizer group 0 lr"].tolist() == [1e-2]
    assert named["train_state.step"].tolist() == [1]


def test_under_fsdp2_gptrains_model_leaves_only_adamws_step_counters_to_compare(one_process_group):
    """gptrain's model sharded as parallelize shards it (one rank: the same placements as on
    every rank): every parameter and every AdamW moment is a shard, skipped; the model has no
    buffers; so the tensors compared are AdamW's per-parameter step counters (plain tensors every
    rank holds), beside the groups' hyperparameters and the numbers passed."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32))
    parallelize._fully_shard(model, model.blocks(), DistConfig(mode="fsdp"), DistInfo(), False, torch.float32)  # fmt: skip
    assert parallelize.is_sharded(model) and list(model.buffers()) == []
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(1))
    model(x, x)[1].backward()
    optimizer.step()
    named = dict(replicas.replicated(model, optimizer, {"train_state.step": 1}))
    params = [n for n, _ in model.named_parameters()]
    assert not set(params) & set(named)
    tensors = {k for k in named if k.startswith("optimizer ") and " group " not in k}
    assert tensors == {f"optimizer {n}.step" for n in params}
    assert all(named[k].tolist() == 1.0 for k in tensors)  # one step taken
    assert named["optimizer group 0 lr"].tolist() == [1e-2]


@pytest.mark.slow
def test_two_ranks_name_the_rank_and_the_first_tensor_that_differs(tmp_path):
    out = tmp_path / "check"
    modes = ["same", "perturbed", "swapped", "cursor", "counts"]
    procs = h.spawn(["tests/replicas_worker.py", "check", str(out), *modes])
    h.check_ok(h.wait_all(procs, h.TIMEOUT))
    lines = [json.loads(out.with_suffix(f".{r}").read_text()) for r in range(2)]
    assert lines[0] == lines[1]  # the same line on every rank
    got = lines[0]
    assert got["same"] is None
    want = {
        "perturbed": "rank 1 differs from rank 0 in 0.bias;",
        "swapped": "rank 1 differs from rank 0 in optimizer 0.weight.exp_avg;",
        "cursor": "rank 1 differs from rank 0 in data.windows_consumed;",
        "counts": "the ranks hold different numbers of tensors (rank 0: ",
    }
    for mode, needle in want.items():
        assert got[mode].startswith("step 2: the replicas differ: "), got[mode]
        assert needle in got[mode], got[mode]
        assert "\n" not in got[mode] and "exit 5" in got[mode]
    n0, n1 = map(int, re.search(r"rank 0: (\d+), rank 1: (\d+)", got["counts"]).groups())
    assert n1 == n0 - 1


def gptrain_args(byte_data, run_dir, *extra):
    args = ["-m", "gptrain", "train", "--config", h.DEBUG, f"--data.dir={byte_data}"]
    return [*args, f"--run.dir={run_dir}", "--dist.mode=ddp", *h.FAST, *extra]


@pytest.mark.slow
def test_a_perturbed_replica_stops_the_run_at_the_next_checkpoint(byte_data, tmp_path):
    """perturb@4/1: rank 1's first weight moves by one ulp after step 4's update; the checkpoint
    of step 4 is not written, both ranks exit 5 with one line, `latest` stays at step 2. (A move
    made a step before the checkpoint can be rounded away by the next update: the replicas are
    then equal again, and the check rightly passes.)"""
    run_dir = tmp_path / "run"
    args = gptrain_args(byte_data, run_dir, "--train.max_steps=6", "--checkpoint.every=2")
    results = h.wait_all(h.spawn(args, **{faults.ENV: "perturb@4/1"}), h.TIMEOUT)
    for rc, _, err in results:
        lines = [x for x in err.splitlines() if x.startswith("gptrain: error:")]
        assert rc == EXIT_DIVERGED, err[-3000:]
        assert "Traceback" not in err and len(lines) == 1, err[-3000:]
        assert lines[0].startswith("gptrain: error: step 4: the replicas differ: rank 1 differs from rank 0 in transformer.wte.weight")  # fmt: skip
    assert "perturb at step 4: transformer.wte.weight[0] moved by one ulp" in results[1][2]
    assert checkpoint.latest(run_dir).name == "step_00000002"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_")) == ["step_00000002"]  # fmt: skip
    assert "stopped: step 4: the replicas differ" in (run_dir / "train.log").read_text()


@pytest.mark.slow
def test_a_budget_run_with_unequal_step_times_keeps_its_replicas_equal(byte_data, tmp_path):
    """Rank 0's steps count 1 s, rank 1's 1.5 s (GPTRAIN_FAULT=step_time) under a 9 s budget, a
    checkpoint (and so a replica check of every weight, AdamW moment and lr) after every step:
    the run passes every check and ends at the agreed step (1.5 s x 6 = 9 s)."""
    run_dir = tmp_path / "run"
    budget = ["--train.time_budget=9s", "--train.max_steps=100", "--checkpoint.every=1"]
    fault = {faults.ENV: "step_time@1/0,step_time@1.5/1"}
    h.check_ok(h.wait_all(h.spawn(gptrain_args(byte_data, run_dir, *budget), **fault), h.TIMEOUT))
    assert checkpoint.latest(run_dir).name == "step_00000006"
