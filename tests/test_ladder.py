"""The compute multiplier from a ladder of complete baseline runs (gptrain/logs/ladder.py): the
interpolation, the power law's fit, the bootstrap interval and the bounds against numpy, SciPy and
hand computations; a ladder race of the debug model end to end; its bad input."""

import json
import math

import numpy as np
import pytest
from test_race import FAST, listing

from gptrain.__main__ import main as cli
from gptrain.errors import UserError
from gptrain.logs import ladder
from gptrain.logs.race import analyse
from gptrain.logs.race_report import markdown_table, multiplier_cell


def runs(tokens: float, losses: list[float]) -> list[dict]:
    return [{"tokens": tokens, "val_loss": v} for v in losses]


# three rungs at 1x, 2x, 4x of 1000 tokens; their mean final losses 3.0, 2.5, 2.2
RUNGS = [runs(1000, [3.02, 2.98]), runs(2000, [2.52, 2.48]), runs(4000, [2.21, 2.19])]


def numpy_multiplier(rungs, candidate) -> float:
    """The reference: numpy's linear interpolation of log tokens against the mean losses."""
    t = np.array([np.mean([r["tokens"] for r in g]) for g in rungs])
    loss = np.array([np.mean([r["val_loss"] for r in g]) for g in rungs])
    c = np.mean([r["val_loss"] for r in candidate])
    tokens = np.exp(np.interp(c, loss[::-1], np.log(t[::-1])))
    return float(tokens / np.mean([r["tokens"] for r in candidate]))


def test_the_multiplier_interpolates_in_log_tokens_between_the_rungs_final_losses():
    """Mean 2.8 lies 0.4 of the way from rung 1 (3.0) to rung 2 (2.5): 1000 * 2^0.4 tokens,
    over the candidate's 1000: 1.3195."""
    cand = runs(1000, [2.81, 2.79])
    m = ladder.multiplier(RUNGS, cand, [1, 2, 4])
    assert m["value"] == pytest.approx(2**0.4, rel=1e-12) and m["bound"] is None
    assert m["value"] == pytest.approx(numpy_multiplier(RUNGS, cand), rel=1e-12)
    for loss in (2.95, 2.5, 2.31, 2.2):  # at and between the rungs, a candidate at 1500 tokens
        cand = runs(1500, [loss - 0.01, loss + 0.01])
        got = ladder.multiplier(RUNGS, cand, [1, 2, 4])["value"]
        assert got == pytest.approx(numpy_multiplier(RUNGS, cand), rel=1e-12)


def test_beyond_the_top_rung_a_lower_bound_with_its_one_sided_welch_test():
    stats = pytest.importorskip("scipy.stats")
    finals = [2.1, 2.12, 2.08]
    m = ladder.multiplier(RUNGS, runs(1000, finals), [1, 2, 4])
    assert m["bound"] == ">" and m["value"] == 4.0  # the top rung's tokens over the candidate's
    top = [2.21, 2.19]
    want = stats.ttest_ind(finals, top, equal_var=False, alternative="less").pvalue
    assert m["p"] == pytest.approx(want, rel=1e-9) and m["p"] < 0.05
    worse = [3.3, 3.1]  # above the lowest rung: an upper bound, tested the other way
    m = ladder.multiplier(RUNGS, runs(2000, worse), [1, 2, 4])
    assert m["bound"] == "<" and m["value"] == 0.5
    want = stats.ttest_ind(worse, [3.02, 2.98], equal_var=False, alternative="greater").pvalue
    assert m["p"] == pytest.approx(want, rel=1e-9)
    cell = multiplier_cell(ladder.multiplier(RUNGS, runs(1000, finals), [1, 2, 4]), ladder=True)
    assert cell.startswith("> 4× p=") and cell.endswith("(beyond the top rung)")


def test_the_power_law_fit_recovers_a_law_and_marks_an_extrapolation():
    """Rungs exactly on L = 2 + 50 D^-0.3: the fit returns E, A, alpha; a candidate inside the
    ladder gets the law's tokens, one beyond it the same marked extrapolated."""
    tokens = [1e5, 1.5e5, 2e5, 3e5]
    rungs = [runs(t, [2 + 50 * t**-0.3] * 2) for t in tokens]
    fit = ladder.fit_power_law(*ladder.points(rungs))
    assert (fit["E"], fit["A"], fit["alpha"]) == (
        pytest.approx(2.0, abs=1e-9),
        pytest.approx(50.0, rel=1e-7),
        pytest.approx(0.3, rel=1e-9),
    )
    inside = 2 + 50 * 2.5e5**-0.3
    m = ladder.multiplier(rungs, runs(1e5, [inside - 1e-3, inside + 1e-3]), [1, 1.5, 2, 3])
    assert m["fit_value"] == pytest.approx(2.5, rel=1e-6) and not m["fit_extrapolated"]
    beyond = 2 + 50 * 6e5**-0.3
    m = ladder.multiplier(rungs, runs(1e5, [beyond - 1e-3, beyond + 1e-3]), [1, 1.5, 2, 3])
    assert m["bound"] == ">" and m["value"] == pytest.approx(3.0)  # the headline: a bound
    assert m["fit_value"] == pytest.approx(6.0, rel=1e-6) and m["fit_extrapolated"]
    assert ladder.fit_power_law(tokens[:2], [3.0, 2.5]) is None  # 2 rungs: no fit


T_975_DF2 = (
    0.95 * (2 / (1 - 0.95**2)) ** 0.5
)  # t(2)'s 97.5% point: F(t) = 1/2 + t / (2 sqrt(2 + t^2))


def accepted_grid(rungs, candidate, n=200_001):
    """The log tokens, on a dense grid over the ladder, where |ladder(x) - L_c| <= t * se(x),
    computed with numpy: the ladder's means and the variances of the means interpolated
    linearly in log tokens between neighbouring rungs (the weights squared for the variance)."""
    x = np.log([g[0]["tokens"] for g in rungs])
    mean = np.array([np.mean([r["val_loss"] for r in g]) for g in rungs])
    var = np.array([np.var([r["val_loss"] for r in g], ddof=1) / len(g) for g in rungs])
    c = [r["val_loss"] for r in candidate]
    grid = np.linspace(x[0], x[-1], n)
    j = np.clip(np.searchsorted(x, grid, side="right") - 1, 0, len(x) - 2)
    w = (grid - x[j]) / (x[j + 1] - x[j])
    d = (1 - w) * mean[j] + w * mean[j + 1] - np.mean(c)
    v = (1 - w) ** 2 * var[j] + w**2 * var[j + 1] + np.var(c, ddof=1) / len(c)
    return grid[np.abs(d) <= T_975_DF2 * np.sqrt(v)], grid[1] - grid[0]


@pytest.mark.parametrize(
    "cand_losses",
    [[2.84, 2.8, 2.74], [2.62, 2.52, 2.6], [2.95, 3.0, 2.9], [2.3, 2.2, 2.5]],
)
def test_the_interval_is_where_welchs_statistic_along_the_ladder_stays_within_t(cand_losses):
    """3 seeds per group: Hsu's df is 2. The interval's ends are the first and last log tokens
    of the accepted grid (within its spacing); an end reaching the lowest or top rung is open."""
    rungs = [
        runs(1000, [3.05, 2.98, 2.97]),
        runs(2000, [2.55, 2.5, 2.42]),
        runs(4000, [2.21, 2.26, 2.17]),
    ]
    cand = runs(1000, cand_losses)
    got = ladder.interval(rungs, cand)
    ok, step = accepted_grid(rungs, cand)
    x = np.log([1000, 2000, 4000])
    for end, want, edge in ((got["ci"][0], ok.min(), x[0]), (got["ci"][1], ok.max(), x[-1])):
        if abs(want - edge) < step:
            assert end is None
        else:
            assert math.log(end * 1000) == pytest.approx(want, abs=step)
    assert got["two_sided"] == (None not in got["ci"])
    assert "Hsu" in got["interval"] and "3 seeds" in got["interval"]
    m = ladder.multiplier(rungs, cand, [1, 2, 4])
    assert m["ci"] == got["ci"] and m["interval"] == got["interval"]
    if None not in got["ci"]:
        assert got["ci"][0] < m["value"] < got["ci"][1]


def test_beyond_the_ladder_at_95_percent_the_interval_is_one_sided_and_never_two_sided():
    rungs = [runs(1000, [3.0, 3.02, 2.98]), runs(2000, [2.5, 2.52, 2.48])]
    m = ladder.multiplier(rungs, runs(1000, [2.1, 2.12, 2.08]), [1, 2])  # far below the top
    assert m["bound"] == ">" and m["ci"] == [2.0, None] and not m["two_sided"]
    m = ladder.multiplier(rungs, runs(1000, [3.4, 3.42, 3.38]), [1, 2])  # far above the lowest
    assert m["bound"] == "<" and m["ci"] == [None, 1.0] and not m["two_sided"]
    m = ladder.multiplier(rungs, runs(1000, [2.45, 2.6, 2.53]), [1, 2])  # inside, near the top
    assert m["bound"] is None and m["ci"][1] is None and not m["two_sided"]


def test_fewer_than_two_seeds_in_a_group_is_one_line():
    rungs = [runs(1000, [3.0, 3.02]), runs(2000, [2.5])]
    with pytest.raises(UserError, match="needs 2 finished runs or more in each rung.*2, 1, 2"):
        ladder.multiplier(rungs, runs(1000, [2.8, 2.7]), [1, 2])


def synthetic(config, seed, tokens, curve_losses, final):
    """A finished run whose curve passes `curve_losses` at evenly spaced tokens, ending at `final`."""
    xs = [tokens * i / (len(curve_losses)) for i in range(len(curve_losses) + 1)]
    ys = [*curve_losses, final]
    return {
        "config": config,
        "seed": seed,
        "status": "done",
        "curve": {"tokens": xs, "seconds": xs, "val_loss": ys, "val_bpb": ys},
        "val_loss": final,
        "val_bpb": final,
        "tokens": tokens,
        "train_s": tokens,
        "flops_per_token": 1.0,
    }


def test_a_candidate_reached_mid_curve_by_a_rung_gets_the_ladder_value_not_the_curve_value():
    """Rung 2x passes 2.8 at 800 tokens on its way (mid-schedule, before its decay), but the
    rungs END at 3.0 (1000 tokens) and 2.5 (2000): the multiplier of a candidate ending at 2.8
    with 1000 tokens is the ladder's 2^0.4 = 1.3195, not the curve's 0.8."""
    out = []
    for seed, off in ((1, -0.01), (2, 0.01)):
        out.append(synthetic("b@1", seed, 1000, [5.0, 3.5], 3.0 + off))
        out.append(synthetic("b@2", seed, 2000, [5.0, 2.6], 2.5 + off))  # 2.6 at 1000 tokens
        out.append(synthetic("cand", seed, 1000, [5.0, 3.2], 2.8 + off))
    race = analyse(out, ["b@1", "b@2", "cand"], "baseline", {"b@1": 1.0, "b@2": 2.0})
    m = race["configs"][2]["compute_multiplier"]
    assert m["value"] == pytest.approx(2**0.4, rel=1e-12) and m["bound"] is None
    assert race["configs"][1]["compute_multiplier"] == {"rung": 2.0}
    table = markdown_table(race)
    assert "compute multiplier (ladder)" in table and "| 1.32× [" in table
    assert m["interval"].endswith("95%, 2 seeds") and f"Interval ({m['interval']}):" in table
    assert "rung 2×" in table


def test_without_a_ladder_the_baseline_is_one_rung_and_the_multiplier_a_bound():
    """No baseline curve is read mid-schedule: a candidate ending below the baseline's final
    loss gets > the baseline's tokens over its own, with the one-sided p."""
    out = []
    for seed, off in ((1, -0.01), (2, 0.01)):
        out.append(synthetic("base", seed, 1500, [5.0, 2.0], 3.0 + off))  # 2.0 mid-curve
        out.append(synthetic("cand", seed, 1000, [5.0, 3.2], 2.8 + off))
    race = analyse(out, ["base", "cand"], "baseline")
    m = race["configs"][1]["compute_multiplier"]
    assert m["bound"] == ">" and m["value"] == 1.5 and race["ladder"] is None
    assert "> 1.5× p=" in markdown_table(race) and "compute multiplier (bound)" in markdown_table(
        race
    )


# ---------------------------------------------------------------- a ladder race of the debug model


def ladder_args(configs, out, byte_data, rungs="1,2", *more):
    return [
        "race",
        "--config",
        configs[0],
        "--config",
        configs[1],
        "--ladder",
        rungs,
        "--seeds",
        "2",
        "--out",
        str(out),
        f"--data.dir={byte_data}",
        *FAST,
        "--train.max_steps=3",
        "--eval.every=3",
        "--checkpoint.every=0",
        "--log.every=1",
        *more,
    ]


def test_a_ladder_race_trains_its_rungs_as_run_directories_and_reports_the_ladder_value(
    configs,
    byte_data,
    tmp_path,
    capsys,
):
    out = tmp_path / "race"
    assert cli(ladder_args(configs, out, byte_data)) == 0
    table = capsys.readouterr().out
    race = json.loads((out / "race.json").read_text())
    assert race["ladder"] == {"debug@1": 1.0, "debug@2": 2.0}
    assert [c["label"] for c in race["configs"]] == ["debug@1", "debug@2", "fast"]
    # in the order they ran: seed by seed, the longest schedule (debug@2's 6 steps) first
    order = [(r["config"], r["seed"]) for r in race["runs"]]
    assert order == [(c, s) for s in (1, 2) for c in ("debug@2", "debug@1", "fast")]
    for label, steps, warmup in (("debug@1", 3, 2), ("debug@2", 6, 4)):
        text = (out / label / "seed_2" / "config.toml").read_text()
        assert f"\nmax_steps = {steps}\n" in text and f"\nwarmup_steps = {warmup}\n" in text
    done = {c: [r for r in race["runs"] if r["config"] == c] for c in race["ladder"]}
    assert all(len(v) == 2 and all(r["status"] == "done" for r in v) for v in done.values())
    fast = [r for r in race["runs"] if r["config"] == "fast"]
    m = race["configs"][2]["compute_multiplier"]
    if m["bound"] is None:  # the value from the recorded finals, by numpy
        assert m["value"] == pytest.approx(numpy_multiplier(list(done.values()), fast), rel=1e-9)
    else:
        ends = [np.mean([r["tokens"] for r in done[c]]) for c in race["ladder"]]
        edge = ends[-1] if m["bound"] == ">" else ends[0]
        assert m["value"] == pytest.approx(edge / np.mean([r["tokens"] for r in fast]))
    assert "compute multiplier (ladder)" in table and "| debug@2 | 2 |" in table


@pytest.mark.parametrize(
    "rungs, more, says",
    [
        ("2", [], "one rung has nothing to interpolate between"),
        ("2,1", [], "must be above 0 and increasing"),
        ("0,1", [], "must be above 0 and increasing"),
        ("1,x", [], "is not a list of multiples"),
        ("1,1.1", [], "rungs 1 and 1.1 both train 3 steps"),
        ("1,2", ["--train.time_budget=10m"], "race a ladder without a time budget"),
        ("1,2", ["--seeds", "1"], "use --seeds 2 or more"),
    ],
)
def test_bad_ladders_are_one_line_and_nothing_is_written(
    configs,
    byte_data,
    tmp_path,
    capsys,
    rungs,
    more,
    says,
):
    before = listing(tmp_path)
    assert cli(ladder_args(configs, tmp_path / "race", byte_data, rungs, *more)) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
    assert listing(tmp_path) == before and not (tmp_path / "race").exists()


def test_a_ladder_of_configs_on_other_data_is_refused(configs, byte_data, tmp_path, capsys):
    """The ladder on a prepared folder, the candidate on the built-in corpus."""
    base = tmp_path / "base.toml"
    base.write_text(open(configs[0]).read().replace('dir = "shakespeare"', f'dir = "{byte_data}"'))
    argv = ladder_args([str(base), configs[1]], tmp_path / "race", byte_data)
    argv.remove(f"--data.dir={byte_data}")
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "their losses cannot be compared" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "race").exists()
