"""Time-based checkpoints (checkpoint.every_minutes) and goodput in summary.json (productive step
time over wall time across every attempt in attempts.jsonl, and where the rest went)."""

import json
import os
import sys
import time

import forked
import pytest
import torch
from train_helpers import DEBUG, REPO, run, weights

import gptrain.training.saving as checkpointer_module
from gptrain.__main__ import main as cli
from gptrain.training import attempts

QUICK = ["eval.every=0", "eval.sample_every=0", "eval.tokens=512", "eval.sample_tokens=1"]
QUICK += ["optim.warmup_steps=1", "log.every=1", "log.progress=false", "log.plot=false"]


def test_goodput_of_given_attempts():
    """Attempt 1 died after its progress line at step 12 (checkpoint 10 survived); attempt 2
    resumed from 10 and finished at 20. Steady step time 3 s in both."""
    a1 = {
        "attempt": 1, "signal": None, "end": None,
        "start": {"time": 0.0, "start_step": 0},
        "progress": {"time": 50.0, "step": 12, "resumed_step": 0, "steps_trained": 12, "startup_s": 5.0,
                     "step_s": 43.0, "first_step_s": 10.0, "save_s": 1.0, "eval_s": 1.0},
    }  # fmt: skip
    a2 = {
        "attempt": 2, "signal": None, "progress": None,
        "start": {"time": 80.0, "start_step": 10},
        "end": {"time": 150.0, "step": 20, "resumed_step": 10, "steps_trained": 10, "startup_s": 4.0,
                "step_s": 40.0, "first_step_s": 13.0, "save_s": 2.0, "eval_s": 3.0},
    }  # fmt: skip
    g = attempts.goodput([a1, a2])
    # productive: steps 1-10 of attempt 1 and 11-20 of attempt 2, 3 s each; recomputed: 11, 12
    assert g == {
        "goodput": 0.4, "wall_s": 150.0, "productive_s": 60.0, "startup_s": 9.0, "compile_s": 17.0,
        "save_s": 3.0, "eval_s": 4.0, "recomputed_s": 6.0, "gaps_s": 30.0, "other_s": 21.0, "attempts": 2,
    }  # fmt: skip


class Clock:
    """time for gptrain/training/saving.py (the checkpointer): monotonic() advances 1 s per call, the rest is real."""

    def __init__(self):
        self.t = 0.0

    def monotonic(self):
        self.t += 1.0
        return self.t

    def __getattr__(self, name):
        return getattr(time, name)


def test_time_based_checkpoints(byte_data, tmp_path, monkeypatch):
    """every_minutes = 0.05 (3 s) on a clock that moves 1 s per look: due at steps 3, 6, 9 (the
    loop looks once per step and once after each save), and 12 at the end; saving changes nothing."""
    common = ["train.max_steps=12", "checkpoint.every=0", "checkpoint.keep_last=10", *QUICK]
    run(byte_data, tmp_path / "plain", *common)
    monkeypatch.setattr(checkpointer_module, "time", Clock())
    run(byte_data, tmp_path / "timed", *common, "checkpoint.every_minutes=0.05")
    names = sorted(p.name for p in (tmp_path / "timed" / "checkpoints").glob("step_*"))
    assert names == [f"step_{s:08d}" for s in (3, 6, 9, 12)]
    assert [p.name for p in (tmp_path / "plain" / "checkpoints").glob("step_*")] == ["step_00000012"]  # fmt: skip
    a, b = weights(tmp_path / "plain"), weights(tmp_path / "timed")
    for k in a:
        assert torch.equal(a[k], b[k]), k
    progress = [json.loads(x) for x in (tmp_path / "timed" / attempts.LEDGER).read_text().splitlines()]  # fmt: skip
    assert [r["step"] for r in progress if r["event"] == "progress"] == [3, 6, 9, 12]


def test_bad_every_minutes_is_one_line_exit_2(tmp_path, capsys):
    assert cli(["train", "--config", DEBUG, f"--run.dir={tmp_path / 'r'}", "--checkpoint.every_minutes=-1"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint.every_minutes = -1.0 must be >= 0" in err[0]
    assert not (tmp_path / "r").exists()


def test_goodput_across_a_hung_attempt_and_its_rerun(byte_data, tmp_path):
    """The watchdog ends attempt 1 in step 7 (checkpoint 4): its steps 5 and 6 are trained again
    by attempt 2, so the summary shows recomputed time, a gap, and every second accounted."""
    run_dir = tmp_path / "r"
    cmd = [sys.executable, "-m", "gptrain", "train", "--config", DEBUG, f"--data.dir={byte_data}"]
    cmd += [f"--run.dir={run_dir}", "--train.max_steps=8", "--checkpoint.every=4"]
    cmd += [*(f"--{q}" for q in QUICK), "--dist.hang_timeout_s=2"]
    env = {**os.environ, "GPTRAIN_FAULT": "hang@7", "PYTHONPATH": str(REPO)}
    assert forked.run(cmd, env=env, capture_output=True, timeout=120).returncode == 3
    summary = run(byte_data, run_dir, "train.max_steps=8", "checkpoint.every=4", *QUICK)
    g = summary["goodput"]
    assert json.loads((run_dir / "summary.json").read_text())["goodput"] == g
    assert g["attempts"] == 2 and 0 < g["goodput"] < 1
    assert g["recomputed_s"] > 0 and g["gaps_s"] > 0 and g["startup_s"] > 0
    parts = ("productive_s", *attempts.PARTS, "other_s")
    assert all(g[k] >= 0 for k in parts)
    assert sum(g[k] for k in parts) == pytest.approx(g["wall_s"], abs=0.01)
    hung = attempts.read(run_dir)[0]["end"]
    assert hung["exit"] == "hung" and hung["step"] == 6 and hung["steps_trained"] == 6
    assert "goodput" in (run_dir / "train.log").read_text().splitlines()[-1]


# Rank 1's clock moves 1 s per look; rank 0's stands still (it would never call a save due).
RANK_CLOCKS = """
import os, sys, time
import gptrain.training.saving as checkpointer_module
from gptrain.__main__ import entry

class Clock:
    def __init__(self, step):
        self.t, self.step = 0.0, step
    def monotonic(self):
        self.t += self.step
        return self.t
    def __getattr__(self, name):
        return getattr(time, name)

checkpointer_module.time = Clock(1.0 if os.environ["RANK"] == "1" else 0.0)
entry()  # main(sys.argv[1:]), exiting as gptrain does
"""


@pytest.mark.slow
def test_time_based_checkpoint_is_due_by_any_ranks_clock(byte_data, tmp_path):
    """2 ranks (gloo): only rank 1's clock reaches checkpoint.every_minutes, yet rank 0 (which
    writes the checkpoints) saves at the same steps as the one-process run with that clock (3, 6,
    9, then 12 at the end): the decision is agreed in the per-step all-reduce."""
    import dist_helpers as h

    run_dir = tmp_path / "run"
    args = ["-c", RANK_CLOCKS, "train", "--config", DEBUG, f"--data.dir={byte_data}",
            f"--run.dir={run_dir}", "--train.max_steps=12", "--train.micro_batch_size=4",
            "--train.total_batch_size=1024", "--train.dtype=float32", "--checkpoint.every=0",
            "--checkpoint.keep_last=10", "--checkpoint.every_minutes=0.05",
            *[f"--{x}" for x in QUICK]]  # fmt: skip
    h.check_ok(h.wait_all(h.spawn(args), 240))
    names = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert names == [f"step_{s:08d}" for s in (3, 6, 9, 12)]
