"""benchmarks/gpu/gpu_recipe.py, the recipe against llm.c's by time on a GPU, checked on a CPU: its dry
run trains the recipe for T and llm.c's recipe for T and 2T, each under its own time budget, and
its table holds what each run's summary.json says; the same command again trains nothing; bad
input is one line, exit code 2."""

import json
import sys
import tomllib

import forked
import pytest
from train_helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
import gpu_recipe  # noqa: E402

T = 1.0  # seconds: the dry run's budget T (tiny-model steps take a few milliseconds)


@pytest.mark.benchmark
def test_the_dry_run_trains_each_config_for_its_budget_and_tables_their_summaries(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(gpu_recipe, "run_command", forked.run)
    out = tmp_path / "runs"
    assert gpu_recipe.main(["--dry-run", "--budget", f"{T:g}s", "--out", str(out)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    want = [("recipe@T", "muon", T), ("llmc@T", "adamw", T), ("llmc@2T", "adamw", 2 * T)]
    assert len(rows) == len(want)
    for row, (name, optimizer, budget) in zip(rows, want, strict=True):
        run_dir = out / f"{name}-{budget:g}s"
        config = tomllib.loads((run_dir / "config.toml").read_text())
        summary = json.loads((run_dir / "summary.json").read_text())
        assert config["optim"]["name"] == optimizer
        assert config["train"]["time_budget"] == f"{budget:g}s"
        assert summary["steps"] < config["train"]["max_steps"]  # the budget ended the run
        assert budget / 2 < summary["train_s"] < budget * 1.5  # (within a step's time of it)
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells == [
            name,
            f"{budget:g} s",
            f"{summary['steps']:,}",
            f"{summary['tokens']:,}",
            f"{summary['tok_per_s']:,.0f}",
            f"{summary['val_loss']:.4f}",
        ]
    attempts = {p: p.read_text() for p in out.glob("*/attempts.jsonl")}
    assert gpu_recipe.main(["--dry-run", "--budget", f"{T:g}s", "--out", str(out)]) == 0
    assert {p: p.read_text() for p in out.glob("*/attempts.jsonl")} == attempts  # none started


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    out = tmp_path / "runs"
    assert gpu_recipe.main(["--budget", "5x", "--out", str(out)]) == 2
    assert capsys.readouterr().out.strip().splitlines() == [
        "gpu_recipe: --budget '5x' is not a duration; write it as 60s or 2m"
    ]
    assert not out.exists()
