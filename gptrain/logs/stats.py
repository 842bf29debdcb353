"""Statistics for comparing training runs across seeds, in plain Python (no SciPy):

    student_t_cdf(t, df)      the Student t distribution, through the regularized incomplete beta
    student_t_ppf(q, df)      its quantiles (bisection on the CDF)
    welch(a, b)               Welch's unequal-variance t-test of mean(a) - mean(b): t, df, the
                              two-sided p-value and the difference's confidence interval
    ratio_ci(a, b)            mean(a) / mean(b) with Fieller's confidence interval under Welch's
                              test: the ratios r for which the test of mean(a) - r * mean(b) = 0
                              does not reject, so the interval excludes 1 exactly when Welch's
                              test of a against b rejects at the same level

Every function takes the seeds' values as sequences of floats; sd is the sample standard
deviation (n - 1). tests/test_race.py checks them against closed forms, mpmath and SciPy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

_EPS = 1e-15  # relative accuracy of the continued fraction
_TINY = 1e-300  # keeps the continued fraction's denominators off zero (modified Lentz)
_NORMAL_DF = 1e7  # above this many degrees of freedom the t distribution is the normal one


def mean_sd(xs: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (nan for fewer than two values)."""
    n = len(xs)
    m = math.fsum(xs) / n
    sd = math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (n - 1)) if n > 1 else math.nan
    return m, sd


def betainc(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function (a, b > 0, 0 <= x <= 1).

    I_x(a, b) = x^a (1-x)^b / (a B(a, b)) * 1 / (1 + d1 / (1 + d2 / (1 + ...))) with
    d(2m+1) = -(a+m)(a+b+m) x / ((a+2m)(a+2m+1)) and d(2m) = m(b-m) x / ((a+2m-1)(a+2m)),
    evaluated by the modified Lentz method. It converges fast for x < (a+1)/(a+b+2); above
    that, I_x(a, b) = 1 - I_(1-x)(b, a)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - betainc(b, a, 1.0 - x)
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    return math.exp(log_front) * _beta_fraction(a, b, x) / a


def _beta_fraction(a: float, b: float, x: float) -> float:
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    f = d
    for m in range(1, 100_000):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),  # d(2m)
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),  # d(2m+1)
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > _TINY else _TINY)
            c = 1.0 + numerator / c
            c = c if abs(c) > _TINY else _TINY
            f *= c * d
        if abs(c * d - 1.0) < _EPS:
            return f
    raise ArithmeticError(f"incomplete beta I_{x}({a}, {b}) did not converge")


def student_t_sf2(t: float, df: float) -> float:
    """P(|T| >= |t|) for T ~ Student t with df degrees of freedom: the two-sided p-value,
    I_(df / (df + t^2))(df / 2, 1 / 2), which keeps its relative accuracy far into the tail."""
    if math.isnan(t):
        return math.nan
    if math.isinf(t):
        return 0.0
    if df > _NORMAL_DF:
        return math.erfc(abs(t) / math.sqrt(2.0))
    return betainc(df / 2.0, 0.5, df / (df + t * t))


def student_t_cdf(t: float, df: float) -> float:
    """P(T <= t) for T ~ Student t with df (> 0, not necessarily whole) degrees of freedom."""
    tail = 0.5 * student_t_sf2(t, df)
    return tail if t < 0 else 1.0 - tail


def student_t_ppf(q: float, df: float) -> float:
    """The t with P(T <= t) = q (0 < q < 1), by bisection on the CDF to double precision."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"quantile {q} is outside (0, 1)")
    if q < 0.5:
        return -student_t_ppf(1.0 - q, df)
    lo, hi = 0.0, 1.0
    while student_t_cdf(hi, df) < q:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if student_t_cdf(mid, df) < q else (lo, mid)
    return (lo + hi) / 2.0


@dataclass(frozen=True)
class Welch:
    """Welch's t-test of mean(a) - mean(b) = 0 (the variances not assumed equal)."""

    diff: float  # mean(a) - mean(b)
    se: float  # sqrt(var(a) / n_a + var(b) / n_b)
    df: float  # Welch-Satterthwaite degrees of freedom
    t: float
    p: float  # two-sided

    def ci(self, level: float = 0.95) -> tuple[float, float]:
        """The confidence interval of the difference of means."""
        half = student_t_ppf(0.5 + level / 2.0, self.df) * self.se
        return self.diff - half, self.diff + half


def welch(a: Sequence[float], b: Sequence[float]) -> Welch:
    """Welch's two-sided t-test; each sample needs two values or more. Two samples without any
    spread give t = 0, p = 1 when their means are equal and t = +-inf, p = 0 when not."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError(
            f"Welch's test needs 2 values or more per sample, got {len(a)} and {len(b)}"
        )
    (ma, sa), (mb, sb) = mean_sd(a), mean_sd(b)
    va, vb = sa * sa / len(a), sb * sb / len(b)
    diff, se = ma - mb, math.sqrt(va + vb)
    if se == 0.0:
        t = 0.0 if diff == 0.0 else math.copysign(math.inf, diff)
        return Welch(diff, 0.0, len(a) + len(b) - 2.0, t, 1.0 if diff == 0.0 else 0.0)
    df = (va + vb) ** 2 / (va * va / (len(a) - 1) + vb * vb / (len(b) - 1))
    t = diff / se
    return Welch(diff, se, df, t, student_t_sf2(t, df))


@dataclass(frozen=True)
class Ratio:
    """mean(a) / mean(b) and its confidence interval; hi is None where the interval is open."""

    value: float
    lo: float | None
    hi: float | None


def ratio_ci(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> Ratio:
    """mean(a) / mean(b) for positive quantities (tokens, seconds, FLOPs) with Fieller's interval:
    the r where |mean(a) - r mean(b)| / sqrt(var(a)/n_a + r^2 var(b)/n_b) stays within the t
    quantile at that r's Welch-Satterthwaite degrees of freedom. Each side's bound is found by
    bisection (the statistic grows monotonically away from the estimate for positive means)."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError(
            f"a ratio's interval needs 2 values or more per sample, got {len(a)} and {len(b)}"
        )
    (ma, sa), (mb, sb) = mean_sd(a), mean_sd(b)
    if ma <= 0.0 or mb <= 0.0:
        raise ValueError("ratio_ci is for positive quantities")
    va, vb, na, nb = sa * sa / len(a), sb * sb / len(b), len(a), len(b)
    value = ma / mb

    def accepted(r: float) -> bool:
        var = va + r * r * vb
        if var == 0.0:
            return ma == r * mb
        df = var * var / (va * va / (na - 1) + (r * r * vb) ** 2 / (nb - 1))
        return abs(ma - r * mb) / math.sqrt(var) <= student_t_ppf(0.5 + level / 2.0, df)

    lo = 0.0 if accepted(0.0) else bisect_boundary(accepted, value, 0.0)
    far = value
    for _ in range(64):  # doubling until rejected; never rejected: the interval is open
        far *= 2.0
        if not accepted(far):
            return Ratio(value, lo, bisect_boundary(accepted, value, far))
    return Ratio(value, lo, None)


def bisect_boundary(inside: Callable[[float], bool], a: float, b: float, steps: int = 100) -> float:
    """The point between a (inside) and b (outside) where `inside` turns false."""
    for _ in range(steps):
        mid = (a + b) / 2.0
        if mid in (a, b):
            break
        a, b = (mid, b) if inside(mid) else (a, mid)
    return (a + b) / 2.0
