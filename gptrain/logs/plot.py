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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    out = Path(out or Path(run_dir) / "loss.png")
    hella = [
        (r["tokens"], r["hellaswag_acc"], r["hellaswag_acc_norm"])
        for r in rows
        if "hellaswag_acc_norm" in r
    ]
    if hella:
        fig, (ax, hx) = plt.subplots(1, 2, figsize=(13, 5))
        tokens, acc, acc_norm = zip(*hella, strict=True)
        hx.plot(tokens, acc_norm, "o-", label="HellaSwag acc_norm")
        hx.plot(tokens, acc, "s--", label="HellaSwag acc")
        hx.axhline(0.25, color="gray", lw=0.8, label="chance")
        hx.set_xlabel("tokens")
        hx.set_ylabel("accuracy")
        hx.grid(alpha=0.3)
        hx.legend()
    else:
        fig, ax = plt.subplots(figsize=(8, 5))
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
    fig.tight_layout()
    tmp = out.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out)
    return out
