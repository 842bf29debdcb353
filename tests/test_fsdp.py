"""Activation checkpointing, the wrap_model order, the meta-device build and FSDP2 numerics.

Single process: activation checkpointing changes neither the loss nor the gradients, nor the
state-dict keys; the meta-device build keeps the tied head tied. Two gloo ranks
(tests/fsdp_worker.py): the sharded init equals the single-process init bit for bit; under
dist.fsdp_reduce = every a rank holds only gradient shards between micro-steps, and trains like
`last`; FSDP2 with
per-block compile + checkpointing trains like eager FSDP2 with no recompile after the first step;
bf16 FSDP2 keeps DDP + autocast's float32 residual stream and agrees with DDP within bf16 noise.
"""

import json

import dist_helpers as h
import forked
import pytest
import torch

from gptrain.config.load import load_config
from gptrain.config.sections import DistConfig
from gptrain.distributed import failures, parallelize
from gptrain.distributed import runtime as dist
from gptrain.model.gpt import GPT, GPTConfig
from gptrain.training.build import build_model

CFG = GPTConfig(vocab_size=65, block_size=32, n_layer=3, n_head=2, n_embd=32, dropout=0.1)


def _loss_and_grads(activation_checkpointing: str):
    torch.manual_seed(0)
    model = GPT(CFG)
    parallelize.wrap_model(
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
def test_fsdp_reduce_every_holds_only_shards_and_trains_like_last(fsdp_runs):
    """dist.fsdp_reduce: between micro-steps each rank holds its gradient shards (every) or
    nothing in .grad (last: FSDP2 keeps the unsharded gradient itself); the same training."""
    for rank_result in fsdp_runs[0]:
        every, last = rank_result["held"]["every"], rank_result["held"]["last"]
        assert 0.4 < every <= 0.51 and last == 0, rank_result["held"]
    r = fsdp_runs[0][0]
    torch.testing.assert_close(
        torch.tensor(r["fsdp_last"]["losses"]), torch.tensor(r["fsdp"]["losses"]), rtol=1e-5, atol=0
    )


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


@pytest.mark.slow
def test_async_save_holds_the_state_at_its_step(fsdp_runs):
    """checkpoint.async: DCP's writer held back for two more optimizer steps (tests/fsdp_worker.py);
    the checkpoint holds the weights, AdamW moments and data cursor of its own step, and is
    invisible to resume until it is published."""
    for rank_result in fsdp_runs[0]:
        r = rank_result["async_save"]
        assert r["hidden_before_wait"] and r["published"]
    r = fsdp_runs[0][0]["async_save"]
    assert r["weights_moved"] and r["moments_moved"]  # training really moved on meanwhile
    assert r["weights_at_save"] and r["moments_at_save"] and r["cursor_at_save"] and r["latest"]


@pytest.fixture(scope="module")
def dcp_run(byte_data, tmp_path_factory):
    """A 2-rank FSDP2 run (dropout on) with one sharded checkpoint, at its last step (4), each
    rank's shards written by 2 threads into 2 files."""
    run_dir = tmp_path_factory.mktemp("dcp") / "run"
    args = ["-m", "gptrain", "train", "--config", h.DEBUG, f"--data.dir={byte_data}", f"--run.dir={run_dir}", "--dist.mode=fsdp", "--train.max_steps=4", "--checkpoint.every=2", "--model.dropout=0.1", "--train.micro_batch_size=4", "--checkpoint.io_threads=2", *h.FAST]  # fmt: skip
    h.check_ok(h.wait_all(h.spawn(args), 300))
    return run_dir


def _cli(*args):
    import sys

    return forked.run([sys.executable, "-m", "gptrain", *args], env=h.env(), cwd=h.REPO, capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.mark.slow
def test_async_saved_run_resumes_like_the_uninterrupted_one(dcp_run, byte_data, tmp_path):
    """dcp_run with checkpoint.async = true and a save at step 2, written while steps 3-4
    trained and published at step 4's save, each rank's shards in 3 files (dcp_run: 2): the final
    checkpoint is complete at exit 0 and equals dcp_run's; resumed from step 2, the run reaches
    step 4 bit for bit like dcp_run (weights, AdamW state, data cursor, RNG of every rank)."""
    import shutil

    from gptrain.checkpoint import dcp as sharded
    from gptrain.checkpoint import manager as checkpoint

    def tensors(folder):
        meta = checkpoint.load_meta(folder)
        return {p: sharded.load_full(folder, meta, p) for p in ("model.", "optim.")}

    def same(a, b) -> bool:
        ta, tb = tensors(a), tensors(b)
        equal = all(ta[p].keys() == tb[p].keys() and all(torch.equal(ta[p][k], v) for k, v in tb[p].items()) for p in tb)  # fmt: skip
        sa, sb = checkpoint.load_state(a), checkpoint.load_state(b)
        rngs = zip(sa["train_state"]["rng"], sb["train_state"]["rng"], strict=True)
        return equal and sa["data"] == sb["data"] and all(torch.equal(x["torch"], y["torch"]) for x, y in rngs)  # fmt: skip

    run_dir, resumed = tmp_path / "run", tmp_path / "resumed"
    args = ["-m", "gptrain", "train", "--config", h.DEBUG, f"--data.dir={byte_data}", "--dist.mode=fsdp", "--train.max_steps=4", "--model.dropout=0.1", "--train.micro_batch_size=4", *h.FAST, "--checkpoint.every=2", "--checkpoint.async=true", "--checkpoint.io_threads=3"]  # fmt: skip
    h.check_ok(h.wait_all(h.spawn([*args, f"--run.dir={run_dir}"]), 300))
    root = run_dir / "checkpoints"
    assert checkpoint.pointer(root) == "step_00000004" and not list(root.glob(".tmp-*"))
    shards = sorted(p.name for p in (root / "step_00000002").glob("*.distcp"))
    assert shards == [f"__{r}_{i}.distcp" for r in (0, 1) for i in range(3)]
    assert same(checkpoint.find(run_dir, 4), checkpoint.find(dcp_run, 4))
    shutil.copytree(run_dir, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000004")
    (resumed / "checkpoints" / "latest").write_text("step_00000002\n")
    h.check_ok(h.wait_all(h.spawn([*args, f"--run.dir={resumed}"]), 300))
    log = (resumed / "train.log").read_text()
    assert f"resumed from {resumed / 'checkpoints' / 'step_00000002'}" in log
    assert same(checkpoint.find(resumed, 4), checkpoint.find(dcp_run, 4))


@pytest.mark.slow
def test_async_preemption_checkpoint_is_complete_at_exit_0(byte_data, tmp_path):
    """checkpoint.async, SIGTERM to rank 1 mid-run: both ranks publish the pending background save,
    save the stop step, wait for it and exit 0; `latest` names the stop step, which is valid, and
    no temporary folder is left."""
    import signal

    from gptrain.checkpoint import manager as checkpoint
    from gptrain.checkpoint import retention

    run_dir = tmp_path / "run"
    args = ["-m", "gptrain", "train", "--config", h.DEBUG, f"--data.dir={byte_data}", f"--run.dir={run_dir}", "--dist.mode=fsdp", "--train.max_steps=60", "--train.micro_batch_size=4", *h.FAST, "--checkpoint.every=2", "--checkpoint.async=true"]  # fmt: skip
    procs = h.spawn(args)
    h.wait_for_step(run_dir, procs, 5)
    procs[1].send_signal(signal.SIGTERM)
    results = h.wait_all(procs, timeout=240)
    h.check_ok(results)
    stopped = checkpoint.latest(run_dir)
    step = checkpoint.load_meta(stopped)["step"]
    assert 5 <= step < 60 and retention.problem(stopped) is None, step
    assert f"checkpoint {stopped} is complete" in results[0][1] + results[0][2]
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))


@pytest.mark.slow
def test_sharded_checkpoint_layout_and_export_sample(dcp_run, tmp_path):
    from gptrain.checkpoint import dcp as sharded
    from gptrain.checkpoint import manager as checkpoint
    from gptrain.model.hf import load_hf_folder

    folder = checkpoint.find(dcp_run)
    meta = checkpoint.load_meta(folder)
    names = {p.name for p in folder.iterdir()}
    assert meta["layout"] == "dcp" and "model.safetensors" not in names
    shards = [f"__{r}_{i}.distcp" for r in (0, 1) for i in (0, 1)]  # 2 files per rank
    assert names - {"meta.json"} == set(meta["files"]) == {".metadata", "state.pt", *shards}
    full = sharded.load_full_model_state(folder, meta)
    assert full["lm_head.weight"] is full["transformer.wte.weight"]
    shard_bytes = [sum(meta["files"][f"__{r}_{i}.distcp"]["bytes"] for i in (0, 1)) for r in (0, 1)]  # fmt: skip
    model_bytes = sum(v.numel() * 4 for k, v in full.items() if k != "lm_head.weight")
    assert sum(shard_bytes) > 3 * model_bytes  # weights + 2 AdamW moments, all stored
    assert max(shard_bytes) < 0.6 * sum(shard_bytes)  # each rank wrote about half
    done = _cli("sample", "--run", str(dcp_run), "--max-new-tokens", "8", "--device", "cpu")
    assert done.returncode == 0 and done.stdout.strip(), done.stderr[-2000:]
    done = _cli("export", "--run", str(dcp_run), "--out", str(tmp_path / "hf"))
    assert done.returncode == 0, done.stderr[-2000:]
    exported = load_hf_folder(tmp_path / "hf").state_dict()
    for k in ("transformer.h.1.attn.c_attn.weight", "transformer.wpe.weight", "transformer.ln_f.bias"):  # fmt: skip
        assert torch.equal(exported[k], full[k]), k


@pytest.mark.slow
def test_damaged_shard_is_refused_before_anything_is_read(dcp_run, tmp_path):
    import shutil

    from gptrain.checkpoint import manager as checkpoint

    run = tmp_path / "run"
    shutil.copytree(dcp_run, run)
    shard = checkpoint.find(run) / "__1_1.distcp"  # the second of rank 1's two files
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    config = run / "config.toml"
    for args in (
        ["train", "--config", str(config), f"--run.dir={run}", "--train.max_steps=6"],
        ["sample", "--run", str(run), "--device", "cpu"],
    ):
        done = _cli(*args)
        assert done.returncode == 2, done.stderr[-2000:]
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "__1_1.distcp is damaged" in lines[0], done.stderr[-2000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


@pytest.mark.slow
def test_crafted_dcp_index_runs_nothing(dcp_run, tmp_path):
    """DCP's .metadata is a pickle: one naming anything but DCP's own classes is refused with one
    line (meta.json rewritten to vouch for it, as whoever hands out a checkpoint can), and the
    payload never runs; a genuine index still loads (the other tests)."""
    import hashlib
    import json
    import os
    import pickle
    import shutil

    from gptrain.checkpoint import manager as checkpoint

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(tmp_path / "pwned"),))

    run = tmp_path / "run"
    shutil.copytree(dcp_run, run)
    folder = checkpoint.find(run)
    data = pickle.dumps(Payload())
    (folder / ".metadata").write_bytes(data)
    meta = json.loads((folder / "meta.json").read_text())
    meta["files"][".metadata"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "meta.json").write_text(json.dumps(meta))
    for args in (["sample", "--run", str(run), "--device", "cpu"], ["export", "--run", str(run), "--out", str(tmp_path / "hf")]):  # fmt: skip
        done = _cli(*args)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
        assert ".metadata" in lines[0] and "never code" in lines[0], lines
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "hf").exists()


def test_nccl_error_handling_is_set_unless_the_user_set_it_and_attempts_get_their_own_prefix():
    env = {}
    failures.nccl_error_handling(env)
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}  # abort communicators, not the process
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    failures.nccl_error_handling(env)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert dist.attempt_prefix({"TORCHELASTIC_RESTART_COUNT": "2"}) != dist.attempt_prefix({})
    elastic = {dist.FRESH_STORE: "1"}  # a new store each round: agents' restart counts differ
    assert dist.attempt_prefix(
        {**elastic, "TORCHELASTIC_RESTART_COUNT": "2"}
    ) == dist.attempt_prefix(elastic)


@pytest.mark.slow
def test_restarted_attempt_sees_no_keys_of_the_failed_one():
    """torchrun --max-restarts=1 reuses its store; without the attempt prefix attempt 1 reads
    attempt 0's keys (checked by hand: stale=True), with it none."""
    proc = h.torchrun(["--nproc_per_node=2", "--max-restarts=1", "--monitor-interval=0.5"], ["tests/restart_worker.py"])  # fmt: skip
    ((rc, out, err),) = h.wait_all([proc], 200)
    assert rc == 0, err[-3000:]
    assert sorted(out.split("\n"))[-2:] == ["rank 0 attempt 1 stale=False", "rank 1 attempt 1 stale=False"]  # fmt: skip


@pytest.mark.slow
def test_sharded_checkpoint_without_a_shared_filesystem_is_one_line(byte_data, tmp_path):
    """FSDP2 ranks in different working directories with a relative run.dir (two nodes without
    a shared filesystem): the save is refused on every rank with one line; nothing is published."""
    cwds = [tmp_path / "node0", tmp_path / "node1"]
    for c in cwds:
        c.mkdir()
    args = ["-m", "gptrain", "train", "--config", h.DEBUG, f"--data.dir={byte_data}", "--run.dir=run", "--dist.mode=fsdp", "--train.max_steps=1", "--train.micro_batch_size=4", *h.FAST]  # fmt: skip
    results = h.wait_all(h.spawn(args, cwds=cwds), 300)
    needles = ["need run.dir on a filesystem every node sees", "another rank failed"]
    for (rc, _, err), needle in zip(results, needles, strict=True):
        assert rc == 2, err[-2000:]
        assert needle in err.strip().splitlines()[-1], err[-2000:]
    assert not (cwds[0] / "run" / "checkpoints" / "latest").exists()
