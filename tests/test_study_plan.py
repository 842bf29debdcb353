"""benchmarks/study/study.py's cells, tunings and plan: a cell named on one corpus or a kind on every
corpus; cells tuned at their own size and steps (--tune-cells), the tuning cell tuned only while
a raced cell carries its points; the plan counts every tuning's trials and every race's runs, the
copied ones apart, each at its block's speed."""

import json
import sys

import pytest
from train_helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks" / "study"))
import study  # noqa: E402
import study_plan  # noqa: E402
import study_tuning  # noqa: E402
from study_cells import SIZES, Cell, run_seconds, tune_cell  # noqa: E402

from gptrain.errors import UserError  # noqa: E402

DECIDING = ["--corpora", "code,prose", "--cells", "large-1x,code-small-4x"]


def args(tmp_path, *more):
    return study.parse_args(["plan", "--out", str(tmp_path), *more])


def names(cells):
    return [c.name for c in cells]


def test_cells_are_kinds_on_every_corpus_or_one_corpus_s_cell(tmp_path):
    a = args(tmp_path, *DECIDING)
    assert names(study.cells(a.corpora, a.cells)) == ["code-large-1x", "prose-large-1x", "code-small-4x"]  # fmt: skip
    with pytest.raises(UserError, match="--tune-cells: unknown prose-huge-1x"):
        args(tmp_path, "--tune-cells", "prose-huge-1x")
    with pytest.raises(UserError, match="--cells: unknown code-small-1x"):
        args(tmp_path, "--corpora", "prose", "--cells", "code-small-1x")
    with pytest.raises(UserError, match="--arms: unknown muon"):
        args(tmp_path, "--arms", "baseline,muon")


def test_the_tuning_cell_is_tuned_only_while_a_raced_cell_carries_its_points(tmp_path):
    default = args(tmp_path)
    assert [names(study_tuning.tunings(default, c)) for c in ("prose", "code")] == [["prose-small-1x"], ["code-small-1x"]]  # fmt: skip
    own = args(tmp_path, *DECIDING, "--tune-cells", "large-1x,code-small-4x")
    assert names(study_tuning.tunings(own, "code")) == ["code-large-1x", "code-small-4x"]
    assert names(study_tuning.tunings(own, "prose")) == ["prose-large-1x"]
    part = args(tmp_path, *DECIDING, "--tune-cells", "code-large-1x")
    assert names(study_tuning.tunings(part, "code")) == ["code-small-1x", "code-large-1x"]
    record = args(tmp_path, *DECIDING, "--tuned", str(REPO / "benchmarks/study/study_tuned.toml"))
    assert study_tuning.tunings(record, "code") == []


def test_a_cell_tuned_at_itself_races_at_its_own_best(tmp_path):
    own = args(tmp_path, *DECIDING, "--tune-cells", "code-large-1x")
    for cell, best in ((Cell("code", SIZES["large"], 1), 0.01), (tune_cell("code"), 0.02)):
        folder = tmp_path / "tuning" / (cell.name if cell.size.name == "large" else "code")
        folder.mkdir(parents=True)
        arms = {arm: {"best": {"point": {"lr": best}}} for arm in own.arms}
        (folder / "tune.json").write_text(json.dumps({"arms": arms, "complete": True}))
    large, small4x = study.cells(["code"], ("large-1x", "small-4x"))
    assert study_tuning.tuned(own, large)["recipe"] == {"lr": 0.01}
    assert study_tuning.tuned(own, small4x)["recipe"] == {"lr": 0.02}  # carried


def test_the_plan_counts_each_tuning_and_race_at_its_blocks_speed(tmp_path):
    a = args(tmp_path, *DECIDING, "--tune-cells", "large-1x,code-small-4x")
    speeds = {"small": {"tok_per_cpu_s": 25000.0, "start_cpu_s": 4.0}}
    speeds["large"] = {"tok_per_cpu_s": 21000.0, "start_cpu_s": 5.0}
    speeds["large/nanochat"] = {"tok_per_cpu_s": 15000.0, "start_cpu_s": 6.0}
    rows = study_plan.plan_rows(a, speeds)
    assert [(r["stage"], r["cell"].name) for r in rows] == [
        ("tune", "code-large-1x"),
        ("tune", "code-small-4x"),
        ("tune", "prose-large-1x"),
        ("race", "code-large-1x"),
        ("race", "prose-large-1x"),
        ("race", "code-small-4x"),
    ]
    large = rows[0]["cell"]
    gpt2, nano = run_seconds(large, speeds["large"]), run_seconds(large, speeds["large/nanochat"])
    assert rows[0]["runs"] == "60 (+ up to 140)"  # 5 arms x 12 trials, up to 28 more each
    assert rows[0]["s"] == pytest.approx(12 * (3 * gpt2 + 2 * nano), rel=1e-12)
    # every seed: the baseline's 3 rungs and the ablation; the recipe's 4 rungs (its baseline
    # copied); nanochat's 4 rungs (its recipe copied); nanochat_adamw (the baseline's rungs copied)
    assert rows[3]["runs"] == "39 (+15 copied)"
    seed = sum(run_seconds(large, speeds["large"], m) for m in (0.5, 1, 2, 1, 0.125, 0.25, 0.5, 1))
    seed += sum(run_seconds(large, speeds["large/nanochat"], m) for m in (0.125, 0.25, 0.5, 1, 1))
    assert rows[3]["s"] == pytest.approx(3 * seed, rel=1e-12)
    assert rows[5]["s"] is not None  # small: nanochat's block at GPT-2's speed, not measured
    done = tmp_path / "tuning" / "code-large-1x" / "tune.json"
    done.parent.mkdir(parents=True)
    done.write_text(json.dumps({"complete": True}))
    assert study_plan.plan_rows(a, speeds)[0]["left"] == 0
