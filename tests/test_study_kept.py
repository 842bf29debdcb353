"""benchmarks/study/study_saved.py's kept runs: a study outlives its machine. A finished run kept in
the repository (config.toml, summary.json, metrics.jsonl) and copied into a new machine's OUT
is, to `gptrain race`, the run it was: finished, with the same record; a tuning trial kept is
read back, not trained; a kept run of another config is never copied."""

import json
import os
import subprocess
import sys

import pytest
from test_study_reuse import FAST, config_text, train
from train_helpers import REPO

from gptrain.commands import race
from gptrain.commands.race_plan import Job

sys.path.insert(0, str(REPO / "benchmarks" / "study"))
import study_reuse  # noqa: E402
import study_saved  # noqa: E402
import tune  # noqa: E402


def test_a_kept_race_run_copied_to_a_new_machine_is_finished_with_the_same_record(
    byte_data, tmp_path, capsys
):
    old, new, results = tmp_path / "old", tmp_path / "new", tmp_path / "results"
    rel = "races/code-large-1x/baseline-ladder/baseline@1/seed_2"
    train(byte_data, old / rel, capsys)
    (old / "races" / ".x.copying" / "seed_1").mkdir(parents=True)  # a copy cut short: no run
    (old / "races" / ".x.copying" / "seed_1" / "summary.json").write_text("{}")
    written = study_saved.keep_runs(old, results)
    kept = results / "finished_runs" / rel
    assert sorted(written) == sorted(kept / n for n in study_saved.RUN_FILES)
    assert study_saved.keep_runs(old, results) == []  # equal files are not written again
    assert study_saved.kept(old, results, old / rel) == kept
    assert not (kept / "checkpoints").exists()  # the files a race reads, not the weights

    dest = new / rel  # the new machine: the same path under its OUT
    assert not study_reuse.copy_finished(kept, dest, config_text(byte_data, dest, "optim.lr=1e-3"))
    assert not dest.exists()  # a kept run of another config is not this run
    assert study_reuse.copy_finished(kept, dest, config_text(byte_data, dest))
    job = Job("baseline@1", 2, dest, ())
    assert race.finished(job)  # the race does not start it
    a = race.record(Job("baseline@1", 2, old / rel, ()), 0, 1.0)
    b = race.record(job, 0, 1.0)
    assert a["status"] == "done" and {**a, "dir": None} == {**b, "dir": None}


def test_a_saved_config_of_an_older_gptrain_matches_as_this_one_resolves_it(
    byte_data, tmp_path, capsys
):
    """A key added to gptrain since a run was kept takes its default: the kept run still counts."""
    source = tmp_path / "kept" / "seed_2"
    train(byte_data, source, capsys)
    text = (source / "config.toml").read_text()
    older = text.replace("stride = 0\n", "")  # a key this gptrain has, that one lacked
    assert older != text
    (source / "config.toml").write_text(older)
    dest = tmp_path / "out" / "seed_2"
    assert study_reuse.copy_finished(source, dest, config_text(byte_data, dest))


def test_a_kept_tuning_trial_is_read_back_on_a_new_machine_not_trained(
    byte_data, tmp_path, monkeypatch
):
    tiny_arm = tune.ARMS["baseline"]  # at 4 steps of short windows: a trial takes seconds
    o = [f"data.dir={byte_data}", *FAST, "train.total_batch_size=1024", "train.seq_len=64"]
    o += tiny_arm.overrides({a.name: a.center for a in tiny_arm.axes}, 4)
    kept = tmp_path / "results" / "finished_runs" / "tuning" / "code" / "baseline" / "point"
    first = tune.train_trial(tiny_arm, tmp_path / "old" / "point", o, kept)
    assert first == json.loads((kept / "summary.json").read_text())["val_loss"]

    def no_training(*a, **k):
        raise AssertionError("a kept trial was trained again")

    monkeypatch.setattr(subprocess, "run", no_training)
    saved = {p.name: p.read_bytes() for p in kept.iterdir()}
    assert tune.train_trial(tiny_arm, tmp_path / "new" / "point", o, kept) == first
    assert {
        p.name: p.read_bytes() for p in kept.iterdir()
    } == saved  # the copy back is not kept again
    other = [*o, "optim.weight_decay=0.0"]  # another point's config: not read from this one
    with pytest.raises(AssertionError, match="trained again"):
        tune.train_trial(tiny_arm, tmp_path / "new" / "other", other, kept)


def test_kept_runs_are_files_git_keeps():
    """A kept run lives in the repository: no .gitignore pattern (such as `runs/`) hides it."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    path = study_saved.RESULTS / "finished_runs" / "races" / "c" / "r" / "a@1" / "seed_1"
    for name in study_saved.RUN_FILES:
        done = subprocess.run(["git", "check-ignore", "-q", str(path / name)], cwd=REPO)
        assert done.returncode == 1, f"{path / name} is ignored by git"


# A stand-in for `gptrain race`: 200 KB on stdout (more than a pipe holds), then it waits, at
# most 30 s, for the marker that keep() writes, and prints its table only once it exists.
WAITS_FOR_KEEP = """
import os, sys, time
from pathlib import Path
marker = Path(sys.argv[1])
Path(sys.argv[2]).write_text(str(os.getpid()))
sys.stdout.write("x" * 200_000 + "\\n")
sys.stdout.flush()
deadline = time.monotonic() + 30
while not marker.exists():
    if time.monotonic() > deadline:
        sys.exit(1)
    time.sleep(0.01)
print("| the table |")
"""


def test_a_race_in_progress_has_its_runs_kept_and_its_whole_output_returned(tmp_path):
    marker, pid = tmp_path / "kept", tmp_path / "pid"
    cmd = [sys.executable, "-c", WAITS_FOR_KEEP, str(marker), str(pid)]
    calls = []

    def keep():
        calls.append(1)
        marker.write_text("kept")

    code, out = study_saved.run_keeping(cmd, {}, keep, every_s=0.05)
    assert code == 0, "the race ended without keep() having run while it trained"
    assert calls
    assert out == "x" * 200_000 + "\n| the table |\n"


def test_a_race_whose_keeping_fails_is_killed_not_left_running(tmp_path):
    marker, pid = tmp_path / "never", tmp_path / "pid"
    cmd = [sys.executable, "-c", WAITS_FOR_KEEP, str(marker), str(pid)]

    def keep():
        if pid.exists():
            raise RuntimeError("keeping failed")

    with pytest.raises(RuntimeError, match="keeping failed"):
        study_saved.run_keeping(cmd, {}, keep, every_s=0.05)
    with pytest.raises(ProcessLookupError):  # killed and reaped, not waited out for 30 s
        os.kill(int(pid.read_text()), 0)
