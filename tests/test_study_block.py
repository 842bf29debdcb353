"""benchmarks/study/study_block.py and study_saved.py: the block race's multiplier, computed from the runs
and inverted as the recipe's; configs/nanochat_124m.toml's step count from the block's and the
recipe's lower bounds, each dividing nothing when it is below 1.1, open, a bound or not measured;
finished races kept in the repository and read back by `study.py report` when OUT lacks them."""

import io
import json
import math
import sys
from contextlib import redirect_stdout

import pytest
from test_study_report import baseline_race, ladder_race, recipe_race
from train_helpers import REPO

from gptrain.logs import ladder

sys.path.insert(0, str(REPO / "benchmarks" / "study"))
import study  # noqa: E402
import study_block  # noqa: E402
import study_saved  # noqa: E402


def nanochat_race():
    """nanochat's ladder: 0.25x, 0.5x, 1x end at 3.25, 2.75, 2.25; the recipe on GPT-2's block at
    1x ends at 2.5, halfway in loss between the 0.5x and 1x rungs: nanochat reaches it at
    sqrt(500 * 1000) tokens, so the block's multiplier is 1000 / 707.1 = 2^0.5."""
    return ladder_race("nanochat", {0.25: 3.25, 0.5: 2.75, 1: 2.25}, "recipe", 2.5)


def adamw_race():
    """nanochat_adamw on the baseline's ladder (3.5, 3.0, 2.6 at 0.5x, 1x, 2x) ends at 3.0."""
    return ladder_race("baseline", {0.5: 3.5, 1: 3.0, 2: 2.6}, "nanochat_adamw", 3.0)


def test_the_blocks_multiplier_is_the_inverse_of_the_recipes_on_nanochats_ladder():
    race = nanochat_race()
    r = study_block.row("code-large-1x", race, adamw_race())
    runs = {c: [x for x in race["runs"] if x["config"] == c] for c in race["ladder"]}
    against = ladder.multiplier(list(runs.values()), [x for x in race["runs"] if x["config"] == "recipe"], [0.25, 0.5, 1.0])  # fmt: skip
    assert against["value"] == pytest.approx(2**-0.5, rel=1e-12) and against["two_sided"]
    lo, hi = against["ci"]
    assert r["block_x"].startswith(f"{2**0.5:#.3g}x [{1 / hi:#.3g}, {1 / lo:#.3g}]")
    assert r["block_low"] == pytest.approx(1 / hi, rel=1e-12) and r["block_why"] is None
    assert r["nanochat"] == "2.2500 ± 0.0100" and r["recipe"] == "2.5000 ± 0.0100"
    assert r["adamw_x"].startswith("1.00x [") and r["nanochat_adamw"] == "3.0000 ± 0.0100"
    empty = study_block.row("prose-small-4x", None, None)
    assert empty["block_x"] == "not run" and empty["block_why"] == "not measured"
    assert study_block.table([r, empty]).splitlines()[3].startswith("| prose | small | 4x | not run |")  # fmt: skip


def rows(key, lows):
    """Rows of the deciding cells with `key`_low and `key`_why as study_report/study_block write."""
    out = []
    for cell, low in lows.items():
        corpus, size, horizon = cell.split("-")
        why = None if isinstance(low, float) else low
        out.append({"corpus": corpus, "size": size, "horizon": horizon, f"{key}_low": None if why else low, f"{key}_why": why})  # fmt: skip
    return out


RECIPE = {"code-large-1x": 2.0, "prose-large-1x": 1.88, "code-small-4x": 1.96}


def test_the_nanochat_step_count_divides_by_both_lowest_bounds():
    block = {"code-large-1x": 1.5, "prose-large-1x": 1.25, "code-small-4x": 1.3}
    steps, why = study_block.nanochat_steps(rows("recipe", RECIPE), rows("block", block))
    assert steps == math.ceil(19073 / (1.88 * 1.25)) == 8117
    assert "recipe's lower bound 1.88 (prose-large-1x)" in why
    assert "block's lower bound 1.25 (prose-large-1x)" in why


@pytest.mark.parametrize(
    "block, says",
    [
        ({"code-large-1x": 1.5, "prose-large-1x": 1.09}, "below 1.1"),  # a bound below 1.1
        (  # an interval open at its end of the ladder
            {
                "code-large-1x": 1.5,
                "prose-large-1x": "its interval reaches the end of its ladder (open); add rungs",
            },  # fmt: skip
            "prose-large-1x: its interval reaches the end",
        ),
        ({"code-large-1x": 1.5, "prose-large-1x": "not measured"}, "not measured (prose-large-1x)"),
        ({}, "not measured (no cells)"),
    ],
)
def test_a_block_factor_that_cannot_divide_counts_as_1(block, says):
    """The block's factor divides nothing: the steps are llm.c's over the recipe's bound alone."""
    steps, why = study_block.nanochat_steps(rows("recipe", RECIPE), rows("block", block))
    assert steps == math.ceil(19073 / 1.88)
    assert "the block divides nothing" in why and says in why
    steps, why = study_block.nanochat_steps(rows("recipe", {"code-large-1x": 1.05}), rows("block", block))  # fmt: skip
    assert steps == 19073 and "the recipe divides nothing" in why


def test_a_block_bound_past_its_ladder_never_divides():
    """nanochat's lowest rung already beats the recipe: the block is "> 8x", a bound."""
    race = ladder_race("nanochat", {0.125: 2.5, 0.25: 2.6, 0.5: 2.7, 1: 2.8}, "recipe", 3.0)
    r = study_block.row("prose-large-1x", race, None)
    assert r["block_x"].startswith("> 8x") and r["block_low"] is None
    steps, why = study_block.nanochat_steps(rows("recipe", RECIPE), [r])
    assert steps == math.ceil(19073 / 1.88) and "bound past its ladder" in why


def write_race(folder, race):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "race.json").write_text(json.dumps(race))
    (folder / "table.md").write_text(f"| table of {folder.name} |\n")


def report(tmp_path, *more) -> str:
    args = ["report", "--corpora", "code", "--out", str(tmp_path / "out")]
    args += ["--data", str(tmp_path / "data"), "--results", str(tmp_path / "kept"), *more]
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert study.main(args) == 0
    return buf.getvalue()


def test_finished_races_are_kept_and_read_back_when_out_lacks_them(tmp_path):
    races = tmp_path / "out" / "races" / "code-large-1x"
    made = {"baseline-ladder": baseline_race(), "recipe-ladder": recipe_race()}
    made |= {"nanochat-ladder": nanochat_race(), "nanochat_adamw-on-baseline-ladder": adamw_race()}
    for name, race in made.items():
        write_race(races / name, race)
    (races / "unfinished").mkdir()  # a race without its race.json is not kept
    assert study_saved.save(races / "unfinished", tmp_path / "kept", "code-large-1x", "x") == []
    before = report(tmp_path, "--save")
    kept = tmp_path / "kept" / "code-large-1x"
    for name in made:
        assert (kept / name / "race.json").read_text() == (races / name / "race.json").read_text()
    assert "| table of nanochat-ladder |" in before
    block = study_block.row("code-large-1x", made["nanochat-ladder"], made["nanochat_adamw-on-baseline-ladder"])  # fmt: skip
    assert (
        f"| code | large | 1x | 2.5000 ± 0.0100 | 2.2500 ± 0.0100 | {block['block_x']} |" in before
    )
    for path in races.rglob("*"):  # OUT lost with its machine
        if path.is_file():
            path.unlink()
    assert report(tmp_path) == before
    assert "| code | large | 1x | not run |" in report(
        tmp_path, "--results", str(tmp_path / "none")
    )
