"""The train state is one checkpoint part: float16 runs (loss scaling) resume bit for bit, one
process and DDP, and a checkpoint whose train state lacks the newer entries still resumes."""

import shutil

import dist_helpers as h
import pytest
import torch
from train_helpers import DEBUG, run, weights

from gptrain.checkpoint import manager as checkpoint
from gptrain.training.guards import NonFinite, Spikes
from gptrain.training.state import TrainState

FLOAT16 = ["train.dtype=float16", "eval.every=0", "eval.sample_every=0", "eval.tokens=1024"]


def cut_back(full, cut, step: int, later: list[int]) -> None:
    """`cut` is `full` as a crash right after step `step`'s checkpoint left it."""
    shutil.copytree(full, cut)
    for s in later:
        shutil.rmtree(cut / "checkpoints" / f"step_{s:08d}")
    (cut / "checkpoints" / "latest").write_text(f"step_{step:08d}\n")


def assert_same_run(a_dir, b_dir) -> None:
    a, b = weights(a_dir), weights(b_dir)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    sa = checkpoint.load_state(checkpoint.find(a_dir))
    sb = checkpoint.load_state(checkpoint.find(b_dir))
    for k, v in sa["optimizer"]["state"].items():
        for name, t in v.items():
            assert torch.equal(t, sb["optimizer"]["state"][k][name]), (k, name)
    assert sa["data"] == sb["data"]
    # the GradScaler's scale and growth tracker: a fresh scaler after the resume would count
    # its growth interval from 0 again (and re-learn a lowered scale by skipping steps)
    assert sa["train_state"]["scaler"] == sb["train_state"]["scaler"]
    assert sa["train_state"]["scaler"]["_growth_tracker"] == 8


def test_float16_resume_is_bit_for_bit_with_the_loss_scale(byte_data, tmp_path):
    """float16 on a CPU (emulated, slow: only to test this path): stop after step 4 of 8."""
    common = ["train.max_steps=8", "checkpoint.every=4", *FLOAT16]
    full, cut = tmp_path / "full", tmp_path / "cut"
    run(byte_data, full, *common)
    cut_back(full, cut, 4, [8])
    assert run(byte_data, cut, *common)["steps"] == 8
    assert_same_run(full, cut)


@pytest.mark.slow
def test_float16_ddp_resume_is_bit_for_bit_with_the_loss_scale(byte_data, tmp_path):
    """The same on 2 DDP ranks (gloo): the resumed run equals the uninterrupted one."""
    common = ["--train.max_steps=8", "--checkpoint.every=4", *(f"--{o}" for o in FLOAT16)]
    full, cut = tmp_path / "full", tmp_path / "cut"
    args = [
        "-m",
        "gptrain",
        "train",
        "--config",
        DEBUG,
        f"--data.dir={byte_data}",
        "--dist.mode=ddp",
    ]
    h.check_ok(h.wait_all(h.spawn([*args, f"--run.dir={full}", *common]), h.TIMEOUT))
    cut_back(full, cut, 4, [8])
    h.check_ok(h.wait_all(h.spawn([*args, f"--run.dir={cut}", *common]), h.TIMEOUT))
    assert_same_run(full, cut)


def state_with_scaler(scale: float) -> TrainState:
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))])
    nonfinite = NonFinite("skip", 10, opt, scaler, "cpu", sharded=False)
    return TrainState(nonfinite, Spikes("log", 3.0, 4), scaler)


def test_train_state_round_trip_against_torch_s_scaler_state():
    """Every counter and the scaler come back as torch's GradScaler.state_dict holds them."""
    a = state_with_scaler(2.0**5)
    a.advance(1024), a.advance(1024)
    a.rollbacks, a.wandb_run_id = 1, "abc123"
    a.nonfinite.set_count(3)
    saved = a.state_dict()
    b = state_with_scaler(2.0**16)
    b.load_state_dict(saved)
    assert (b.step, b.tokens, b.rollbacks, b.wandb_run_id) == (2, 2048, 1, "abc123")
    assert b.nonfinite.count() == 3
    assert b.scaler.state_dict() == a.scaler.state_dict() and b.scaler.get_scale() == 2.0**5


def test_a_train_state_without_the_newer_entries_resumes_with_fresh_ones():
    """A checkpoint written before the scaler and tracker id were saved: the fresh values, which
    are what its run had (a float32/bf16 run has no active scaler)."""
    old = {"step": 6, "tokens": 6144, "elapsed_s": 3.5, "skipped": 0, "rollbacks": 0,
           "spikes": None, "world_size": 1}  # fmt: skip
    s = state_with_scaler(2.0**16)
    s.load_state_dict(old)
    assert (s.step, s.tokens, s.wandb_run_id) == (6, 6144, None)
    assert s.elapsed() == pytest.approx(3.5)
    assert s.scaler.get_scale() == 2.0**16
