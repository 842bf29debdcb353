"""Where a run's metrics and text go: one tiny interface, main process only.

`log(step, metrics: dict)`, `text(line)`, `close()`. The main process gets a RunLogger
(metrics.jsonl, train.log, the console, and optionally TensorBoard and Weights & Biases); the other
ranks get a NullLogger that does nothing.

Resume and a mid-run rollback (`rewind`) keep every sink showing the redone values: metrics.jsonl
rows past the step are dropped (`rewind_metrics`; all rows when a run that crashed before its first
checkpoint starts over), TensorBoard hides the same events (a writer reopened with `purge_step`),
and W&B, whose own step must only increase, plots every metric against `trainer/step` (a custom
x-axis, `define_metric`): each row is sent with its training step there, so redone steps are sent
again under their own numbers and the last row for a step is the one that counts. A resumed run
continues the same W&B run (its id is kept in run.dir/wandb_run_id).

In TensorBoard and W&B the curves are grouped by `tracker_key` (`train/loss`, `val/loss`,
`hellaswag/acc_norm`, ...) against the step; metrics.jsonl keeps the flat keys. At the end,
`scorecard` records the run's settings with its results (TensorBoard hparams, W&B run summary).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from gptrain.config.sections import OptimConfig, TrainConfig
from gptrain.errors import UserError

WANDB_ID_FILE = "wandb_run_id"
WANDB_STEP = "trainer/step"  # W&B's x-axis: the training step (W&B's own step only increases)
GROUPS = ("val", "hellaswag")  # val_loss -> val/loss, hellaswag_acc -> hellaswag/acc; else train/


def tracker_key(key: str) -> str:
    """The grouped name a metrics.jsonl key gets in TensorBoard and W&B."""
    group, _, rest = key.partition("_")
    return f"{group}/{rest}" if group in GROUPS and rest else f"train/{key}"


def require_packages(tensorboard: bool, wandb_project: str) -> None:
    """The optional logging packages a config asks for are installed (checked on every rank at
    start-up, so a missing one is a one-line error everywhere, not a hang of the other ranks)."""
    for wanted, module, key in (
        (tensorboard, "tensorboard", "log.tensorboard = true"),
        (wandb_project, "wandb", f"log.wandb = {wandb_project!r}"),
    ):
        if wanted and not _importable(module):
            raise UserError(f"{key} needs the {module} package: pip install {module}")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules
        return False


def rewind_metrics(run_dir: str | Path, step: int) -> int:
    """Drop metrics.jsonl rows logged after `step` (a run that crashed after its last checkpoint
    redoes those steps when it resumes); the file is replaced atomically. Returns rows dropped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    kept = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:  # a line cut short by the crash
            continue
        if row.get("step", 0) <= step:
            kept.append(line)
    if len(kept) == len(lines):
        return 0
    tmp = path.with_name(".metrics.jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    return len(lines) - len(kept)


def best_val(run_dir: str | Path, best: dict) -> dict:
    """{best_val_loss, best_val_step}: the lowest val_loss among metrics.jsonl's rows and `best`
    (a checkpoint's record), so an eval that ran after its step's checkpoint still counts."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = path.read_text().splitlines() if path.is_file() else []
    for line in rows:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        loss = row.get("val_loss")
        if isinstance(loss, (int, float)) and loss < best.get("best_val_loss", float("inf")):
            best = {"best_val_loss": loss, "best_val_step": row.get("step", 0)}
    return best


class NullLogger:
    """What non-main ranks get: every call does nothing."""

    def log(self, step: int, metrics: dict) -> None:
        pass

    def text(self, line: str, echo: bool = True) -> None:
        pass

    def rewind(self, step: int) -> None:
        pass

    def scorecard(self, hparams: dict, metrics: dict) -> None:
        pass

    def close(self) -> None:
        pass


class RunLogger(NullLogger):
    """Main process: metrics.jsonl + train.log in the run directory, optional TensorBoard / W&B.

    `echo` is called with every text line (the progress bar's `write`, or print). `resume_step`
    is the checkpoint's step when the run resumes (None for a fresh run); `wandb_run_id` the W&B
    run the checkpoint belongs to (else run.dir's record of it). `.wandb_run_id`: the W&B run.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = False,
        wandb_project: str = "",
        config: dict | None = None,
        resume_step: int | None = None,
        wandb_run_id: str | None = None,
        echo=print,
    ):
        require_packages(tensorboard, wandb_project)
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        # rows of steps this run will log again: past the checkpoint, or all of them when a run
        # that crashed before its first checkpoint starts over
        rewind_metrics(self.dir, -1 if resume_step is None else resume_step)
        self.echo = echo
        self.tb = self.wandb = None
        self.wandb_run_id = None
        if wandb_project:
            self.wandb = self._start_wandb(wandb_project, config, resume_step, wandb_run_id)
            self.wandb_run_id = self.wandb.id
        if tensorboard:
            # events of the steps logged again (see above), written before a crash, are hidden
            self.tb = self._tensorboard(0 if resume_step is None else resume_step + 1)
        self.jsonl = open(self.dir / "metrics.jsonl", "a", buffering=1)
        self.textlog = open(self.dir / "train.log", "a", buffering=1)

    def _start_wandb(self, project: str, config: dict | None, resume_step: int | None, run_id):
        import wandb

        # a resumed run continues its W&B run; a fresh one (even in an old run.dir) starts anew
        id_file = self.dir / WANDB_ID_FILE
        if resume_step is None:
            run_id = None
        elif run_id is None and id_file.is_file():  # a checkpoint that does not name its run
            run_id = id_file.read_text().strip()
        try:
            run = wandb.init(
                project=project,
                dir=str(self.dir),
                config=config,
                id=run_id,
                resume="allow" if run_id else None,
            )
        except Exception as e:  # not logged in, unreachable server, bad project name, ...
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UserError(
                f"log.wandb = {project!r}: W&B did not start ({first}); run `wandb login`, or set WANDB_MODE=offline to log locally"
            ) from None
        if run_id is None or not id_file.is_file():
            tmp = id_file.with_name(f".{WANDB_ID_FILE}.tmp")
            tmp.write_text(run.id + "\n")
            os.replace(tmp, id_file)
        # W&B's own step only increases; the charts' x-axis is the training step, sent in each row
        run.define_metric(WANDB_STEP)
        run.define_metric("*", step_metric=WANDB_STEP)
        return run

    def _tensorboard(self, purge_step: int):
        """A SummaryWriter on run.dir/tb that hides earlier events of steps >= purge_step."""
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(self.dir / "tb"), purge_step=purge_step)

    def log(self, step: int, metrics: dict) -> None:
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        grouped = {tracker_key(k): v for k, v in metrics.items()}
        for key, value in grouped.items():
            if self.tb is not None and isinstance(value, (int, float)):
                self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log({WANDB_STEP: step, **grouped})

    def rewind(self, step: int) -> None:
        """A rollback redoes the steps after `step`: metrics.jsonl drops their rows, TensorBoard
        hides their events (a new writer with purge_step = step + 1); W&B needs nothing (the redone
        rows are sent under their own `trainer/step`, after the discarded ones)."""
        self.jsonl.close()
        rewind_metrics(self.dir, step)
        self.jsonl = open(self.dir / "metrics.jsonl", "a", buffering=1)
        if self.tb is not None:
            self.tb.close()
            self.tb = self._tensorboard(step + 1)

    def scorecard(self, hparams: dict, metrics: dict) -> None:
        """The run's settings with its results: TensorBoard's hparams table (metrics under
        `scorecard/`), and the W&B run summary (settings under `hparams/`)."""
        results = {f"scorecard/{k}": v for k, v in metrics.items()}
        if self.tb is not None:
            self.tb.add_hparams(hparams, results, run_name=".")
        if self.wandb is not None:
            self.wandb.summary.update(
                {**results, **{f"hparams/{k}": v for k, v in hparams.items()}}
            )

    def text(self, line: str, echo: bool = True) -> None:
        self.textlog.write(line + "\n")
        if echo:
            self.echo(line)

    def close(self) -> None:
        self.jsonl.close()
        self.textlog.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def scorecard_hparams(t: TrainConfig, o: OptimConfig, arch, tokens: int, train_tokens: int) -> dict:
    """The settings the trackers' scorecard (TensorBoard hparams, W&B summary) records.
    Peak lr and weight decay are read here only."""
    return {
        "optimizer": o.name,
        "peak_lr": o.lr,
        "weight_decay": o.weight_decay,
        "steps": t.max_steps,
        "n_layer": arch.n_layer,
        "n_embd": arch.n_embd,
        "seq_len": t.seq_len,
        "total_tokens": tokens,
        "epochs": tokens / max(train_tokens, 1),  # passes through the training split
    }


def scorecard_metrics(summary: dict) -> dict:
    """The scorecard's results: best val loss, final val bpb, final HellaSwag."""
    keys = {
        "best_val_loss": "best_val_loss",
        "val_bpb": "final_val_bpb",
        "hellaswag_acc": "hellaswag_acc",
        "hellaswag_acc_norm": "hellaswag_acc_norm",
    }
    return {new: summary[old] for old, new in keys.items() if old in summary}
