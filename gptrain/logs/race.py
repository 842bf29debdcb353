"""A race's numbers, from its runs' records (gptrain/commands/race.py trains the runs and writes
race.json; this module reads metrics and computes):

    curve_from_metrics(rows)        a run's validation curve: tokens, training seconds, val loss
                                    and bits/byte at each evaluation
    analyse(runs, labels, target, rungs)
                                    each run's tokens, seconds and FLOPs to the target loss
                                    (censored when not reached), each config's mean +- sd, its
                                    ratios to the baseline (the first config), p-values and its
                                    compute multiplier against the ladder's rungs
                                    (gptrain/logs/ladder.py; without a ladder, the baseline is
                                    its one rung and the multiplier only a bound)

The table and race.png: gptrain/logs/race_report.py.

Training seconds are a row's `train_s` where metrics.jsonl has one (the run's clock of its
optimizer steps), else summed from each logged interval's throughput (tokens / tok_per_s): either
way evaluation, samples and checkpoints are excluded, as they are from tok/s. Crossings of the target
are interpolated linearly between evaluations. Statistics: gptrain/logs/stats.py.
"""

from __future__ import annotations

import math

from gptrain.logs import ladder
from gptrain.logs.stats import mean_sd, ratio_ci, welch

LEVEL = 0.95  # confidence level of every interval
EARLY_NATS = 1.0  # a baseline ending less than this below the unigram entropy: early regime
METHODS = {
    "p": "Welch's t-test (unequal variances), two-sided",
    "ratio_ci": "Fieller's interval for a ratio of means under Welch's test",
    "compute_multiplier": "the tokens at which the ladder's mean final val losses (each rung a complete baseline run at a multiple of its steps), interpolated linearly in log tokens between rungs, reach the config's mean final val loss, over the config's mean tokens; beyond the top rung a lower bound (> m), below the lowest an upper bound (< m), each with the one-sided Welch p-value of the config's final losses against that rung's",
    "compute_multiplier_ci": "the log tokens at which Welch's t statistic of (the ladder's mean final loss interpolated there - the config's mean final loss) stays within Student's t quantile at Hsu's degrees of freedom (the fewest seeds in a group - 1): Fieller's interval along the ladder; an end that reaches the lowest or the top rung is open, and only an interval with both ends inside the ladder is two-sided (tests/test_ladder_coverage.py: it covers known multipliers at the study's noise)",
    "fit": "L(D) = E + A D^-alpha through the rungs' means (3 rungs or more), least squares; its multiplier is shown beside, marked where it extrapolates beyond the ladder",
    "seconds": "training seconds, the run's train_s or from the logged throughput (evaluation and checkpoints excluded)",
}


def curve_from_metrics(rows: list[dict]) -> dict:
    """{tokens, seconds, val_loss, val_bpb}: one entry per evaluation in metrics.jsonl's rows."""
    curve = {"tokens": [], "seconds": [], "val_loss": [], "val_bpb": []}
    done, seconds = 0, 0.0
    for row in rows:
        tokens = row.get("tokens")
        if tokens is None:
            continue
        if "train_s" in row:  # the run's own clock of its optimizer steps, where it logs one
            seconds = row["train_s"]
        elif row.get("tok_per_s") and tokens > done:
            seconds += (tokens - done) / row["tok_per_s"]
        done = max(done, tokens)
        if "val_loss" in row:
            curve["tokens"].append(tokens)
            curve["seconds"].append(seconds)
            curve["val_loss"].append(row["val_loss"])
            curve["val_bpb"].append(row.get("val_bpb", math.nan))
    return curve


def first_crossing(xs: list[float], ys: list[float], target: float) -> float | None:
    """The first x where y falls to `target`, linear between points; None: never (censored)."""
    for i, y in enumerate(ys):
        if y <= target:
            if i == 0:
                return xs[0]
            x0, y0, x1 = xs[i - 1], ys[i - 1], xs[i]
            return x0 + (y0 - target) * (x1 - x0) / (y0 - y)
    return None


def value_at(xs: list[float], ys: list[float], x: float) -> float | None:
    """y at x, linear between points; None outside [xs[0], xs[-1]]."""
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    for i in range(1, len(xs)):
        if x <= xs[i]:
            x0, x1 = xs[i - 1], xs[i]
            w = (x - x0) / (x1 - x0) if x1 > x0 else 1.0
            return ys[i - 1] + w * (ys[i] - ys[i - 1])
    return ys[0]


def mean_curve(curves: list[dict], axis: str = "tokens") -> tuple[list[float], list[float]]:
    """The runs' mean val loss against `axis` (tokens or seconds), on the points of every run
    (each run interpolated there) up to where the shortest run ends."""
    end = min(c[axis][-1] for c in curves)
    grid = sorted({x for c in curves for x in c[axis] if x <= end})
    means = [
        math.fsum(value_at(c[axis], c["val_loss"], x) for c in curves) / len(curves) for x in grid
    ]
    return grid, means


def analyse(
    runs: list[dict],
    labels: list[str],
    target: float | str,
    rungs: dict[str, float] | None = None,
    unigram: dict | None = None,
) -> dict:
    """The race's results from its run records (config, seed, status, curve, val_loss, val_bpb,
    tokens, train_s, flops_per_token, ...): `target` is a loss or "baseline" (the baseline's mean
    final val loss); `rungs` maps the ladder's configs to their multiples, in increasing order
    (None: the baseline is the one rung, at 1); `unigram` is the regime (gptrain/data/unigram.py:
    its "nats"), each config's mean final loss shown below it, a baseline's less than
    EARLY_NATS below marked early. Each finished run gains `to_target`; the result lists each
    config."""
    done = {
        label: [r for r in runs if r["config"] == label and r["status"] == "done"]
        for label in labels
    }
    base = done[labels[0]]
    if not base:
        raise ValueError(f"no run of the baseline {labels[0]!r} finished")
    value = mean_sd([r["val_loss"] for r in base])[0] if target == "baseline" else float(target)
    for r in (r for group in done.values() for r in group):
        c = r["curve"]
        tokens = first_crossing(c["tokens"], c["val_loss"], value)
        r["to_target"] = None  # censored: the run never reached the target
        if tokens is not None:
            seconds = first_crossing(c["seconds"], c["val_loss"], value)
            r["to_target"] = {
                "tokens": tokens,
                "seconds": seconds,
                "flops": tokens * r["flops_per_token"],
            }
    rungs = rungs or {labels[0]: 1.0}
    ladder_runs = [done[label] for label in rungs if done[label]]
    multiples = [m for label, m in rungs.items() if done[label]]
    configs = [_config(label, done[label], base, value, label == labels[0]) for label in labels]
    for c, label in zip(configs, labels, strict=True):
        c["failed"] = sum(r["config"] == label and r["status"] != "done" for r in runs)
        if unigram is not None and c.get("val_loss"):
            c["below_unigram"] = unigram["nats"] - c["val_loss"]["mean"]
            if label in rungs:  # the baseline's runs: is the race in the early regime?
                c["early_regime"] = c["below_unigram"] < EARLY_NATS
        if label in rungs:
            c["compute_multiplier"] = {"rung": rungs[label]}
        elif done[label]:
            c["compute_multiplier"] = ladder.multiplier(ladder_runs, done[label], multiples)
    return {
        "target": value,
        "target_from": "the baseline's mean final val loss" if target == "baseline" else "--target",
        "baseline": labels[0],
        "ladder": rungs if len(rungs) > 1 else None,
        "unigram": unigram,
        "level": LEVEL,
        "methods": METHODS,
        "configs": configs,
        "runs": runs,
    }


def _summary(xs: list[float]) -> dict | None:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return None
    m, sd = mean_sd(xs)
    return {"mean": m, "sd": None if math.isnan(sd) else sd, "n": len(xs)}


def _config(label: str, runs: list[dict], base: list[dict], target: float, is_base: bool) -> dict:
    out = {"label": label, "runs": len(runs)}
    if not runs:
        return out
    finals = [r["val_loss"] for r in runs]
    out |= {
        "val_loss": _summary(finals),
        "val_bpb": _summary([r["val_bpb"] for r in runs]),
        "tokens": _summary([r["tokens"] for r in runs]),
        "train_s": _summary([r["train_s"] for r in runs]),
        "flops_per_token": runs[0]["flops_per_token"],
    }
    if any(r.get("hellaswag_acc_norm") is not None for r in runs):
        out["hellaswag_acc_norm"] = _summary([r.get("hellaswag_acc_norm") for r in runs])
    if not is_base and len(runs) > 1 and len(base) > 1:
        w = welch(finals, [r["val_loss"] for r in base])
        out["val_loss_vs_baseline"] = {"diff": w.diff, "ci": list(w.ci(LEVEL)), "p": w.p}
    for key in ("tokens", "seconds", "flops"):
        out[f"{key}_to_target"] = _to_target(key, runs, base, target, is_base)
    return out


def _to_target(key: str, runs: list[dict], base: list[dict], target: float, is_base: bool) -> dict:
    """Mean +- sd over the runs that reached the target, the mean curve's crossing, and (when
    every run of both configs reached it) the ratio to the baseline with its interval and p."""

    def values(group):
        return [r["to_target"][key] if r["to_target"] else None for r in group]

    def crossing(group):
        axis = "seconds" if key == "seconds" else "tokens"
        x = first_crossing(*mean_curve([r["curve"] for r in group], axis), target)
        return x * group[0]["flops_per_token"] if x is not None and key == "flops" else x

    mine, theirs = values(runs), values(base)
    out = {"reached": sum(v is not None for v in mine), "of": len(mine)}
    out |= {"stats": _summary(mine), "mean_curve": crossing(runs)}
    if is_base:
        return out
    complete = None not in mine + theirs and min(mine + theirs) > 0  # a ratio of positive means
    if complete and len(mine) > 1 and len(theirs) > 1:
        r = ratio_ci(mine, theirs, LEVEL)
        out["vs_baseline"] = {"ratio": r.value, "ci": [r.lo, r.hi], "p": welch(mine, theirs).p}
    elif out["mean_curve"] is not None and (b := crossing(base)) is not None:
        out["vs_baseline"] = {
            "ratio": out["mean_curve"] / b,
            "ci": None,
            "p": None,
            "censored": True,
        }
    return out
