"""benchmarks/study/study_progress.py: the share of each run still to train, read from its folder as a
resumed run would (its newest checkpoint), and the runs of one race of the study."""

import sys

from train_helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks" / "study"))
import study_progress  # noqa: E402


def test_a_run_is_left_from_its_newest_checkpoint_and_done_with_its_summary(tmp_path):
    run = tmp_path / "seed_1"
    assert study_progress.run_left(run, 200) == 1.0  # not started
    for step in (50, 150):
        (run / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
    (run / "checkpoints" / ".tmp-step_00000175").mkdir()  # being written: not resumable
    assert study_progress.run_left(run, 200) == 0.25
    (run / "summary.json").write_text("{}")
    assert study_progress.run_left(run, 200) == 0.0


def test_a_tuning_is_left_until_complete(tmp_path):
    assert study_progress.tuning_left(tmp_path) == 1.0
    (tmp_path / "tune.json").write_text('{"complete": false}')
    assert study_progress.tuning_left(tmp_path) == 1.0
    (tmp_path / "tune.json").write_text('{"complete": true}')
    assert study_progress.tuning_left(tmp_path) == 0.0


def test_a_races_runs_are_its_rungs_and_the_other_arm_at_1x(tmp_path):
    runs = study_progress.race_runs(tmp_path, [0.125, 1.0], ("recipe", "baseline"), 2)
    names = [(str(folder.relative_to(tmp_path)), m) for folder, m in runs]
    assert names == [
        ("recipe@0.125/seed_1", 0.125),
        ("recipe@0.125/seed_2", 0.125),
        ("recipe@1/seed_1", 1.0),
        ("recipe@1/seed_2", 1.0),
        ("baseline/seed_1", 1.0),
        ("baseline/seed_2", 1.0),
    ]
