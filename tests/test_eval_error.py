"""An evaluation that fails on one of 2 ranks (gloo) right after a save step: GPTRAIN_FAULT=
eval_error@4/1 raises in rank 1's evaluation at step 4, whose checkpoint was just written (in the
background under FSDP2's checkpoint.async). Every rank ends within 60 s, non-zero; step 4's
checkpoint is published before the evaluation, so it is complete and named in `latest`, never a
temporary folder that retention deletes; the same command without the fault then ends bit for
bit where an uninterrupted run ends."""

import time

import dist_helpers as h
import pytest
import torch

from gptrain.checkpoint import manager as checkpoint

pytestmark = pytest.mark.slow

COMMON = ["--train.max_steps=6", "--train.micro_batch_size=4", *h.FAST, "--checkpoint.every=2"]
COMMON += ["--eval.every=4", "--eval.tokens=512", "--checkpoint.keep_last=1"]
MODES = {"ddp": ["--dist.mode=ddp"], "fsdp": ["--dist.mode=fsdp", "--checkpoint.async=true"]}


def args(byte_data, run_dir, mode):
    cmd = ["-m", "gptrain", "train", "--config", h.DEBUG, f"--data.dir={byte_data}"]
    return [*cmd, f"--run.dir={run_dir}", *MODES[mode], *COMMON]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_failed_evaluation_keeps_the_checkpoint_saved_before_it(byte_data, tmp_path, mode):
    full, run_dir = tmp_path / "full", tmp_path / "run"
    h.check_ok(h.wait_all(h.spawn(args(byte_data, full, mode)), h.TIMEOUT))
    started = time.time()
    results = h.wait_all(h.spawn(args(byte_data, run_dir, mode), GPTRAIN_FAULT="eval_error@4/1"))
    assert time.time() - started < 60 + 30  # start-up included
    assert all(rc != 0 for rc, _, _ in results), [r[2][-2000:] for r in results]
    assert "eval error at step 4" in results[1][2]
    root = run_dir / "checkpoints"
    assert checkpoint.latest(run_dir).name == "step_00000004"
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]  # nothing half-made
    h.check_ok(h.wait_all(h.spawn(args(byte_data, run_dir, mode)), h.TIMEOUT))
    a, b = h.checkpoint_tensors(full), h.checkpoint_tensors(run_dir)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
