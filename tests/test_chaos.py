"""The chaos drill (benchmarks/chaos.py), short: 5 random events (SIGKILL to a worker, SIGTERM to
the launcher, hang, stall_save) on a 2-rank run restarted after each; the final weights equal an
uninterrupted run's bit for bit."""

import sys

import forked
import pytest
from train_helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import chaos  # noqa: E402


@pytest.mark.slow
def test_chaos_drill_five_events(byte_data, tmp_path, monkeypatch):
    # 30 steps, not the drill's 60: this seed's five events all come before step 21, and each
    # run (the uninterrupted one, the last attempt) then trains half as long
    assert chaos.ARGS[0] == f"--train.max_steps={chaos.STEPS}"
    monkeypatch.setattr(chaos, "launch", forked.Popen)
    monkeypatch.setattr(chaos, "STEPS", 30)
    monkeypatch.setattr(chaos, "ARGS", ["--train.max_steps=30", *chaos.ARGS[1:]])
    lines = []
    assert chaos.drill(5, 1, byte_data, tmp_path, echo=lines.append), lines
    assert len(lines) >= 7 and lines[-1].startswith("OK: 5 events")
    codes = {line.split("exit ")[1].split(",")[0] for line in lines[:5]}
    assert codes <= {"0", "1", "3"}, lines  # preempted, killed, hung: never a crash-loop stop
