"""The search of benchmarks/study/tune.py (docs/study.md): a coordinate search on a lattice per axis,
the same rule for every arm, and `tune`, which runs every arm's search to the same count.

    Axis(name, center, step, scale, lo, hi, choices)   one hyperparameter's lattice
    Search(axes)                                       one arm's trials; propose() the next
    tune(searches, trial, budget, cap, after, jobs)    every arm's search, equal trials
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

MAX_REFINE = 6  # halvings of an axis's spacing around the best


@dataclass(frozen=True)
class Axis:
    name: str
    center: float
    step: float  # log: a factor; lin: an increment; cat: unused
    scale: str = "log"  # log | lin | cat
    lo: float = -math.inf  # lin: the lowest value allowed
    hi: float = math.inf
    choices: tuple[float, ...] = ()  # cat: every value


def _mid(axis: Axis, a: float, b: float) -> float:
    return math.sqrt(a * b) if axis.scale == "log" else (a + b) / 2


def _past(axis: Axis, value: float, side: int) -> float | None:
    """One base step past `value` on `side` (-1 down, +1 up), stopping at a bound; None when
    `value` is the bound."""
    if axis.scale == "log":
        return value * axis.step**side
    bound = axis.lo if side < 0 else axis.hi
    if value == bound:
        return None
    nxt = round(value + side * axis.step, 10)
    return min(nxt, bound) if side > 0 else max(nxt, bound)


@dataclass
class Search:
    """The coordinate search of one arm over its results so far (point -> val loss)."""

    axes: tuple[Axis, ...]
    results: dict[tuple[float, ...], float] = field(default_factory=dict)
    order: list[tuple[float, ...]] = field(default_factory=list)

    def __post_init__(self):
        self.values = {a.name: sorted(a.choices) if a.choices else [a.center] for a in self.axes}

    def record(self, point: tuple[float, ...], loss: float) -> None:
        self.results[point] = loss if math.isfinite(loss) else math.inf
        self.order.append(point)
        for axis, value in zip(self.axes, point, strict=True):
            if value not in self.values[axis.name]:
                self.values[axis.name] = sorted([*self.values[axis.name], value])

    def best(self) -> tuple[float, ...] | None:
        """The lowest loss so far; the earlier trial on a tie."""
        return min(self.order, key=lambda p: self.results[p]) if self.order else None

    def _with(self, point, i: int, value: float) -> tuple[float, ...]:
        return (*point[:i], value, *point[i + 1 :])

    def _neighbours(self, i: int, point) -> list[tuple[float, ...]]:
        """The points next to `point` on axis i (every other value on a categorical axis)."""
        axis, vals = self.axes[i], self.values[self.axes[i].name]
        if axis.scale == "cat":
            return [self._with(point, i, v) for v in vals if v != point[i]]
        k = vals.index(point[i])
        near = [vals[k - 1]] if k > 0 else []
        near += [vals[k + 1]] if k + 1 < len(vals) else []
        return [self._with(point, i, v) for v in near]

    def position(self, i: int) -> str:
        """Where the best sits on axis i among the points tried on its line (the best with only
        axis i changed): inside (tried on both sides; every value of a categorical axis), at a
        bound (nothing can be tried past it), or at an edge."""
        best, axis = self.best(), self.axes[i]
        line = [p[i] for p in self.order if self._with(best, i, p[i]) == p and p != best]
        if axis.scale == "cat":
            return "inside" if set(line) | {best[i]} == set(axis.choices) else "edge"
        where = "inside"
        for side in (-1, 1):
            if not any((v - best[i]) * side > 0 for v in line):
                if _past(axis, best[i], side) is not None:
                    return "edge"
                where = "bound"
        return where

    def at_edge(self) -> bool:
        return self.best() is not None and any(
            self.position(i) == "edge" for i in range(len(self.axes))
        )

    def _fill(self) -> tuple[float, ...] | None:
        """The best's first missing neighbour, extending an axis at whose end the best sits."""
        best = self.best()
        for i, axis in enumerate(self.axes):
            vals = self.values[axis.name]
            if axis.scale != "cat":
                for side, end in ((-1, vals[0]), (1, vals[-1])):
                    past = _past(axis, end, side) if best[i] == end else None
                    if past is not None:
                        self.values[axis.name] = sorted([*vals, past])
                        vals = self.values[axis.name]
            for n in self._neighbours(i, best):
                if n not in self.results:
                    return n
        return None

    def _refine(self) -> bool:
        """Halve the spacing around the best on the least refined numeric axis; False if none."""
        best, levels = self.best(), []
        for i, axis in enumerate(self.axes):
            if axis.scale == "cat":
                continue
            vals = self.values[axis.name]
            k = vals.index(best[i])
            gaps = [(vals[j], best[i]) for j in (k - 1, k + 1) if 0 <= j < len(vals)]
            unit = math.log(axis.step) if axis.scale == "log" else axis.step
            width = [abs(math.log(a / b)) if axis.scale == "log" else abs(a - b) for a, b in gaps]
            level = round(math.log2(unit / max(width))) if width else MAX_REFINE
            if level < MAX_REFINE:
                levels.append((level, i, gaps))
        if not levels:
            return False
        _, i, gaps = min(levels)
        axis = self.axes[i]
        mids = [round(_mid(axis, a, b), 12) for a, b in gaps]
        self.values[axis.name] = sorted({*self.values[axis.name], *mids})
        return True

    def propose(self, refine: bool = True) -> tuple[float, ...] | None:
        """The next point to try; None when there is none (refine=False: only edges and
        neighbours, no refinement)."""
        if not self.order:
            return tuple(a.center for a in self.axes)
        while True:
            if (point := self._fill()) is not None:
                return point
            if not refine or not self._refine():
                return None


def tune(
    searches: dict[str, Search], trial, budget: int, cap: int, after=None, jobs: int = 1
) -> dict[str, int]:
    """Run every arm's search with `trial(arm, point) -> loss` (then `after()`, when given);
    returns each arm's trial count. Phase 1: `budget` trials each; phase 2: an arm at an edge gets
    trials that only extend and fill, up to `budget + cap` in all; phase 3: every arm is brought to
    the largest count. A trial of phase 3 can move an arm's best to a point at an edge, so phases
    2 and 3 repeat until no arm below `budget + cap` is at an edge (each round adds a trial, so it
    ends). An arm's search depends on its own results only, so `jobs` arms run side by side
    (threads, each trial its own process) and propose the same trials as one at a time."""
    lock = threading.Lock()

    def step(arm: str, refine: bool) -> bool:
        with lock:
            point = searches[arm].propose(refine)
        if point is None:
            return False
        loss = trial(arm, point)
        with lock:
            searches[arm].record(point, loss)
            if after:
                after()
        return True

    def edged(arm: str) -> bool:
        s = searches[arm]
        return len(s.order) < budget + cap and s.at_edge()

    def first(arm: str) -> bool:  # one trial of phases 1 and 2; False when the arm is through
        if len(searches[arm].order) < budget:
            return step(arm, True) or first(arm)
        return edged(arm) and step(arm, False)

    def level(arm: str, most: int) -> bool:
        return len(searches[arm].order) < most and step(arm, True)

    arms = list(searches)
    while True:
        _each(first, arms, jobs)
        most = max(len(s.order) for s in searches.values())
        _each(lambda arm, most=most: level(arm, most), arms, jobs)
        if not any(edged(arm) for arm in arms):
            return {arm: len(s.order) for arm, s in searches.items()}


def _each(fn, arms: list[str], jobs: int) -> None:
    """fn(arm), one trial, until it returns False, for every arm: `jobs` trials at a time, each
    worker taking the first arm with no trial in progress; the first exception is raised after
    the trials in progress end."""
    if jobs <= 1:
        for arm in arms:
            while fn(arm):
                pass
        return
    lock, idle = threading.Lock(), list(arms)

    def work() -> None:
        while True:
            with lock:
                if not idle:
                    return
                arm = idle.pop(0)
            if fn(arm):
                with lock:
                    idle.append(arm)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for future in [pool.submit(work) for _ in range(jobs)]:
            future.result()
