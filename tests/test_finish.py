"""A run killed after its last checkpoint, before it finished (in its final evaluation, or before
summary.json), is completed by the same command, which takes over the killed trainer's lock:
the final evaluation, the last step's row (its training metrics carried in the checkpoint's
meta.json), summary.json and the plot, equal to what the uninterrupted run wrote but for
wall-clock numbers. A finished run is left alone
(tests/test_resume.py::test_rerunning_a_finished_run_changes_nothing). An exception leaving the
loop publishes a pending background save first (2 ranks, FSDP2, checkpoint.async), unless a
peer cannot join in."""

import json
import os
import shutil
import signal
import socket
import sys
import time

import dist_helpers as h
import forked
import pytest
import torch
from train_helpers import DEBUG, REPO, run

from gptrain.checkpoint import manager as checkpoint
from gptrain.distributed import faults
from gptrain.training.meter import carried

COMMON = ["train.max_steps=6", "checkpoint.every=2", "eval.every=4", "eval.sample_every=0"]
COMMON += ["eval.tokens=512", "eval.sample_tokens=1", "optim.warmup_steps=1", "log.every=1"]
COMMON += ["model.dropout=0.1", "log.plot=true"]  # the plot is part of what a completion writes
CLOCK = {"tok_per_s", "mfu", "train_s"}  # wall-clock numbers: differ between any two runs
SUMMARY_CLOCK = CLOCK | {"elapsed_s", "goodput"}


def rows(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summary(run_dir, clock=SUMMARY_CLOCK) -> dict:
    """summary.json without its wall-clock numbers; of the speed choices only what was chosen
    (how and in what time are the last attempt's: a resumed one keeps the checkpoint's)."""
    s = without(json.loads((run_dir / "summary.json").read_text()), clock)
    s["speed_choices"] = {
        k: v for k, v in s["speed_choices"].items() if v is None or isinstance(v, str)
    }
    return s


def without(d: dict, keys) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


def killed(byte_data, run_dir, fault: str):
    """`gptrain train` in a process of its own with GPTRAIN_FAULT=fault; it must die by SIGKILL."""
    cmd = [sys.executable, "-m", "gptrain", "train", "--config", DEBUG, f"--data.dir={byte_data}"]
    cmd += [f"--run.dir={run_dir}", "--log.progress=false", *(f"--{o}" for o in COMMON)]
    env = {**os.environ, faults.ENV: fault, "PYTHONPATH": str(REPO)}
    p = forked.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr[-2000:])


@pytest.fixture(scope="module")
def uninterrupted(byte_data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("finish") / "full"
    run(byte_data, run_dir, *COMMON)
    return run_dir


def test_killed_in_the_final_evaluation_the_rerun_completes_the_run(
    byte_data, tmp_path, uninterrupted, capsys
):
    run_dir = tmp_path / "r"
    killed(byte_data, run_dir, "kill_eval@6")
    dead = json.loads((run_dir / ".lock").read_text())["pid"]  # the killed trainer's lock
    assert checkpoint.latest(run_dir).name == "step_00000006"
    assert not (run_dir / "summary.json").exists() and max(r["step"] for r in rows(run_dir)) == 5
    logged = checkpoint.load_meta(checkpoint.latest(run_dir))["logged"]  # measured before the kill
    assert run(byte_data, run_dir, *COMMON)["steps"] == 6
    err = capsys.readouterr().err  # the stale lock is taken over with one line, then released
    assert f"taking over the lock of gptrain train (host {socket.gethostname()}, pid {dead}" in err
    assert f"pid {dead} is not running" in err and not (run_dir / ".lock").exists()
    got, want = rows(run_dir), rows(uninterrupted)
    assert [without(r, CLOCK) for r in got] == [without(r, CLOCK) for r in want]
    assert got[-1]["step"] == 6 and "val_loss" in got[-1]
    assert {k: got[-1][k] for k in CLOCK} == {k: logged[k] for k in CLOCK}  # the killed run's
    assert summary(run_dir) == summary(uninterrupted)
    assert (run_dir / "loss.png").stat().st_size > 10_000
    log = (run_dir / "train.log").read_text()
    assert "step 6/6 loss" in log and "done: 6 steps" in log
    assert "completing it (final evaluation, summary, plot)" in log
    # and now it is finished: a third start changes nothing
    before = (run_dir / "summary.json").read_text(), (run_dir / "metrics.jsonl").read_text()
    assert run(byte_data, run_dir, *COMMON)["steps"] == 6
    assert (
        (run_dir / "summary.json").read_text(),
        (run_dir / "metrics.jsonl").read_text(),
    ) == before
    assert "already trained to step 6" in (run_dir / "train.log").read_text()


def test_a_rerun_with_max_steps_below_the_checkpoint_completes_it_and_says_so(
    byte_data, tmp_path, uninterrupted
):
    """Killed in the final evaluation at step 6, rerun with train.max_steps = 4: the run ends
    at step 6 as the uninterrupted one did (a checkpoint cannot go back), with a line saying so."""
    run_dir = tmp_path / "r"
    killed(byte_data, run_dir, "kill_eval@6")
    lower = [o if o != "train.max_steps=6" else "train.max_steps=4" for o in COMMON]
    assert run(byte_data, run_dir, *lower)["steps"] == 6
    assert summary(run_dir) == summary(uninterrupted)
    log = (run_dir / "train.log").read_text()
    assert "past train.max_steps = 4, so the run ends at step 6" in log


def test_killed_before_summary_json_the_rerun_writes_it_without_evaluating_again(
    byte_data, tmp_path, uninterrupted
):
    """What a kill after the last row and before summary.json leaves: every file of the finished
    run but summary.json and loss.png (written after it)."""
    run_dir = tmp_path / "r"
    shutil.copytree(uninterrupted, run_dir)
    (run_dir / "summary.json").unlink()
    (run_dir / "loss.png").unlink()
    metrics = (run_dir / "metrics.jsonl").read_text()
    assert run(byte_data, run_dir, *COMMON)["steps"] == 6
    assert (run_dir / "metrics.jsonl").read_text() == metrics  # no row again, no evaluation
    clock = {"elapsed_s", "goodput"}  # the row is the uninterrupted run's: so is the rest
    assert summary(run_dir, clock) == summary(uninterrupted, clock)
    assert (run_dir / "loss.png").is_file()
    assert "completing it (summary, plot)" in (run_dir / "train.log").read_text()


def test_a_carried_row_is_read_back_as_data_only():
    row = {"step": 6, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens": 6144, "tok_per_s": 9e3}
    row |= {"mfu": 0.1, "skipped": 0, "train_s": 1.5}
    assert carried(row, 6, 6144) == (without(row, {"step"}), "")
    for bad, why in [
        (None, "does not record them"),
        ({**row, "step": 5}, "not a row of step 6"),
        ([row], "not a row of step 6"),
        ({**row, "loss": "2.5"}, "not numbers ['loss']"),
        ({**row, "mfu": True}, "not numbers ['mfu']"),
        ({**row, "code": 1}, "unknown ['code']"),
        (without(row, {"lr"}), "missing ['lr']"),
        ({**row, "tokens": 1}, "counts 1 tokens, not 6144"),
    ]:
        got, problem = carried(bad, 6, 6144)
        assert got == {} and why in problem, (bad, problem)


@pytest.mark.slow
def test_two_ranks_killed_in_the_final_evaluation_are_completed_by_the_rerun(byte_data, tmp_path):
    """DDP, 2 gloo ranks: rank 1 SIGKILLed in step 6's evaluation (rank 0 then fails on its
    peer); the same command completes the run like an uninterrupted one."""

    def args(run_dir):
        cmd = ["-m", "gptrain", "train", "--config", h.DEBUG, f"--data.dir={byte_data}"]
        cmd += [f"--run.dir={run_dir}", "--train.micro_batch_size=4", "--log.progress=false"]
        return cmd + [f"--{o}" for o in COMMON]

    full, run_dir = tmp_path / "full", tmp_path / "r"
    h.check_ok(h.wait_all(h.spawn(args(full)), h.TIMEOUT))
    results = h.wait_all(h.spawn(args(run_dir), GPTRAIN_FAULT="kill_eval@6/1"), h.TIMEOUT)
    assert results[1][0] == -signal.SIGKILL and results[0][0] != 0, [r[2][-2000:] for r in results]
    assert checkpoint.latest(run_dir).name == "step_00000006"
    assert not (run_dir / "summary.json").exists()
    h.check_ok(h.wait_all(h.spawn(args(run_dir)), h.TIMEOUT))
    assert [without(r, CLOCK) for r in rows(run_dir)] == [without(r, CLOCK) for r in rows(full)]
    assert summary(run_dir) == summary(full)


# `gptrain train` whose step STEP raises on the ranks named (a bug or an error in a step)
RAISING = """
import sys
from gptrain.__main__ import entry
from gptrain.training import run as phases
step, ranks, argv = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3:]
real = phases.Run.train_step
def train_step(self, *args, **kwargs):
    if self.state.step + 1 == step and str(self.info.rank) in ranks:
        raise RuntimeError(f"step {step} fails on rank {self.info.rank}")
    return real(self, *args, **kwargs)
phases.Run.train_step = train_step
sys.argv = ["gptrain", *argv]
entry()
"""


def fsdp_async(byte_data, run_dir) -> list[str]:
    """A 2-rank FSDP2 run whose step 2 checkpoint is written in the background (published at
    the next save, step 4, or before an evaluation)."""
    cmd = ["train", "--config", h.DEBUG, f"--data.dir={byte_data}", f"--run.dir={run_dir}"]
    cmd += [*h.FAST, "--dist.mode=fsdp", "--checkpoint.async=true", "--checkpoint.every=2"]
    return cmd + ["--train.max_steps=4", "--train.micro_batch_size=4", "--model.dropout=0.1"]


@pytest.mark.slow
def test_an_error_in_a_step_on_every_rank_publishes_the_pending_background_save(
    byte_data, tmp_path
):
    full, run_dir = tmp_path / "full", tmp_path / "r"
    h.check_ok(h.wait_all(h.spawn(["-m", "gptrain", *fsdp_async(byte_data, full)]), 300))
    raising = ["-c", RAISING, "3", "0,1", *fsdp_async(byte_data, run_dir)]
    results = h.wait_all(h.spawn(raising), 300)
    assert all(rc == 1 for rc, _, _ in results), [r[2][-2000:] for r in results]
    assert all("step 3 fails on rank" in err for _, _, err in results)
    latest = checkpoint.latest(run_dir)
    assert latest is not None and latest.name == "step_00000002"
    assert checkpoint.problem(latest) is None
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    assert f"step 2: checkpoint {latest}" in (run_dir / "train.log").read_text()
    # resumable: the same command ends where the uninterrupted run ends
    h.check_ok(h.wait_all(h.spawn(["-m", "gptrain", *fsdp_async(byte_data, run_dir)]), 300))
    assert f"resumed from {latest}" in (run_dir / "train.log").read_text()
    a, b = h.checkpoint_tensors(full), h.checkpoint_tensors(run_dir)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_an_error_on_one_rank_leaves_the_pending_save_unpublished_and_says_so(byte_data, tmp_path):
    """Rank 1's step raises while rank 0 trains on: the save's collectives cannot complete, so
    neither rank waits for them; both end, and the main process's log names the step."""
    run_dir = tmp_path / "r"
    raising = ["-c", RAISING, "3", "1", *fsdp_async(byte_data, run_dir)]
    started = time.monotonic()
    results = h.wait_all(h.spawn(raising), 120)
    assert time.monotonic() - started < 60  # start-up included: nobody waits for the save
    assert all(rc != 0 for rc, _, _ in results), [r[2][-2000:] for r in results]
    assert "step 3 fails on rank 1" in results[1][2]
    assert checkpoint.latest(run_dir) is None
    log = (run_dir / "train.log").read_text()
    assert "step 2's checkpoint (written in the background) is not published: " in log
    assert "the last complete checkpoint is None" in log
