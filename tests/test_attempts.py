"""The restart ledger (run.dir/attempts.jsonl) and the crash-loop stop (run.max_failed_attempts):
`crash` right after the resume point stops the run with exit 4 after exactly the configured number
of attempts; a run preempted (SIGTERM) as often never stops; bad input writes nothing."""

import os
import signal
import subprocess
import sys
import time

import forked
import pytest
from train_helpers import DEBUG, REPO, run

from gptrain.__main__ import main as cli
from gptrain.checkpoint import manager as checkpoint
from gptrain.distributed import launch, watchdog
from gptrain.training import attempts
from gptrain.training.attempts import failed_streak
from gptrain.training.guards import Preemption

QUICK = ["eval.every=0", "eval.sample_every=0", "eval.tokens=512", "eval.sample_tokens=1"]
QUICK += ["optim.warmup_steps=1", "log.progress=false", "log.plot=false", "checkpoint.every=2"]


def attempt(n, latest, end=None, signal=None, limit=3):
    start = {"attempt": n, "last_checkpoint": latest, "max_failed_attempts": limit}
    return {"attempt": n, "start": start, "signal": signal, "end": end and {"exit": end}}


def test_failed_streak_rules():
    died = [attempt(1, "step_2", "finished"), attempt(2, "step_4"), attempt(3, "step_4")]
    assert [a["attempt"] for a in failed_streak(died, "step_4")] == [3, 2]  # 2 made step_4: no
    assert [a["attempt"] for a in failed_streak(died[:2], "step_4")] == [2]
    assert failed_streak(died, "step_6") == []  # attempt 3 wrote step_6: progress
    errors = [attempt(1, None, "error"), attempt(2, None, "hung"), attempt(3, None, "stopped")]
    assert len(failed_streak(errors, "")) == 3  # no checkpoint ever: all failed
    for kind in ("finished", "preempted", "interrupted", "bad input"):
        runs = [*errors, attempt(4, None, kind), attempt(5, None, "error")]
        assert [a["attempt"] for a in failed_streak(runs, "")] == [5], kind
    signalled = [*errors, attempt(4, None, signal={"signal": "SIGTERM"}), attempt(5, None)]
    assert [a["attempt"] for a in failed_streak(signalled, "")] == [5]  # killed after SIGTERM
    refusals = [*errors, attempt(4, None, "crash loop"), attempt(5, None, "error")]
    assert [a["attempt"] for a in failed_streak(refusals, "")] == [5, 3, 2, 1]  # looked past
    reset = [*errors, attempt(4, None, "error", limit=0), attempt(5, None, "error")]
    assert [a["attempt"] for a in failed_streak(reset, "")] == [5, 4]  # counted from the reset


def test_exit_codes_agree_with_the_launcher():
    assert (launch.HUNG, launch.CRASH_LOOP) == (watchdog.EXIT_CODE, attempts.EXIT_CRASH_LOOP)


def test_a_run_records_its_starts_and_ends(byte_data, tmp_path):
    run_dir = tmp_path / "r"
    run(byte_data, run_dir, "train.max_steps=2", *QUICK)
    run(byte_data, run_dir, "train.max_steps=2", *QUICK)  # already trained
    run(byte_data, run_dir, "train.max_steps=4", *QUICK)
    rows = attempts.read(run_dir)
    assert [a["attempt"] for a in rows] == [1, 2, 3]
    assert [a["start"]["last_checkpoint"] for a in rows] == [None, "step_00000002", "step_00000002"]  # fmt: skip
    assert [a["start"]["start_step"] for a in rows] == [0, 2, 2]
    assert [a["end"]["exit"] for a in rows] == ["finished"] * 3
    assert [a["end"]["step"] for a in rows] == [2, 2, 4]
    assert rows[0]["start"]["hosts"] == [os.uname().nodename] and rows[0]["start"]["world_size"] == 1  # fmt: skip


def test_bad_input_writes_nothing(byte_data, tmp_path, capsys):
    run_dir = tmp_path / "r"
    args = [
        "train",
        "--config",
        DEBUG,
        f"--data.dir={tmp_path / 'nowhere'}",
        f"--run.dir={run_dir}",
    ]
    assert cli(args) == 2
    assert not run_dir.exists()
    run(byte_data, run_dir, "train.max_steps=2", *QUICK)
    before = (run_dir / attempts.LEDGER).read_text()
    assert cli([*args, "--train.max_steps=4"]) == 2  # an existing run: its ledger is unchanged
    assert (run_dir / attempts.LEDGER).read_text() == before
    assert cli(["train", "--config", DEBUG, "--run.max_failed_attempts=-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "run.max_failed_attempts = -1 must be >= 0" in err[-1]


def finish(p, timeout=120):
    """(stdout, stderr) of a started run; killed if it outlives `timeout` (no orphans)."""
    try:
        return p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise


def start(byte_data, run_dir, *extra, fault=""):
    cmd = [sys.executable, "-m", "gptrain", "train", "--config", DEBUG, f"--data.dir={byte_data}"]
    cmd += [f"--run.dir={run_dir}", "--train.max_steps=6", *(f"--{q}" for q in QUICK), *extra]
    env = {**os.environ, "GPTRAIN_FAULT": fault, "PYTHONPATH": str(REPO)}
    return forked.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip


def test_crash_after_resume_stops_with_exit_4_after_exactly_the_configured_attempts(byte_data, tmp_path):  # fmt: skip
    run_dir = tmp_path / "r"
    run(byte_data, run_dir, "train.max_steps=4", *QUICK)  # the resume point: step 4
    codes = []
    for _ in range(4):  # what a requeue loop would do
        p = start(byte_data, run_dir, "--run.max_failed_attempts=2", fault="crash@5")
        _, err = finish(p)
        codes.append(p.returncode)
    assert codes == [1, 1, attempts.EXIT_CRASH_LOOP, attempts.EXIT_CRASH_LOOP]
    line = err.strip().splitlines()
    assert len(line) == 1 and "the last 2 starts each ended without a new checkpoint" in line[0]
    assert "attempt 2 died (no exit recorded)" in line[0] and "do not requeue" in line[0]
    assert "--run.max_failed_attempts=0" in line[0]
    rows = attempts.read(run_dir)
    assert [attempts.outcome(a) for a in rows] == ["finished", "died (no exit recorded)", "died (no exit recorded)", "crash loop", "crash loop"]  # fmt: skip
    assert (run_dir / "train.log").read_text().count("resumed from") == 2  # refusals load nothing
    # fixed (no fault): one start with the check off finishes, and counting starts again after it
    p = start(byte_data, run_dir, "--run.max_failed_attempts=0")
    assert finish(p) and p.returncode == 0 and checkpoint.latest(run_dir).name == "step_00000006"


def test_preempted_as_often_never_stops(byte_data, tmp_path):
    """SIGTERM during start-up: the run exits 0 before its first step, with no new checkpoint.
    Three such starts (more than run.max_failed_attempts = 2) do not stop the next one."""
    run_dir = tmp_path / "r"
    run(byte_data, run_dir, "train.max_steps=4", *QUICK)
    ledger = run_dir / attempts.LEDGER
    for n in (2, 3, 4):
        p = start(byte_data, run_dir, "--run.max_failed_attempts=2")
        deadline = time.time() + 60
        while f'"attempt": {n},' not in ledger.read_text() and time.time() < deadline:
            time.sleep(0.01)
        p.send_signal(signal.SIGTERM)
        _, err = finish(p)
        assert p.returncode == 0, err[-2000:]
        assert checkpoint.latest(run_dir).name == "step_00000004"  # nothing new: preempted only
    log = (run_dir / "train.log").read_text()
    assert log.count("stopped by SIGTERM during start-up, before step 5") == 3
    rows = attempts.read(run_dir)
    assert [a["signal"]["signal"] for a in rows[1:]] == ["SIGTERM"] * 3
    assert [a["end"]["exit"] for a in rows[1:]] == ["preempted"] * 3
    p = start(byte_data, run_dir, "--run.max_failed_attempts=2")
    assert finish(p) and p.returncode == 0 and checkpoint.latest(run_dir).name == "step_00000006"


@pytest.fixture
def own_signal_handlers():
    """This test process's SIGTERM/SIGUSR1 handlers, put back afterwards (a stopped Preemption
    leaves them ignored, as a process that is exiting wants)."""
    before = {sig: signal.getsignal(sig) for sig in Preemption.SIGNALS}
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


def test_a_signal_before_the_ledger_is_connected_is_still_recorded(byte_data, tmp_path, monkeypatch, own_signal_handlers):  # fmt: skip
    """SIGTERM in the moment after the ledger wrote its start line and before the signal handler
    could tell it (the window test_preempted_as_often_never_stops sometimes hit): the attempt
    still gets its signal line (without it, a later hard kill of the attempt would count as a
    failure) and ends preempted with nothing new saved."""
    run_dir = tmp_path / "r"
    run(byte_data, run_dir, "train.max_steps=4", *QUICK)
    enter = attempts.Ledger.__enter__

    def enter_then_signal(self):
        ledger = enter(self)
        os.kill(os.getpid(), signal.SIGTERM)  # handled (a flag) by the Preemption train() installed
        return ledger

    monkeypatch.setattr(attempts.Ledger, "__enter__", enter_then_signal)
    run(byte_data, run_dir, "train.max_steps=6", *QUICK)
    rows = attempts.read(run_dir)
    assert rows[-1]["signal"] is not None and rows[-1]["signal"]["signal"] == "SIGTERM", rows[-1]
    assert rows[-1]["end"]["exit"] == "preempted"
    assert checkpoint.latest(run_dir).name == "step_00000004"


def test_preemption_tells_a_late_listener_once_and_an_early_one_from_the_handler(
    own_signal_handlers,
):
    """Preemption.connect: a signal received before connect is told at connect; one received
    after is told by the handler; only the first signal is told."""
    told = []
    p = Preemption().install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        p.connect(told.append)
        assert told == ["SIGUSR1"]
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal: not told again
        assert told == ["SIGUSR1"] and p.received == "SIGUSR1"
    finally:
        p.restore()
    told2 = []
    q = Preemption().install()
    try:
        q.connect(told2.append)
        assert told2 == []
        os.kill(os.getpid(), signal.SIGTERM)
        assert told2 == ["SIGTERM"]
    finally:
        q.restore()


def test_a_hung_attempt_is_recorded_and_counts(byte_data, tmp_path):
    """An attempt the watchdog ended (exit 3) records `hung` and counts as failed."""
    run_dir = tmp_path / "r"
    run(byte_data, run_dir, "train.max_steps=4", *QUICK)
    p = start(
        byte_data, run_dir, "--dist.hang_timeout_s=2", fault="hang@6"
    )  # (step 5, the first, has 1 h)
    _, err = finish(p)
    assert p.returncode == watchdog.EXIT_CODE, err[-2000:]
    end = attempts.read(run_dir)[-1]["end"]
    assert end["exit"] == "hung" and end["code"] == 3 and "hung: step 6" in end["reason"]
    assert len(failed_streak(attempts.read(run_dir), "step_00000004")) == 1
