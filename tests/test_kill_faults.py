"""A process SIGKILLed during a save or an evaluation (GPTRAIN_FAULT=kill_save@4, kill_eval@4) on
one process, checkpoints every 2 steps, an evaluation every 4: it dies by SIGKILL; the newest
complete checkpoint is named in `latest` (step 2 when step 4's was being written, whose
temporary folder is left behind; step 4 when the evaluation after its save was killed), and the
same command without the fault ends bit for bit where an uninterrupted run ends."""

import os
import signal
import sys

import forked
import pytest
import torch
from train_helpers import DEBUG, REPO

from gptrain.checkpoint import manager as checkpoint
from gptrain.distributed import faults

COMMON = ["train.max_steps=6", "checkpoint.every=2", "eval.every=4", "eval.sample_every=0"]
COMMON += ["eval.tokens=512", "eval.sample_tokens=1", "optim.warmup_steps=1", "log.every=1"]
COMMON += ["log.progress=false", "log.plot=false", "model.dropout=0.1"]
LATEST = {"kill_save": "step_00000002", "kill_eval": "step_00000004"}
SAID = {
    "kill_save": "kill_save at step 4: checkpoint written, not published: SIGKILL",
    "kill_eval": "kill_eval at step 4: killed inside the evaluation: SIGKILL",
}


def train(byte_data, run_dir, fault=""):
    """`gptrain train` on the debug config in a process of its own; its CompletedProcess."""
    cmd = [sys.executable, "-m", "gptrain", "train", "--config", DEBUG, f"--data.dir={byte_data}"]
    cmd += [f"--run.dir={run_dir}", *(f"--{o}" for o in COMMON)]
    env = {**os.environ, faults.ENV: fault, "PYTHONPATH": str(REPO)}
    return forked.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def uninterrupted(byte_data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    p = train(byte_data, run_dir)
    assert p.returncode == 0, p.stderr[-2000:]
    return checkpoint.load_model_state(checkpoint.find(run_dir))[0]


@pytest.mark.parametrize("kind", ["kill_save", "kill_eval"])
def test_a_kill_keeps_the_previous_checkpoint_and_the_rerun_is_exact(
    byte_data, tmp_path, uninterrupted, kind
):
    run_dir = tmp_path / "r"
    p = train(byte_data, run_dir, f"{kind}@4")
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr[-2000:])
    assert f"gptrain: fault injection (GPTRAIN_FAULT): {SAID[kind]}" in p.stderr
    root = run_dir / "checkpoints"
    assert checkpoint.latest(run_dir).name == LATEST[kind]
    assert checkpoint.problem(root / LATEST[kind]) is None  # complete, every file as recorded
    hidden = sorted(p.name for p in root.iterdir() if p.name.startswith("."))
    if kind == "kill_save":  # killed after every file of step 4 was written, before the rename
        assert hidden == [".tmp-step_00000004"]
        assert (root / hidden[0] / "meta.json").is_file()
        assert not (root / "step_00000004").exists()
    else:
        assert hidden == []
    p = train(byte_data, run_dir)  # the same command, no fault: resumes from `latest`
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"resumed from {root / LATEST[kind]}" in (run_dir / "train.log").read_text()
    got = checkpoint.load_model_state(checkpoint.find(run_dir))[0]
    assert got.keys() == uninterrupted.keys()
    for k, v in uninterrupted.items():
        assert torch.equal(got[k], v), k
