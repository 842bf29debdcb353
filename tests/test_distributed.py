"""Multi-process tests (CPU, gloo, 2 ranks as subprocesses): DDP, FSDP2 and a two-node run train
exactly like one process on the same global batches; gradients cross the wire once per optimizer
step; only rank 0 writes; FSDP checkpoints resume; dead or stuck peers end the run with one clear
line instead of a hang. Bad input to such runs: test_distributed_bad_input.py."""

import json
import shutil
import signal
import subprocess
import sys
import time

import dist_helpers as h
import forked
import pytest
import torch
from conftest import skip_where_bf16_is_emulated
from safetensors.torch import load_file
from train_helpers import comparable

from gptrain.checkpoint import dcp as sharded
from gptrain.checkpoint import manager as checkpoint
from gptrain.commands.train import train
from gptrain.config.load import load_config
from gptrain.distributed.runtime import DistInfo

pytestmark = pytest.mark.slow

STEPS = 5
# the same 1024-token global batch every step: 1 x 4 micro-batches of 4, or 2 ranks x 2 of 4;
# a small clip threshold so that the global gradient-norm clipping acts on every step
COMMON = [
    f"--train.max_steps={STEPS}",
    "--train.micro_batch_size=4",
    "--train.total_batch_size=1024",
    "--optim.grad_clip=0.05",
    *h.FAST,
]


def gptrain_args(byte_data, run_dir, *extra):
    return ["-m", "gptrain", "train", "--config", h.DEBUG, f"--data.dir={byte_data}", f"--run.dir={run_dir}", *COMMON, *extra]  # fmt: skip


def metrics(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def weights(run_dir):
    """The latest checkpoint's full model state (tied alias included), full or sharded (DCP)."""
    return checkpoint.load_model_state(checkpoint.find(run_dir))[0]


def assert_same_weights(a, b, what):
    for k in a.keys() & b.keys():
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=f"{k} differs: {what}")


@pytest.fixture(scope="module")
def runs(byte_data, tmp_path_factory):
    """The same 5 optimizer steps four ways; each entry is the run directory."""
    root = tmp_path_factory.mktemp("dist")
    out = {}
    # 1 process, accumulation 4 (in this process)
    cfg = load_config(h.DEBUG, [a[2:] for a in gptrain_args(byte_data, root / "single")[5:]])
    train(cfg, DistInfo())
    out["single"] = root / "single"

    # DDP: 2 processes x accumulation 2, started by hand, each in its own working directory with a
    # relative run.dir, so that anything a non-main rank writes would show up in its folder
    cwds = [root / "ddp_rank0", root / "ddp_rank1"]
    for c in cwds:
        c.mkdir()
    procs = h.spawn(gptrain_args(byte_data, "run", "--dist.mode=ddp"), cwds=cwds)
    out["ddp_results"] = h.wait_all(procs, h.TIMEOUT)
    h.check_ok(out["ddp_results"])
    out["ddp"], out["ddp_cwds"] = cwds[0] / "run", cwds

    # FSDP2: 2 processes x accumulation 2 through `gptrain train --dist.nproc_per_node=2`
    # (torch.distributed.run underneath); a checkpoint at step 3 for the resume test
    args = gptrain_args(byte_data, root / "fsdp", "--dist.mode=fsdp", "--dist.nproc_per_node=2", "--checkpoint.every=3")  # fmt: skip
    proc = forked.Popen([sys.executable, *args], env=h.env(), cwd=h.REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    h.check_ok(h.wait_all([proc], h.TIMEOUT))
    out["fsdp"] = root / "fsdp"

    # two "nodes": two torchrun agents, --nnodes=2, one process each, c10d rendezvous on localhost
    port = h.free_port()
    launcher = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=gptrain-test"]  # fmt: skip
    # (with other DDP settings than the defaults: no bucket views, 1 MB buckets)
    ddp_options = ["--dist.gradient_as_bucket_view=false", "--dist.bucket_cap_mb=1"]
    train_args = gptrain_args(byte_data, root / "multinode", *ddp_options)[1:]  # drop "-m"
    agents = [h.torchrun(launcher, ["-m", *train_args]) for _ in range(2)]
    h.check_ok(h.wait_all(agents, h.TIMEOUT))
    out["multinode"] = root / "multinode"

    # the same two nodes through gptrain's own launcher (torch.distributed.run underneath)
    port = h.free_port()
    nodes = ["--dist.nnodes=2", f"--dist.rdzv_endpoint=127.0.0.1:{port}", "--dist.nproc_per_node=1"]
    args = gptrain_args(byte_data, root / "multinode_cli", *nodes)
    procs = [forked.Popen([sys.executable, *args], env=h.env(), cwd=h.REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]  # fmt: skip
    h.check_ok(h.wait_all(procs, h.TIMEOUT))
    out["multinode_cli"] = root / "multinode_cli"
    return out


def test_ddp_fsdp_multinode_equal_single_process(runs):
    """1 x accumulation 4 == 2 DDP x 2 == 2 FSDP2 x 2 == 2 nodes x 1 x 2, in float32 after 5 steps."""
    single = weights(runs["single"])
    for name in ("ddp", "fsdp", "multinode", "multinode_cli"):
        other = weights(runs[name])
        meta = checkpoint.load_meta(checkpoint.find(runs[name]))
        assert meta["step"] == STEPS
        assert single.keys() == other.keys(), name
        if meta.get("layout") == "dcp":  # FSDP2: sharded; the tied lm_head is stored once
            assert meta["tied"] == {"lm_head.weight": "transformer.wte.weight"}
        else:
            assert "lm_head.weight" not in load_file(
                str(checkpoint.find(runs[name]) / "model.safetensors")
            )
        assert_same_weights(single, other, f"1 process vs {name}")
    torch.manual_seed(1337)  # training really moved the weights
    cfg = load_config(h.DEBUG)
    from gptrain.training.build import build_model

    init = build_model(cfg, 257).state_dict()
    assert max((init[k] - single[k]).abs().max().item() for k in single) > 1e-3


def test_logged_metrics_are_global(runs):
    """Logged loss = mean over micro-steps and ranks (equal to the 1-process loss); the grad norm
    is the global one (clipping at 0.05 acted); tokens count the global batch."""
    ref = metrics(runs["single"])
    assert [r["step"] for r in ref] == list(range(1, STEPS + 1))
    for name in ("ddp", "fsdp", "multinode", "multinode_cli"):
        rows = metrics(runs[name])
        assert [r["step"] for r in rows] == [r["step"] for r in ref], name
        for a, b in zip(ref, rows, strict=True):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (name, a["step"])
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (name, a["step"])
            assert b["tokens"] == a["tokens"] and b["tok_per_s"] > 0 and 0 < b["mfu"] < 1
            assert a["grad_norm"] > 0.05  # so the clipping was active on every step
    summary = json.loads((runs["ddp"] / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == STEPS


def test_only_rank0_writes_and_prints(runs):
    rank0, rank1 = runs["ddp_cwds"]
    assert list(rank1.iterdir()) == []  # rank 1's run.dir ("run" relative to its cwd) never made
    written = {p.name for p in (rank0 / "run").iterdir()}
    assert {"metrics.jsonl", "train.log", "config.toml", "checkpoints", "summary.json"} <= written
    (rc0, out0, _), (rc1, out1, err1) = runs["ddp_results"]
    assert "done: 5 steps" in out0 and "world size 2" in out0
    assert out1.strip() == "" and "step" not in err1


def test_fsdp_checkpoint_resumes_exactly(runs, tmp_path):
    """An FSDP2 run cut after its step-3 checkpoint (sharded, DCP) and resumed (2 ranks, FSDP2
    again) ends with the uninterrupted run's weights and optimizer state, bit for bit."""
    full, cut = runs["fsdp"], tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / f"step_{STEPS:08d}")
    (cut / "checkpoints" / "latest").write_text("step_00000003\n")
    args = ["-m", "gptrain", "train", "--config", str(cut / "config.toml"), f"--run.dir={cut}"]
    procs = h.spawn(args)  # by hand this time, a third way to start workers
    results = h.wait_all(procs, h.TIMEOUT)
    h.check_ok(results)
    assert "resumed from" in results[0][1] and "step_00000003" in results[0][1]
    a, b = weights(full), weights(cut)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(b[k], a[k]), k
    sa, sb = (checkpoint.load_state(checkpoint.find(r)) for r in (full, cut))
    assert sa["data"] == sb["data"] and sa["train_state"]["step"] == sb["train_state"]["step"]
    oa, ob = (sharded.load_full(checkpoint.find(r), checkpoint.load_meta(checkpoint.find(r)), "optim.") for r in (full, cut))  # fmt: skip
    assert oa.keys() == ob.keys() and len(oa) > 0
    for k, t in oa.items():
        assert torch.equal(ob[k], t), k


def test_resume_needs_the_run_directory_on_rank_0_only(runs, byte_data, tmp_path):
    """No shared filesystem: rank 1's working directory holds no run directory at all. Rank 0
    finds the checkpoint and sends the rest, so 2 ranks continue the DDP run from step 5 to 7 and
    end where one process continuing the same checkpoint ends."""
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    shutil.copytree(runs["ddp_cwds"][0], node0)
    node1.mkdir()
    longer = "--train.max_steps=7"
    procs = h.spawn(gptrain_args(byte_data, "run", "--dist.mode=ddp", longer), cwds=[node0, node1])
    results = h.wait_all(procs, h.TIMEOUT)
    h.check_ok(results)
    assert "resumed from" in results[0][1] and "step_00000005" in results[0][1]
    assert list(node1.iterdir()) == []
    single = tmp_path / "single"
    shutil.copytree(node0 / "run", single)
    shutil.rmtree(single / "checkpoints" / "step_00000007")
    (single / "checkpoints" / "latest").write_text("step_00000005\n")
    cfg = load_config(h.DEBUG, [a[2:] for a in gptrain_args(byte_data, single, longer)[5:]])
    assert train(cfg, DistInfo())["steps"] == 7
    a = load_file(str(checkpoint.find(single) / "model.safetensors"))
    b = load_file(str(checkpoint.find(node0 / "run") / "model.safetensors"))
    assert checkpoint.find(single).name == checkpoint.find(node0 / "run").name == "step_00000007"
    assert_same_weights(a, b, "2 ranks resumed without a shared run directory")


def test_checkpoint_resumes_on_another_world_size(runs, tmp_path):
    """The FSDP2 run's step-3 checkpoint (2 ranks, sharded) resumed by ONE plain process ends
    where the 1-process run ends: weights, optimizer and data cursor are world-size independent."""
    cut = tmp_path / "to_one"
    shutil.copytree(runs["fsdp"], cut)
    shutil.rmtree(cut / "checkpoints" / f"step_{STEPS:08d}")
    (cut / "checkpoints" / "latest").write_text("step_00000003\n")
    overrides = [f"run.dir={cut}", "dist.mode=ddp", "dist.nproc_per_node=1"]
    summary = train(load_config(str(cut / "config.toml"), overrides), DistInfo())
    assert summary["steps"] == STEPS and summary["world_size"] == 1
    single = load_file(str(checkpoint.find(runs["single"]) / "model.safetensors"))
    resumed = load_file(str(checkpoint.find(cut) / "model.safetensors"))
    assert single.keys() == resumed.keys()
    assert_same_weights(single, resumed, "2-rank FSDP checkpoint resumed on 1 process")
    assert metrics(cut)[-1]["loss"] == pytest.approx(metrics(runs["single"])[-1]["loss"], rel=1e-5)


def test_muon_ddp_equals_single_process_and_resumes_on_one(byte_data, tmp_path):
    """optim.name = muon (Muon for the block matrices, AdamW for the rest), wsd schedule:
    2 DDP ranks x accumulation 2 == 1 process x accumulation 4, and the DDP run's step-3
    checkpoint resumed by one process == the 1-process run.

    Compared through the losses, not the weights: torch's Muon orthogonalises in bfloat16, so the
    ~1e-7 rounding differences between summation orders flip bf16 roundings that Newton-Schulz
    amplifies in the near-null directions of the updates (weights then differ by up to ~1e-2 in
    attention's c_attn, directions the loss barely sees). The losses agree to ~1e-5 relative
    while they fall by ~5% a step; a DDP that left any gradient unsynchronised would not."""
    muon = ["--optim.name=muon", "--optim.lr_schedule=wsd", "--optim.decay_fraction=0.4", "--checkpoint.every=3"]  # fmt: skip
    cfg = load_config(h.DEBUG, [a[2:] for a in gptrain_args(byte_data, tmp_path / "single", *muon)[5:]])  # fmt: skip
    train(cfg, DistInfo())
    procs = h.spawn(gptrain_args(byte_data, tmp_path / "ddp", "--dist.mode=ddp", *muon))
    h.check_ok(h.wait_all(procs, h.TIMEOUT))
    state = checkpoint.load_state(checkpoint.find(tmp_path / "ddp"))
    assert "momentum_buffer" in state["optimizer"]["state"]["transformer.h.1.attn.c_proj.weight"]
    cut = tmp_path / "to_one"
    shutil.copytree(tmp_path / "ddp", cut)
    shutil.rmtree(cut / "checkpoints" / f"step_{STEPS:08d}")
    (cut / "checkpoints" / "latest").write_text("step_00000003\n")
    train(load_config(str(cut / "config.toml"), [f"run.dir={cut}"]), DistInfo())
    ref = metrics(tmp_path / "single")
    assert ref[0]["loss"] - ref[-1]["loss"] > 0.5  # it trained
    for name in ("ddp", "to_one"):
        rows = metrics(tmp_path / name)
        assert [r["step"] for r in rows] == [r["step"] for r in ref] == [1, 2, 3, 4, 5]
        for a, b in zip(ref, rows, strict=True):
            assert b["lr"] == a["lr"], (name, a["step"])
            assert b["loss"] == pytest.approx(a["loss"], rel=3e-5), (name, a["step"])
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3), (name, a["step"])
        assert rows[-1]["val_loss"] == pytest.approx(ref[-1]["val_loss"], rel=3e-5), name


def run_comm_worker(byte_data, tmp_path, mode, accum_micro=2, steps=3, extra=()):
    out = tmp_path / f"comm-{mode}"
    # micro-batch 2 of 64 tokens x 2 ranks x 4 micro-steps = 1024 tokens
    overrides = [f"--data.dir={byte_data}", "--train.micro_batch_size=2", "--train.total_batch_size=1024", *extra]  # fmt: skip
    procs = h.spawn([str(h.REPO / "tests" / "dist_helpers.py"), "comm", str(out), str(steps), mode, *overrides])  # fmt: skip
    h.check_ok(h.wait_all(procs, h.TIMEOUT))
    return [json.loads((tmp_path / f"comm-{mode}.{r}").read_text()) for r in range(2)]


def test_gradients_all_reduced_once_per_step_and_ranks_stay_identical(byte_data, tmp_path):
    """With accumulation 4 a DDP communication hook sees every gradient element once per
    optimizer step; without no_sync() (the control) it would see it 4 times."""
    once = run_comm_worker(byte_data, tmp_path, "once")
    control = run_comm_worker(byte_data, tmp_path, "every", steps=1)
    for rank in range(2):
        rec = once[rank]
        assert rec["accum"] == 4
        assert rec["initial"][0] == rec["initial"][1]  # identical parameters before training
        for step in rec["steps"]:
            assert step["elements"] == rec["params"] and step["buckets"] >= 1
            assert step["checksums"][0] == step["checksums"][1]  # identical after every step
        assert rec["steps"][0]["checksums"] != rec["steps"][-1]["checksums"]  # and they moved
        assert control[rank]["steps"][0]["elements"] == rec["accum"] * rec["params"]
    # Muon: the same one all-reduce per step, and every rank orthogonalises the same gradients
    (tmp_path / "muon").mkdir()
    muon = run_comm_worker(byte_data, tmp_path / "muon", "once", extra=["--optim.name=muon"])
    for step in muon[0]["steps"]:
        assert step["elements"] == muon[0]["params"]
        assert step["checksums"][0] == step["checksums"][1]
    assert muon[0]["steps"][-1]["checksums"] != once[0]["steps"][-1]["checksums"]  # not AdamW


def test_identical_init_and_rank_specific_dropout(byte_data, tmp_path):
    """The real train() on 2 ranks with dropout: parameters identical on both ranks before the
    first forward, dropout masks different (each rank has its own stream)."""
    out = tmp_path / "probe"
    args = [str(h.REPO / "tests" / "dist_helpers.py"), "train_probe", str(out), f"--data.dir={byte_data}", f"--run.dir={tmp_path / 'run'}", "--model.dropout=0.1", *COMMON]  # fmt: skip
    args = [a for a in args if not a.startswith("--train.max_steps")] + ["--train.max_steps=2"]
    h.check_ok(h.wait_all(h.spawn(args), h.TIMEOUT))
    probes = [json.loads((tmp_path / f"probe.{r}").read_text()) for r in range(2)]
    for p in probes:
        assert p["initial"][0] == p["initial"][1]
        assert 0.05 < p["mask_fraction"] < 0.15  # a dropout mask was really probed
        assert p["masks_equal"] == [True, False]


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_dead_or_stuck_peer_ends_the_run_with_its_rank(byte_data, tmp_path, how):
    """Rank 1 killed (or frozen) mid-run: rank 0 exits non-zero within the time-out, one line
    naming itself, the operation and rank 1."""
    timeout_s = 3
    args = gptrain_args(byte_data, tmp_path / "run", "--train.max_steps=100000", f"--dist.timeout_s={timeout_s}")  # fmt: skip
    procs = h.spawn(args)
    try:
        deadline = time.monotonic() + h.TIMEOUT
        while "step 2/" not in procs[0].stdout.readline():  # rank 0 is training
            assert time.monotonic() < deadline and procs[0].poll() is None
        procs[1].send_signal(getattr(signal, how))
        t0 = time.monotonic()
        _, err = procs[0].communicate(timeout=timeout_s + 30)
        elapsed = time.monotonic() - t0
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
    assert procs[0].returncode not in (0, None)
    assert elapsed < timeout_s + 15
    line = [x for x in err.splitlines() if x.startswith("gptrain: error:")]
    assert len(line) == 1 and "Traceback" not in err, err[-2000:]
    assert "rank 0 of 2: `" in line[0] and "failed: rank 1 does not answer" in line[0], line[0]


@skip_where_bf16_is_emulated("a 2-rank bf16 FSDP2 training run")
def test_fsdp_bf16_mixed_precision_under_torchrun(runs, byte_data, tmp_path):
    """`torchrun --standalone --nproc_per_node=2` with FSDP2 and bf16 compute (MixedPrecisionPolicy,
    fp32 reduction): trains, keeps fp32 master weights, and its losses track the fp32 run's."""
    run_dir = tmp_path / "bf16"
    args = gptrain_args(byte_data, run_dir, "--dist.mode=fsdp", "--train.dtype=bfloat16")
    proc = h.torchrun(["--standalone", "--nproc_per_node=2"], args)
    h.check_ok(h.wait_all([proc], h.TIMEOUT))
    assert {v.dtype for v in weights(run_dir).values()} == {torch.float32}
    for a, b in zip(metrics(runs["single"]), metrics(run_dir), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2), a["step"]


def test_compiled_ddp_run_saves_plain_keys(byte_data, runs, tmp_path):
    """compile, then DDP (2 ranks): the checkpoint holds the plain model's keys, no wrapper
    prefix, and matches the eager DDP run's weights (within compiled-kernel rounding)."""
    run_dir = tmp_path / "compiled"  # the same run as `runs`' DDP one, compiled
    args = gptrain_args(byte_data, run_dir, "--dist.mode=ddp", "--train.compile=true")
    h.check_ok(h.wait_all(h.spawn(args), 3 * h.TIMEOUT))  # each rank compiles: slow on a busy CPU
    keys = {name: load_file(str(checkpoint.find(d) / "model.safetensors")) for name, d in (("eager", runs["ddp"]), ("compiled", run_dir))}  # fmt: skip
    assert keys["compiled"].keys() == keys["eager"].keys()
    assert not any(
        k.startswith(("module.", "_orig_mod.")) or "._orig_mod." in k for k in keys["compiled"]
    )
    # compiled kernels round differently; AdamW turns that into ~1e-6 weight differences
    eager, compiled = comparable(keys["eager"]), comparable(keys["compiled"])
    for k in eager:
        torch.testing.assert_close(compiled[k], eager[k], rtol=1e-4, atol=1e-5, msg=k)
