"""A run killed after its last checkpoint, before it finished (in its final evaluation, or before
summary.json), is completed by the same command: the final evaluation, the last step's row (its
training metrics carried in the checkpoint's meta.json), summary.json and the plot, equal to
what the uninterrupted run wrote but for wall-clock numbers. A finished run is left alone
(tests/test_resume.py::test_rerunning_a_finished_run_changes_nothing)."""

import json
import os
import shutil
import signal
import sys

import dist_helpers as h
import forked
import pytest
from train_helpers import DEBUG, REPO, run

from gptrain.checkpoint import manager as checkpoint
from gptrain.distributed import faults
from gptrain.training.meter import carried

COMMON = ["train.max_steps=6", "checkpoint.every=2", "eval.every=4", "eval.sample_every=0"]
COMMON += ["eval.tokens=512", "eval.sample_tokens=1", "optim.warmup_steps=1", "log.every=1"]
COMMON += ["model.dropout=0.1"]
CLOCK = {"tok_per_s", "mfu", "train_s"}  # wall-clock numbers: differ between any two runs
SUMMARY_CLOCK = CLOCK | {"elapsed_s", "goodput"}


def rows(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summary(run_dir, clock=SUMMARY_CLOCK) -> dict:
    """summary.json without its wall-clock numbers (the speed choices' start-up seconds too)."""
    s = without(json.loads((run_dir / "summary.json").read_text()), clock)
    s["speed_choices"] = without(s["speed_choices"], {"seconds"})
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
    byte_data, tmp_path, uninterrupted
):
    run_dir = tmp_path / "r"
    killed(byte_data, run_dir, "kill_eval@6")
    assert checkpoint.latest(run_dir).name == "step_00000006"
    assert not (run_dir / "summary.json").exists() and max(r["step"] for r in rows(run_dir)) == 5
    logged = checkpoint.load_meta(checkpoint.latest(run_dir))["logged"]  # measured before the kill
    assert run(byte_data, run_dir, *COMMON)["steps"] == 6
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
