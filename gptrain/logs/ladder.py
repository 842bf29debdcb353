"""The compute multiplier, from complete runs only: a ladder of baseline runs, each trained to the
end of its own schedule at a multiple of the baseline's steps, against a candidate's final losses.

    points(rungs)                 each rung's mean tokens and mean final val loss
    tokens_for(points, loss)      the tokens at which the ladder reaches `loss`, interpolated
                                  linearly in log tokens between rungs; or a bound (beyond the
                                  top rung, below the lowest)
    fit_power_law(points)         L(D) = E + A * D^-alpha through the rungs (3 or more), least
                                  squares: alpha by a search, E and A linear for each alpha
    multiplier(rungs, candidate)  the multiplier (ladder tokens / the candidate's mean tokens),
                                  its bootstrap interval over seeds, a bound's one-sided Welch
                                  p-value, and the fit's multiplier (marked when it extrapolates)

A rung or the candidate is a list of runs, each a dict with "tokens" and "val_loss" (final). No
baseline curve is read before its schedule ended: a run's loss mid-schedule, before its decay, is
higher than a run of that length would end at, so reading it would overstate the multiplier.
"""

from __future__ import annotations

import math

import numpy as np

from gptrain.logs.stats import mean_sd, student_t_sf2, welch

LEVEL = 0.95
BOOT_N = 2000  # bootstrap resamples
BOOT_SEED = 0  # the bootstrap's RNG seed: the interval is the same every time it is computed
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


def _value(rungs_t, rungs_l, cand_t, cand_l) -> float:
    """The multiplier of one (re)sample; a bound: +inf beyond the top rung, 0 below the lowest."""
    t, bound = tokens_for(rungs_t, rungs_l, cand_l)
    return {None: t / cand_t, ">": math.inf, "<": 0.0}[bound]


def bootstrap(rungs: list[list[dict]], candidate: list[dict]) -> list[float | None]:
    """The percentile interval (LEVEL) of the multiplier over BOOT_N resamples: the seeds of each
    rung and of the candidate drawn with replacement (numpy's default_rng(BOOT_SEED): for each
    group in turn, the rungs in order then the candidate, a BOOT_N x seeds matrix of draws).
    A resample beyond the top rung counts as +inf, below the lowest as 0: a bound of the
    interval there is open (None)."""
    rng = np.random.default_rng(BOOT_SEED)
    groups = [*rungs, candidate]
    means = []  # per group: (BOOT_N,) mean tokens and mean loss of its resampled seeds
    for g in groups:
        picks = rng.integers(0, len(g), size=(BOOT_N, len(g)))
        tok = np.asarray([r["tokens"] for r in g], dtype=np.float64)[picks].mean(axis=1)
        loss = np.asarray([r["val_loss"] for r in g], dtype=np.float64)[picks].mean(axis=1)
        means.append((tok, loss))
    values = np.empty(BOOT_N)
    for b in range(BOOT_N):
        rt = [float(t[b]) for t, _ in means[:-1]]
        rl = [float(v[b]) for _, v in means[:-1]]
        values[b] = _value(rt, rl, float(means[-1][0][b]), float(means[-1][1][b]))
    tail = (1.0 - LEVEL) / 2.0
    lo, hi = (float(np.quantile(values, q, method="inverted_cdf")) for q in (tail, 1.0 - tail))
    return [None if lo == 0.0 else lo, None if math.isinf(hi) else hi]


def multiplier(rungs: list[list[dict]], candidate: list[dict], multiples: list[float]) -> dict:
    """The candidate's compute multiplier against the ladder (rungs in increasing multiples):
    value, bound (None, ">" or "<"), ci (bootstrap; None when a group has one seed), p (a
    bound's one-sided Welch test against the top or lowest rung's finals), and with 3 rungs or
    more the power law's fit and its multiplier (`extrapolated` outside the ladder's tokens)."""
    tokens, losses = points(rungs)
    cand_t = mean_sd([r["tokens"] for r in candidate])[0]
    finals = [r["val_loss"] for r in candidate]
    cand_l = mean_sd(finals)[0]
    t, bound = tokens_for(tokens, losses, cand_l)
    out = {"value": t / cand_t, "bound": bound, "ci": None, "p": None}
    out["rungs"] = [
        {"multiple": m, "tokens": tk, "val_loss": lo, "seeds": len(rung)}
        for m, tk, lo, rung in zip(multiples, tokens, losses, rungs, strict=True)
    ]
    if bound is not None:  # the test at the bound: below the top rung, or above the lowest
        edge = rungs[-1] if bound == ">" else rungs[0]
        out["p"] = one_sided_p(finals, [r["val_loss"] for r in edge], below=bound == ">")
    if all(len(g) > 1 for g in (*rungs, candidate)):
        out["ci"] = bootstrap(rungs, candidate)
    fit = fit_power_law(tokens, losses)
    out["fit"] = fit
    if fit is not None:
        d = fit_tokens(fit, cand_l)
        out["fit_value"] = None if d is None else d / cand_t
        out["fit_extrapolated"] = d is None or not tokens[0] <= d <= tokens[-1]
    return out
