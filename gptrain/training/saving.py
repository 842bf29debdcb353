"""The checkpointer: it says when a save is due (every N steps, every M minutes, the last step, an
agreed preemption stop), checks that the replicas agree (gptrain/distributed/replicas.py: a
mismatch stops every rank before anything is written, exit 5), saves (with checkpoint.async,
published at the next save), publishes
(rename into place, `latest`, retention) and rolls back (train.nonfinite or train.spike =
rollback: reload the newest valid checkpoint and move the data cursor past the bad batch).
Every checkpoint goes through checkpoint.manager.
"""

from __future__ import annotations

import time

from gptrain.checkpoint import manager as checkpoint
from gptrain.config.sections import CheckpointConfig
from gptrain.distributed import failures, replicas
from gptrain.distributed import runtime as dist
from gptrain.training.guards import NonFiniteStop, Preemption
from gptrain.training.state import TrainState


class Checkpointer:
    """Saves and restores the run's stateful parts: model, optimizer, loader and train state."""

    def __init__(
        self,
        c: CheckpointConfig,
        run_dir,
        info,
        parts: tuple,
        state: TrainState,
        meta,
        background,
        budget_s: float | None = None,
    ):
        self.c, self.run_dir, self.info, self.budget_s = c, run_dir, info, budget_s
        self.model, self.optimizer, self.loader = parts
        self.state, self.meta = state, meta  # meta: what every meta.json records beside counters
        self.background = background  # checkpoint.async, decided at start (background_saves)
        self.logger = None  # the run's logger, set once it exists
        self.best: dict = {}  # best_val_loss / best_val_step so far, recorded in meta.json
        self.pending: checkpoint.Pending | None = None  # a background save not yet published
        self._saved_at = time.monotonic()

    def due(self, step: int, last_step: bool, preemption: Preemption):
        """Collective: (save now, stop now, last step). One tiny all-reduce (TrainState.agree)
        agrees on a stop signal, a run-folder lock taken over (LockLost on every rank),
        checkpoint.every_minutes by any rank's clock and the training time (the maximum over
        the ranks); the time budget is then read from that agreed time, the same on every rank
        (`out_of_time`, from this rank's own time, can only be true where the agreed one is).
        The last step (train.max_steps or the budget spent) and a stop save."""
        every_s = self.c.every_minutes * 60
        timed = bool(every_s) and time.monotonic() - self._saved_at >= every_s
        stop, timed, lost = self.state.agree(
            preemption.received is not None, timed, preemption.lost is not None
        )
        preemption.stop_if_lost(lost)  # another job owns run.dir now: nothing more is written
        last_step = last_step or self.state.out_of_time(self.budget_s)
        every = self.c.every > 0 and step % self.c.every == 0
        return last_step or timed or every or stop, stop, last_step

    def save(self, wait: bool):
        """Collective: checkpoint the current step; with checkpoint.async and not `wait`, it is
        published at the next save. Returns the published path (main process) or None."""
        self.publish()  # at most one save pending: the previous one first
        s = self.state
        self.check_replicas()  # before anything of this step is written
        self.pending = checkpoint.save(
            self.run_dir,
            s.step,
            self.model,
            self.optimizer,
            self.loader,
            s.state_dict(),
            {**self.meta, "tokens": s.tokens, **self.best},
            self.info,
            background=self.background,
            io_threads=self.c.io_threads,
        )
        self._saved_at = time.monotonic()
        return self.publish() if wait or not self.background else None

    def check_replicas(self) -> None:
        """Collective: the state every rank holds alike (parameters and optimizer state where
        they are replicas, the counters, the data cursor) compared across the ranks by exact
        checksums; ReplicaMismatch (exit 5) on every rank when one differs. Nothing on one
        process."""
        if not dist.active():
            return
        s, numbers = self.state, {}
        numbers.update({f"train_state.{k}": v for k, v in s.replicated().items()})
        numbers.update({f"data.{k}": v for k, v in self.loader.state_dict().items()})
        try:
            replicas.check(
                replicas.replicated(self.model, self.optimizer, numbers), self.info, s.step
            )
        except failures.ReplicaMismatch as e:
            self.logger.text(f"stopped: {e}", echo=False)  # main() prints it once per rank
            raise

    def publish(self):
        """Collective: complete the pending save (rename, `latest`), then retention; its path."""
        done, self.pending = self.pending, None
        if done is None:
            return None
        path = done.wait()
        c, run_dir = self.c, self.run_dir
        dist.on_main(
            self.info, lambda: checkpoint.prune(run_dir, done.step, c.keep_last, c.keep_every)
        )
        self.logger.text(f"step {done.step}: checkpoint {path}")
        return path

    def roll_back(self, bad_step: int, why: str, windows_per_step: int) -> None:
        """Collective: reload the newest valid checkpoint and move the data cursor past the batch
        of `bad_step` (the steps since the checkpoint are trained again on the data after it)."""
        self.publish()  # a pending save is a checked step's: roll back to it
        s, loader = self.state, self.loader
        past_bad = loader.windows_consumed - (s.step - bad_step) * windows_per_step
        ckpt, _ = dist.from_main(self.info, lambda: checkpoint.resume_point(self.run_dir, "auto"))
        if ckpt is None:
            raise NonFiniteStop(
                f"step {bad_step}: {why} and the policy is rollback, but there is no checkpoint to roll back to yet; "
                "lower optim.lr or save earlier (checkpoint.every)"
            )
        meta = dist.from_main(self.info, lambda: checkpoint.load_meta(ckpt))
        saved = checkpoint.restore(ckpt, meta, self.model, self.optimizer, loader, self.info)
        s.load_state_dict(saved, rollback=True)
        s.rollbacks += 1
        loader.skip_windows(past_bad - loader.windows_consumed)
        self.logger.rewind(s.step)  # the steps after the checkpoint are logged again
        self.logger.text(
            f"step {bad_step}: {why}; rolled back to {ckpt.name}, data cursor moved past step {bad_step}'s batch"
        )
