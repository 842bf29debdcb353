"""How a race is shown: the markdown table `gptrain race` prints (one row per config, then a
legend naming the target and the methods) and race.png (val loss against tokens and against
training seconds: each run a thin line, each config's mean a thick one). Both read the dict that
gptrain/logs/race.py's `analyse` returns, which is race.json.
"""

from __future__ import annotations

from pathlib import Path

from gptrain.logs.race import METHODS, mean_curve

SI_PREFIXES = (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3))


def _si(x: float | None, unit: str = "") -> str:
    """1234567 -> 1.23M (three significant digits)."""
    if x is None:
        return "—"
    for prefix, scale in SI_PREFIXES:
        if abs(x) >= scale:
            return f"{x / scale:.3g}{prefix}{unit}"
    return f"{x:.3g}{unit}"


def _p(p: float | None) -> str:
    return "" if p is None else f" p={p:.2g}"


def _stats(s: dict | None, fmt) -> str:
    if s is None:
        return "—"
    return fmt(s["mean"]) if s["sd"] is None else f"{fmt(s['mean'])} ± {fmt(s['sd'])}"


def _interval(ci: list | None, fmt) -> str:
    if ci is None:
        return ""
    lo, hi = ci
    return f" [{fmt(lo)}, {'open' if hi is None else fmt(hi)}]"


def _reach_cell(t: dict, fmt) -> str:
    if t["reached"] == t["of"]:
        return _stats(t["stats"], fmt)
    curve = "not reached" if t["mean_curve"] is None else f"mean curve {fmt(t['mean_curve'])}"
    return f"{curve} ({t['reached']}/{t['of']} reached)"


def _ratio_cell(t: dict, is_base: bool) -> str:
    if is_base:
        return "1×"
    v = t.get("vs_baseline")
    if v is None:
        return "—"

    def fmt(x):
        return f"{x:.3g}"

    note = " (censored: mean curves)" if v.get("censored") else ""
    return f"{fmt(v['ratio'])}×{_interval(v['ci'], fmt)}{_p(v['p'])}{note}"


def _x(x: float | None) -> str:
    return "open" if x is None else f"{x:.3g}×"


def multiplier_cell(m: dict, ladder: bool) -> str:
    """The compute multiplier: a rung's own multiple; the ladder's value and its interval; a
    bound (beyond the top rung, below the lowest) with its one-sided p."""
    if "rung" in m:
        return f"rung {m['rung']:g}×" if ladder else "1× (baseline)"
    where = {">": "beyond the top rung", "<": "below the lowest rung"}
    if not ladder:
        where = {">": "below the baseline's final loss", "<": "above the baseline's final loss"}
    if m["bound"] is not None:
        return f"{m['bound']} {_x(m['value'])}{_p(m['p'])} ({where[m['bound']]})"
    ci = "" if m["ci"] is None else f" [{_x(m['ci'][0])}, {_x(m['ci'][1])}]"
    return f"{_x(m['value'])}{ci}"


def fit_cell(m: dict) -> str:
    """The power law's multiplier, marked where it extrapolates beyond the ladder."""
    if "rung" in m or m.get("fit") is None:
        return "—"
    if m["fit_value"] is None:
        return "below the fit's floor E"
    return f"{_x(m['fit_value'])}" + (" (extrapolated)" if m["fit_extrapolated"] else "")


def markdown_table(race: dict) -> str:
    """One row per config, then a legend naming the target and the methods."""
    target = race["target"]
    hellaswag = any("hellaswag_acc_norm" in c for c in race["configs"])
    ladder = bool(race.get("ladder"))
    fit = ladder and len(race["ladder"]) >= 3
    head = [
        "config",
        "runs",
        "val loss",
        "Δ vs baseline",
        "bits/byte",
        f"tokens to {target:.4g}",
        "× baseline",
        f"seconds to {target:.4g}",
        "× baseline",
        f"FLOPs to {target:.4g}",
        "compute multiplier (ladder)" if ladder else "compute multiplier (bound)",
    ]
    head += ["fit L(D)"] if fit else []
    head += ["below unigram"] if race.get("unigram") else []
    head += ["HellaSwag"] if hellaswag else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in race["configs"]:
        runs = f"{c['runs']}" + (f" ({c['failed']} failed)" if c.get("failed") else "")
        if not c["runs"]:
            lines.append(f"| {c['label']} | {runs} |" + " — |" * (len(head) - 2))
            continue
        row = _row(c, runs, c["label"] == race["baseline"], ladder)
        if fit:
            row.append(fit_cell(c["compute_multiplier"]))
        if race.get("unigram"):
            early = " **early regime**" if c.get("early_regime") else ""
            row.append(f"{c['below_unigram']:.3f}{early}")
        if hellaswag:
            row.append(_stats(c.get("hellaswag_acc_norm"), lambda x: f"{x:.4f}"))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines + _legend(race, ladder))


def _row(c: dict, runs: str, is_base: bool, ladder: bool) -> list[str]:
    """A config's cells from its label to its compute multiplier."""
    d = c.get("val_loss_vs_baseline")
    delta = (
        "—"
        if d is None
        else f"{d['diff']:+.4f}{_interval(d['ci'], lambda x: f'{x:+.4f}')}{_p(d['p'])}"
    )
    return [
        c["label"],
        runs,
        _stats(c["val_loss"], lambda x: f"{x:.4f}"),
        delta,
        _stats(c["val_bpb"], lambda x: f"{x:.4f}"),
        _reach_cell(c["tokens_to_target"], _si),
        _ratio_cell(c["tokens_to_target"], is_base),
        _reach_cell(c["seconds_to_target"], lambda x: f"{x:.3g} s"),
        _ratio_cell(c["seconds_to_target"], is_base),
        _reach_cell(c["flops_to_target"], _si),
        multiplier_cell(c["compute_multiplier"], ladder),
    ]


def _legend(race: dict, ladder: bool) -> list[str]:
    """The lines under the table: the target, the methods, the unigram reference."""
    target, base, level = race["target"], race["baseline"], f"{race['level']:.0%}"
    lines = [
        "",
        f"Target: val loss {target:.4f} ({race['target_from']}); baseline: {base}. Mean ± sd over seeds; intervals are {level}.",
        f"p: {METHODS['p']}. × baseline: ratio of means, {METHODS['ratio_ci']}; shown from the mean curves without an interval when a run did not reach the target (censored).",
        _multiplier_legend(race, ladder),
        f"Seconds: {METHODS['seconds']}.",
    ]
    if u := race.get("unigram"):
        lines.append(
            f"Below unigram: nats of val loss below {u['nats']:.4f}, the val tokens' cross-entropy under the train split's unigram counts ({u['val_tokens']:,} val tokens, {u['train_tokens']:,} train tokens, {u['smoothing']}). A baseline less than 1 nat below it is marked early regime: its loss is still mostly token frequencies, and a recipe's lead there need not hold later in training."
        )
    return lines


def _multiplier_legend(race: dict, ladder: bool) -> str:
    if not ladder:
        return "Compute multiplier (bound): without a ladder (--ladder) the baseline is one rung, read only where its schedule ended: a config ending below its mean final val loss shows > the baseline's mean tokens over the config's, one ending above it <, each with the one-sided Welch p-value of the two configs' final losses."
    rungs = ", ".join(f"{label} ({m:g}×)" for label, m in race["ladder"].items())
    methods = {c["compute_multiplier"].get("interval") for c in race["configs"] if "compute_multiplier" in c} - {None}  # fmt: skip
    return (
        f"Compute multiplier (ladder: {rungs}): {METHODS['compute_multiplier']}. Interval ({'; '.join(sorted(methods)) or 'none'}): {METHODS['compute_multiplier_ci']}."
        + (f" fit L(D): {METHODS['fit']}." if len(race["ladder"]) >= 3 else "")
    )


def plot_race(race: dict, path: str | Path) -> Path:
    """race.png: val loss against tokens and against training seconds; each run a thin line,
    each config's mean a thick one, the target dashed."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    fig = Figure(figsize=(13, 5))  # and its Agg canvas below, no pyplot (as logs/plot.py)
    axes = fig.subplots(1, 2)
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, c in enumerate(race["configs"]):
        color = colors[i % len(colors)]
        runs = [r for r in race["runs"] if r["config"] == c["label"] and r["status"] == "done"]
        for ax, axis in zip(axes, ("tokens", "seconds"), strict=True):
            for r in runs:
                ax.plot(r["curve"][axis], r["curve"]["val_loss"], color=color, lw=0.8, alpha=0.35)
            if runs:
                ax.plot(
                    *mean_curve([r["curve"] for r in runs], axis),
                    color=color,
                    lw=2.5,
                    label=f"{c['label']} (mean of {len(runs)})",
                )
    for ax, xlabel in zip(axes, ("tokens", "training seconds"), strict=True):
        ax.axhline(
            race["target"], color="gray", ls="--", lw=1, label=f"target {race['target']:.4g}"
        )
        ax.set_xlabel(xlabel)
        ax.set_ylabel("val loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
    later = [y for r in race["runs"] if r["status"] == "done" for y in r["curve"]["val_loss"][1:]]
    if later:  # the untrained model's loss (step 0) would squeeze the rest of the curves
        for ax in axes:
            ax.set_ylim(top=max(later) + 0.05 * (max(later) - min(later) + 1e-9))
    fig.subplots_adjust(left=0.06, right=0.985, bottom=0.11, top=0.97, wspace=0.18)  # one draw
    tmp = path.with_suffix(".tmp.png")
    FigureCanvasAgg(fig)
    fig.savefig(tmp, dpi=100)
    tmp.replace(path)
    return path
