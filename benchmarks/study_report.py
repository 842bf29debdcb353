"""The study's results table (docs/study.md): one row per cell, read from each cell's race.json.

    rows = [row(cell_name, race, train_tokens) for ...]; print(table(rows))

A row holds the regime (the val split's unigram entropy under the train split's counts), each
arm's mean final val loss with its seed spread, and the recipe's and the ablation's compute
multipliers against the baseline's ladder with their 95% bootstrap intervals (or a bound and its
one-sided p-value), plus the power law's value where the ladder has 3 rungs or more. A rung
that trains on more tokens than the train split holds is marked: it reads tokens twice.
"""

from __future__ import annotations

ARMS = ("recipe", "ablation")


def _config(race: dict, label: str) -> dict | None:
    return next((c for c in race["configs"] if c["label"] == label), None)


def _loss(c: dict | None) -> str:
    if not c or not c.get("val_loss"):
        return "not run"
    v = c["val_loss"]
    return f"{v['mean']:.4f}" + (f" ± {v['sd']:.4f}" if v.get("sd") is not None else "")


def _multiplier(c: dict | None) -> str:
    """ "2.31x [1.95, 2.70]", "> 4x (p 0.002)" or "< 1x (p 0.03)", and the fit's value."""
    m = (c or {}).get("compute_multiplier")
    if not m or "value" not in m:
        return "not run"
    if m["bound"]:
        p = "" if m["p"] is None else f" (p {m['p']:.2g})"
        text = f"{m['bound']} {m['value']:.3g}x{p}"
    else:
        text = f"{m['value']:.3g}x"
        if m["ci"] is not None:
            lo, hi = (("open" if v is None else f"{v:.3g}") for v in m["ci"])
            text += f" [{lo}, {hi}]"
    if m.get("fit_value") is not None:
        text += f"; fit {m['fit_value']:.3g}x" + (
            " (extrapolated)" if m["fit_extrapolated"] else ""
        )
    return text


def row(cell: str, race: dict, train_tokens: int) -> dict:
    """One cell's numbers: `cell` is <corpus>-<size>-<horizon>; `train_tokens` the race data's
    train split, to mark ladder rungs that read it more than once."""
    corpus, size, horizon = cell.split("-")
    rungs = race.get("ladder") or {race["baseline"]: 1.0}
    base = _config(race, race["baseline"])
    repeats = [
        f"{m:g}x"
        for label, m in rungs.items()
        if (c := _config(race, label)) and c.get("tokens") and c["tokens"]["mean"] > train_tokens
    ]
    unigram = race.get("unigram") or {}
    return {
        "corpus": corpus,
        "size": size,
        "horizon": horizon,
        "tokens": base["tokens"]["mean"] if base and base.get("tokens") else None,
        "unigram": unigram.get("nats"),
        "below": base.get("below_unigram") if base else None,
        "baseline": _loss(base),
        **{arm: _loss(_config(race, arm)) for arm in ARMS},
        **{f"{arm}_x": _multiplier(_config(race, arm)) for arm in ARMS},
        "repeats": ", ".join(repeats) or "none",
    }


def not_run(cell: str) -> dict:
    corpus, size, horizon = cell.split("-")
    row = {"corpus": corpus, "size": size, "horizon": horizon, "tokens": None, "unigram": None}
    keys = ("baseline", *ARMS, *(f"{arm}_x" for arm in ARMS), "repeats")
    return row | {"below": None} | dict.fromkeys(keys, "not run")


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
