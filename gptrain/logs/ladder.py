"""The compute multiplier, from complete runs only: a ladder of baseline runs, each trained to the
end of its own schedule at a multiple of the baseline's steps, against a candidate's final losses.

    points(rungs)                 each rung's mean tokens and mean final val loss
    tokens_for(points, loss)      the tokens at which the ladder reaches `loss`, interpolated
                                  linearly in log tokens between rungs; or a bound (beyond the
                                  top rung, below the lowest)
    fit_power_law(points)         L(D) = E + A * D^-alpha through the rungs (3 or more), least
                                  squares: alpha by a search, E and A linear for each alpha
    crossing_interval(...)        the log tokens at which the ladder may reach the candidate's
                                  loss: Welch's statistic along the ladder, inverted (below)
    interval(rungs, candidate)    that interval as multipliers from the per-seed final losses,
                                  whether it is two-sided, and its method in a line
    multiplier(rungs, candidate)  the multiplier (ladder tokens / the candidate's mean tokens),
                                  its interval, a bound's one-sided Welch p-value, and the fit's
                                  multiplier (marked when it extrapolates)

The interval (`method`) is Fieller's, generalised to the piecewise-linear ladder: the log tokens x
(between the lowest and the top rung) at which the test of "the ladder's interpolated mean loss at
x equals the candidate's mean loss" does not reject at LEVEL. At x between rungs j and j+1, a
share w of the way, the statistic is ((1-w) L_j + w L_j+1 - L_c) / sqrt((1-w)^2 v_j + w^2 v_j+1 +
v_c) (v: a group's variance of its mean, s^2 / n), compared with Student's t quantile at Hsu's
degrees of freedom, the fewest seeds in any group minus 1: with 3 seeds Welch-Satterthwaite's
degrees of freedom overstate the certainty (at the prose-large-1x cell's noise a 5% test at
their df rejects 6.1% of true hypotheses, at Hsu's 2.8%: tests/test_ladder_coverage.py). Within a segment the accepted x solve a quadratic exactly. The
interval spans the accepted x of every segment; an end that reaches the lowest or the top rung is
open (None): the ladder cannot say how far beyond it lies. No accepted x at all: the crossing lies
beyond the ladder at LEVEL, on the candidate's side ([the top rung, open) or (open, the lowest]).
tests/test_ladder_coverage.py simulates races of known multipliers at the study's noise and
checks the interval's coverage.

A rung or the candidate is a list of runs, each a dict with "tokens" and "val_loss" (final). No
baseline curve is read before its schedule ended: a run's loss mid-schedule, before its decay, is
higher than a run of that length would end at, so reading it would overstate the multiplier.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from gptrain.errors import UserError
from gptrain.logs.stats import mean_sd, student_t_ppf, student_t_sf2, welch

LEVEL = 0.95
MIN_SEEDS = 2  # per group (each rung, the candidate): the interval needs each group's spread
ALPHA_GRID = np.geomspace(1e-3, 10.0, 4001)  # the fit's exponents searched


def points(rungs: list[list[dict]]) -> tuple[list[float], list[float]]:
    """Each rung's mean tokens and mean final val loss, in the rungs' order."""
    tokens = [math.fsum(r["tokens"] for r in rung) / len(rung) for rung in rungs]
    losses = [math.fsum(r["val_loss"] for r in rung) / len(rung) for rung in rungs]
    return tokens, losses


def tokens_for(tokens: list[float], losses: list[float], loss: float) -> tuple[float, str | None]:
    """(tokens, bound) at which the ladder reaches `loss`: the first crossing along the rungs
    (ordered by tokens), linear in log tokens between the two rungs around it; bound None.
    A loss above the lowest rung's: (its tokens, "<"); below every rung's: (the top rung's
    tokens, ">")."""
    if loss > losses[0]:
        return tokens[0], "<"
    if loss == losses[0]:
        return tokens[0], None
    for i in range(1, len(tokens)):
        if losses[i] <= loss:  # losses[i - 1] > loss: the first rung at or below it
            w = (losses[i - 1] - loss) / (losses[i - 1] - losses[i])
            lo, hi = math.log(tokens[i - 1]), math.log(tokens[i])
            return math.exp(lo + w * (hi - lo)), None
    return tokens[-1], ">"


def fit_power_law(tokens: list[float], losses: list[float]) -> dict | None:
    """L(D) = E + A * D^-alpha through the rungs' means by least squares (D in tokens); None
    with fewer than 3 rungs, or where no decreasing law fits (A <= 0, or the best alpha at the
    edge of ALPHA_GRID). For each alpha, E and A are the linear least squares of L on
    [1, (D / D_0)^-alpha]; alpha is the grid's best, refined by a golden-section search."""
    if len(tokens) < 3:
        return None
    x = np.asarray(tokens, dtype=np.float64) / tokens[0]
    y = np.asarray(losses, dtype=np.float64)

    def solve(alpha: float) -> tuple[float, float, float]:
        f = x**-alpha
        design = np.stack([np.ones_like(f), f], axis=1)
        (e, a), *_ = np.linalg.lstsq(design, y, rcond=None)
        return float(np.sum((e + a * f - y) ** 2)), float(e), float(a)

    f = x[None, :] ** -ALPHA_GRID[:, None]  # every alpha at once: the regression's SSE
    fc, yc = f - f.mean(axis=1, keepdims=True), y - y.mean()
    slope = (fc @ yc) / np.maximum((fc * fc).sum(axis=1), 1e-300)
    sse = ((yc[None, :] - slope[:, None] * fc) ** 2).sum(axis=1)
    best = int(np.argmin(sse))
    if best in (0, len(ALPHA_GRID) - 1):
        return None
    lo, hi = float(ALPHA_GRID[best - 1]), float(ALPHA_GRID[best + 1])
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(100):
        a, b = hi - golden * (hi - lo), lo + golden * (hi - lo)
        lo, hi = (lo, b) if solve(a)[0] <= solve(b)[0] else (a, hi)
    alpha = (lo + hi) / 2
    sse_best, e, a_scaled = solve(alpha)
    if a_scaled <= 0:
        return None
    # L = E + a_scaled * (D / D_0)^-alpha = E + A * D^-alpha with A = a_scaled * D_0^alpha
    return {"E": e, "A": a_scaled * tokens[0] ** alpha, "alpha": alpha, "sse": sse_best}


def fit_tokens(fit: dict, loss: float) -> float | None:
    """The tokens at which the fitted law reaches `loss`; None at or below its floor E."""
    if loss <= fit["E"]:
        return None
    return (fit["A"] / (loss - fit["E"])) ** (1.0 / fit["alpha"])


def one_sided_p(a: list[float], b: list[float], below: bool) -> float | None:
    """Welch's one-sided p-value that mean(a) < mean(b) (below) or mean(a) > mean(b)."""
    if len(a) < 2 or len(b) < 2:
        return None
    w = welch(a, b)
    half = 0.5 * student_t_sf2(w.t, w.df)
    return half if (w.t < 0) == below else 1.0 - half


def method(seeds: int) -> str:
    """The interval's method in a line, as race.json and the tables name it."""
    return f"Welch's t along the ladder, inverted (Fieller), Hsu's df; {LEVEL:.0%}, {seeds} seeds"


@lru_cache(maxsize=64)
def _quantile(level: float, df: int) -> float:
    return student_t_ppf(0.5 + level / 2.0, df)


def _accepted(a: float, b: float, c: float) -> list[tuple[float, float]]:
    """The parts of [0, 1] where a w^2 + b w + c <= 0."""
    if a == 0.0:
        if b == 0.0:
            return [(0.0, 1.0)] if c <= 0.0 else []
        root = -c / b
        parts = [(-math.inf, root)] if b > 0.0 else [(root, math.inf)]
    else:
        disc = b * b - 4.0 * a * c
        if disc < 0.0:
            return [(0.0, 1.0)] if a < 0.0 else []
        r1, r2 = sorted(((-b - math.sqrt(disc)) / (2 * a), (-b + math.sqrt(disc)) / (2 * a)))
        parts = [(r1, r2)] if a > 0.0 else [(-math.inf, r1), (r2, math.inf)]
    return [(max(lo, 0.0), min(hi, 1.0)) for lo, hi in parts if max(lo, 0.0) <= min(hi, 1.0)]


def crossing_interval(
    x: list[float], means: list[float], var: list[float], cand: float, cand_var: float, q: float
) -> tuple[float | None, float | None] | None:
    """The log tokens in [x[0], x[-1]] where |ladder(x) - cand| <= q * se(x) (module docstring):
    (lo, hi), an end None where it reaches the lowest or the top rung; None where no x is
    accepted. `var` and `cand_var` are the variances of the means."""
    found = []
    for j in range(len(x) - 1):
        d0, g, vj, vk = means[j] - cand, means[j + 1] - means[j], var[j], var[j + 1]
        qq = q * q  # (d0 + g w)^2 - q^2 ((1-w)^2 vj + w^2 vk + v_c) <= 0, a quadratic in w
        a, b, c = g * g - qq * (vj + vk), 2 * d0 * g + 2 * qq * vj, d0 * d0 - qq * (vj + cand_var)
        for lo, hi in _accepted(a, b, c):
            found += [x[j] + lo * (x[j + 1] - x[j]), x[j] + hi * (x[j + 1] - x[j])]
    if not found:
        return None
    lo, hi = min(found), max(found)
    return (None if lo <= x[0] else lo, None if hi >= x[-1] else hi)


def interval(rungs: list[list[dict]], candidate: list[dict], level: float = LEVEL) -> dict:
    """The multiplier's interval from the groups' per-seed final losses: {"ci": [lo, hi] (an end
    None where open), "two_sided": both ends inside the ladder, "interval": the method}; no
    interval (None) with one rung. Fewer than MIN_SEEDS runs in a group: UserError (one line)."""
    groups = [*rungs, candidate]
    if len(rungs) < 2:  # one rung interpolates nothing: a bound and its p-value only
        return {"ci": None, "two_sided": False, "interval": None}
    if min(len(g) for g in groups) < MIN_SEEDS:
        counts = ", ".join(str(len(g)) for g in groups)
        raise UserError(
            f"the compute multiplier's interval needs {MIN_SEEDS} finished runs or more in each rung and in the candidate, got {counts}; train more seeds (--seeds) or rerun the failed ones"
        )
    tokens, losses = points(rungs)
    x = [math.log(t) for t in tokens]
    var = [mean_sd([r["val_loss"] for r in g])[1] ** 2 / len(g) for g in groups]
    cand_t = mean_sd([r["tokens"] for r in candidate])[0]
    cand_l = mean_sd([r["val_loss"] for r in candidate])[0]
    q = _quantile(level, min(len(g) for g in groups) - 1)
    got = crossing_interval(x, losses, var[:-1], cand_l, var[-1], q)
    if got is None:  # rejected everywhere: beyond the ladder on the candidate's side
        got = (x[-1], None) if cand_l < losses[-1] else (None, x[0])
        if losses[-1] <= cand_l <= losses[0]:  # a ladder that does not descend
            got = (None, None)
    ci = [None if e is None else (tokens[x.index(e)] if e in x else math.exp(e)) / cand_t for e in got]  # fmt: skip
    two_sided = None not in ci and got[0] > x[0] and got[1] < x[-1]
    return {"ci": ci, "two_sided": two_sided, "interval": method(min(len(g) for g in groups))}


def multiplier(rungs: list[list[dict]], candidate: list[dict], multiples: list[float]) -> dict:
    """The candidate's compute multiplier against the ladder (rungs in increasing multiples):
    value, bound (None, ">" or "<"), ci and two_sided (`interval`), interval (its method), p (a
    bound's one-sided Welch test against the top or lowest rung's finals), and with 3 rungs or
    more the power law's fit and its multiplier (`extrapolated` outside the ladder's tokens)."""
    tokens, losses = points(rungs)
    cand_t = mean_sd([r["tokens"] for r in candidate])[0]
    finals = [r["val_loss"] for r in candidate]
    cand_l = mean_sd(finals)[0]
    t, bound = tokens_for(tokens, losses, cand_l)
    out = {"value": t / cand_t, "bound": bound, "p": None}
    out |= interval(rungs, candidate)
    if bound is not None:
        out["two_sided"] = False  # a bound is never a point: its interval has one end at most
    out["rungs"] = [
        {"multiple": m, "tokens": tk, "val_loss": lo, "seeds": len(rung)}
        for m, tk, lo, rung in zip(multiples, tokens, losses, rungs, strict=True)
    ]
    if bound is not None:  # the test at the bound: below the top rung, or above the lowest
        edge = rungs[-1] if bound == ">" else rungs[0]
        out["p"] = one_sided_p(finals, [r["val_loss"] for r in edge], below=bound == ">")
    fit = fit_power_law(tokens, losses)
    out["fit"] = fit
    if fit is not None:
        d = fit_tokens(fit, cand_l)
        out["fit_value"] = None if d is None else d / cand_t
        out["fit_extrapolated"] = d is None or not tokens[0] <= d <= tokens[-1]
    return out
