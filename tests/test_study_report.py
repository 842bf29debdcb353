"""benchmarks/study_report.py: the study's table shows each cell's race as the race computed it:
a hand-checked multiplier and its interval, a bound with its p-value, the regime, the rungs that
read the train split twice."""

import math
import sys

import pytest
from test_ladder import synthetic
from train_helpers import REPO

from gptrain.logs.race import analyse

sys.path.insert(0, str(REPO / "benchmarks"))
import study_report  # noqa: E402


def cell_race():
    """Rungs end at 3.0 (1000 tokens) and 2.0 (2000); the recipe ends at 2.5 with 1000 tokens,
    halfway in loss: 2^0.5 = 1.414x the baseline's tokens. The ablation ends below every rung."""
    runs = []
    for seed, off in ((1, -0.01), (2, 0.0), (3, 0.01)):
        runs.append(synthetic("baseline@1", seed, 1000, [5.0], 3.0 + off))
        runs.append(synthetic("baseline@2", seed, 2000, [5.0], 2.0 + off))
        runs.append(synthetic("recipe", seed, 1000, [5.0], 2.5 + off))
        runs.append(synthetic("ablation", seed, 1000, [5.0], 1.5 + off))
    labels = ["baseline@1", "baseline@2", "recipe", "ablation"]
    rungs = {"baseline@1": 1.0, "baseline@2": 2.0}
    return analyse(runs, labels, "baseline", rungs, {"nats": 4.25})


def test_a_cell_row_shows_the_races_multiplier_interval_bound_and_regime():
    race = cell_race()
    recipe = race["configs"][2]["compute_multiplier"]
    assert recipe["value"] == pytest.approx(math.sqrt(2), rel=1e-12)  # by hand
    r = study_report.row("code-small-1x", race, train_tokens=1500)
    lo, hi = recipe["ci"]
    assert r["recipe_x"] == f"{math.sqrt(2):.3g}x [{lo:.3g}, {hi:.3g}]"
    ablation = race["configs"][3]["compute_multiplier"]
    assert ablation["bound"] == ">" and r["ablation_x"].startswith("> 2x (p ")
    assert f"{ablation['p']:.2g}" in r["ablation_x"]
    assert (r["corpus"], r["size"], r["horizon"]) == ("code", "small", "1x")
    assert r["unigram"] == 4.25 and r["below"] == pytest.approx(4.25 - 3.0, abs=1e-12)
    assert r["baseline"] == "3.0000 ± 0.0100" and r["repeats"] == "2x"  # 2000 > 1500 tokens
    assert study_report.row("code-small-1x", race, train_tokens=5000)["repeats"] == "none"
    text = study_report.table([r])
    assert text.splitlines()[2].startswith(
        "| code | small | 1x | 0.00M | 4.250 | 3.0000 ± 0.0100 (1.25) |"
    )
