"""The meter: it says when a step is logged (every log.every steps, and with every evaluation,
save or stop), measures the steps since the last logged one (the loop's only host syncs: loss,
gradient norm, tokens/s, MFU), and reports them (metrics.jsonl and trackers, train.log, the
progress bar). Throughput intervals exclude evaluation, sampling and checkpoints: an interval is
measured before its step's save and evaluations, and the next one starts after them, when the
step is reported (a step that saves or evaluates is always logged).

MFU divides by the peak measured at start-up (printed in the first line), the same number for
every report: an interval whose achieved FLOP/s exceed it reports MFU 1.0, with a warning the
first time (checked_mfu); the peak is never moved.

A logged step's training metrics are measured before its checkpoint is written and logged after
its evaluation; `carry` puts them in that checkpoint's meta.json ("logged"), so that a run killed
in between logs them from there when it is completed (`carried`)."""

from __future__ import annotations

import time

from tqdm import tqdm

from gptrain.config.sections import TrainConfig
from gptrain.distributed import parallelize
from gptrain.distributed import runtime as dist
from gptrain.distributed.runtime import DistInfo
from gptrain.logs.mfu import checked_mfu, synchronize

# the training metrics of a logged step (metrics.jsonl keys; spikes and rollbacks where their
# policy is on), in the order `measure` writes them
TRAIN_KEYS = ("loss", "lr", "grad_norm", "tokens", "tok_per_s", "mfu", "skipped", "train_s")
OPTIONAL_KEYS = ("spikes", "rollbacks")

clock = time.perf_counter  # the throughput clock (a test may replace it)


class Meter:
    def __init__(self, log_every: int, t: TrainConfig, flops_per_token: float, info: DistInfo):
        self.log_every, self.tokens_per_step, self.max_steps = (
            log_every,
            t.total_batch_size,
            t.max_steps,
        )
        self.flops_per_token, self.info = flops_per_token, info
        # the rollback and spike counters are logged where their policy can move them
        self.rollbacks = t.nonfinite == "rollback" or t.spike != "off"
        self.spikes = t.spike != "off"
        self.peak = 1.0  # measured peak FLOP/s of this device (main process)
        self.logger = None  # the run's logger, set once it exists
        self.bar: tqdm | None = None  # the progress bar (main process, log.progress)
        self.last: dict = {}  # the latest logged metrics and evaluation results
        self._capped = False  # an MFU above 1 was reported (and warned about) in this process
        self._steps, self._since = 0, clock()

    def due(self, step: int, last_step: bool, saves: bool = False) -> bool:
        """Every log.every steps, the last step, and a step that saves (its interval ends before
        the save; the caller adds the steps that evaluate)."""
        return last_step or saves or step % self.log_every == 0

    def restart(self, step: int) -> None:
        """A new throughput interval (the loop starts, or a rollback moved the step back)."""
        self._steps, self._since = 0, clock()
        if self.bar:
            self.bar.n = step

    def measure(self, state, loss_sum, grad_norm, lr: float) -> dict:
        """Collective: the metrics of the steps since the last logged one."""
        loss = dist.all_reduce_mean(loss_sum).item()  # mean over micro-steps and ranks
        grad_norm = parallelize.full_value(grad_norm)
        synchronize(self.info.device)
        tok_per_s = self._steps * self.tokens_per_step / (clock() - self._since)
        # MFU <= 1 against the start-up peak: above it, 1.0 and a warning (once)
        world = self.info.world_size
        mfu, _, warning = checked_mfu(tok_per_s, self.flops_per_token, self.peak, world)
        if warning and not self._capped:
            self._capped = True
            self.logger.text(
                f"warning: step {state.step}: {warning}; said once, later intervals above the peak report MFU 100% too"
            )
        metrics = {
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm.item(),
            "tokens": state.tokens,
            "tok_per_s": tok_per_s,
            "mfu": mfu,
            "skipped": state.nonfinite.count(),
            "train_s": state.train_s,  # optimizer steps only (train.time_budget's clock)
        }
        if self.spikes:
            metrics["spikes"] = state.spikes.count
        if self.rollbacks:
            metrics["rollbacks"] = state.rollbacks
        return metrics

    def tick(self) -> None:
        """After each step (the bar moves; the interval counts it)."""
        self._steps += 1
        if self.bar:
            self.bar.update(1)

    def report(self, step: int, m: dict) -> None:
        """metrics.jsonl and trackers, the progress bar and train.log's line; a new interval. (A
        completed run's final row may lack the training metrics: then no line.)"""
        self.logger.log(step, m)
        self.last.update(m)
        self._steps, self._since = 0, clock()
        if "loss" not in m:
            return
        if self.bar:
            self.bar.set_postfix(
                loss=f"{m['loss']:.3f}",
                lr=f"{m['lr']:.2e}",
                tok_s=f"{m['tok_per_s']:,.0f}",
                mfu=f"{m['mfu']:.1%}",
            )
        self.logger.text(
            f"step {step}/{self.max_steps} loss {m['loss']:.4f} lr {m['lr']:.2e} "
            f"tok/s {m['tok_per_s']:,.0f} mfu {m['mfu']:.1%}",
            echo=self.bar is None,
        )


def carry(step: int, metrics: dict | None) -> dict | None:
    """What a checkpoint's meta.json keeps of its step's training metrics ("logged"): the row
    `measure` returned for the step (None on a step that is not logged)."""
    return None if metrics is None else {"step": step, **metrics}


def carried(logged, step: int, tokens: int) -> tuple[dict, str]:
    """A checkpoint's "logged" entry read back as data: (the step's training metrics, "") when
    it is the row of `step` at `tokens` with numbers under the meter's keys only; else ({}, what
    is wrong with it)."""
    if logged is None:
        return {}, "its checkpoint does not record them"
    if not isinstance(logged, dict) or logged.get("step") != step:
        return {}, f"its checkpoint's record is not a row of step {step}"
    row = {k: v for k, v in logged.items() if k != "step"}
    missing = [k for k in TRAIN_KEYS if k not in row]
    unknown = [k for k in row if k not in TRAIN_KEYS + OPTIONAL_KEYS]
    bad = [k for k, v in row.items() if type(v) not in (int, float)]
    if missing or unknown or bad:
        return (
            {},
            f"its checkpoint's record is malformed (missing {missing}, unknown {unknown}, not numbers {bad})",
        )
    if row["tokens"] != tokens:
        return {}, f"its checkpoint's record counts {row['tokens']} tokens, not {tokens}"
    return row, ""
