"""The study's results table (docs/study.md): one row per cell, read from its two races'
race.json: the baseline's ladder (the ablation against it) and the recipe's ladder (the baseline
against it).

    rows = [row(cell_name, baseline_race, recipe_race, train_tokens) for ...]; print(table(rows))

A row holds the regime (the val split's unigram entropy under the train split's counts), each
arm's mean final val loss at 1x with its seed spread, and the recipe's and the ablation's compute
multipliers against the baseline with their 95% intervals (or a bound and its one-sided
p-value), plus the power law's value where a ladder has 3 rungs or more. Each multiplier is
computed again here from the race's per-seed final losses (race.json's runs) by
gptrain/logs/ladder.py's `multiplier`, the race's own function, whatever gptrain wrote the race. The ablation's is read
on the baseline's ladder. The recipe's is the inverse of the baseline's on the recipe's ladder:
the baseline's tokens over the tokens at which the recipe's complete runs reach the baseline's
loss (an interval inverts end for end; a bound flips). A rung that trains on more tokens than the
train split holds is marked: it reads tokens twice.

`config_steps` turns the rows of the cells at the largest size and at the longest horizon into
configs/gpt2_124m.toml's step count: llm.c's divided by the smallest lower 95% bound among them,
each the lower end of a two-sided interval inside its ladder; a bound past a ladder or an open
end divides nothing, and the line names the cell and the fix (more rungs).
"""

from __future__ import annotations

import math

from gptrain.errors import UserError
from gptrain.logs import ladder

ARMS = ("recipe", "ablation")
LLMC_STEPS = 19_073  # llm.c's GPT-2 124M run: ~10B tokens in 2^19-token steps
MIN_DIVISOR = 1.1  # a lower bound below this divides nothing


def _config(race: dict, label: str) -> dict | None:
    return next((c for c in race["configs"] if c["label"] == label), None)


def _loss(c: dict | None) -> str:
    if not c or not c.get("val_loss"):
        return "not run"
    v = c["val_loss"]
    return f"{v['mean']:.4f}" + (f" ± {v['sd']:.4f}" if v.get("sd") is not None else "")


def invert(m: dict) -> dict:
    """The multiplier of the ladder's config against the candidate, from the candidate's against
    the ladder: 1/value, the interval's ends swapped and inverted, a bound's direction flipped."""
    ci = m["ci"] and [None if v is None else 1 / v for v in reversed(m["ci"])]
    out = {"value": 1 / m["value"], "bound": {">": "<", "<": ">", None: None}[m["bound"]]}
    out |= {"ci": ci, "p": m["p"], "fit_extrapolated": m.get("fit_extrapolated")}
    out |= {"two_sided": m.get("two_sided", False), "interval": m.get("interval")}
    fit = m.get("fit_value")
    return out | {"fit_value": None if not fit else 1 / fit}


def _n(v: float) -> str:
    """Three significant digits, trailing zeros kept: 2.00, 2.10, 0.595."""
    return f"{v:#.3g}".rstrip(".")


def _multiplier(m: dict | None) -> str:
    """ "2.31x [1.95, 2.70]", "> 4x (p 0.002)" or "< 1x (p 0.03)", and the fit's value."""
    if not m or "value" not in m:
        return "not run"
    if m["bound"]:
        p = "" if m["p"] is None else f" (p {m['p']:.2g})"
        text = f"{m['bound']} {m['value']:.3g}x{p}"
    else:
        text = f"{_n(m['value'])}x"
        if m["ci"] is not None:
            lo, hi = (("open" if v is None else _n(v)) for v in m["ci"])
            text += f" [{lo}, {hi}]"
    if m.get("fit_value") is not None:
        text += f"; fit {_n(m['fit_value'])}x" + (
            " (extrapolated)" if m["fit_extrapolated"] else ""
        )
    return text


def lower_bound(m: dict | None) -> tuple[float | None, str | None]:
    """(the lower end of a multiplier's 95% interval, why there is none): only a two-sided
    interval inside the ladder gives one; a bound past the ladder or an open end never does."""
    if not m or "value" not in m:
        return None, "not measured"
    if m["bound"]:
        return None, f"a bound past its ladder ({m['bound']} {m['value']:.3g}x), not an interval; add rungs past that end of the ladder and race the cell again"  # fmt: skip
    if not m.get("two_sided"):
        return None, "its interval reaches the end of its ladder (open); add rungs past that end of the ladder and race the cell again"  # fmt: skip
    return m["ci"][0], None


def config_steps(rows: list[dict], steps: int = LLMC_STEPS) -> tuple[int, str]:
    """(max_steps, why) for configs/gpt2_124m.toml from the rows of the cells at the largest size
    and at the longest horizon: `steps` over the smallest recipe lower bound among them, rounded
    up; `steps` itself while one of them is not measured, has no two-sided interval (the line
    names the cell and the fix) or its bound is below MIN_DIVISOR."""
    cells = {f"{r['corpus']}-{r['size']}-{r['horizon']}": r for r in rows}
    missing = [cell for cell, r in cells.items() if r.get("recipe_why", "not measured") == "not measured" and r["recipe_low"] is None]  # fmt: skip
    if not rows or missing:
        return steps, f"{steps:,} steps: not measured ({', '.join(missing) or 'no cells'})"
    refused = [f"{cell}: {r['recipe_why']}" for cell, r in cells.items() if r["recipe_low"] is None]
    if refused:
        return steps, f"{steps:,} steps: no lower bound to divide by ({'; '.join(refused)})"
    cell, low = min(((c, r["recipe_low"]) for c, r in cells.items()), key=lambda kv: kv[1])
    if low < MIN_DIVISOR:
        return steps, f"{steps:,} steps: the lower bound {low:.3g} ({cell}) is below {MIN_DIVISOR}"
    divided = math.ceil(steps / low)
    return divided, f"{divided:,} steps = {steps:,} / {low:.3g}, the lowest bound ({cell})"


def measured(race: dict | None, label: str, cell: str) -> dict | None:
    """The compute multiplier of `label` in `race`, computed from its runs' final losses against
    the race's ladder by gptrain/logs/ladder.py; None where the race or its finished runs are
    missing. Too few seeds: one line naming the cell (UserError)."""
    if not race or not race.get("ladder"):
        return None

    def done(name):
        return [r for r in race["runs"] if r["config"] == name and r["status"] == "done"]

    rungs = [(done(name), m) for name, m in race["ladder"].items() if done(name)]
    if not rungs or not done(label):
        return None
    try:
        return ladder.multiplier([g for g, _ in rungs], done(label), [m for _, m in rungs])
    except UserError as e:
        raise UserError(f"{cell}, {label} against the ladder: {e}") from None


def _repeats(race: dict | None, train_tokens: int) -> list[str]:
    if not race or not race.get("ladder"):
        return []
    return [
        label
        for label in race["ladder"]
        if (c := _config(race, label)) and c.get("tokens") and c["tokens"]["mean"] > train_tokens
    ]


def row(cell: str, baseline_race: dict | None, recipe_race: dict | None, train_tokens: int) -> dict:
    """One cell's numbers: `cell` is <corpus>-<size>-<horizon>; either race may be missing (not
    run yet); `train_tokens` the race data's train split, to mark rungs that read it twice."""
    corpus, size, horizon = cell.split("-")
    base = _config(baseline_race, "baseline@1") if baseline_race else None
    if not base and recipe_race:
        base = _config(recipe_race, "baseline")
    recipe = _config(recipe_race, "recipe@1") if recipe_race else None
    ablation = _config(baseline_race, "ablation") if baseline_race else None
    against = measured(recipe_race, "baseline", cell)
    unigram = ((baseline_race or recipe_race) or {}).get("unigram") or {}
    below = unigram["nats"] - base["val_loss"]["mean"] if unigram and base else None
    repeats = _repeats(baseline_race, train_tokens) + _repeats(recipe_race, train_tokens)
    recipe_m = invert(against) if against else None
    recipe_low, recipe_why = lower_bound(recipe_m)
    return {
        "corpus": corpus,
        "size": size,
        "horizon": horizon,
        "tokens": base["tokens"]["mean"] if base and base.get("tokens") else None,
        "unigram": unigram.get("nats"),
        "below": below,
        "baseline": _loss(base),
        "recipe": _loss(recipe),
        "ablation": _loss(ablation),
        "recipe_x": _multiplier(recipe_m),
        "recipe_low": recipe_low,
        "recipe_why": recipe_why,
        "ablation_x": _multiplier(measured(baseline_race, "ablation", cell)),
        "repeats": ", ".join(repeats) or "none",
    }


def not_run(cell: str) -> dict:
    corpus, size, horizon = cell.split("-")
    row = {"corpus": corpus, "size": size, "horizon": horizon, "tokens": None, "unigram": None}
    keys = ("baseline", *ARMS, *(f"{arm}_x" for arm in ARMS), "repeats")
    row |= {"below": None, "recipe_low": None, "recipe_why": "not measured"}
    return row | dict.fromkeys(keys, "not run")


def table(rows: list[dict]) -> str:
    head = (
        "| corpus | size | horizon | tokens | val unigram entropy | baseline val loss (below unigram) "
        "| recipe val loss | ablation val loss | recipe: x baseline tokens [95%] "
        "| ablation: x baseline tokens [95%] | rungs reading data twice |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        tokens = "not run" if r["tokens"] is None else f"{r['tokens'] / 1e6:.2f}M"
        uni = "not run" if r["unigram"] is None else f"{r['unigram']:.3f}"
        below = "" if r["below"] is None else f" ({r['below']:.2f})"
        lines.append(
            f"| {r['corpus']} | {r['size']} | {r['horizon']} | {tokens} | {uni} | {r['baseline']}{below} "
            f"| {r['recipe']} | {r['ablation']} | {r['recipe_x']} | {r['ablation_x']} | {r['repeats']} |"
        )
    return "\n".join(lines)
