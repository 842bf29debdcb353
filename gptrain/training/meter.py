"""The meter: it says when a step is logged (every log.every steps, and with every evaluation,
save or stop), measures the steps since the last logged one (the loop's only host syncs: loss,
gradient norm, tokens/s, MFU), and reports them (metrics.jsonl and trackers, train.log, the
progress bar). Throughput intervals exclude evaluation, sampling and checkpoints."""

from __future__ import annotations

import time

from tqdm import tqdm

from gptrain.config.sections import TrainConfig
from gptrain.distributed import parallelize
from gptrain.distributed import runtime as dist
from gptrain.distributed.runtime import DistInfo
from gptrain.logs.mfu import checked_mfu, synchronize


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
        self._steps, self._since = 0, time.perf_counter()

    def due(self, step: int, last_step: bool) -> bool:
        return last_step or step % self.log_every == 0

    def restart(self, step: int) -> None:
        """A new throughput interval (the loop starts, or a rollback moved the step back)."""
        self._steps, self._since = 0, time.perf_counter()
        if self.bar:
            self.bar.n = step

    def measure(self, state, loss_sum, grad_norm, lr: float) -> dict:
        """Collective: the metrics of the steps since the last logged one."""
        loss = dist.all_reduce_mean(loss_sum).item()  # mean over micro-steps and ranks
        grad_norm = parallelize.full_value(grad_norm)
        synchronize(self.info.device)
        tok_per_s = self._steps * self.tokens_per_step / (time.perf_counter() - self._since)
        # MFU <= 1: an achieved rate above the measured peak raises the peak, with a warning
        world = self.info.world_size
        mfu, self.peak, warning = checked_mfu(tok_per_s, self.flops_per_token, self.peak, world)
        if warning:
            self.logger.text(f"warning: step {state.step}: {warning}")
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
        """metrics.jsonl and trackers, the progress bar and train.log's line; a new interval."""
        self.logger.log(step, m)
        self.last.update(m)
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
        self._steps, self._since = 0, time.perf_counter()
