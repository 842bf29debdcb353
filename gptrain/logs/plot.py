"""`gptrain plot --run DIR`: train and validation loss (and HellaSwag, when scored) against tokens.

gptrain plot --run runs/debug            # writes runs/debug/loss.png
"""

from __future__ import annotations

import json
from pathlib import Path

from gptrain.errors import UserError


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise UserError(
            f"no metrics file {path}; pass --run with a run directory written by gptrain train"
        )
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise UserError(
                    f"{path}:{n} is not valid JSON; the file was edited or truncated"
                ) from None
    return rows


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write loss.png (train and val loss against tokens seen; HellaSwag accuracy in a second
    panel when the run scored it); returns its path."""
    # a Figure and its Agg canvas, no pyplot: nothing global to set up, close or leak
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = read_metrics(run_dir)
    out = Path(out or Path(run_dir) / "loss.png")
    hella = [
        (r["tokens"], r["hellaswag_acc"], r["hellaswag_acc_norm"])
        for r in rows
        if "hellaswag_acc_norm" in r
    ]
    if hella:
        fig = Figure(figsize=(13, 5))
        ax, hx = fig.subplots(1, 2)
        tokens, acc, acc_norm = zip(*hella, strict=True)
        hx.plot(tokens, acc_norm, "o-", label="HellaSwag acc_norm")
        hx.plot(tokens, acc, "s--", label="HellaSwag acc")
        hx.axhline(0.25, color="gray", lw=0.8, label="chance")
        hx.set_xlabel("tokens")
        hx.set_ylabel("accuracy")
        hx.grid(alpha=0.3)
        hx.legend()
    else:
        fig = Figure(figsize=(8, 5))
        ax = fig.subplots()
    train = [(r["tokens"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["tokens"], r["val_loss"]) for r in rows if "val_loss" in r]
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss")
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="val loss")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(Path(run_dir).name)
    ax.grid(alpha=0.3)
    ax.legend()
    # fixed margins that fit the labels: one draw, where a computed (tight) layout draws twice
    w = fig.get_figwidth()
    fig.subplots_adjust(left=0.8 / w, right=1 - 0.2 / w, bottom=0.11, top=0.93, wspace=0.18)
    tmp = out.with_suffix(".tmp.png")
    FigureCanvasAgg(fig)  # the figure's canvas: PNG through Agg
    fig.savefig(tmp, dpi=100)
    tmp.replace(out)
    return out
