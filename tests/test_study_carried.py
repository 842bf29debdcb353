"""benchmarks/study/study_carried.py: the tuning cell's points trained at a cell tuned at its own
size are exactly the trials tune.py would train there for those points (the same folder, the
same overrides), and the table sets each against the cell's own best and the races' seed spread."""

import json
import statistics
import sys

import pytest
from train_helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks" / "study"))
import study  # noqa: E402
import study_carried  # noqa: E402
import tune  # noqa: E402
from study_cells import cells, tune_cell, tuning_dir  # noqa: E402


def args_for(tmp_path, *more):
    return study.parse_args(["run", "--corpora", "code", "--out", str(tmp_path / "out"),
                             "--results", str(tmp_path / "results"), "--tune-cells",
                             "code-large-1x", "--cells", "large-1x", *more])  # fmt: skip


def finished_tuning(path, points: dict, losses: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    arms = {a: {"best": {"point": p, "val_loss": losses.get(a)}} for a, p in points.items()}
    path.write_text(json.dumps({"arms": arms, "complete": True}))


def test_a_carried_point_is_the_trial_tune_py_trains_for_it(tmp_path, monkeypatch):
    """tune.py run as study.py runs it at code-large-1x (one trial: each arm's starting point);
    the carried check with the tuning cell's best at those same points asks for the same run
    directories with the same overrides."""
    args = args_for(tmp_path, "--arms", "recipe,nanochat_adamw")
    cell = cells(["code"], ("code-large-1x",))[0]
    asked = {}

    def fake_trial(arm, run_dir, overrides, kept=None, env=None):
        asked.setdefault(run_dir, []).append((overrides, kept))
        return 3.0

    monkeypatch.setattr(tune, "train_trial", fake_trial)
    out = tuning_dir(args.out, cell)
    argv = ["--out", str(out), "--budget", "1", "--cap", "0", "--arms", ",".join(args.arms)]
    argv += [f"--{o}" for o in cell.overrides(args.data / "code-tune")]
    assert tune.main(argv) == 0
    by_tune = dict(asked)
    assert len(by_tune) == 2
    asked.clear()
    centers = {a: {x.name: x.center for x in tune.ARMS[a].axes} for a in args.arms}
    finished_tuning(tuning_dir(args.out, tune_cell("code")) / "tune.json", centers, {})
    assert study_carried.trials(args, cell) == {a: 3.0 for a in args.arms}
    assert {d: [o for o, _ in v] for d, v in asked.items()} == {d: [o for o, _ in v] for d, v in by_tune.items()}  # fmt: skip
    for run_dir, [(_, kept)] in asked.items():  # kept where every trial of the study is kept
        assert kept == tmp_path / "results" / "finished_runs" / run_dir.relative_to(args.out)


def test_the_table_holds_an_arm_within_one_seed_sd_of_the_cells_own_best(tmp_path):
    args = args_for(tmp_path, "--arms", "recipe,baseline")
    cell = cells(["code"], ("code-large-1x",))[0]
    points = {a: {x.name: x.center for x in tune.ARMS[a].axes} for a in args.arms}
    finished_tuning(tuning_dir(args.out, tune_cell("code")) / "tune.json", points, {})
    finished_tuning(tuning_dir(args.out, cell) / "tune.json", points, {"recipe": 3.00, "baseline": 3.20})  # fmt: skip
    carried_loss = {"recipe": 3.01, "baseline": 3.30}
    for arm, point in points.items():  # the carried trials, finished
        run_dir = tune.trial_dir(arm, point, tuning_dir(args.out, cell))
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps({"val_loss": carried_loss[arm]}))
    rows = study_carried.rows(args, cell)
    assert [r["holds"] for r in rows] == [None, None]  # no race yet: no seed spread
    seeds = {"recipe@1": [3.0, 3.04, 2.98], "baseline@1": [3.2, 3.26, 3.23]}
    for folder, label in (("recipe-ladder", "recipe@1"), ("baseline-ladder", "baseline@1")):
        race = tmp_path / "results" / cell.name / folder / "race.json"  # a kept race
        race.parent.mkdir(parents=True)
        runs = [{"config": label, "status": "done", "val_loss": v} for v in seeds[label]]
        race.write_text(json.dumps({"runs": runs + [{"config": label, "status": "failed (exit 1)"}]}))  # fmt: skip
    rows = {r["arm"]: r for r in study_carried.rows(args, cell)}
    assert rows["recipe"]["diff"] == pytest.approx(0.01)
    assert rows["recipe"]["sd"] == pytest.approx(statistics.stdev(seeds["recipe@1"]))
    assert rows["recipe"]["holds"] and rows["baseline"]["holds"] is False  # 0.10 > sd 0.03
    text = study_carried.table(list(rows.values()))
    assert "| recipe | 3.0000 | 3.0100 | +0.0100 | 0.0306 | yes |" in text
    assert "| baseline | 3.2000 | 3.3000 | +0.1000 | 0.0300 | no |" in text


def test_an_unknown_stage_is_one_line():
    from gptrain.errors import UserError

    with pytest.raises(UserError, match="--stages: unknown chek; choose from data, tune, check, race"):  # fmt: skip
        study.parse_args(["run", "--stages", "tune,chek"])
