"""The hang watchdog (dist.hang_timeout_s): budgets per phase from measured times, and runs that
hang (GPTRAIN_FAULT=hang, stall_save) in one process and in one of 2 ranks: each ends within its
budget + 30 s with exit code 3 and one line naming rank, host, phase and time, every thread's
stack in train.log; the rerun equals the uninterrupted run bit for bit."""

import os
import signal
import socket
import subprocess
import sys
import time

import dist_helpers as h
import forked
import pytest
import torch
from train_helpers import DEBUG, REPO, run, weights

from gptrain.__main__ import main as cli
from gptrain.checkpoint import manager as checkpoint
from gptrain.distributed import watchdog
from gptrain.distributed.watchdog import FIRST_S, Watchdog

BUDGET = 3  # seconds: dist.hang_timeout_s in the runs below
COMMON = ["train.max_steps=8", "checkpoint.every=4", "model.dropout=0.1", "log.every=1"]
COMMON += ["eval.every=0", "eval.sample_every=0", "eval.tokens=512", "eval.sample_tokens=1"]
COMMON += ["optim.warmup_steps=1", "log.progress=false", "log.plot=false", "train.dtype=float32"]


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_budgets_follow_the_measured_times_per_phase():
    clock = FakeClock()
    wd = Watchdog("auto", 0, clock=clock)  # not started: budgets only
    assert wd.budget("start", None) == FIRST_S
    clock.t = 20.0
    wd.enter("step", 1)  # start-up took 20 s
    assert wd.budget("step", 1) == FIRST_S  # the first step compiles
    clock.t = 320.0
    wd.enter("step", 2)  # the first step took 300 s: not a measure of later steps
    assert wd.first_step_s == 300.0 and "step" not in wd.slowest
    assert wd.budget("step", 2) == FIRST_S  # no step measured yet
    clock.t = 321.0
    wd.enter("step", 3)
    assert wd.budget("step", 3) == 60.0  # 10 x 1 s is below the floor
    clock.t = 329.0
    wd.enter("save", 3)  # step 3 took 8 s
    assert wd.budget("step", 4) == 80.0 and wd.budget("save", 3) == FIRST_S
    clock.t = 359.0
    wd.enter("val", 3)  # the save took 30 s
    assert wd.budget("save", 6) == 300.0 and wd.budget("val", 3) == FIRST_S
    clock.t = 360.0
    wd.enter("hellaswag", 3)  # validation took 1 s
    # the first HellaSwag pass is judged by its own (first) budget, not validation's 60 s
    assert wd.budget("hellaswag", 3) == FIRST_S and wd.budget("val", 6) == 60.0
    clock.t = 660.0
    wd.enter("step", 4)  # HellaSwag took 300 s
    assert wd.budget("hellaswag", 6) == 3000.0 and wd.budget("step", 4) == 80.0
    assert wd.totals == {
        "start": 20.0,
        "step": 309.0,
        "save": 30.0,
        "rollback": 0.0,
        "val": 1.0,
        "hellaswag": 300.0,
        "sample": 0.0,
        "upload": 0.0,
    }

    fixed = Watchdog(7, 0, clock=clock)
    fixed.enter("step", 11)
    assert fixed.budget("start", None) == FIRST_S and fixed.budget("step", 11) == FIRST_S
    assert fixed.budget("step", 12) == 7.0 and fixed.budget("save", 12) == 7.0
    off = Watchdog(0, 0).start()
    assert not off.enabled and off._thread is None


def test_flight_recorder_env_keeps_user_settings(tmp_path):
    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}
    watchdog.flight_recorder_env(str(tmp_path / "run"), env)
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50" and env["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "run" / "nccl_trace_rank_")
    assert watchdog.dump_flight_recorder(0, env) is None  # no NCCL group: no pipe, nothing to do


@pytest.mark.parametrize("value", ["-1", "soon", "1.5"])
def test_bad_hang_timeout_is_one_line_exit_2(tmp_path, capsys, value):
    assert cli(["train", "--config", DEBUG, f"--run.dir={tmp_path / 'r'}", f"--dist.hang_timeout_s={value}"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dist.hang_timeout_s" in err[0] and "auto" in err[0]
    assert not (tmp_path / "r").exists()


def start(byte_data, run_dir, fault):
    cmd = [sys.executable, "-m", "gptrain", "train", "--config", DEBUG, f"--data.dir={byte_data}"]
    cmd += [f"--run.dir={run_dir}", *(f"--{o}" for o in COMMON), f"--dist.hang_timeout_s={BUDGET}"]
    env = {**os.environ, "GPTRAIN_FAULT": fault, "PYTHONPATH": str(REPO)}
    return forked.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)  # fmt: skip


def wait_hung(proc, limit=BUDGET + 30):
    """Read stderr until the fault says it fired; then the process must end within `limit` s.
    Returns (returncode, stderr lines, seconds from the fault to the exit)."""
    lines = []
    for line in proc.stderr:
        lines.append(line.rstrip("\n"))
        if "fault injection" in line:
            break
    fired = time.monotonic()
    try:
        _, rest = proc.communicate(timeout=limit + 60)
    except subprocess.TimeoutExpired:  # no orphan left sleeping forever
        proc.kill()
        proc.communicate()
        raise
    ended = time.monotonic() - fired
    return proc.returncode, lines + rest.splitlines(), ended


def the_line(lines):
    hung = [line for line in lines if line.startswith("gptrain: error:")]
    assert len(hung) == 1, lines
    return hung[0]


@pytest.mark.parametrize(
    "fault, phase, frame",
    [
        ("hang@6", "step 6", "in in_step"),
        ("stall_save@4", "the checkpoint save at step 4", "in stall_save"),
    ],
)
def test_one_process_hang_exits_3_and_the_rerun_equals_an_uninterrupted_run(byte_data, tmp_path, fault, phase, frame):  # fmt: skip
    full, cut = tmp_path / "full", tmp_path / "cut"
    run(byte_data, full, *COMMON)
    rc, lines, ended = wait_hung(start(byte_data, cut, fault))
    assert rc == watchdog.EXIT_CODE, lines
    assert ended < BUDGET + 30, ended
    line = the_line(lines)
    assert f"rank 0 on {socket.gethostname()} hung: {phase} has made no progress for" in line
    assert "safe to restart" in line and f"dist.hang_timeout_s = {BUDGET}" in line
    log = (cut / "train.log").read_text()
    assert "stacks of every thread" in log and frame in log
    kept = 4 if fault.startswith("hang") else None  # a stalled save never became visible
    assert (checkpoint.latest(cut).name == f"step_{kept:08d}") if kept else checkpoint.latest(cut) is None  # fmt: skip
    assert run(byte_data, cut, *COMMON)["steps"] == 8  # the same command, without the fault
    a, b = weights(full), weights(cut)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_hang_in_one_of_two_ranks_exits_3_and_the_rerun_equals_an_uninterrupted_run(byte_data, tmp_path):  # fmt: skip
    args = lambda d: ["-m", "gptrain", "train", "--config", h.DEBUG, f"--data.dir={byte_data}", f"--run.dir={d}", "--train.micro_batch_size=4", *(f"--{o}" for o in COMMON), f"--dist.hang_timeout_s={BUDGET}"]  # noqa: E731 # fmt: skip
    full, cut = tmp_path / "full", tmp_path / "cut"
    h.check_ok(h.wait_all(h.spawn(args(full)), timeout=300))
    procs = h.spawn(args(cut), GPTRAIN_FAULT="hang@6/1")
    rc1, lines1, ended = wait_hung(procs[1])
    rc0, out0, err0 = h.wait_all(procs[:1], timeout=BUDGET + 60)[0]
    assert rc1 == watchdog.EXIT_CODE and ended < BUDGET + 30, (rc1, ended, lines1)
    assert f"rank 1 on {socket.gethostname()} hung: step 6 has made no progress" in the_line(lines1)
    assert "in in_step" in "\n".join(lines1)  # rank 1's stacks: on its stderr
    # rank 0 waits for rank 1 in step 6's gradient all-reduce: its own watchdog (exit 3) or the
    # broken connection when rank 1 exits (exit 1, naming rank 1) ends it, whichever comes first
    assert rc0 in (watchdog.EXIT_CODE, 1), err0[-3000:]
    assert "hung: step 6" in err0 or "rank 1" in err0, err0[-3000:]
    assert checkpoint.latest(cut).name == "step_00000004"
    h.check_ok(h.wait_all(h.spawn(args(cut)), timeout=300))
    a, b = weights(full), weights(cut)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_run_suspended_longer_than_its_budget_is_not_hung_and_trains_as_if_never_stopped(
    byte_data, tmp_path
):
    """SIGSTOP for BUDGET + 5 s in a step (Ctrl-Z, a scheduler's suspend, a paused VM), then
    SIGCONT: the watchdog counts none of it, says so once, and the run ends as the same run
    never stopped."""
    steps = ["train.max_steps=40", "checkpoint.every=40"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    run(byte_data, full, *COMMON, *steps)
    cmd = [sys.executable, "-m", "gptrain", "train", "--config", DEBUG, f"--data.dir={byte_data}"]
    cmd += [f"--run.dir={cut}", *(f"--{o}" for o in [*COMMON, *steps])]
    cmd += [f"--dist.hang_timeout_s={BUDGET}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    proc = forked.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # a step after the first (which compiles: a longer budget)
            if line.startswith("step 3/"):
                break
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(BUDGET + 5)
        os.kill(proc.pid, signal.SIGCONT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "this process was suspended for" in err and "hung" not in err
    a, b = weights(full), weights(cut)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_two_ranks_suspended_together_are_not_hung(byte_data, tmp_path):
    """Both ranks SIGSTOPped for BUDGET + 5 s in a step (a scheduler suspends the whole job), then
    SIGCONTed: each says it was suspended, neither is hung, and the run finishes. (That a
    suspension leaves the training itself alone, bit for bit, the one-process test shows.)"""
    steps = ["--train.max_steps=40", "--checkpoint.every=40"]
    cut = tmp_path / "cut"
    argv = ["-m", "gptrain", "train", "--config", h.DEBUG, f"--data.dir={byte_data}", f"--run.dir={cut}", "--train.micro_batch_size=4", *(f"--{o}" for o in COMMON), *steps, f"--dist.hang_timeout_s={BUDGET}"]  # fmt: skip
    procs = h.spawn(argv)
    for line in procs[0].stdout:  # a step after the first (which compiles: a longer budget)
        if line.startswith("step 3/"):
            break
    for p in procs:
        os.kill(p.pid, signal.SIGSTOP)
    time.sleep(BUDGET + 5)
    for p in procs:
        os.kill(p.pid, signal.SIGCONT)
    results = h.wait_all(procs, timeout=300)
    h.check_ok(results)
    for rank, (_, _, err) in enumerate(results):
        assert f"rank {rank}: this process was suspended for" in err and "hung" not in err
    assert checkpoint.latest(cut).name == "step_00000040"
