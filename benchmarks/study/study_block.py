"""The block race's table (docs/study.md): one row per cell, read from two races' race.json:
nanochat's ladder (the recipe on nanochat's block, against which the recipe on GPT-2's block at
1x is the candidate) and nanochat_adamw on the baseline's ladder (nanochat's block with AdamW,
against the baseline on GPT-2's block).

    rows = [row(cell_name, nanochat_race, adamw_race) for ...]; print(table(rows))
    steps, why = nanochat_steps(recipe_rows, block_rows)   # configs/nanochat_124m.toml's steps

The block's multiplier under Muon is the inverse of the recipe's on nanochat's ladder: the GPT-2
block's tokens over the tokens at which nanochat's block, with the same recipe, reaches its loss
(benchmarks/study/study_report.py `invert`, each computed again from the runs). Under AdamW it is read
on the baseline's ladder as it stands: nanochat_adamw's final loss in the GPT-2 baseline's tokens.
The two separate the block's gain from Muon's.

`nanochat_steps` divides llm.c's 19,073 steps by the block's lower 95% bound times the recipe's,
each the smallest among the cells at the largest size and at the longest horizon: a factor whose
cells are not all measured, whose interval is open or a bound, or whose bound is below 1.1
divides nothing (it counts as 1), and the line says which and why.
"""

from __future__ import annotations

import math

import study_report
from study_report import LLMC_STEPS, MIN_DIVISOR, _loss, _multiplier, invert, lower_bound, measured


def row(cell: str, nanochat_race: dict | None, adamw_race: dict | None) -> dict:
    """One cell's block numbers; either race may be missing (not run yet)."""
    corpus, size, horizon = cell.split("-")
    config = study_report._config
    against = measured(nanochat_race, "recipe", cell)
    block = invert(against) if against else None
    low, why = lower_bound(block)
    return {
        "corpus": corpus,
        "size": size,
        "horizon": horizon,
        "recipe": _loss(config(nanochat_race, "recipe") if nanochat_race else None),
        "nanochat": _loss(config(nanochat_race, "nanochat@1") if nanochat_race else None),
        "nanochat_adamw": _loss(config(adamw_race, "nanochat_adamw") if adamw_race else None),
        "block_x": _multiplier(block),
        "block_low": low,
        "block_why": why,
        "adamw_x": _multiplier(measured(adamw_race, "nanochat_adamw", cell)),
    }


def table(rows: list[dict]) -> str:
    head = (
        "| corpus | size | horizon | recipe val loss (GPT-2 block) | nanochat val loss "
        "| nanochat: x recipe tokens [95%] | nanochat_adamw val loss "
        "| nanochat_adamw: x baseline tokens [95%] |"
    )
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(
            f"| {r['corpus']} | {r['size']} | {r['horizon']} | {r['recipe']} | {r['nanochat']} "
            f"| {r['block_x']} | {r['nanochat_adamw']} | {r['adamw_x']} |"
        )
    return "\n".join(lines)


def factor(rows: list[dict], key: str) -> tuple[float, str]:
    """(the divisor, why) from the rows' `key`_low and `key`_why: the smallest lower bound when
    every row has one of at least MIN_DIVISOR; else 1 and the reason."""
    named = {f"{r['corpus']}-{r['size']}-{r['horizon']}": r for r in rows}
    lows = {cell: r.get(f"{key}_low") for cell, r in named.items()}
    whys = {cell: r.get(f"{key}_why") or "not measured" for cell, r in named.items()}
    missing = [cell for cell, low in lows.items() if low is None and whys[cell] == "not measured"]
    if not rows or missing:
        return 1.0, f"not measured ({', '.join(missing) or 'no cells'})"
    if refused := [f"{cell}: {whys[cell]}" for cell, low in lows.items() if low is None]:
        return 1.0, f"no lower bound ({'; '.join(refused)})"
    cell, low = min(lows.items(), key=lambda kv: kv[1])
    if low < MIN_DIVISOR:
        return 1.0, f"its lower bound {low:.3g} ({cell}) is below {MIN_DIVISOR}"
    return low, f"lower bound {low:.3g} ({cell})"


def nanochat_steps(
    recipe_rows: list[dict], block_rows: list[dict], steps: int = LLMC_STEPS
) -> tuple[int, str]:
    """(max_steps, why) for configs/nanochat_124m.toml: `steps` / (the block's lower bound x the
    recipe's), rounded up, each factor 1 where it divides nothing (`factor`)."""
    recipe, recipe_why = factor(recipe_rows, "recipe")
    block, block_why = factor(block_rows, "block")
    divided = math.ceil(steps / (recipe * block)) if recipe * block > 1 else steps
    parts = []
    for name, value, why in (("recipe", recipe, recipe_why), ("block", block, block_why)):
        parts.append(f"the {name}'s {why}" if value > 1 else f"the {name} divides nothing: {why}")
    return (
        divided,
        f"{divided:,} steps = {steps:,} / ({recipe:.3g} x {block:.3g}): {'; '.join(parts)}",
    )
