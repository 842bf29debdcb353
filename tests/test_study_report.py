"""benchmarks/study/study_report.py: the study's table shows each cell's two races as the races computed
them: the recipe's multiplier, the inverse of the baseline's on the recipe's ladder, checked by
hand with its interval, computed again from the runs; a bound never sets the step count; the ablation's bound with its p-value; the regime; the rungs that read
the train split twice."""

import math
import sys

import pytest
from test_ladder import synthetic
from train_helpers import REPO

from gptrain.errors import UserError
from gptrain.logs.race import analyse

sys.path.insert(0, str(REPO / "benchmarks" / "study"))
import study_report  # noqa: E402

SEEDS = ((1, -0.01), (2, 0.0), (3, 0.01))


def ladder_race(arm, rungs, other, other_loss):
    """A race of `arm` on a ladder (multiple -> final loss; 1x is 1000 tokens) and `other` at 1x,
    3 seeds around each loss, regime 4.25 nats."""
    runs = []
    for seed, off in SEEDS:
        for m, loss in rungs.items():
            runs.append(synthetic(f"{arm}@{m:g}", seed, int(1000 * m), [5.0], loss + off))
        runs.append(synthetic(other, seed, 1000, [5.0], other_loss + off))
    labels = {f"{arm}@{m:g}": float(m) for m in rungs}
    return analyse(runs, [*labels, other], "baseline", labels, {"nats": 4.25})


def baseline_race():
    """The baseline's ladder: 0.5x, 1x, 2x end at 3.5, 3.0, 2.6; the ablation at 1x ends at
    2.0, below every rung."""
    return ladder_race("baseline", {0.5: 3.5, 1: 3.0, 2: 2.6}, "ablation", 2.0)


def recipe_race():
    """The recipe's ladder: 0.25x, 0.5x, 1x end at 3.25, 2.75, 2.25; the baseline at 1x (1000
    tokens) ends at 3.0, halfway in loss between the 0.25x and 0.5x rungs: the recipe reaches it
    at sqrt(250 * 500) tokens, so its multiplier is 1000 / 353.55 = 2^1.5."""
    return ladder_race("recipe", {0.25: 3.25, 0.5: 2.75, 1: 2.25}, "baseline", 3.0)


def test_a_cell_row_shows_both_races_multipliers_intervals_bounds_and_regime():
    base, rec = baseline_race(), recipe_race()
    against = rec["configs"][3]["compute_multiplier"]
    assert against["value"] == pytest.approx(2**-1.5, rel=1e-12)
    r = study_report.row("code-small-1x", base, rec, train_tokens=1500)
    lo, hi = against["ci"]
    assert r["recipe_x"].startswith(f"{2**1.5:#.3g}x [{1 / hi:#.3g}, {1 / lo:#.3g}]")
    assert 1 / hi < 2**1.5 < 1 / lo
    ablation = base["configs"][3]["compute_multiplier"]
    assert ablation["bound"] == ">" and r["ablation_x"].startswith("> 2x (p ")
    assert f"{ablation['p']:.2g}" in r["ablation_x"]
    assert (r["corpus"], r["size"], r["horizon"]) == ("code", "small", "1x")
    assert r["unigram"] == 4.25 and r["below"] == pytest.approx(4.25 - 3.0, abs=1e-12)
    assert r["baseline"] == "3.0000 ± 0.0100" and r["recipe"] == "2.2500 ± 0.0100"
    assert r["repeats"] == "baseline@2"  # 2000 tokens > 1500
    assert study_report.row("code-small-1x", base, rec, 5000)["repeats"] == "none"
    text = study_report.table([r, study_report.not_run("prose-large-1x")])
    assert text.splitlines()[2].startswith(
        "| code | small | 1x | 0.00M | 4.250 | 3.0000 ± 0.0100 (1.25) |"
    )
    assert text.splitlines()[3].startswith("| prose | large | 1x | not run |")


def test_inverting_flips_a_bound_and_opens_the_right_end():
    """The baseline beyond the recipe's lowest rung ("<": the recipe's smallest run already beats
    it) is the recipe's "> 1/value"; an open upper end of the interval becomes an open lower end."""
    m = {"value": 0.25, "bound": "<", "ci": [None, 0.5], "p": 0.01, "fit_value": 0.2}
    m["fit_extrapolated"] = True
    inv = study_report.invert(m)
    assert inv["value"] == 4.0 and inv["bound"] == ">" and inv["p"] == 0.01
    assert inv["ci"] == [2.0, None] and inv["fit_value"] == 5.0
    assert study_report._multiplier(inv) == "> 4x (p 0.01); fit 5.00x (extrapolated)"
    assert math.isclose(study_report.invert(inv)["value"], 0.25)


def _cell(name, low):
    corpus, size, horizon = name.split("-")
    return {"corpus": corpus, "size": size, "horizon": horizon, "recipe_low": low}


def test_the_124m_step_count_divides_by_the_lowest_bound_or_by_nothing():
    """llm.c's 19,073 steps over the smallest lower 95% bound of the deciding cells, rounded up;
    undivided while a cell is not measured or the bound is below 1.1."""
    rows = [_cell("code-large-1x", 2.0), _cell("prose-large-1x", 1.83), _cell("code-small-4x", 1.9)]
    steps, why = study_report.config_steps(rows)
    assert steps == math.ceil(19073 / 1.83) == 10423 and "prose-large-1x" in why
    rows.append(_cell("prose-small-4x", None))
    assert study_report.config_steps(rows)[0] == 19073
    assert "not measured (prose-small-4x)" in study_report.config_steps(rows)[1]
    rows[-1] = _cell("prose-small-4x", 1.09)
    assert study_report.config_steps(rows) == (
        19073,
        "19,073 steps: the lower bound 1.09 (prose-small-4x) is below 1.1",
    )
    assert study_report.config_steps([])[0] == 19073


def test_a_rows_lower_bound_is_its_two_sided_intervals_low_end_and_never_a_bound():
    rec = study_report.row("code-small-1x", baseline_race(), recipe_race(), 5000)
    against = recipe_race()["configs"][3]["compute_multiplier"]
    assert against["two_sided"]
    assert rec["recipe_low"] == pytest.approx(1 / against["ci"][1], rel=1e-12)
    assert rec["recipe_why"] is None
    low, why = study_report.lower_bound({"value": 8.0, "bound": ">", "ci": [8.0, None]})
    assert low is None and "bound past its ladder (> 8x)" in why and "add rungs" in why
    assert study_report.lower_bound({"value": 0.5, "bound": "<", "ci": None})[0] is None
    open_end = {"value": 2.0, "bound": None, "ci": [1.5, None], "two_sided": False}
    assert study_report.lower_bound(open_end)[0] is None
    assert study_report.not_run("prose-large-1x")["recipe_low"] is None


def test_a_bound_past_a_flipped_ladder_never_sets_the_step_count():
    """The recipe's ladder ends above the baseline's loss at every rung (its lowest rung already
    beats it): the recipe's multiplier is "> 8x", a bound. The step count stays llm.c's and
    its line names the cell and the fix; the table shows the bound, never a point."""
    flipped = ladder_race("recipe", {0.125: 2.5, 0.25: 2.6, 0.5: 2.7, 1: 2.8}, "baseline", 3.0)
    r = study_report.row("prose-large-1x", baseline_race(), flipped, 5000)
    assert r["recipe_x"].startswith("> 8x") and r["recipe_low"] is None
    rows = [_cell("code-large-1x", 2.0), r]
    steps, why = study_report.config_steps(rows)
    assert steps == 19073 and "prose-large-1x" in why and "add rungs" in why


def test_the_row_recomputes_each_multiplier_from_the_runs_and_refuses_one_seed():
    """A race.json written with another interval (an old bootstrap's numbers) is read again from
    its runs' final losses; a rung with one finished run is one line naming the cell."""
    rec = recipe_race()
    rec["configs"][3]["compute_multiplier"] |= {"ci": [0.3, 0.4], "two_sided": True}
    want = study_report.invert(recipe_race()["configs"][3]["compute_multiplier"])
    r = study_report.row("code-small-1x", baseline_race(), rec, 5000)
    assert r["recipe_low"] == pytest.approx(want["ci"][0], rel=1e-12)
    for run in rec["runs"]:
        if run["config"] == "recipe@0.5" and run["seed"] > 1:
            run["status"] = "failed (exit 1)"
    with pytest.raises(UserError, match="code-small-1x, baseline against the ladder: .*needs 2"):
        study_report.row("code-small-1x", baseline_race(), rec, 5000)
