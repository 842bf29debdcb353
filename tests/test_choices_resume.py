"""Speed choices through a real run (training/build.py speed_choices, training/run.py): a resumed
run reuses its recorded micro-batch and equals the uninterrupted run bit for bit, an explicit
value that differs from a recorded choice is one line, and a mixed-hardware drill (two gloo
ranks, one with faked facts) agrees on choices both can run and trains to the end with its
replicas agreeing."""

import json
import shutil

import pytest
import torch
from dist_helpers import DEBUG, FAST, spawn, wait_all
from train_helpers import run, weights

from gptrain.checkpoint import manager as checkpoint
from gptrain.training import batch


def _gpu_like_trials(monkeypatch, state: dict) -> None:
    """micro_batch_size = auto measured as on a GPU (trial steps), its memory given by `state`:
    "room" sequences fit (the largest candidate fits where it is None)."""

    def trials(t, info, wrapped, model, autocast, vocab_size, options, device):
        room = state["room"]
        return options[0] if room is None else next(o for o in options if o <= room)

    monkeypatch.setattr(batch, "runs_trials", lambda t, info: t.micro_batch_size == "auto")
    monkeypatch.setattr(batch, "_trials", trials)


def test_a_resume_reuses_the_recorded_micro_batch_bit_for_bit(byte_data, tmp_path, monkeypatch):
    """micro_batch_size = auto, 16 sequences per step: the first start's trials fit 4, the
    resumed start's would fit 16 (more free memory). The resumed run keeps the recorded 4 and ends
    bit for bit as the uninterrupted run; the checkpoint records it with the speed choices."""
    state = {"room": 4}
    _gpu_like_trials(monkeypatch, state)
    common = ["train.max_steps=4", "checkpoint.every=2", "eval.every=0", "eval.sample_every=0"]
    common += ["train.micro_batch_size=auto", "model.dropout=0.1", "optim.warmup_steps=1"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert run(byte_data, full, *common)["micro_batch_size"] == 4
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step_00000004")
    (cut / "checkpoints" / "latest").write_text("step_00000002\n")
    state["room"] = None  # a fresh measurement would take 16 now
    assert run(byte_data, cut, *common)["micro_batch_size"] == 4
    a, b = weights(full), weights(cut)
    assert all(torch.equal(a[k], b[k]) for k in a)
    record = checkpoint.load_meta(checkpoint.find(cut))["speed_choices"]
    assert record["micro_batch_size"] == 4 and record["compile"] is False
    assert "cannot run here" not in (cut / "train.log").read_text()


def test_an_explicit_value_that_differs_on_resume_is_one_line(byte_data, tmp_path):
    """A run recorded train.loss = full (configs/debug.toml); resumed with train.loss=chunked and
    train.micro_batch_size=4: one line each, naming the key and both values; the explicit
    values are what the resumed run records."""
    common = ["train.max_steps=2", "checkpoint.every=2", "eval.every=0", "eval.sample_every=0"]
    run(byte_data, tmp_path, *common, "optim.warmup_steps=1")
    run(byte_data, tmp_path, *common, "train.max_steps=3", "checkpoint.every=3", "train.loss=chunked", "train.micro_batch_size=4", "optim.warmup_steps=1")  # fmt: skip
    log = (tmp_path / "train.log").read_text()
    tail = "the explicit value wins, so the numerics differ from the uninterrupted run"
    assert log.count(f"train.loss = chunked (explicit) differs from the checkpoint's recorded full; {tail}") == 1  # fmt: skip
    assert log.count(f"train.micro_batch_size = 4 (explicit) differs from the checkpoint's recorded 8; {tail}") == 1  # fmt: skip
    record = checkpoint.load_meta(checkpoint.find(tmp_path))["speed_choices"]
    assert (record["loss"], record["micro_batch_size"]) == ("chunked", 4)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_mixed_hardware_drill_agrees_on_choices_every_rank_can_run(byte_data, tmp_path, mode):
    """Two gloo ranks (DDP, FSDP2), rank 1 reporting another device (GPTRAIN_FAULT=facts@1/1: no
    FP8, no native bf16, 1 MiB): dtype, loss and Muon's split left to auto are decided for both (float32,
    the chunked loss by the rank with the least memory, split by rule), every rank prints the same
    choices, and the run trains to the end with its replicas agreeing at each checkpoint."""
    args = ["-m", "gptrain", "train", "--config", DEBUG, f"--data.dir={byte_data}", *FAST]
    args += [f"--run.dir={tmp_path}", "--train.max_steps=4", "--checkpoint.every=2"]
    args += ["--train.dtype=auto", "--train.loss=auto", "--optim.name=muon", f"--dist.mode={mode}"]
    results = wait_all(spawn(args, GPTRAIN_FAULT="facts@1/1"), timeout=240)
    for rank, (rc, _, e) in enumerate(results):
        assert rc == 0, (rank, e[-3000:])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 4
    choices = summary["speed_choices"]
    assert (choices["dtype"], choices["loss"], choices["muon_split"]) == ("float32", "chunked", "split")  # fmt: skip
    if mode == "ddp":  # FSDP2 always splits, whatever the ranks
        assert choices["how"]["muon_split"].startswith("rule: ranks differ (")
        assert "(faked by GPTRAIN_FAULT=facts@1/1) [" in choices["how"]["muon_split"]
    assert "of the least free memory of any rank (0.0 GiB)" in choices["how"]["loss"]
    assert choices["how"]["dtype"].startswith(("rule: bf16 not native on every rank (", "measured: bf16 emulated", "cached: bf16 emulated"))  # fmt: skip
