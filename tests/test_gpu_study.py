"""benchmarks/gpu/gpu_study.py, the study's cell at a GPU's size, checked on a CPU: its dry run tunes
the baseline's lr at the cell (the carried lr and it scaled by the widths), races the recipe's
ladder against the winner, and writes the race's table and race.json; bad input is one line,
exit code 2."""

import json
import sys
import tomllib

import forked
import pytest
from train_helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
import gpu_study  # noqa: E402


@pytest.mark.benchmark
def test_the_dry_run_tunes_the_baseline_at_the_cell_and_races_the_ladder(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(gpu_study.gpu_recipe, "run_command", forked.run)
    out = tmp_path / "study"
    assert gpu_study.main(["--dry-run", "--out", str(out)]) == 0
    tuned = json.loads((out / "tuned.json").read_text())
    losses = {}
    for name in tuned["baseline_lr"]:
        summary = json.loads((out / "tuning" / name / "summary.json").read_text())
        assert summary["steps"] == tuned["steps"]
        losses[name] = summary["val_loss"]
    assert losses == tuned["baseline_lr"] and len(losses) == 2
    lrs = {n: tomllib.loads((out / "configs" / f"{n}.toml").read_text())["optim"]["lr"] for n in losses}  # fmt: skip
    assert abs(min(lrs.values()) / max(lrs.values()) - 96 / 256) < 1e-9
    winner = min(losses, key=losses.get)
    plan = json.loads((out / "race" / "plan.json").read_text())
    race = json.loads((out / "race" / "race.json").read_text())
    assert winner in json.dumps(plan) and "recipe@0.25" in json.dumps(race)
    steps = {p.parent.parent.name: json.loads(p.read_text())["steps"] for p in (out / "race").glob("*/seed_1/summary.json")}  # fmt: skip
    n = tuned["steps"]
    assert steps == {"recipe@0.25": n // 4, "recipe@0.5": n // 2, "recipe@1": n, winner: n}
    assert "compute multiplier" in capsys.readouterr().out


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    out = tmp_path / "study"
    assert gpu_study.main(["--dry-run", "--seeds", "1", "--out", str(out)]) == 2
    assert capsys.readouterr().out.strip().splitlines() == [
        "gpu_study: --seeds must be at least 2 and --tokens-per-param above 0"
    ]
    assert not out.exists()
